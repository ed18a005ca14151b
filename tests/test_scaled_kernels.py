"""Scaled (fp8) calls on the ``symm`` backend's Triton path, run by Triton's interpreter on CPU.

First the two GEMM kernels in one process with W simulated ranks (as in ``test_kernels.py``):
the all-gather consumer reading packed rows (row-wise scales) or fp8 bytes (a tensor-wise scale)
that a late copier thread moves under the progress words, and the reduce-scatter producer with
its scales, pushed by hand and reduced. Then the backend across 2 and 3 processes (as in
``test_symm_backend.py``), against the ``reference`` backend's scaled call, with the launches
counted: a scaled call that fell back to the torch path fails.

What the results are held to (:func:`_check`): the kernels accumulate the fp8 products in fp32
(exact products, fp32 sums), multiply the accumulator by the scales in fp32 and round once to the
output dtype. ``scaled_mm`` (torchao's block product, what the ``reference`` backend computes)
may round twice: row-wise without fast accumulation it rounds the unscaled product to bf16, then
the scaled one; row-wise fp32 (fp16) outputs are made in bf16 and cast. So:

* against the float64 product of the dequantized operands, the kernels are off by at most one
  rounding to the output dtype (half an ulp, ``u |exact|``: u = 2^-8 bf16, 2^-11 fp16, 2^-24
  fp32) plus the fp32 accumulation's error (bounded by ``K * 2^-24 * |A| @ |B|``);
* against ``scaled_mm``, by that plus ``scaled_mm``'s own two bf16 roundings at most: ``3 *
  2^-8 |exact|``, about 1.5 bf16 ulps of the output's magnitude (1 bf16 ulp is 2^-7 relative at
  worst), where its output went through bf16, else ``2 u |exact|`` (one rounding each).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

# Must precede the first import of triton (in this process and in the ranks).
os.environ["TRITON_INTERPRET"] = "1"


import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from test_kernels import _copy_in  # noqa: E402  (the copier as the symm backend runs it)

from tp_kernels import kernels, signals  # noqa: E402
from tp_kernels.backends import reference, symm_gather  # noqa: E402
from tp_kernels.backends import symm as symm_backend  # noqa: E402
from tp_kernels.backends.scaled import Scaling, pack_rows, scaled_mm, unpack_rows  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NAN = float("nan")
CHANNEL = 1
# Half an ulp (unit roundoff) of each output dtype.
UNIT = {BF16: 2.0**-8, FP16: 2.0**-11, FP32: 2.0**-24}


def _require_interpreter() -> None:
    if not kernels.INTERPRET:
        raise RuntimeError("tp_kernels.kernels was imported before TRITON_INTERPRET=1 was set")


_require_interpreter()


# ---------------------------------------------------------------- operands and the tolerance


def _fp8(shape, gen, dtype, spread: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * spread).to(dtype)


def _scale(shape, gen) -> torch.Tensor:
    """Dequant scales in [0.25, 2): not powers of two, so the epilogue's products round."""
    return torch.rand(shape, generator=gen) * 1.75 + 0.25


def _weight(k: int, n: int, gen, dtype=E4M3) -> torch.Tensor:
    """B [K, N] as a Linear's weight gives it: the transpose of a row-major [N, K]."""
    return _fp8((n, k), gen, dtype).t()


