"""``python -m tp_kernels.kernels.compile_check``: the offline sm_90 and sm_100 compiles of the
kernels and the PTX checks. The whole variant set runs in ``.ci/run`` (minutes); here, the checker
itself and a few variants, in fresh interpreters without TRITON_INTERPRET."""

from __future__ import annotations

import os

# The session's kernels run in the interpreter, chosen before triton is first imported (importing
# compile_check imports tp_kernels.kernels); the compilations below run in fresh interpreters.
os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from _processes import run_without_interpreter  # noqa: E402

from tp_kernels import tiling  # noqa: E402
from tp_kernels.kernels import compile_check  # noqa: E402


def test_check_ptx_names_what_is_missing():
    ptx = "ld.acquire.sys.global.b32 %v, [%rd1];\nmov.u64 %t0, %globaltimer;"
    assert compile_check.check_ptx(ptx, compile_check.WAIT_PATTERNS) == []
    missing = compile_check.check_ptx("ld.global.b32 %v, [%rd1];", compile_check.WAIT_PATTERNS)
    assert missing == [what for _, what in compile_check.WAIT_PATTERNS]
    relaxed = "atom.global.gpu.relaxed.exch.b32 %r5, [ %rd5 + 0 ], %r3;"
    assert compile_check.check_ptx(relaxed, compile_check.SIGNAL_PATTERNS) != []


def test_hopper_pipeline_facts():
    """sm_90's asynchronous wgmma is a wait_group that leaves MMAs in flight; ptxas's advisory
    that it serialized them is caught; an fp8 GEMM's promotions are its fp32 adds (the lines are
    Triton's PTX and ptxas's wording)."""
    waits = "wgmma.wait_group.sync.aligned 0;\n"
    assert compile_check.check_ptx(waits, compile_check.ASYNC_WGMMA_PATTERNS) != []
    waits += "wgmma.wait_group.sync.aligned 1;"
    assert compile_check.check_ptx(waits, compile_check.ASYNC_WGMMA_PATTERNS) == []
    advisory = (
        "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are "
        "serialized due to the presence of Extern calls in the function '_ag_matmul_kernel'."
    )
    assert re.search(compile_check.WGMMA_SERIALIZED, advisory)
    assert not re.search(compile_check.WGMMA_SERIALIZED, "ptxas info    : Used 216 registers")
    loop = "\tadd.f32 \t%r1, %r2, %r3;\n\t@%p4 add.rn.f32 %r5, %r5, %r6;\n\tmul.f32 %r7, %r7, %r8;"
    assert compile_check.count_promotions(loop) == 2


def test_wait_order_holds_only_with_the_wait_before_the_loads():
    """The consumer's wait-before-load order in PTX (check_wait_order): acquire, proxy fence, TMA
    load, in the tile loop with the K loop nested; a load hoisted before the tile loop, a load
    before the acquire, or a flattened loop (no nested K loop) fail."""
    load = "cp.async.bulk.tensor.2d.shared::cta.global.mbarrier::complete_tx::bytes [%r1], [%rd2];"
    tile = (
        "$L__BB0_2: // =>This Loop Header: Depth=1\n"
        "ld.acquire.sys.global.b32 %v, [%rd24];\n"
        "fence.proxy.async.global; mov.u32 %r115, %r116;\n"
        f"{load}\n"
        "$L__BB0_9: // =>  This Inner Loop Header: Depth=2\n"
        f"{load}\n"
    )
    assert compile_check.check_wait_order(tile) == []
    assert compile_check.check_wait_order(load + "\n" + tile) != []
    early = tile.replace("ld.acquire", load + "\nld.acquire")
    assert compile_check.check_wait_order(early) != []
    flat = tile.replace("This Inner Loop Header: Depth=2", "in Loop: Header=BB0_2 Depth=1")
    assert compile_check.check_wait_order(flat) != []


