"""Block-scaled (MXFP8) calls on the ``symm`` backend's Triton path, run by Triton's interpreter.

The two GEMM kernels in one process with W simulated ranks (as in ``test_scaled_kernels.py``):
the all-gather consumer reading packed MXFP8 rows (e4m3 data, then one e8m0 scale per 32
elements) that a late copier moves under the progress words, and the reduce-scatter producer with
its block scales; then the MXFP8 ops of :mod:`tp_kernels.mxfp8` on ``symm`` across 2 and 3
processes against the ``reference`` backend (torchao's own GEMM per block), with the launches
counted: a call that took the torch path fails. Where the kernels take no block scales (a GPU
without a block-scaled MMA), the same calls take the torch path and equal the reference bit for
bit.

What the results are held to (:func:`_check`): the interpreter runs each K step as the
dequantized blocks' fp32 product (:func:`tp_kernels.kernels._shared._accumulate_mx`; on sm_100 one
block-scaled MMA, fp32 accumulation, the same sum). An e4m3 value times a power of two is exact
in fp32, and so is the product of two (3 + 3 mantissa bits), so the only errors are the fp32
sums (at most ``K * 2^-24 * |A| @ |B|``, with a margin of 4) and the one rounding to the output
dtype (half an ulp: ``2^-8 |exact|`` for bf16). torchao's emulated GEMM (the reference backend's
product) dequantizes exactly into bf16 and runs one bf16 GEMM with fp32 accumulation: the same
bound, so the two differ by at most twice it.
"""

from __future__ import annotations

import os

# Must precede the first import of triton (in this process and in the ranks).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from test_kernels import _copy_in  # noqa: E402  (the copier as the symm backend runs it)
from test_scaled_kernels import triton_path_launches  # noqa: E402

from tp_kernels import kernels  # noqa: E402
from tp_kernels.backends import symm_gather  # noqa: E402
from tp_kernels.backends.scaled import pack_mx_rows, unpack_mx_rows  # noqa: E402
from tp_kernels.tiling import MX_BLOCK  # noqa: E402

E4M3, E8M0, BF16 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.bfloat16
NAN = float("nan")
CHANNEL = 1

if not kernels.INTERPRET:
    raise RuntimeError("tp_kernels.kernels was imported before TRITON_INTERPRET=1 was set")