def _dequant(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return data.double() * scale.double()


def _check(where, got, data, a_scale, b, b_scale, out_dtype, fast_accum) -> str | None:
    """``got`` against the float64 truth and ``scaled_mm`` (the module docstring's bounds)."""
    exact = _dequant(data, a_scale) @ _dequant(b, b_scale)
    magnitude = _dequant(data, a_scale).abs() @ _dequant(b, b_scale).abs()
    accumulation = 4 * data.shape[1] * 2.0**-24 * magnitude + 1e-30
    one_rounding = UNIT[out_dtype] * exact.abs() + accumulation
    ref = scaled_mm(
        data, a_scale.contiguous(), b, b_scale, out_dtype, fast_accum=fast_accum, post_scale=True
    )
    via_bf16 = a_scale.dim() == 2 and (out_dtype != BF16 or not fast_accum)
    ref_bound = 2 * 2.0**-8 * exact.abs() if via_bf16 else UNIT[out_dtype] * exact.abs()
    if got.dtype != out_dtype or got.shape != exact.shape:
        return f"{where}: got {got.dtype} {tuple(got.shape)}, expected {out_dtype} {exact.shape}"
    err = (got.double() - exact).abs()
    if not (err <= one_rounding).all():
        return (
            f"{where}: off the truth by {(err - one_rounding).max().item():.3e} past one rounding"
        )
    ref_err = (got.double() - ref.double()).abs()
    if not (ref_err <= one_rounding + ref_bound).all():
        return f"{where}: off scaled_mm by {ref_err.max().item():.3e}"
    return None


# ---------------------------------------------------------------- one process, simulated ranks


@pytest.mark.parametrize(
    ("world_size", "rank", "m", "k", "ns", "rows", "a_dtype", "rowwise", "out_dtype", "tma"),
    [
        (1, 0, 3, 16, (5,), 3, E4M3, True, BF16, True),
        (2, 1, 5, 32, (24, 9), 2, E4M3, True, BF16, True),
        (2, 0, 7, 16, (17,), 7, E5M2, True, FP32, False),
        (3, 2, 1, 48, (6, 20, 3), 1, E4M3, False, FP32, True),
        (3, 0, 20, 32, (18,), 16, E5M2, False, BF16, False),
        (3, 1, 9, 16, (33,), 4, E4M3, True, FP16, True),
    ],
)
def test_scaled_ag_matmul_consumer(
    world_size, rank, m, k, ns, rows, a_dtype, rowwise, out_dtype, tma, monkeypatch
):
    """The consumer reads A's fp8 data and scales from the gathered bytes that a late copier
    moves unchanged (packed rows [m, K+16], or fp8 bytes with one scale): chunks smaller than a
    tile, a tile spanning chunks, m of 1; e4m3 and e5m2 left operands (against e4m3 weights);
    A and B through descriptors (TMA on a GPU), or through pointers (below sm_90)."""
    if not tma:
        monkeypatch.setattr(kernels.ag_matmul, "tma_supported", lambda device, dtype: False)
    gen = torch.Generator().manual_seed(world_size * 100 + m)
    data = _fp8((world_size * m, k), gen, a_dtype)
    if rowwise:
        a_scale = _scale((world_size * m, 1), gen)
        packed, kernel_scale = pack_rows(data, a_scale), None
        b_scales = [_scale((1, n), gen) for n in ns]
    else:
        a_scale = kernel_scale = _scale((), gen)
        packed = data.view(torch.uint8).clone()
        b_scales = [_scale((), gen) for _ in ns]
    shards = [packed[s * m : (s + 1) * m].clone() for s in range(world_size)]
    bs = [_weight(k, n, gen) for n in ns]
    outs = [torch.full((world_size * m, n), NAN, dtype=out_dtype) for n in ns]
    a_out = torch.full_like(packed, 0xFF)
    progress = torch.zeros(world_size * symm_gather.MAX_CHUNKS, dtype=torch.int32)
    status = kernels.new_status(world_size, torch.device("cpu"))
    order = torch.empty(world_size, dtype=torch.int64)
    copier = _copy_in(shards, a_out, rank, rows, progress, delay_s=0.2)
    kernels.ag_matmul_consumer(
        a_out, bs, outs, progress=progress, chunk_rows=rows, status=status, rank=rank,
        world_size=world_size, order_out=order, a_dtype=a_dtype, a_scale=kernel_scale,
        b_scales=b_scales,
    )  # fmt: skip
    copier.join()
    assert status.tolist() == [0] * world_size
    assert order.tolist() == [(rank + s) % world_size for s in range(world_size)]
    assert torch.equal(a_out, packed)  # the bytes, scales and padding moved unchanged
    for j, (b, b_scale, c) in enumerate(zip(bs, b_scales, outs, strict=True)):
        for fast_accum in (True, False):
            problem = _check(f"outs[{j}]", c, data, a_scale, b, b_scale, out_dtype, fast_accum)
            assert problem is None, problem


@pytest.mark.parametrize(
    ("world_size", "m", "k", "n", "rowwise", "out_dtype", "tma"),
    [
        (2, 5, 32, 20, True, BF16, True),
        (3, 3, 16, 9, False, FP32, True),
        (3, 7, 48, 17, True, FP32, False),
    ],
)
def test_scaled_matmul_rs_producer_and_reduce(
    world_size, m, k, n, rowwise, out_dtype, tma, monkeypatch
):
    """Each rank's scaled partials (fp8 a [W*m, K] with its scales, a weight's b), rounded once
    into the blocks' dtype; pushed by hand, the slots reduce in fp32 in rank order. Operands
    through descriptors, or through pointers."""
    if not tma:
        monkeypatch.setattr(kernels.matmul_rs, "tma_supported", lambda device, dtype: False)
    gen = torch.Generator().manual_seed(world_size * 10 + n)
    parts = []
    for _ in range(world_size):
        a = _fp8((world_size * m, k), gen, E4M3)
        a_scale = _scale((world_size * m, 1) if rowwise else (), gen)
        b_scale = _scale((1, n) if rowwise else (), gen)
        parts.append((a, a_scale, _weight(k, n, gen), b_scale))
    buffers = [torch.full((world_size, m, n), NAN, dtype=out_dtype) for _ in range(world_size)]
    pads = [torch.zeros(4 * world_size, dtype=torch.int32) for _ in range(world_size)]
    signal_ptrs = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)
    counters = kernels.new_counters(world_size, torch.device("cpu"))
    for r, (a, a_scale, b, b_scale) in enumerate(parts):
        staging = torch.full((world_size, m, n), NAN, dtype=out_dtype)
        progress = torch.zeros(world_size, dtype=torch.int32)
        kernels.matmul_rs_producer(
            a, b, staging, buffers[r], progress, signal_ptrs, counters=counters, rank=r,
            world_size=world_size, channel=CHANNEL, a_scale=a_scale, b_scale=b_scale,
        )  # fmt: skip
        assert progress.tolist() == [0 if d == r else 1 for d in range(world_size)]
        blocks = staging.clone()
        blocks[r] = buffers[r][r]
        problem = _check(
            f"rank {r}", blocks.view(world_size * m, n), a, a_scale, b, b_scale, out_dtype, True
        )
        assert problem is None, problem
        for d in range(world_size):  # the pusher's work, by hand
            if d != r:
                buffers[d][r].copy_(staging[d])
                pads[d].view(-1, world_size)[CHANNEL, r] = signals.RAISED
    for dst in range(world_size):
        out = torch.full((m, n), NAN, dtype=out_dtype)
        status = kernels.new_status(world_size, torch.device("cpu"))
        kernels.reduce_slots(
            buffers[dst], out, signal_ptrs, status=status, rank=dst, world_size=world_size,
            channel=CHANNEL,
        )  # fmt: skip
        acc = buffers[dst][0].float()
        for s in range(1, world_size):
            acc = acc + buffers[dst][s].float()
        assert torch.equal(out, acc.to(out_dtype))


