"""``python -m tp_kernels.kernels.compile_check``: compile every kernel variant for a GPU
architecture without a GPU, and check what the PTX must contain.

Every variant the launchers can choose is compiled with Triton's ``ASTSource`` for
``GPUTarget("cuda", <arch>, 32)``, with the specialization the runtime gives real arguments
(16-byte aligned pointers, sizes and strides that are multiples of 16) and the tuner's
configs (every config of the menus). Each PTX file is written to ``--out`` and checked:

* a kernel that waits polls with ``ld.acquire.sys`` and reads ``%globaltimer`` (its deadline): the
  barrier (``barrier``, which also raises its peers' words with a system-scope release), the
  reduction, and the all-gather consumer's first launch, which waits for the copy engine's progress
  words (and, reading A with TMA, fences the async proxy after the acquire);
* a kernel that signals stores its word with a system-scope release atomic; the reduce-scatter
  producer, whose stores are local, counts each tile at GPU scope (no system-scope fence per
  tile: only a block's last tile releases its word at system scope);
* every GEMM with 16-bit operands uses ``wgmma`` on sm_90 (warpgroup MMA), ``mma.sync`` below,
  and on sm_100 (B200) ``tcgen05.mma``, whose accumulator lives in tensor memory: allocated with
  ``tcgen05.alloc`` and read back with ``tcgen05.ld``;
* every scaled (fp8) GEMM, compiled for sm_90 and sm_100 (e4m3 operands, row-wise and
  tensor-wise scales, bf16 out; fp8 ``tl.dot`` needs sm_89, so none for sm_80), uses
  ``wgmma`` on e4m3 operands on sm_90 (``.f32.e4m3.e4m3``; an e5m2 A: ``.e5m2.e4m3``) and
  ``tcgen05.mma`` of ``kind::f8f6f4`` on sm_100 (whose operand types live in the instruction
  descriptor, a register, not in the text), with the tensor-memory facts above;
* every block-scaled (MXFP8) GEMM, compiled for sm_100 only (where the kernels run them: e4m3
  operands with e8m0 scales per 32 elements along K, bf16 out, every config of the ``mxfp8``
  menu), runs ``tcgen05.mma`` of ``kind::mxf8f6f4`` with ``block_scale``: the MMA applies the
  scales itself, with the tensor-memory facts above;
* every GEMM feeds its main loop with asynchronous copies (``cp.async`` or TMA's
  ``cp.async.bulk.tensor``): without them its loads are not pipelined behind the math;
* a GEMM that takes an operand as a tensor descriptor (sm_90 and sm_100) copies it with TMA
  (``cp.async.bulk.tensor``): the all-gather consumer takes its (local) A so in every variant
  whose A rows are 16-byte multiples, and the ``B=ptr`` variants, whose B goes through pointers,
  show that those TMA copies are A's; no variant needs more shared memory than the architecture
  has;
* the all-gather consumer whose outputs take descriptors (sm_90 and sm_100, rows of 16-byte
  multiples) stores its tiles with TMA (``cp.async.bulk.tensor`` global from shared);
* on sm_90 a GEMM whose B comes by TMA keeps wgmmas in flight across K steps (a
  ``wgmma.wait_group.sync.aligned N`` with N > 0), but for tf32 with an N-major B, which wgmma
  cannot read from shared memory;
* every fp8 GEMM on sm_90 adds each K block's wgmma product into its fp32 accumulator once: its
  PTX holds one ``add.f32`` per accumulator element of a thread (``BLOCK_M * BLOCK_N /
  threads``; none would be the tensor cores' reduced-precision accumulation across all of K);
* the all-gather consumer's waiting launch, reading A with TMA, issues a tile's loads of A only
  after the tile's wait: the K loop is nested in the tile loop (not flattened into it), and in
  the tile loop the acquire precedes the proxy fence, which precedes the first TMA load
  (:func:`check_wait_order`);
* the reduce-scatter producer, which waits for nothing, runs one loop: its tile loop and K loop
  fused (``flatten=True``) and pipelined, so a tile's epilogue runs after the next K steps' copies
  are issued; no loop is nested in another, one loop holds the copies and the tiles' count, and
  copies are issued ahead of it (the pipeliner's prologue) (:func:`check_flattened`).

Each variant's PTX is also assembled by the ``ptxas`` that comes with Triton (``-v``), which must
report no advisory that it serialized wgmmas, and for a GEMM on sm_90 and sm_100 (every config
of the tile menus) no spill stores or loads; the table reports each variant's registers per
thread, its spill stores and loads, its shared memory and whether it uses TMA.
Which variants are compiled (not every combination): see :func:`variants`.

Exit status 0 when every variant compiles and passes, 1 naming each variant that does not, 2 for
bad arguments (or ``TRITON_INTERPRET=1``, under which nothing is compiled for a GPU).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Variant", "check_ptx", "compile_variant", "main", "variants"]

_ARCHS = {"sm_80": 80, "sm_90": 90, "sm_100": 100}
# Sizes the runtime specializes as multiples of 16 (and pointers as 16-byte aligned).
_ALIGNED = {"tt.divisibility": 16}

WAIT_PATTERNS = (
    (r"ld\.acquire\.sys\.global", "an acquire load at system scope (the signal poll)"),
    (r"%globaltimer", "a read of %globaltimer (the wait's deadline)"),
)
SIGNAL_PATTERNS = (
    (r"atom\.global\.(sys\.release|release\.sys)\.", "a release atomic at system scope"),
)
# The reduce-scatter producer's stores are local: each tile counts itself at GPU scope, and only
# a block's last tile releases (at system scope, for the copy engine) its progress word.
LOCAL_COUNT_PATTERNS = (
    (r"atom\.global\.gpu\.acq_rel\.add", "the per-tile count at GPU scope (local stores)"),
)
ASYNC_COPY_PATTERNS = (
    (r"cp\.async\.(cg|ca|bulk\.tensor)", "asynchronous copies (cp.async) feeding the GEMM"),
)
TMA_PATTERN = r"cp\.async\.bulk\.tensor"
TMA_PATTERNS = ((TMA_PATTERN, "TMA copies (cp.async.bulk.tensor) of the descriptor operands"),)
# The all-gather consumer's epilogue, where its outputs take descriptors: TMA stores.
TMA_STORE_PATTERNS = (
    (r"cp\.async\.bulk\.tensor\.\S*global\.shared", "TMA stores (shared to global) of C"),
)
# A consumer that waits for a progress word and then reads A with TMA orders the two proxies.
PROXY_FENCE_PATTERNS = (
    (r"fence\.proxy\.async\.global", "a proxy fence between the acquire and the TMA loads"),
)
# sm_90's MMAs overlap the next K step's: some wgmma.wait_group leaves MMAs in flight (N > 0),
# where a wait for 0 after every wgmma would serialize them.
ASYNC_WGMMA_PATTERNS = (
    (r"wgmma\.wait_group\.sync\.aligned\s+[1-9]", "asynchronous wgmma (a wait_group with N > 0)"),
)
# TMA's copies into shared memory (loads; a TMA store runs the other way, shared to global).
TMA_LOAD = r"cp\.async\.bulk\.tensor\.\S*shared::\w+\.global"
# ptxas's advisory that it serialized the wgmmas (C7515 "Potential Performance Loss: wgmma.mma_async
# instructions are serialized due to ..."): the pipeline Triton built is then lost.
WGMMA_SERIALIZED = r"wgmma\S*.*serializ"
GEMM16_PATTERNS = {
    90: ((r"wgmma\.mma_async", "wgmma (sm_90 warpgroup MMA) in the 16-bit GEMM"),),
    80: ((r"mma\.sync\.aligned", "mma.sync (tensor cores) in the 16-bit GEMM"),),
    # Blackwell's MMA reads its operands from shared memory and accumulates in tensor memory,
    # which the kernel allocates and reads the result back from.
    100: (
        (r"tcgen05\.mma\.\S*kind::f16", "tcgen05.mma (sm_100 MMA, 16-bit inputs) in the GEMM"),
        (r"tcgen05\.alloc\.", "a tensor memory allocation (tcgen05.alloc) for the accumulator"),
        (r"tcgen05\.ld\.", "the accumulator's load from tensor memory (tcgen05.ld)"),
    ),
}

# The fp8 GEMMs' MMAs, as Triton emits them for e4m3 operands (read in the PTX of 3.6.0, 3.7.1
# and 3.8.0): on sm_90 wgmma names both operand types in the instruction; on sm_100 tcgen05.mma
# runs the fp8/fp6/fp4 kind and carries the operand types in its instruction descriptor (a
# register operand, not text), with the accumulator in tensor memory as for 16 bits.
GEMM8_PATTERNS = {
    90: (
        (
            r"wgmma\.mma_async\S*\.f32\.e4m3\.e4m3",
            "wgmma (sm_90 warpgroup MMA) with e4m3 operands and an fp32 accumulator",
        ),
    ),
    100: (
        (r"tcgen05\.mma\S*kind::f8f6f4", "tcgen05.mma (sm_100 MMA) of kind f8f6f4 (fp8 inputs)"),
        *GEMM16_PATTERNS[100][1:],
    ),
}
# The block-scaled (MXFP8) GEMMs on sm_100: tl.dot_scaled of e4m3 operands with e8m0 scales per
# 32 elements is one tcgen05.mma of kind mxf8f6f4 that reads both scales itself (the block32 /
# scale_vec::1X qualifier, by Triton version), with the accumulator in tensor memory; not an
# upcast to 16 bits (no kind::f16 MMA).
GEMM_MX_PATTERNS = {
    100: (
        (
            r"tcgen05\.mma\S*kind::mxf8f6f4\.block_scale",
            "tcgen05.mma (sm_100 MMA) of kind mxf8f6f4 with block scales",
        ),
        *GEMM16_PATTERNS[100][1:],
    ),
}
# e5m2 A (a gradient) against e4m3 B (a weight): one wgmma of mixed operand types.
GEMM8_MIXED_PATTERNS = {
    90: (
        (
            r"wgmma\.mma_async\S*\.f32\.e5m2\.e4m3",
            "wgmma (sm_90 warpgroup MMA) with e5m2 A and e4m3 B",
        ),
    ),
}


@dataclass(frozen=True)
class Variant:
    """One compilation: a kernel, the types of its runtime arguments, its constexprs and launch
    options, and the patterns its PTX must contain."""

    name: str
    kernel: object  # a triton JITFunction
    signature: dict[str, str]
    constexprs: dict[str, object]
    aligned: tuple[str, ...]
    num_warps: int = 4
    num_stages: int = 3
    required: tuple[tuple[str, str], ...] = field(default=())
    # fp8 on sm_90: the fp32 adds of wgmma products into the accumulator the loop body holds
    # (one per accumulator element and K block: max_num_imprecise_acc = BLOCK_K); 0: unchecked.
    promotions: int = 0
    # A waiting consumer reading A with TMA: its waits precede A's loads (check_wait_order).
    wait_order: bool = False
    # The reduce-scatter producer: one fused, pipelined tile and K loop (check_flattened).
    flattened: bool = False
    # A GEMM on sm_90 or newer, the GPUs the tile menus are chosen for: ptxas must spill nothing
    # (every config of the menus is one a launch may run). On sm_80, whose mma.sync holds the
    # operands in registers too, the large 16-bit tiles spill, and the tuner weighs that.
    no_spills: bool = False


def _variant(name, kernel, types, constexprs, aligned, required, **options) -> Variant:
    signature = {arg: types.get(arg, "constexpr") for arg in kernel.arg_names}
    missing = [a for a in kernel.arg_names if a not in types and a not in constexprs]
    if missing:
        raise ValueError(f"{name}: no type or constexpr value for the arguments {missing}")
    return Variant(name, kernel, signature, constexprs, aligned, required=required, **options)


def _promotions(arch: int, scale: str, config: dict) -> int:
    """The fp32 adds an fp8 GEMM's loop body must hold on ``arch`` (:attr:`Variant.promotions`):
    one per accumulator element of a thread, ``BLOCK_M * BLOCK_N / threads``, on sm_90; none
    to check where the MMA accumulates in fp32 itself (sm_100) or unscaled."""
    if arch != 90 or scale == "none":
        return 0
    return config["BLOCK_M"] * config["BLOCK_N"] // (32 * config["num_warps"])


# How a GEMM operand [R, C] reaches the kernel (see tp_kernels.kernels.tma_layout): "rc" and "cr"
# are tensor descriptors over the operand or its transpose (sm_90 and newer: TMA), "pointer"
# its pointer. B [K, N] comes row-major ("B=kn") or as the transpose of a row-major [N, K] (a
# Linear's weight, ``w.t()``: "B=nk"). The stride that is 1 is specialized to the constant 1 by
# the runtime, as here; the other is a multiple of 16 in every shape that matters, except in
# "B=ptr": a row stride that is no multiple of 16 bytes, which TMA cannot take, so the pointer
# path reads it.
_B_LAYOUTS = {
    "B=nk": ("cr", "stride_bk", "stride_bn", True),
    "B=kn": ("rc", "stride_bn", "stride_bk", True),
    "B=ptr": ("pointer", "stride_bn", "stride_bk", False),
}
# Shared memory per block (bytes) that each architecture grants: sm_80 163 KiB, sm_90 and sm_100
# 227 KiB (the CUDA C++ Programming Guide's table of compute capabilities).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}


def _blocks(config: dict) -> str:
    return "x".join(str(config[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))


def _stage_bytes(config, itemsize: int) -> int:
    """Shared memory the pipelined A and B tiles of a GEMM config take."""
    kw = config.kwargs
    tile = (kw["BLOCK_M"] + kw["BLOCK_N"]) * kw["BLOCK_K"] * itemsize
    return config.num_stages * tile


def _operand_type(layout: str, elem: str, block_r: int, block_c: int) -> str:
    """The signature type of an operand passed as ``layout``: a pointer or a descriptor type."""
    if layout == "pointer":
        return f"*{elem}"
    shape = (block_r, block_c) if layout == "rc" else (block_c, block_r)
    return f"tensordesc<{elem}[{shape[0]}, {shape[1]}]>"


def variants(arch: int) -> list[Variant]:
    """The variants of every kernel the launchers can run on ``arch`` (80, 90 or 100).

    Not the full cross product, too long to compile for every Triton and arch in CI: every
    config of a dtype's tile menu (:func:`tp_kernels.tiling.gemm_shapes`) is compiled for that
    dtype (and fp32 precision) in the common layout, B=nk (the first launch of the all-gather
    GEMM, which waits on the progress words, and a later one); the other layouts of B are
    compiled with one config per dtype, as the layout changes only the loads and not the tile
    loop. All-gather configs whose stage buffers exceed the architecture's shared memory (the
    4-stage 128x256 16-bit tile on sm_80) are left out: the tuner skips them there (they fail
    to load). On sm_90 and newer the operands, all local,
    are tensor descriptors (TMA) where their layout allows (not for fp32 without TF32); below
    sm_90 the launchers always read through pointers.
    """
    import torch
    import triton.language as tl

    from tp_kernels.kernels import ag_matmul, matmul_rs
    from tp_kernels.kernels._shared import gemm_configs, gemm_kind

    gemm16 = GEMM16_PATTERNS[arch]
    tma = arch >= 90
    dtypes = {
        "fp32": (tl.float32, torch.float32, ("tf32", "ieee")),
        "fp16": (tl.float16, torch.float16, (None,)),
        "bf16": (tl.bfloat16, torch.bfloat16, (None,)),
    }
    i32 = "i32"
    found = [
        _variant(
            f"barrier{'[clear]' if clear else ''}",
            ag_matmul._barrier_kernel,
            {
                # Without CLEAR the launcher passes the address table as the (unread) words.
                "signal_ptrs": "*i64",
                "words": "*i32" if clear else "*i64",
                "status_addr": "i64",
                "rank": i32,
                "world_size": i32,
                "channel": i32,
                "n_words": i32,
                "slot_channel": i32,
                "timeout_ns": "i64",
            },  # fmt: skip
            {"CLEAR": clear, "WORDS_PER_PROGRAM": 16, "WAIT": 1},
            ("signal_ptrs", "words"),
            SIGNAL_PATTERNS + WAIT_PATTERNS,
            num_warps=1,
        )
        for clear in (False, True)
    ]

    def layout_of(layout: str, precision: str | None) -> str:
        # As _shared.tma_supported decides: fp32 without TF32 reads through pointers.
        return layout if tma and precision != "ieee" else "pointer"

    def gemm_constants(tl_type, precision, a_layout, b_layout, scale="none", **more):
        # The constexprs of both GEMM kernels as a GPU launch sets them: no trace, bf16 by the MMA.
        return {
            "DTYPE": tl_type, "A_LAYOUT": a_layout, "B_LAYOUT": b_layout, "SCALE": scale,
            "TRACE": False, "BF16_BY_HAND": False, "INPUT_PRECISION": precision, **more,
        }  # fmt: skip

    def scale_args(scale, a_elem, scale_strides):
        # The scales' arguments: unread pointers and strides when unscaled (the launchers pass
        # an operand and 0); a row-wise scale steps by 1 (specialized to the constant 1, as at
        # run time), a tensor-wise one by 0, a block-scaled row of scales by K / 32 (a multiple
        # of 16 at every Llama K); the all-gather's row-wise and block scales are in A's packed
        # rows, so its a_scale_ptr is A again; block scales are bytes.
        types = dict.fromkeys(scale_strides, i32)
        constants = {}
        if scale == "row":
            types, constants = {}, dict.fromkeys(scale_strides, 1)
        a_scale = f"*{a_elem}" if scale in ("none", "row", "mx") else "*fp32"
        b_scale = {"none": None, "mx": "*u8"}.get(scale, "*fp32")
        return a_scale, b_scale, types, constants

    def gemm_patterns(own, mma, a_layout, b_layout, precision):
        # What a GEMM's PTX must hold: its own protocol's, pipelined loads, the MMA, TMA where an
        # operand is a descriptor, and on sm_90 asynchronous wgmma where B comes by TMA (B
        # through pointers, and tf32's N-major B, which wgmma cannot read from shared memory
        # for tf32, leave Triton a synchronous wgmma).
        tma_loads = TMA_PATTERNS if {a_layout, b_layout} != {"pointer"} else ()
        async_mma = arch == 90 and bool(mma) and b_layout != "pointer"
        async_mma = async_mma and not (precision == "tf32" and b_layout == "rc")
        return own + ASYNC_COPY_PATTERNS + mma + tma_loads + ASYNC_WGMMA_PATTERNS * async_mma

    def ag_variant(
        tag, elem, tl_type, precision, mma, config, b_name, wait, num_b=1, scale="none",
        out=None, a_elem=None, c_pointer=False,
    ):  # fmt: skip
        # Scaled: ``elem`` is B's fp8 type, ``a_elem`` A's, ``out`` (elem, tl type) C's.
        # ``c_pointer``: C's rows are no 16-byte multiples, so it takes pointer stores.
        out_elem, out_type = out or (elem, tl_type)
        a_elem = a_elem or elem
        b_layout, unit, other, other_aligned = _B_LAYOUTS[b_name]
        b_layout = layout_of(b_layout, precision)
        # A is the local gathered A, [W*m, K] row-major: TMA (but for fp32 without TF32). Rows
        # that are no multiple of 16 bytes (an odd K) would take neither TMA nor cp.async, for A
        # or for a weight's B=nk; no Llama shape has them.
        a_layout = layout_of("rc", precision)
        # C [W*m, N] stored through a descriptor over its view [W, m, N], wide tiles in halves.
        c_layout = "pointer" if c_pointer else layout_of("tma", precision)
        kw = config.kwargs
        b_type = _operand_type(b_layout, elem, kw["BLOCK_K"], kw["BLOCK_N"])
        c_type = f"*{out_elem}"
        if c_layout == "tma":
            columns = ag_matmul.store_columns(kw["BLOCK_N"])
            c_type = f"tensordesc<{out_elem}[1, {kw['BLOCK_M']}, {columns}]>"
        # Every right-hand matrix of a launch (up to 3: QKV) as the first: its own strides.
        units = [unit.replace("stride_b", f"stride_b{j}") for j in range(3)]
        others = [other.replace("stride_b", f"stride_b{j}") for j in range(3)]
        scale_strides = [f"stride_b{j}s" for j in range(3)]
        a_scale, b_scale, scale_types, scale_constants = scale_args(scale, a_elem, scale_strides)
        types = {
            "a": _operand_type(a_layout, a_elem, kw["BLOCK_M"], kw["BLOCK_K"]),
            "a_ptr": f"*{a_elem}", "a_scale_ptr": a_scale, "progress_addr": "i64",
            "trace_ptr": "*i32", "status_addr": "i64", "rank": i32, "world_size": i32, "m": i32,
            "K": i32, "stride_am": i32, "chunk_rows": i32, "chunks": i32, "timeout_ns": "i64",
            **scale_types,
        }  # fmt: skip
        for j in range(3):
            types |= {f"b{j}": b_type, f"c{j}": c_type, f"N{j}": i32, others[j]: i32}
            # Unscaled, the launcher passes A (a tensor) as the unread scales.
            types[f"b{j}_scale"] = b_scale or f"*{a_elem}"
        aligned = ["a_ptr", "trace_ptr", "m", "K", "stride_am", "chunk_rows"]
        aligned += ["a_scale_ptr"] + [f"b{j}_scale" for j in range(3)] * (scale != "none")
        aligned += scale_strides * (scale == "mx")
        aligned += [f"N{j}" for j in range(3)] + [f"c{j}" for j in range(3)] * (c_layout != "tma")
        aligned += others * other_aligned
        aligned += [f"b{j}" for j in range(3) if b_layout == "pointer"]
        aligned += ["a"] * (a_layout == "pointer")
        # The first launch of a call waits for the progress words; later ones read A as it is.
        own = WAIT_PATTERNS if wait else ()
        if wait and a_layout != "pointer":
            own += PROXY_FENCE_PATTERNS
        required = gemm_patterns(own, mma, a_layout, b_layout, precision)
        required += TMA_STORE_PATTERNS * (c_layout == "tma")
        a_tag = ",A=tma" if a_layout == "rc" else ",A=ptr"
        a_tag += ",C=ptr" if c_pointer and tma else ""
        return _variant(
            f"ag_matmul[{tag},{b_name},{_blocks(kw)},w{config.num_warps}s{config.num_stages}"
            f"{a_tag}{',wait' if wait else ''}{f',{num_b}b' if num_b > 1 else ''}]",
            ag_matmul._ag_matmul_kernel,
            types,
            gemm_constants(
                out_type,
                precision,
                a_layout,
                b_layout,
                scale,
                C_LAYOUT=c_layout,
                **dict.fromkeys(units, 1),
                **scale_constants,
                WAIT=wait,
                NUM_B=num_b,
                **kw,
            ),  # fmt: skip
            tuple(aligned),
            required,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            promotions=_promotions(arch, scale, {**kw, "num_warps": config.num_warps}),
            wait_order=wait and a_layout != "pointer",
            no_spills=arch >= 90,
        )

    def rs_variant(
        tag, elem, tl_type, precision, mma, config, a_layout, b_name, scale="none", out=None
    ):
        # Scaled: ``elem`` is the operands' fp8 type, ``out`` (elem, tl type) the blocks'.
        out_elem, out_type = out or (elem, tl_type)
        b_layout, unit, other, other_aligned = _B_LAYOUTS[b_name]
        a_layout, b_layout = layout_of(a_layout, precision), layout_of(b_layout, precision)
        blocks = {k: config[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
        a_scale, b_scale, scale_types, scale_constants = scale_args(
            scale, elem, ["stride_as", "stride_bs"]
        )
        a_type = _operand_type(a_layout, elem, blocks["BLOCK_M"], blocks["BLOCK_K"])
        b_type = _operand_type(b_layout, elem, blocks["BLOCK_K"], blocks["BLOCK_N"])
        types = {
            "a": a_type, "b": b_type,
            "staging": f"*{out_elem}", "own_slots": f"*{out_elem}", "progress": "*i32",
            "signal_ptrs": "*i64", "counter_ptr": "*i32", "trace_ptr": "*i32",
            # Unscaled, the launcher passes a and b (tensors) as the unread scales.
            "a_scale_ptr": b_scale or f"*{elem}",
            "b_scale_ptr": b_scale or f"*{elem}",
            "rank": i32, "world_size": i32, "m": i32, "N": i32, "K": i32,
            "stride_am": i32, other: i32, "channel": i32, **scale_types,
        }  # fmt: skip
        aligned = ["staging", "own_slots", "progress", "signal_ptrs", "counter_ptr", "m", "N", "K"]
        aligned += ["a_scale_ptr", "b_scale_ptr"] * (scale != "none")
        aligned += ["stride_am"] + ["stride_as", "stride_bs"] * (scale == "mx")
        aligned += [other] * other_aligned
        aligned += [arg for arg, lay in (("a", a_layout), ("b", b_layout)) if lay == "pointer"]
        required = gemm_patterns(
            SIGNAL_PATTERNS + LOCAL_COUNT_PATTERNS, mma, a_layout, b_layout, precision
        )
        return _variant(
            f"matmul_rs_producer[{tag},{b_name},{_blocks(blocks)},w{config['num_warps']}"
            f"s{config['num_stages']},A={'ptr' if a_layout == 'pointer' else 'tma'}]",
            matmul_rs._matmul_rs_kernel,
            types,
            gemm_constants(
                out_type,
                precision,
                a_layout,
                b_layout,
                scale,
                stride_ak=1,
                **{unit: 1},
                **scale_constants,
                **blocks,
            ),  # fmt: skip
            tuple(aligned),
            required,
            num_warps=config["num_warps"],
            num_stages=config["num_stages"],
            promotions=_promotions(arch, scale, config),
            flattened=True,
            no_spills=arch >= 90,
        )

    for dname, (tl_type, torch_type, precisions) in dtypes.items():
        elem = dname
        mma = gemm16 if dname != "fp32" else ()
        itemsize = torch.tensor([], dtype=torch_type).element_size()
        configs = [
            c
            for c in gemm_configs(gemm_kind(torch_type))
            if _stage_bytes(c, itemsize) <= SHARED_LIMIT[arch]
        ]
        producer_configs = []
        for m, n in ((128, 256), (128, 128), (64, 256), (64, 128), (64, 64)):
            config = matmul_rs._producer_config(m, n, gemm_kind(torch_type))
            if config not in producer_configs:
                producer_configs.append(config)
        for precision in precisions:
            tag = f"{dname}{'-' + precision if precision else ''}"
            args = (tag, elem, tl_type, precision, mma)
            for config in configs:
                for wait in (True, False):
                    found.append(ag_variant(*args, config, "B=nk", wait))
            # QKV's three right-hand matrices in one launch (the loop body three times).
            found.append(ag_variant(*args, configs[0], "B=nk", True, num_b=3))
            for b_name in ("B=kn", "B=ptr"):
                for wait in (True, False):
                    # B=ptr's rows are no 16-byte multiples, and then no C's are either.
                    c_pointer = b_name == "B=ptr"
                    found.append(ag_variant(*args, configs[-1], b_name, wait, c_pointer=c_pointer))
            for config in producer_configs:
                found.append(rs_variant(*args, config, "rc", "B=nk"))
            found.append(rs_variant(*args, producer_configs[-1], "rc", "B=kn"))
            found.append(rs_variant(*args, producer_configs[-1], "rc", "B=ptr"))
        for config in matmul_rs._reduce_configs():
            found.append(
                _variant(
                    f"reduce_slots[{dname},{config.kwargs['BLOCK']},w{config.num_warps}]",
                    matmul_rs._reduce_slots_kernel,
                    {
                        "slots_ptr": f"*{elem}",
                        "out_ptr": f"*{elem}",
                        "signal_ptrs": "*i64",
                        "status_addr": "i64",
                        "rank": i32,
                        "world_size": i32,
                        "numel": i32,
                        "channel": i32,
                        "timeout_ns": "i64",
                    },  # fmt: skip
                    {"OUT_DTYPE": tl_type, "BF16_BY_HAND": False, **config.kwargs},
                    ("slots_ptr", "out_ptr", "signal_ptrs", "numel"),
                    WAIT_PATTERNS,
                    num_warps=config.num_warps,
                )
            )
    if arch in GEMM8_PATTERNS:
        found += fp8_variants(arch, ag_variant, rs_variant)
    if arch in GEMM_MX_PATTERNS:
        found += mx_variants(arch, ag_variant, rs_variant)
    return found


def fp8_variants(arch: int, ag_variant, rs_variant) -> list[Variant]:
    """The scaled (fp8) GEMMs on ``arch`` (sm_90, sm_100; ``tl.dot`` of fp8 needs sm_89, so
    sm_80 has none): e4m3 operands in the common layout (B=nk: a Linear's weight, K-major as the
    fp8 MMAs want both operands), bf16 out, the all-gather consumer's first launch reading packed
    rows (row-wise scales) or fp8 bytes (a tensor-wise scale), the reduce-scatter producer with
    row-wise and tensor-wise scales; every config of the fp8 menu for the row-wise consumer, one
    for the others (the scales change only the epilogue), and a row-wise consumer with e5m2 A
    (the gradient's type) against e4m3 B on sm_90."""
    import triton.language as tl

    from tp_kernels.kernels import matmul_rs
    from tp_kernels.kernels._shared import gemm_configs

    mma = GEMM8_PATTERNS[arch]
    e4m3, bf16 = ("fp8e4nv", tl.float8e4nv), ("bf16", tl.bfloat16)
    configs = gemm_configs("fp8")
    config = configs[0]
    producer = matmul_rs._producer_config(128, 256, "fp8")
    found = []
    for scale in ("row", "tensor"):
        tag = f"fp8e4m3-{scale}"
        args = (tag, e4m3[0], e4m3[1], None, mma)
        # Every config of the fp8 menu once (row-wise), for its registers and spills.
        for menu_config in configs if scale == "row" else configs[:1]:
            found.append(ag_variant(*args, menu_config, "B=nk", True, scale=scale, out=bf16))
        found.append(rs_variant(*args, producer, "rc", "B=nk", scale=scale, out=bf16))
    if arch == 90:
        args = ("fp8e5m2xe4m3-row", e4m3[0], e4m3[1], None, GEMM8_MIXED_PATTERNS[arch])
        found.append(ag_variant(*args, config, "B=nk", True, scale="row", out=bf16, a_elem="fp8e5"))
    return found


def mx_variants(arch: int, ag_variant, rs_variant) -> list[Variant]:
    """The block-scaled (MXFP8) GEMMs on ``arch`` (sm_100 only: where the kernels run them,
    :func:`tp_kernels.kernels.block_scaled_mma`): e4m3 operands with e8m0 block scales, bf16
    out, B=nk (a weight cast along K, transposed); every config of the mxfp8 menu for the
    all-gather consumer's first launch (packed rows), QKV's three right-hand sides in one launch,
    a later launch, and the reduce-scatter producer's tiles."""
    import triton.language as tl

    from tp_kernels.kernels import matmul_rs
    from tp_kernels.kernels._shared import gemm_configs

    mma = GEMM_MX_PATTERNS[arch]
    args = ("mxfp8", "fp8e4nv", tl.float8e4nv, None, mma)
    bf16 = ("bf16", tl.bfloat16)
    configs = gemm_configs("mxfp8")
    found = [ag_variant(*args, c, "B=nk", True, scale="mx", out=bf16) for c in configs]
    found.append(ag_variant(*args, configs[0], "B=nk", True, num_b=3, scale="mx", out=bf16))
    found.append(ag_variant(*args, configs[0], "B=nk", False, scale="mx", out=bf16))
    producers = []
    for m, n in ((128, 256), (128, 128), (64, 64)):
        config = matmul_rs._producer_config(m, n, "mxfp8")
        if config not in producers:
            producers.append(config)
    found += [rs_variant(*args, c, "rc", "B=nk", scale="mx", out=bf16) for c in producers]
    return found


def check_ptx(ptx: str, required: Sequence[tuple[str, str]]) -> list[str]:
    """The descriptions of the ``required`` patterns that ``ptx`` lacks."""
    return [what for pattern, what in required if re.search(pattern, ptx) is None]


def count_promotions(ptx: str) -> int:
    """The fp32 adds (``add.f32``, ``add.rn.f32``) in ``ptx``: in an fp8 GEMM on sm_90, where
    nothing else adds in fp32, the adds of each K block's wgmma product into the accumulator."""
    return len(re.findall(r"^\s*(?:@%p\d+\s+)?add(?:\.rn)?\.f32\s", ptx, re.MULTILINE))


def check_wait_order(ptx: str) -> list[str]:
    """What breaks, in a waiting consumer's PTX, the order its tiles rest on: a tile's TMA loads
    of A issued only after its progress word's acquire and the proxy fence after it.

    Read from the text and LLVM's loop comments: the tile loop (``Loop Header: Depth=1``) holds
    the K loop as a nested loop (``Inner Loop Header: Depth=2``), so the loads of a tile are
    issued in that tile's iteration of the tile loop (a flattened or cross-tile pipelined loop
    has no nested loop: it could issue a tile's loads in an earlier tile's iteration, before
    the tile's wait); and in the text, from the tile loop's header, the first ``ld.acquire.sys``
    comes before the first ``fence.proxy.async``, which comes before the first TMA load, and no
    TMA load precedes the header (a prologue hoisted out of the tile loop, before any wait)."""
    header = re.search(r"=>This Loop Header: Depth=1", ptx)
    if header is None or re.search(r"This Inner Loop Header: Depth=2", ptx) is None:
        return ["no tile loop with the K loop nested in it (a tile's loads may precede its wait)"]
    problems = []
    if re.search(TMA_LOAD, ptx[: header.start()]):
        problems.append("a TMA load before the tile loop, ahead of every wait")
    body = ptx[header.start() :]
    firsts = [re.search(p, body) for p in (r"ld\.acquire\.sys", r"fence\.proxy\.async", TMA_LOAD)]
    if None in firsts or not firsts[0].start() < firsts[1].start() < firsts[2].start():
        problems.append(
            "in the tile loop, the acquire, the proxy fence and A's TMA loads are not in that order"
        )
    return problems


# A block of the PTX: its label (``$L__BB0_8:``) or LLVM's comment for an unlabelled one
# (``// %bb.9:``), then LLVM's loop comments on that line and the comment lines after it.
_BLOCK = re.compile(r"^(?:\$L__(BB\d+_\d+):|// %bb\.\d+:)")
_LOOP_HEADER = re.compile(r"=>\s*This (?:Inner )?Loop Header: Depth=(\d+)")
_IN_LOOP = re.compile(r"in Loop: Header=(BB\d+_\d+) Depth=(\d+)")
# Asynchronous copies into shared memory: cp.async (16-byte pieces) and TMA's.
ASYNC_LOAD = rf"cp\.async\.c[ag]\.shared|{TMA_LOAD}"
# The reduce-scatter producer's per-tile count, the last thing each tile's epilogue does but
# the announcement of a complete block.
TILE_COUNT = r"atom\.global\.gpu\.acq_rel\.add"


def ptx_blocks(ptx: str) -> list[tuple[str | None, int, str]]:
    """The blocks of ``ptx`` in text order (the text before the first label is one too), each as
    ``(loop, depth, text)``: the header of the innermost loop holding it (``"BB0_8"``) and that
    loop's depth, or ``(None, 0)`` outside every loop, as LLVM's comments in the PTX say."""
    found = []
    label, loop, depth, lines, annotating = None, None, 0, [], False
    for line in ptx.splitlines():
        start = _BLOCK.match(line)
        if start:
            found.append((loop, depth, "\n".join(lines)))
            label, loop, depth, lines = start.group(1), None, 0, []
        annotating = bool(start) or (annotating and line.lstrip().startswith("//"))
        if annotating:
            # A nested loop's header also names its parent loop: keep the deepest.
            header, inside = _LOOP_HEADER.search(line), _IN_LOOP.search(line)
            if header and int(header.group(1)) > depth:
                loop, depth = label, int(header.group(1))
            elif inside and int(inside.group(2)) > depth:
                loop, depth = inside.group(1), int(inside.group(2))
        lines.append(line)
    found.append((loop, depth, "\n".join(lines)))
    return found


def check_flattened(ptx: str) -> list[str]:
    """What breaks, in the reduce-scatter producer's PTX, its one pipelined loop: its tile loop
    and K loop fused into a single loop (``tl.range(..., flatten=True)``), which Triton's
    pipeliner pipelines, so a tile's epilogue runs after the next K steps' loads are issued.

    Read from LLVM's loop comments: no loop is nested in another (the K loop fused into the
    tile loop); one loop holds both the asynchronous copies of the K steps (cp.async or TMA)
    and the tiles' count (the epilogue); and copies are also issued before that loop, outside
    every loop: the pipeliner's prologue, which a loop it did not pipeline lacks."""
    blocks = ptx_blocks(ptx)
    problems = []
    if any(depth > 1 for _, depth, _ in blocks):
        problems.append("a loop nested in another: the K loop is not fused into the tile loop")
    loads = {loop for loop, _, text in blocks if loop and re.search(ASYNC_LOAD, text)}
    counts = {loop for loop, _, text in blocks if loop and re.search(TILE_COUNT, text)}
    fused = loads & counts
    if not fused:
        problems.append("no loop holds both the K steps' copies and the tiles' count")
        return problems
    first = min(i for i, (loop, _, _) in enumerate(blocks) if loop in fused)
    if not any(loop is None and re.search(ASYNC_LOAD, text) for loop, _, text in blocks[:first]):
        problems.append("no copy issued ahead of the fused loop: it is not pipelined")
    return problems


@dataclass
class Outcome:
    """What compiling one variant gave: its resources, and what is wrong."""

    name: str
    problems: list[str]
    shared_bytes: int = 0
    registers: int = -1
    spill_bytes: int = -1
    tma: bool = False
    seconds: float = 0.0


def ptxas_usage(ptx_path: Path, arch: int) -> tuple[int, int, list[str]]:
    """``(registers per thread, spill stores + loads in bytes, advisories)`` of the PTX at
    ``ptx_path``, the advisories being ptxas's lines that it serialized wgmmas; as
    Triton's own ``ptxas -v`` reports them for ``sm_<arch>`` (``sm_90a`` for Hopper's wgmma,
    ``sm_100a`` for Blackwell's tcgen05): the binary Triton itself assembles that architecture with
    (versions differ in which they bundle; sm_100 has its own, ``ptxas-blackwell``)."""
    from triton.backends.nvidia.compiler import get_ptxas

    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    done = subprocess.run(
        [get_ptxas(arch).path, "-v", "--gpu-name", gpu, str(ptx_path), "-o", os.devnull],
        capture_output=True,
        text=True,
        check=True,
    )
    report = done.stdout + done.stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if registers is None or spills is None:
        raise ValueError(f"ptxas -v printed no register or spill counts: {report[:300]!r}")
    advisories = [line.strip() for line in report.splitlines() if re.search(WGMMA_SERIALIZED, line)]
    return int(registers.group(1)), int(spills.group(1)) + int(spills.group(2)), advisories


def compile_variant(variant: Variant, arch: int, out_dir: Path) -> Outcome:
    """Compile ``variant`` for ``sm_<arch>`` (PTX and cubin; ptxas comes with Triton), write its
    PTX into ``out_dir`` and check it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    started = time.perf_counter()
    names = variant.kernel.arg_names
    attrs = {(names.index(a),): [[k, v] for k, v in _ALIGNED.items()] for a in variant.aligned}
    source = ASTSource(variant.kernel, variant.signature, variant.constexprs, attrs)
    try:
        compiled = triton.compile(
            source,
            target=GPUTarget("cuda", arch, 32),
            options={"num_warps": variant.num_warps, "num_stages": variant.num_stages},
        )
    except Exception as exc:  # any compile error is this variant's finding, not a crash
        first = str(exc).strip().splitlines()
        return Outcome(variant.name, [f"does not compile: {type(exc).__name__}: {first[:3]}"])
    ptx = compiled.asm["ptx"]
    path = out_dir / f"sm_{arch}" / (re.sub(r"[^A-Za-z0-9_.,-]+", "_", variant.name) + ".ptx")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(ptx)
    problems = [f"PTX lacks {what}" for what in check_ptx(ptx, variant.required)]
    shared = int(getattr(compiled.metadata, "shared", 0))
    if shared > SHARED_LIMIT[arch]:
        problems.append(f"needs {shared} B of shared memory, sm_{arch} has {SHARED_LIMIT[arch]}")
    if variant.promotions and count_promotions(ptx) != variant.promotions:
        problems.append(
            f"{count_promotions(ptx)} fp32 adds of wgmma products, expected {variant.promotions}"
            " (one per accumulator element and K block)"
        )
    if variant.wait_order:
        problems += check_wait_order(ptx)
    if variant.flattened:
        problems += check_flattened(ptx)
    registers, spill_bytes, advisories = ptxas_usage(path, arch)
    if spill_bytes and variant.no_spills:
        problems.append(f"ptxas spills {spill_bytes} B per thread")
    problems += [f"ptxas: {line}" for line in advisories]
    return Outcome(
        variant.name,
        problems,
        shared,
        registers,
        spill_bytes,
        re.search(TMA_PATTERN, ptx) is not None,
        time.perf_counter() - started,
    )


def _compile_one(args: tuple[int, int, str]) -> Outcome:
    index, arch, out_dir = args
    return compile_variant(variants(arch)[index], arch, Path(out_dir))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tp_kernels.kernels.compile_check",
        description="Compile every tp_kernels Triton kernel variant for a GPU architecture "
        "without a GPU and check its PTX.",
    )
    p.add_argument("--arch", choices=sorted(_ARCHS), default="sm_90")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where to write the PTX files (default: a new temporary folder)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="compilations in parallel (default: one per core)",
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        help="compile only the variants whose name contains this text (repeatable)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (see the module docstring)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 is set: unset it, the interpreter compiles nothing")
    if args.jobs < 1:
        parser.error(f"--jobs: got {args.jobs}, expected >= 1")
    import triton

    arch = _ARCHS[args.arch]
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="tp_kernels_ptx_"))
    chosen = [
        i
        for i, v in enumerate(variants(arch))
        if not args.only or any(text in v.name for text in args.only)
    ]
    if not chosen:
        parser.error(f"--only {args.only} matches no variant")
    print(
        f"compile_check: {len(chosen)} variants for {args.arch} with Triton {triton.__version__}"
        f", PTX into {out_dir}",
        flush=True,
    )
    started = time.perf_counter()
    work = [(i, arch, str(out_dir)) for i in chosen]
    if args.jobs == 1:
        outcomes = [_compile_one(w) for w in work]
    else:
        with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
            outcomes = list(pool.map(_compile_one, work))
    width = max(len(o.name) for o in outcomes)
    for o in outcomes:
        verdict = "ok" if not o.problems else "FAIL: " + "; ".join(o.problems)
        print(
            f"  {o.name.ljust(width)}  smem {o.shared_bytes:>6} B  regs {o.registers:>3}  "
            f"spills {o.spill_bytes:>4} B  tma {'yes' if o.tma else 'no ':3}  "
            f"{o.seconds:5.1f} s  {verdict}"
        )
    failed = [o.name for o in outcomes if o.problems]
    elapsed = time.perf_counter() - started
    if failed:
        print(
            f"compile_check: {len(failed)} of {len(outcomes)} variants FAILED for {args.arch} "
            f"({elapsed:.0f} s): {failed}",
            file=sys.stderr,
        )
        return 1
    print(f"compile_check: all {len(outcomes)} variants ok for {args.arch} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