def test_flattened_holds_only_for_one_fused_pipelined_loop():
    """The producer's loop in PTX (check_flattened), as LLVM's comments mark it in Triton
    3.7.1's: copies issued ahead of one loop that holds the next copies and the tile's count
    passes; the nested loops, a fused loop with no copy ahead of it (not pipelined), and one
    whose count is in another loop fail."""
    load = "@%p9 cp.async.bulk.tensor.2d.shared::cta.global.mbarrier::complete_tx::bytes [%r1];"
    count = "@%p58 atom.global.gpu.acq_rel.add.u32 %r355, [ %rd45 + 0 ], %r353;"
    fused = (
        f"{load}\n"
        "$L__BB0_12: //   in Loop: Header=BB0_8 Depth=1\n"
        "add.s32 %r1, %r1, 1;\n"
        "$L__BB0_8: // =>This Inner Loop Header: Depth=1\n"
        "wgmma.wait_group.sync.aligned 1;\n"
        f"{load}\n"
        "// %bb.11: //   in Loop: Header=BB0_8 Depth=1\n"
        f"st.global.v4.b32 [ %rd29 + 0 ], {{ %r288 }};\n{count}\n"
        "$L__BB0_13: // %._crit_edge\n"
        "ret;\n"
    )
    assert compile_check.check_flattened(fused) == []
    # The blocks, as read: the prologue outside every loop, three blocks in loop BB0_8.
    blocks = compile_check.ptx_blocks(fused)
    assert [(loop, depth) for loop, depth, _ in blocks] == [(None, 0)] + [("BB0_8", 1)] * 3 + [
        (None, 0)
    ]
    assert compile_check.check_flattened(fused.split("\n", 1)[1]) != []  # no prologue
    nested = fused.replace(
        "// %bb.11: //   in Loop: Header=BB0_8 Depth=1",
        "$L__BB0_4: // %.lr.ph\n//   Parent Loop BB0_8 Depth=1\n"
        "// =>  This Inner Loop Header: Depth=2",
    )
    assert compile_check.ptx_blocks(nested)[3][:2] == ("BB0_4", 2)
    assert compile_check.check_flattened(nested) != []
    apart = fused.replace(count, "").replace("ret;", count)
    assert compile_check.check_flattened(apart) != []


def test_sm_100_gemm_facts_are_tcgen05_with_tensor_memory():
    """On sm_100 a 16-bit GEMM must hold Blackwell's MMA, its accumulator's tensor memory
    allocation and the load back from it; sm_90's wgmma does not pass."""
    facts = compile_check.GEMM16_PATTERNS[100]
    blackwell = (
        "@%p8 tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%r29], 64;\n"
        "@%p51 tcgen05.mma.cta_group::1.kind::f16 [ %r314 + 0 ], %rd74, %rd75, %r139, %p50;\n"
        "tcgen05.ld.sync.aligned.16x32bx2.x32.b32 {%r195, %r196}, [%r227 + 0], 32;"
    )
    assert compile_check.check_ptx(blackwell, facts) == []
    hopper = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1;"
    assert compile_check.check_ptx(hopper, facts) == [what for _, what in facts]
    # An MMA of another kind (tf32), or one whose accumulator never leaves tensor memory, fails.
    tf32_only = blackwell.replace("kind::f16", "kind::tf32")
    assert compile_check.check_ptx(tf32_only, facts) == [facts[0][1]]
    no_load = blackwell.replace("tcgen05.ld.", "tcgen05.st.")
    assert compile_check.check_ptx(no_load, facts) == [facts[2][1]]


def test_fp8_gemm_facts_name_the_operand_types():
    """sm_90's fp8 GEMM must run wgmma on e4m3 operands (a 16-bit wgmma does not pass), and the
    e5m2 x e4m3 one on those; sm_100's, tcgen05.mma of the f8f6f4 kind with tensor memory (the
    lines are Triton's PTX of those variants)."""
    hopper = "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {%r1}, %rd1, %rd2, 1, 1;"
    assert compile_check.check_ptx(hopper, compile_check.GEMM8_PATTERNS[90]) == []
    bf16 = hopper.replace("k32.f32.e4m3.e4m3", "k16.f32.bf16.bf16")
    assert compile_check.check_ptx(bf16, compile_check.GEMM8_PATTERNS[90]) != []
    mixed = hopper.replace("e4m3.e4m3", "e5m2.e4m3")
    assert compile_check.check_ptx(mixed, compile_check.GEMM8_MIXED_PATTERNS[90]) == []
    assert compile_check.check_ptx(mixed, compile_check.GEMM8_PATTERNS[90]) != []
    blackwell = (
        "@%p8 tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%r29], 256;\n"
        "@%p42 tcgen05.mma.cta_group::1.kind::f8f6f4 [ %r605 + 0 ], %rd39, %rd40, %r159, %p41;\n"
        "tcgen05.ld.sync.aligned.32x32b.x128.b32 {%r1}, [%r2];"
    )
    assert compile_check.check_ptx(blackwell, compile_check.GEMM8_PATTERNS[100]) == []
    f16 = blackwell.replace("kind::f8f6f4", "kind::f16")
    assert compile_check.check_ptx(f16, compile_check.GEMM8_PATTERNS[100]) != []
    # fp8 tl.dot needs sm_89: sm_80 has no fp8 variants.
    assert 80 not in compile_check.GEMM8_PATTERNS