def test_scaled_operands_are_checked():
    """What would send the consumer to a wrong byte is refused before the launch."""
    w, m, k = 2, 4, 16
    b = _weight(k, 8, torch.Generator().manual_seed(0))
    common = dict(
        progress=torch.zeros(w * symm_gather.MAX_CHUNKS, dtype=torch.int32), chunk_rows=m,
        status=kernels.new_status(w, torch.device("cpu")), rank=0, world_size=w,
    )  # fmt: skip
    out = [torch.empty(w * m, 8)]
    unpacked = torch.zeros(w * m, k, dtype=torch.uint8)
    with pytest.raises(ValueError, match="packed rows of 32 bytes"):
        kernels.ag_matmul_consumer(
            unpacked, [b], out, a_dtype=E4M3, b_scales=[torch.ones(1, 8)], **common
        )
    with pytest.raises(ValueError, match=r"b_scales\[0\]"):
        kernels.ag_matmul_consumer(
            unpacked, [b], out, a_dtype=E4M3, a_scale=torch.tensor(1.0),
            b_scales=[torch.ones(8, 1)], **common,
        )  # fmt: skip
    with pytest.raises(TypeError, match="a_dtype"):
        kernels.ag_matmul_consumer(
            unpacked, [b], out, a_dtype=torch.uint8, a_scale=torch.tensor(1.0),
            b_scales=[torch.ones(())], **common,
        )  # fmt: skip


# ---------------------------------------------------------------- the backend across processes


@contextlib.contextmanager
def triton_path_launches(count_of: Callable[[list[str]], int]) -> Iterator[dict[str, int]]:
    """symm's Triton path asked for (``config.SYMM_TRITON``; two chunks per shard, so that a
    tile of a peer's rows waits on a chunk of its own), with the two GEMM launchers wrapped:
    each launch adds ``count_of(its launches' SCALE values)`` to its launcher's count in the
    yielded dict (a call that took the torch path counts none). Undone on exit."""
    from tp_kernels import config

    launchers = {
        "ag_matmul_consumer": kernels.AgMatmulConsumer,
        "matmul_rs_producer": kernels.RsProducer,
    }
    counts = dict.fromkeys(launchers, 0)
    originals = {name: launcher.launch for name, launcher in launchers.items()}

    def counting(name):
        def launch(self, *args, **kwargs):
            counts[name] += count_of(
                [run.args["SCALE"] for run in getattr(self, "launches", [self])]
            )
            return originals[name](self, *args, **kwargs)

        return launch

    config.SYMM_TRITON.set(True)
    config.SYMM_CHUNKS.set(2)
    for name, launcher in launchers.items():
        launcher.launch = counting(name)
    try:
        yield counts
    finally:
        config.SYMM_TRITON.reset()
        config.SYMM_CHUNKS.reset()
        for name, launcher in launchers.items():
            launcher.launch = originals[name]