def _data(shape, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(E4M3)


def _scales(rows: int, k: int, gen) -> torch.Tensor:
    """e8m0 scales ``[rows, K / 32]`` from 2^-9 to 2^8: blocks of very different magnitudes."""
    biased = torch.randint(118, 136, (rows, k // MX_BLOCK), generator=gen, dtype=torch.uint8)
    return biased.view(E8M0)


def _dequant(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``data [R, C]`` times its block scales ``[R, C / 32]``, in float64."""
    r, c = data.shape
    factor = torch.exp2(scales.view(torch.uint8).double() - 127)
    return (data.double().reshape(r, c // MX_BLOCK, MX_BLOCK) * factor[:, :, None]).reshape(r, c)


def _torchao_mm(data, scales, w_data, w_scales) -> torch.Tensor:
    """torchao's emulated MXFP8 GEMM ``x @ w.t()`` of ``x`` and ``w`` cast along K."""
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.quantization.quantize_.common import KernelPreference

    def mx(d, s):
        return MXTensor(d, s, E4M3, MX_BLOCK, BF16, KernelPreference.EMULATED, None, False)

    return torch.mm(mx(data, scales), mx(w_data, w_scales).t())


def _check(where, got, data, scales, w_data, w_scales) -> str | None:
    """``got`` (bf16) of ``x @ w.t()`` against the float64 truth and torchao's emulated GEMM."""
    a, w = _dequant(data, scales), _dequant(w_data, w_scales)
    exact = a @ w.t()
    bound = 2.0**-8 * exact.abs() + 4 * data.shape[1] * 2.0**-24 * (a.abs() @ w.abs().t())
    if got.dtype != BF16 or got.shape != exact.shape:
        return f"{where}: got {got.dtype} {tuple(got.shape)}, expected bf16 {tuple(exact.shape)}"
    err = (got.double() - exact).abs()
    if not (err <= bound).all():
        return f"{where}: off the truth by {(err - bound).max().item():.3e} past its bound"
    ref_err = (got.double() - _torchao_mm(data, scales, w_data, w_scales).double()).abs()
    if not (ref_err <= 2 * bound).all():
        return f"{where}: off torchao's GEMM by {ref_err.max().item():.3e}"
    return None


# ---------------------------------------------------------------- one process, simulated ranks


@pytest.mark.parametrize(
    ("world_size", "rank", "m", "k", "ns", "rows", "tma"),
    [
        (1, 0, 3, 32, (5,), 3, True),
        (2, 1, 5, 64, (24, 9), 2, True),
        (3, 2, 1, 96, (6, 20, 3), 1, True),
        (3, 0, 20, 32, (18,), 16, False),
    ],
)
def test_mx_ag_matmul_consumer(world_size, rank, m, k, ns, rows, tma, monkeypatch):
    """The consumer reads A's e4m3 data and its block scales from the packed rows a late copier
    moves unchanged, applying both sides' scales per 32 elements of K: chunks smaller than a
    tile, a tile spanning chunks, m of 1, up to three right-hand sides in one launch, K of one
    to three MX blocks; A and B through descriptors (TMA on a GPU) or pointers."""
    if not tma:
        monkeypatch.setattr(kernels.ag_matmul, "tma_supported", lambda device, dtype: False)
    gen = torch.Generator().manual_seed(world_size * 100 + m)
    data, scales = _data((world_size * m, k), gen), _scales(world_size * m, k, gen)
    packed = pack_mx_rows(data, scales)
    shards = [packed[s * m : (s + 1) * m].clone() for s in range(world_size)]
    weights = [(_data((n, k), gen), _scales(n, k, gen)) for n in ns]
    outs = [torch.full((world_size * m, n), NAN, dtype=BF16) for n in ns]
    a_out = torch.full_like(packed, 0xFF)
    progress = torch.zeros(world_size * symm_gather.MAX_CHUNKS, dtype=torch.int32)
    status = kernels.new_status(world_size, torch.device("cpu"))
    copier = _copy_in(shards, a_out, rank, rows, progress, delay_s=0.2)
    kernels.ag_matmul_consumer(
        a_out, [w.t() for w, _ in weights], outs, progress=progress, chunk_rows=rows,
        status=status, rank=rank, world_size=world_size,
        b_scales=[s for _, s in weights],
    )  # fmt: skip
    copier.join()
    assert status.tolist() == [0] * world_size
    assert torch.equal(a_out, packed)
    for j, ((w, w_scales), out) in enumerate(zip(weights, outs, strict=True)):
        problem = _check(f"outs[{j}]", out, data, scales, w, w_scales)
        assert problem is None, problem


@pytest.mark.parametrize(
    ("world_size", "m", "k", "n", "tma"),
    [(2, 5, 64, 20, True), (3, 3, 32, 9, True), (3, 7, 96, 17, False)],
)
def test_mx_matmul_rs_producer(world_size, m, k, n, tma, monkeypatch):
    """Each rank's block-scaled partials (e4m3 a [W*m, K] with its scales [W*m, K / 32], a
    weight's b with [N, K / 32]), rounded once into the blocks' dtype, announced per block."""
    if not tma:
        monkeypatch.setattr(kernels.matmul_rs, "tma_supported", lambda device, dtype: False)
    gen = torch.Generator().manual_seed(world_size * 10 + n)
    pads = [torch.zeros(4 * world_size, dtype=torch.int32) for _ in range(world_size)]
    signal_ptrs = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)
    counters = kernels.new_counters(world_size, torch.device("cpu"))
    for r in range(world_size):
        a, a_scales = _data((world_size * m, k), gen), _scales(world_size * m, k, gen)
        w, w_scales = _data((n, k), gen), _scales(n, k, gen)
        own = torch.full((world_size, m, n), NAN, dtype=BF16)
        staging = torch.full((world_size, m, n), NAN, dtype=BF16)
        progress = torch.zeros(world_size, dtype=torch.int32)
        kernels.matmul_rs_producer(
            a, w.t(), staging, own, progress, signal_ptrs, counters=counters, rank=r,
            world_size=world_size, channel=CHANNEL, a_scale=a_scales, b_scale=w_scales,
        )  # fmt: skip
        assert progress.tolist() == [0 if d == r else 1 for d in range(world_size)]
        blocks = staging.clone()
        blocks[r] = own[r]
        problem = _check(f"rank {r}", blocks.view(world_size * m, n), a, a_scales, w, w_scales)
        assert problem is None, problem


def test_block_scaled_operands_are_checked():
    """What would send a kernel to a wrong scale byte is refused before the launch, naming the
    argument, what it got and what it needs."""
    w, m, k, n = 2, 4, 64, 8
    gen = torch.Generator().manual_seed(0)
    b, b_scales = _data((n, k), gen).t(), _scales(n, k, gen)
    common = dict(
        progress=torch.zeros(w * symm_gather.MAX_CHUNKS, dtype=torch.int32), chunk_rows=m,
        status=kernels.new_status(w, torch.device("cpu")), rank=0, world_size=w,
    )  # fmt: skip
    packed = pack_mx_rows(_data((w * m, k), gen), _scales(w * m, k, gen))
    out = [torch.empty(w * m, n, dtype=BF16)]
    with pytest.raises(ValueError, match=r"b_scales\[0\].*expected contiguous"):
        kernels.ag_matmul_consumer(packed, [b], out, b_scales=[b_scales.t()], **common)
    with pytest.raises(ValueError, match=r"b_scales\[0\].*\(8, 2\)"):
        kernels.ag_matmul_consumer(packed, [b], out, b_scales=[b_scales[:, :1]], **common)
    with pytest.raises(ValueError, match="packed MXFP8 rows of 80 bytes"):
        kernels.ag_matmul_consumer(packed[:, :k], [b], out, b_scales=[b_scales], **common)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        kernels.ag_matmul_consumer(packed, [b[:48]], out, b_scales=[b_scales], **common)
    a = _data((w * m, k), gen)
    blocks = torch.empty(w, m, n, dtype=BF16)
    with pytest.raises(ValueError, match=r"a_scale.*\(8, 2\)"):
        kernels.matmul_rs_producer(
            a, b, blocks, blocks.clone(), torch.zeros(w, dtype=torch.int32),
            torch.zeros(w, dtype=torch.int64), counters=kernels.new_counters(w, a.device),
            rank=0, world_size=w, channel=CHANNEL, a_scale=_scales(w * m, 32, gen),
            b_scale=b_scales,
        )  # fmt: skip


# ---------------------------------------------------------------- the backend across processes


def _mx_calls(cases, *, block_scaled_mma: bool) -> dict:
    """The MXFP8 ops on ``symm`` (its Triton path asked for) against ``reference``, with the
    kernels' block-scaled launches counted; ``block_scaled_mma`` False plays a GPU whose
    kernels take no block scales."""
    from tp_kernels import mxfp8
    from tp_kernels.backends import symm as symm_backend

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    recipe = mxfp8.Recipe(*_emulated_rceil())
    problems, capture_reasons = [], []
    original_mma = kernels.block_scaled_mma
    kernels.block_scaled_mma = lambda device: block_scaled_mma
    try:
        with triton_path_launches(lambda scales: scales.count("mx")) as counts:
            for i, (op, m, k, ns) in enumerate(cases):
                where = f"case {i} ({op} m={m} k={k} ns={ns})"
                gen = torch.Generator().manual_seed(1000 + i)  # the same weights on every rank
                weights = [torch.randn(n, k, generator=gen, dtype=BF16) for n in ns]
                rights = [mxfp8.cast_rows(w, recipe).t() for w in weights]
                own = torch.Generator().manual_seed(100 * i + rank)
                rows = m if op == "ag" else world * m
                x = mxfp8.cast_rows(torch.randn(rows, k, generator=own, dtype=BF16), recipe)
                if op == "ag":
                    got = mxfp8.all_gather_mx_matmul(x, rights, group, backend="symm")
                    ref = mxfp8.all_gather_mx_matmul(x, rights, group, backend="reference")
                    packed = pack_mx_rows(x.qdata, x.scale)
                    gathered = [torch.empty_like(packed) for _ in range(world)]
                    dist.all_gather(gathered, packed)
                    data, scales = unpack_mx_rows(torch.cat(gathered), k)
                    for j, (out, right) in enumerate(zip(got, rights, strict=True)):
                        w_data, w_scales = right.qdata.t(), right.scale.t()
                        if block_scaled_mma:
                            problem = _check(
                                f"{where} outs[{j}]", out, data, scales, w_data, w_scales
                            )
                        elif not torch.equal(out, ref[j]):
                            problem = f"{where} outs[{j}]: not the reference's bits"
                        else:
                            problem = None
                        if problem:
                            problems.append(problem)
                else:
                    got = mxfp8.mx_matmul_reduce_scatter(x, rights[0], group, backend="symm")
                    ref = mxfp8.mx_matmul_reduce_scatter(x, rights[0], group, backend="reference")
                    # Each rank's partial within _check's bound of torchao's; the fp32 sums then add
                    # one rounding of the result, as for the scaled kernels.
                    tol = 4 * 2.0**-8 * ref.double().abs().amax()
                    err = (got.double() - ref.double()).abs().max()
                    exact = block_scaled_mma or torch.equal(got, ref)
                    if got.dtype != BF16 or not err <= tol or not exact:
                        problems.append(f"{where}: {got.dtype}, off the reference by {err:.3e}")
            need = symm_backend.CaptureNeed(
                "matmul_reduce_scatter", 1 << 16, E4M3, block_scaled=True
            )
            capture_reasons.append(
                symm_backend.BACKEND.capture_unready_reason(group, torch.device("cpu"), need)
            )
    finally:
        kernels.block_scaled_mma = original_mma
    return {"problems": problems, "launches": counts, "capture": capture_reasons}


def _emulated_rceil() -> tuple:
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common import KernelPreference

    return KernelPreference.EMULATED, ScaleCalculationMode.RCEIL, False


# (op, m per rank, K, ns): uneven and one-block shapes (m a multiple of 32 is not needed here:
# the ops take ready casts along K).
MX_CASES = [
    ("ag", 5, 64, (24, 32)),
    ("ag", 1, 32, (64,)),
    ("rs", 3, 64, (32,)),
    ("rs", 4, 96, (64,)),
]


@pytest.mark.parametrize("world_size", [2, 3])
def test_mx_calls_take_the_triton_path(worlds, world_size):
    results = worlds(world_size).run(_mx_calls, MX_CASES, block_scaled_mma=True)
    ags = sum(case[0] == "ag" for case in MX_CASES)
    for rank, result in enumerate(results):
        assert result["problems"] == [], (rank, result["problems"])
        assert result["launches"] == {
            "ag_matmul_consumer": ags,
            "matmul_rs_producer": len(MX_CASES) - ags,
        }, (rank, result["launches"])


def test_mx_calls_take_the_torch_path_without_a_block_scaled_mma(worlds):
    """On a GPU whose kernels take no block scales (Hopper), symm runs torch's schedule with
    torchao's GEMM per block: the reference's bits, no block-scaled launch, and a capture of
    such a call refused by name (its waits are the host's)."""
    for rank, result in enumerate(worlds(2).run(_mx_calls, MX_CASES, block_scaled_mma=False)):
        assert result["problems"] == [], (rank, result["problems"])
        assert result["launches"] == {"ag_matmul_consumer": 0, "matmul_rs_producer": 0}
        assert "torch path" in result["capture"][0], result["capture"]