def test_sm_100_variants_require_tcgen05_and_tma_not_wgmma():
    """Every 16-bit GEMM variant for sm_100 requires the tcgen05 facts, and TMA where an operand
    is a descriptor (sm_100 has TMA as sm_90 does); none requires wgmma. The variants are those of
    a GPU launch, so they are listed in a fresh interpreter without TRITON_INTERPRET."""
    done = run_without_interpreter(
        """
        import json
        from tp_kernels.kernels import compile_check
        print(json.dumps({v.name: v.required for v in compile_check.variants(100)}))
        """
    )
    assert done.returncode == 0, done.stderr
    required = {
        name: {tuple(p) for p in patterns} for name, patterns in json.loads(done.stdout).items()
    }
    gemms = {name: patterns for name, patterns in required.items() if "matmul" in name}
    sixteen_bit = [p for name, p in gemms.items() if "fp32" not in name and "fp8" not in name]
    tcgen05 = set(compile_check.GEMM16_PATTERNS[100])
    assert sixteen_bit and all(tcgen05 <= patterns for patterns in sixteen_bit)
    # The fp8 GEMMs (the consumer in every config of the fp8 menu with row-wise scales, in one
    # with tensor-wise; the producer with both): tcgen05 of the fp8 kind instead.
    fp8 = [patterns for name, patterns in gemms.items() if "[fp8e" in name]
    tcgen05_fp8 = set(compile_check.GEMM8_PATTERNS[100])
    assert len(fp8) == len(tiling.gemm_shapes("fp8")) + 3
    assert all(tcgen05_fp8 <= patterns for patterns in fp8)
    # The block-scaled GEMMs (the consumer in every config of the mxfp8 menu, QKV's three in one
    # launch, a later launch; the producer's three tiles): the block-scaled tcgen05 kind.
    mx = [patterns for name, patterns in gemms.items() if "[mxfp8" in name]
    assert len(mx) == len(tiling.gemm_shapes("mxfp8")) + 2 + 3
    assert all(set(compile_check.GEMM_MX_PATTERNS[100]) <= patterns for patterns in mx)
    assert not any("wgmma" in pattern for patterns in gemms.values() for pattern, _ in patterns)
    with_tma = [patterns for name, patterns in gemms.items() if "A=tma" in name]
    tma = set(compile_check.TMA_PATTERNS)
    assert with_tma and all(tma <= patterns for patterns in with_tma)


def test_the_consumer_is_tuned_over_its_operands_menu():
    """The all-gather consumer hands the tuner (kernels/tuning.py) the menu of its operands'
    kind (tiling.gemm_shapes): fp32, 16-bit, fp8 for a scaled call, mxfp8 for a block-scaled
    one."""
    done = run_without_interpreter(
        """
        import json
        import torch
        from tp_kernels.kernels import ag_matmul

        offered = {}

        def choose(kernel, key, configs, run, device):
            offered[f"{key[4]} {key[10]}"] = [
                [*(c.kwargs[b] for b in ("BLOCK_M", "BLOCK_N", "BLOCK_K")), c.num_warps,
                 c.num_stages]
                for c in configs
            ]
            return configs[0]

        ag_matmul.tuning.choose = choose  # no launch: nothing here has a GPU
        ag_matmul.persistent_programs = lambda device: 132
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.zeros(64, 32, dtype=dtype), torch.zeros(32, 16, dtype=dtype)
            ag_matmul.AgMatmulConsumer(
                a, [b], [torch.zeros(64, 16, dtype=dtype)], chunk_rows=32, rank=0, world_size=2
            )
        fp8 = torch.float8_e4m3fn
        packed = torch.zeros(64, 32 + 16, dtype=torch.uint8)
        ag_matmul.AgMatmulConsumer(
            packed, [torch.zeros(32, 16).to(fp8)], [torch.zeros(64, 16, dtype=torch.bfloat16)],
            chunk_rows=32, rank=0, world_size=2, a_dtype=fp8, b_scales=[torch.ones(())],
        )
        mx_rows = torch.zeros(64, 32 + 16, dtype=torch.uint8)
        ag_matmul.AgMatmulConsumer(
            mx_rows, [torch.zeros(32, 16).to(fp8)], [torch.zeros(64, 16, dtype=torch.bfloat16)],
            chunk_rows=32, rank=0, world_size=2,
            b_scales=[torch.zeros(16, 1, dtype=torch.uint8).view(torch.float8_e8m0fnu)],
        )
        print(json.dumps(offered))
        """
    )
    assert done.returncode == 0, done.stderr
    kinds = {
        "torch.float32 none": "fp32",
        "torch.bfloat16 none": "16bit",
        "torch.float8_e4m3fn row": "fp8",
        "torch.float8_e4m3fn mx": "mxfp8",
    }
    menus = {
        dtype: [list(shape) for shape in tiling.gemm_shapes(kind)] for dtype, kind in kinds.items()
    }
    assert json.loads(done.stdout) == menus