def _scaled_launch(scales: list[str]) -> int:
    """One scaled call's launch, none of whose launches may be unscaled."""
    assert "none" not in scales, scales
    return 1


def _scaled_calls(cases) -> dict:
    """The symm backend's scaled calls on the Triton path against the reference backend's, with
    the kernels' launches counted (:func:`triton_path_launches`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    backend, ref_backend = symm_backend.BACKEND, reference.BACKEND
    problems = []
    with triton_path_launches(_scaled_launch) as counts:
        for i, (op, m, k, ns, a_dtype, rowwise, out_dtype, fast) in enumerate(cases):
            where = f"case {i} ({op} m={m} k={k} ns={ns} {a_dtype} rowwise={rowwise} {out_dtype})"
            # The same weights and scales on every rank; each rank's own shard (seeded by rank).
            gen = torch.Generator().manual_seed(1000 + i)
            bs = [_weight(k, n, gen) for n in ns]
            b_scales = tuple(_scale((1, n) if rowwise else (), gen) for n in ns)
            own = torch.Generator().manual_seed(100 * i + rank)
            if op == "ag":
                data = _fp8((m, k), own, a_dtype)
                if rowwise:
                    shard, a_scale = pack_rows(data, _scale((m, 1), own)), None
                else:  # the tensor-wise scale is the same on every rank
                    shard, a_scale = data.view(torch.uint8), _scale((), gen)
                scaling = Scaling(a_scale, b_scales, out_dtype, fast, a_dtype)
                a, outs = backend.all_gather_matmul(
                    shard, bs, group, return_a=True, scaling=scaling
                )
                ref_a, refs = ref_backend.all_gather_matmul(
                    shard, bs, group, return_a=True, scaling=scaling
                )
                if not torch.equal(a, ref_a):
                    problems.append(f"{where}: the gathered bytes differ")
                if rowwise:
                    full, full_scale = unpack_rows(ref_a, k, a_dtype)
                else:
                    full, full_scale = ref_a.view(a_dtype), a_scale
                pairs = list(zip(outs, refs, bs, b_scales, strict=True))
                for j, (out, ref, b, b_scale) in enumerate(pairs):
                    if p := _check(f"{where} outs[{j}]", out, full, full_scale, b, b_scale,
                                   out_dtype, fast):  # fmt: skip
                        problems.append(p)
                    if out.dtype != ref.dtype:
                        problems.append(f"{where}: {out.dtype} but the reference's {ref.dtype}")
            else:
                a = _fp8((world * m, k), own, E4M3)
                a_scale = _scale((world * m, 1) if rowwise else (), own)
                scaling = Scaling(a_scale, b_scales, out_dtype, fast)
                got = backend.matmul_reduce_scatter(a, bs[0], group, scaling=scaling)
                ref = ref_backend.matmul_reduce_scatter(a, bs[0], group, scaling=scaling)
                # Each rank's partial is within the bounds of _check of scaled_mm's; the fp32
                # sums then add one rounding of the result, as for the unscaled kernels.
                tol = (4 * 2.0**-8 if out_dtype == BF16 else 1e-5) * ref.double().abs().amax()
                err = (got.double() - ref.double()).abs().max()
                if got.dtype != out_dtype or not err <= tol:
                    problems.append(f"{where}: {got.dtype}, off the reference by {err:.3e}")
    return {"problems": problems, "launches": counts}


# (op, m, K, ns, a_dtype, row-wise, out_dtype, fast_accum): uneven and tiny m.
SCALED_CASES = [
    ("ag", 5, 32, (24, 9), E4M3, True, BF16, False),
    ("ag", 3, 16, (7,), E5M2, False, FP32, True),
    ("ag", 1, 16, (5,), E4M3, True, FP32, True),
    ("rs", 5, 32, (12,), E4M3, True, BF16, True),
    ("rs", 3, 16, (9,), E4M3, False, FP32, False),
]


@pytest.mark.parametrize("world_size", [2, 3])
def test_scaled_calls_take_the_triton_path(worlds, world_size):
    results = worlds(world_size).run(_scaled_calls, SCALED_CASES)
    ags = sum(case[0] == "ag" for case in SCALED_CASES)
    for rank, result in enumerate(results):
        assert result["problems"] == [], (rank, result["problems"])
        assert result["launches"] == {
            "ag_matmul_consumer": ags,
            "matmul_rs_producer": len(SCALED_CASES) - ags,
        }, (rank, result["launches"])