def test_waiting_and_signalling_kernels_compile_for_sm_90(tmp_path):
    """The barrier (signals and waits; with and without clearing the words), the reduction
    (waits), and a 16-bit all-gather consumer whose B goes through pointers (its first launch
    waits on progress words; both read A with TMA) compile for sm_90 and pass their checks;
    every PTX file is written."""
    only = ("barrier", "reduce_slots[bf16,1024,w4]", "ag_matmul[bf16,B=ptr")
    args = ["--out", str(tmp_path), "--jobs", "1"] + [x for o in only for x in ("--only", o)]
    done = run_without_interpreter(
        f"""
        from tp_kernels.kernels import compile_check
        raise SystemExit(compile_check.main({args!r}))
        """
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "all 5 variants ok for sm_90" in done.stdout, done.stdout
    # Resources from Triton's own ptxas, per variant: registers per thread and spilled bytes.
    usage = re.findall(r"regs +(\d+) +spills +(\d+) B", done.stdout)
    assert len(usage) == 5 and all(int(regs) > 0 for regs, _ in usage), done.stdout
    written = sorted(p.name for p in Path(tmp_path, "sm_90").iterdir())
    assert "barrier_clear_.ptx" in written and len(written) == 5, written
    ptx = Path(tmp_path, "sm_90", "barrier_clear_.ptx").read_text()
    # The peer's word raised at system scope, after the own slot words are cleared.
    assert "atom.global.sys.release.exch" in ptx and "atom.global.sys.relaxed.exch" in ptx
    # B is read through pointers, so the TMA copies are A's; the waiting launch fences the
    # async proxy after its acquire, the other launch neither waits nor fences.
    consumers = {p.name: p.read_text() for p in Path(tmp_path, "sm_90").glob("ag_matmul*")}
    (waiting,) = [ptx for name, ptx in consumers.items() if ",wait" in name]
    (reading,) = [ptx for name, ptx in consumers.items() if ",wait" not in name]
    assert "cp.async.bulk.tensor" in waiting and "cp.async.bulk.tensor" in reading
    assert "ld.acquire.sys" in waiting and "fence.proxy.async.global" in waiting
    assert "ld.acquire.sys" not in reading and "fence.proxy.async.global" not in reading


def test_a_16_bit_gemm_compiles_for_sm_100_with_tcgen05(tmp_path):
    """A 16-bit reduce-scatter producer compiled for sm_100 (B200) with Triton's own Blackwell
    ptxas: its PTX targets sm_100a and holds tcgen05.mma, tensor memory and TMA, and no wgmma."""
    only = "matmul_rs_producer[bf16,B=ptr"
    args = ["--arch", "sm_100", "--out", str(tmp_path), "--jobs", "1", "--only", only]
    done = run_without_interpreter(
        f"""
        from tp_kernels.kernels import compile_check
        raise SystemExit(compile_check.main({args!r}))
        """
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "all 1 variants ok for sm_100" in done.stdout, done.stdout
    (ptx,) = [p.read_text() for p in Path(tmp_path, "sm_100").iterdir()]
    assert re.search(r"^\.target sm_100a", ptx, re.MULTILINE), ptx[:500]
    assert "tcgen05.mma" in ptx and "cp.async.bulk.tensor" in ptx and "wgmma" not in ptx


def test_a_variant_that_lacks_a_pattern_fails_by_name(tmp_path):
    done = run_without_interpreter(
        f"""
        from tp_kernels.kernels import compile_check
        compile_check.SIGNAL_PATTERNS = (("wgmma", "a pattern no signal has"),)
        raise SystemExit(compile_check.main(
            ["--out", {str(tmp_path)!r}, "--jobs", "1", "--only", "barrier"]
        ))
        """
    )
    assert done.returncode == 1, done.stdout
    assert "barrier" in done.stderr and "FAILED" in done.stderr, done.stderr
    assert "PTX lacks a pattern no signal has" in done.stdout, done.stdout


def test_interpreter_mode_is_refused():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-m", "tp_kernels.kernels.compile_check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "TRITON_INTERPRET=1 is set" in done.stderr, done.stderr
