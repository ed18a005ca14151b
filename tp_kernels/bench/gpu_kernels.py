"""``python -m tp_kernels.bench.gpu_kernels``: the symm kernels' tile GEMMs on one GPU vs cuBLAS.

A device check for a single GPU, with no process group. Every launcher of
:mod:`tp_kernels.kernels` runs with ``world_size=1``: its address tables hold this GPU's own
buffer and signal pad, and each signal a kernel waits for is set before it runs, so no wait
blocks and what is measured is compute, not communication. With ``A [M, K]``, ``B [K, N]``:

* ``barrier``: with one rank nothing to wait for; it clears the progress word and word
  ``AG_CHANNEL`` of the pad, as a call's start barrier clears the previous call's words;
* ``ag_matmul_consumer``: ``C [M, N] = A @ B``, ``A`` the (local) gathered A, read with TMA on
  sm_90; with one rank every row is the own shard's, so no tile waits for a progress word;
* ``matmul_rs_producer``: slot 0 of the buffer ``slots [1, M, N]`` = ``A @ B``, then its signal;
* ``reduce_slots``: ``out [M, N] = float32(slots[0])`` cast back: memory-bound, so its rate
  is in bytes moved (one read and one write of ``out``), not flops;
* ``torch.mm`` (cuBLAS): ``A @ B``, the baseline that the GEMMs are checked and timed against.

Each launcher first runs once and is checked: the GEMMs against ``torch.mm`` within
:func:`tp_kernels.bench.tolerance.matmul_tolerance` (one rounding to the dtype; ``B`` is scaled by
``1/sqrt(K)`` so outputs are O(1), as that tolerance assumes), the reduction bit for bit (one
slot summed alone is the slot), the signals by reading the pad. A launcher whose check fails is
not timed. The others are timed by the protocol of ``python -m tp_kernels.bench``
(:func:`tp_kernels.bench.protocol.time_providers`, here without a process group): ``--warmup``
untimed rounds (the first call of a shape also compiles and tunes it), then ``--reps`` rounds
in which every launcher and ``torch.mm`` runs once, in an order rotated by the round, each call
timed on the host clock from a synchronized device to its own synchronization; the table shows
the median and the 20th/80th percentiles. Timed calls go through the public launchers as the symm
backend makes them (address tables, timeout status and tile counters made once; the status, in
host memory, is read once at the end), so a launcher's host work and launch latency are part of
its time, as they are of every call in training (without CUDA graphs).

``--dtype fp8-rowwise``: the two GEMM launchers in fp8 against ``torch._scaled_mm`` (cuBLASLt
on a GPU), the barrier and the reduction left out (nothing in them depends on the dtype). ``A``
is e4m3 ``[M, K]`` with fp32 row-wise dequant scales ``[M, 1]``, ``B`` e4m3 ``[K, N]``
column-major (a Linear's weight, as ``_scaled_mm`` takes it) with scales ``[1, N]`` that carry
the ``1/sqrt(K)`` (e4m3 holds ``randn / sqrt(K)`` poorly: many such values are subnormal), so
that outputs are O(1); bf16 out, ``use_fast_accum=False``:

* ``torch._scaled_mm``: the baseline, checked against the fp32 product of the dequantized
  operands (``torch.mm`` of ``A * a_scale`` and ``B * b_scale`` in fp32);
* ``ag_matmul_consumer``: reads ``A`` as the gathered packed rows (each row's fp8 bytes, then its
  scale: :func:`tp_kernels.backends.scaled.pack_rows`), as a row-wise scaled all-gather leaves
  them; checked against ``torch._scaled_mm``;
* ``matmul_rs_producer``: ``a_scale``/``b_scale`` in its epilogue; checked against
  ``torch._scaled_mm``.

``--dtype mxfp8`` (issue 36; a B200's check): the same two launchers on MXFP8 operands, e4m3
with one e8m0 scale per 32 elements along K (:class:`MxProblem`): the consumer reads the packed
MX rows (:func:`tp_kernels.backends.scaled.pack_mx_rows`), the producer ``a`` with its scales
beside it; the baseline is ``torch._scaled_mm`` with the scales in cuBLAS's blocked layout
(torchao's ``to_blocked``) on sm_100, and elsewhere (Hopper, whose kernels upcast to bf16, and
a CPU) the bf16-dequantized operands' ``torch.mm``, as the table's header says.

Each within :func:`tp_kernels.bench.tolerance.matmul_tolerance` with one rounding to bf16: the fp8
products are exact in fp32 and every side sums them in fp32 and rounds once to bf16 (the
kernels scale the accumulator in the epilogue; ``_scaled_mm``'s epilogue too), as the bf16
GEMMs do. An accumulator with fewer bits than fp32 across ``K`` (Hopper's fp8 tensor cores
without promotion, Triton's default ``max_num_imprecise_acc`` on sm_90, which the kernels
override with ``BLOCK_K``) is not allowed for.

Exit status: 0 when every check passes, 1 when one fails, 2 for bad arguments. Without a CUDA
device it prints ``no CUDA device: nothing to measure`` and exits 0. ``--device cpu`` runs the
same checks and table on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1`` must be set
first); that tests this script, its times mean nothing. The first call of each shape chooses
its tiles on this process alone (:mod:`tp_kernels.kernels.tuning`) and logs what it compiled,
how long that took and what it chose (INFO, the ``tp_kernels`` logger, which this script shows).
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tp_kernels import signals
from tp_kernels.backends.scaled import pack_mx_rows, pack_rows
from tp_kernels.bench.driver import device_ready, exit_status
from tp_kernels.bench.protocol import (
    DTYPES,
    non_negative_int,
    positive_int,
    render_table,
    summarize,
    time_cells,
    time_providers,
    versions,
)
from tp_kernels.bench.tolerance import error_ratio, matmul_tolerance

__all__ = [
    "NO_CUDA_MESSAGE",
    "Problem",
    "Result",
    "check_all",
    "launchers",
    "main",
    "parse_args",
    "per_second",
    "result_rows",
]

NO_CUDA_MESSAGE = "no CUDA device: nothing to measure"
AG_CHANNEL, RS_CHANNEL = 0, 1
# Every wait is satisfied before it starts; a protocol slip then fails the check within this.
WAIT_TIMEOUT_S = 30.0
UNIT_SCALE = {"TFLOP/s": 1e12, "GB/s": 1e9}
BASELINE = "torch.mm"
HEADER = ("kernel", "median ms", "p20 ms", "p80 ms", "rate", "vs torch.mm", "check")
FP8 = "fp8-rowwise"
MXFP8 = "mxfp8"
FP8_BASELINE = "torch._scaled_mm"
# MXFP8's baseline where no block-scaled GEMM runs (a CPU, Hopper): torchao's emulation, the
# operands dequantized to bf16 and multiplied by torch.mm.
MX_EMULATED_BASELINE = "dequantized torch.mm"


def per_second(amount: float, ms: float, unit: str) -> float:
    """``amount`` (flops for ``TFLOP/s``, bytes for ``GB/s``) done in ``ms`` milliseconds, in
    ``unit``."""
    if unit not in UNIT_SCALE:
        raise ValueError(f"unit: got {unit!r}, expected one of {sorted(UNIT_SCALE)}")
    if not ms > 0:
        raise ValueError(f"ms: got {ms}, expected a positive duration")
    return amount / (ms * 1e-3) / UNIT_SCALE[unit]


@dataclass
class Result:
    """One launcher's check and times. ``amount`` is its work per call in ``unit``'s numerator
    (flops or bytes; 0 for a signal, which has no rate); ``times_ms`` is empty when not timed."""

    name: str
    check: str
    ok: bool
    amount: float = 0.0
    unit: str = "TFLOP/s"
    times_ms: list[float] = field(default_factory=list)


def result_rows(results: Sequence[Result], baseline: str = BASELINE) -> list[tuple[str, ...]]:
    """The cells of :data:`HEADER` for each result; ``vs torch.mm`` is the baseline's median
    over this one's, for results in the baseline's unit (flops)."""
    base = next((r for r in results if r.name == baseline and r.times_ms), None)
    base_ms = summarize(base.times_ms)["median_ms"] if base else None
    rows = []
    for r in results:
        if not r.times_ms:
            rows.append((r.name, "-", "-", "-", "-", "-", r.check))
            continue
        med = summarize(r.times_ms)["median_ms"]
        rate = f"{per_second(r.amount, med, r.unit):.1f} {r.unit}" if r.amount and med > 0 else "-"
        vs = f"{base_ms / med:.2f}x" if base and base.unit == r.unit and r.amount else "-"
        rows.append((r.name, *time_cells(r.times_ms, 4), rate, vs, r.check))
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tp_kernels.bench.gpu_kernels",
        description="Check and time the symm backend's Triton kernels on one GPU (world_size=1) "
        "against cuBLAS.",
    )
    p.add_argument("--M", type=positive_int, default=8192, help="rows of A and C")
    p.add_argument("--N", type=positive_int, default=3584, help="columns of B and C")
    p.add_argument("--K", type=positive_int, default=8192, help="reduction dim")
    p.add_argument(
        "--dtype",
        choices=[*DTYPES, FP8, MXFP8],
        default="bf16",
        help=f"the GEMMs' dtype; {FP8}: e4m3 operands with row-wise scales, bf16 out, against "
        f"{FP8_BASELINE}; {MXFP8}: e4m3 with e8m0 scales per 32 elements of K, against "
        f"{FP8_BASELINE} with blocked scales on sm_100 ({MX_EMULATED_BASELINE} elsewhere)",
    )
    p.add_argument("--warmup", type=non_negative_int, default=5, help="untimed calls per kernel")
    p.add_argument(
        "--reps", type=positive_int, default=50, help="timed rounds (one call per kernel each)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (default; the current device), or cpu to test this script in Triton's "
        "interpreter (needs TRITON_INTERPRET=1)",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; exits with status 2 on bad arguments."""
    return _parser().parse_args(argv)


class _OneRankWords:
    """What the launchers of a world_size=1 run signal and wait on, on ``device``: a pad of one
    word per channel and the table of its address, the waits' timeout status, the producer's tile
    counters and the consumer's progress word."""

    def __init__(self, device: torch.device) -> None:
        self.pad = torch.zeros(2, dtype=torch.int32, device=device)  # channels x world_size
        self.pad_ptrs = torch.tensor([self.pad.data_ptr()], dtype=torch.int64, device=device)
        self.status = kernels_module().new_status(1, device)
        self.counters = kernels_module().new_counters(1, device)
        self.progress = torch.zeros(1, dtype=torch.int32, device=device)

    def timed_out(self) -> bool:
        """Whether any wait of any call so far ran past its deadline (host memory: no sync)."""
        return bool(self.status.any())


class Problem(_OneRankWords):
    """The tensors, address tables and signal pad of a world_size=1 run on ``device``: ``a [m, k]``
    (standard normal) and ``b [k, n]`` (normal / sqrt(k)) in ``dtype``, ``want = torch.mm(a, b)``,
    the outputs ``c`` and ``reduced [m, n]``, the buffer ``slots [1, m, n]``, and a pad of one word
    per channel."""

    def __init__(self, m: int, n: int, k: int, dtype: torch.dtype, seed: int, device: torch.device):
        super().__init__(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        self.a = torch.randn(m, k, generator=gen, device=device, dtype=torch.float32).to(dtype)
        b = torch.randn(k, n, generator=gen, device=device, dtype=torch.float32) / math.sqrt(k)
        self.b = b.to(dtype)
        self.want = torch.mm(self.a, self.b)
        self.c = torch.empty_like(self.want)
        self.slots = torch.empty((1, m, n), dtype=dtype, device=device)
        self.reduced = torch.empty_like(self.want)
        self.flops = 2.0 * m * n * k
        self.out_bytes = 2.0 * self.want.numel() * self.want.element_size()


def kernels_module():
    """:mod:`tp_kernels.kernels`, imported on first use (it imports Triton)."""
    from tp_kernels import kernels

    return kernels


def launchers(p: Problem) -> dict[str, Callable[[], None]]:
    """Zero-argument calls of each launcher on ``p`` (and of ``torch.mm``), by kernel name."""
    kernels = kernels_module()
    one = {"rank": 0, "world_size": 1}
    wait = {"timeout_s": WAIT_TIMEOUT_S, "status": p.status}
    return {
        "barrier": lambda: kernels.barrier(
            p.pad_ptrs, channel=AG_CHANNEL, clear=(p.progress, AG_CHANNEL), **one, **wait
        ),
        "ag_matmul_consumer": lambda: kernels.ag_matmul_consumer(
            p.a, [p.b], [p.c], progress=p.progress, chunk_rows=p.a.shape[0], **one, **wait
        ),
        "matmul_rs_producer": _producer(p, p.a),
        "reduce_slots": lambda: kernels.reduce_slots(
            p.slots, p.reduced, p.pad_ptrs, channel=RS_CHANNEL, **one, **wait
        ),
        BASELINE: lambda: torch.mm(p.a, p.b, out=p.c),
    }


def _producer(
    p: Problem | Fp8Problem | MxProblem, a: torch.Tensor, **scales: torch.Tensor
) -> Callable[[], None]:
    """A zero-argument call of the reduce-scatter's producer on ``a @ p.b`` as the only rank (its
    only block is its own, so the staging buffer is never written); ``scales``: the fp8 GEMM's
    ``a_scale`` and ``b_scale``."""
    kernels = kernels_module()
    return lambda: kernels.matmul_rs_producer(
        a, p.b, p.slots, p.slots, p.progress, p.pad_ptrs, counters=p.counters,
        channel=RS_CHANNEL, rank=0, world_size=1, **scales,
    )  # fmt: skip


def _scaled_header(baseline: str) -> tuple[str, ...]:
    return (*HEADER[:5], f"vs {baseline}", HEADER[6])


class Fp8Problem(_OneRankWords):
    """The fp8 tensors of a world_size=1 run on ``device`` (see the module docstring): ``a_data
    [m, k]`` e4m3 with ``a_scale [m, 1]``, packed into ``a [m, k + 16]`` bytes; ``b [k, n]`` e4m3
    column-major with ``b_scale [1, n]``; ``want``: ``torch._scaled_mm``'s bf16 product, ``fp32``:
    the fp32 product of the dequantized operands; outputs ``c`` and ``slots [1, m, n]``."""

    def __init__(self, m: int, n: int, k: int, seed: int, device: torch.device):
        super().__init__(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        e4m3 = torch.float8_e4m3fn

        def scales(shape: tuple[int, int]) -> torch.Tensor:
            # Not powers of two, so that the epilogue's products round.
            return torch.rand(shape, generator=gen, device=device) * 1.75 + 0.25

        self.a_data = torch.randn(m, k, generator=gen, device=device).to(e4m3)
        self.a_scale = scales((m, 1))
        self.a = pack_rows(self.a_data, self.a_scale)
        self.b = torch.randn(n, k, generator=gen, device=device).to(e4m3).t()
        self.b_scale = scales((1, n)) / math.sqrt(k)
        self.want = self.scaled_mm()
        left = self.a_data.float() * self.a_scale
        self.fp32 = torch.mm(left, self.b.float() * self.b_scale)
        self.c = torch.empty_like(self.want)
        self.slots = torch.empty((1, m, n), dtype=self.want.dtype, device=device)
        self.flops = 2.0 * m * n * k
        self.baseline = FP8_BASELINE
        self.consumer_scales = {"a_dtype": self.a_data.dtype, "b_scales": [self.b_scale]}

    def scaled_mm(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """``torch._scaled_mm`` of the operands, bf16, without fast accumulation."""
        return torch._scaled_mm(
            self.a_data, self.b, scale_a=self.a_scale, scale_b=self.b_scale,
            out_dtype=torch.bfloat16, use_fast_accum=False, out=out,
        )  # fmt: skip


class MxProblem(_OneRankWords):
    """The MXFP8 tensors of a world_size=1 run on ``device``: ``a_data [m, k]`` e4m3 with e8m0
    ``a_scale [m, k / 32]`` (one per 32 elements of a row), packed into ``a [m,
    mx_row_bytes(k)]`` as a block-scaled all-gather leaves its rows; ``b [k, n]`` e4m3
    column-major (a weight cast along K) with e8m0 ``b_scale [n, k / 32]`` that carry the ``1 /
    sqrt(k)``; ``want``: the baseline's bf16 product (``torch._scaled_mm`` with the scales in
    cuBLAS's blocked layout on sm_100, else the bf16-dequantized operands' ``torch.mm``, torchao's
    emulation), ``fp32``: the fp32 product of the dequantized operands."""

    def __init__(self, m: int, n: int, k: int, seed: int, device: torch.device):
        super().__init__(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        e4m3, e8m0 = torch.float8_e4m3fn, torch.float8_e8m0fnu

        def scales(rows: int, low: int, high: int) -> torch.Tensor:
            # Biased exponents from low to high - 1: blocks of different magnitudes.
            biased = torch.randint(low, high, (rows, k // 32), generator=gen, device=device)
            return biased.to(torch.uint8).view(e8m0)

        self.a_data = torch.randn(m, k, generator=gen, device=device).to(e4m3)
        self.a_scale = scales(m, 124, 131)
        self.a = pack_mx_rows(self.a_data, self.a_scale)
        shift = round(math.log2(math.sqrt(k)))  # outputs O(1), as the tolerance assumes
        self.b_weight = torch.randn(n, k, generator=gen, device=device).to(e4m3)
        self.b = self.b_weight.t()
        self.b_scale = scales(n, 125 - shift, 130 - shift)
        blocked = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10
        self.baseline = FP8_BASELINE if blocked else MX_EMULATED_BASELINE
        left, right = (
            _mx_dequantize(self.a_data, self.a_scale),
            _mx_dequantize(self.b_weight, self.b_scale),
        )
        self.fp32 = torch.mm(left, right.t())
        self.want = self.scaled_mm()
        self.c = torch.empty_like(self.want)
        self.slots = torch.empty((1, m, n), dtype=self.want.dtype, device=device)
        self.flops = 2.0 * m * n * k
        self.consumer_scales = {"b_scales": [self.b_scale]}

    def scaled_mm(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The baseline's bf16 product (see the class docstring)."""
        if self.baseline == FP8_BASELINE:
            from torchao.prototype.mx_formats.utils import to_blocked

            return torch._scaled_mm(
                self.a_data, self.b, to_blocked(self.a_scale), to_blocked(self.b_scale),
                out_dtype=torch.bfloat16, out=out,
            )  # fmt: skip
        left = _mx_dequantize(self.a_data, self.a_scale).to(torch.bfloat16)
        right = _mx_dequantize(self.b_weight, self.b_scale).to(torch.bfloat16)
        return torch.mm(left, right.t(), out=out)


def _mx_dequantize(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``data [r, c]`` (e4m3) times its e8m0 block scales ``[r, c / 32]``, in fp32 (exact)."""
    r, c = data.shape
    factor = torch.exp2(scale.view(torch.uint8).float() - 127)
    return (data.float().reshape(r, c // 32, 32) * factor[:, :, None]).reshape(r, c)


def scaled_launchers(p: Fp8Problem | MxProblem) -> dict[str, Callable[[], None]]:
    """Zero-argument calls of the two GEMM launchers on the scaled operands ``p`` (and of its
    baseline), by kernel name."""
    kernels = kernels_module()
    one = {"rank": 0, "world_size": 1}
    return {
        "ag_matmul_consumer": lambda: kernels.ag_matmul_consumer(
            p.a,
            [p.b],
            [p.c],
            progress=p.progress,
            chunk_rows=p.a.shape[0],
            timeout_s=WAIT_TIMEOUT_S,
            status=p.status,
            **p.consumer_scales,
            **one,
        ),  # fmt: skip
        "matmul_rs_producer": _producer(p, p.a_data, a_scale=p.a_scale, b_scale=p.b_scale),
        p.baseline: lambda: p.scaled_mm(out=p.c),
    }


def check_scaled(
    p: Fp8Problem | MxProblem, run: dict[str, Callable[[], None]], tol: float
) -> list[Result]:
    """Run each launcher of ``run`` once and check it: the baseline against the fp32 product,
    the kernels against the baseline, each within ``tol``
    (:func:`~tp_kernels.bench.tolerance.error_ratio`)."""
    return [
        _check_gemm(p, run, p.baseline, p.c, p.fp32, tol, versus="fp32"),
        _check_gemm(p, run, "ag_matmul_consumer", p.c, p.want, tol, versus=p.baseline),
        _check_gemm(p, run, "matmul_rs_producer", p.slots[0], p.want, tol, versus=p.baseline),
    ]


def _check_gemm(
    p: _OneRankWords,
    run: dict[str, Callable[[], None]],
    name: str,
    got: torch.Tensor,
    want: torch.Tensor,
    tol: float,
    versus: str = "",
) -> Result:
    """Run launcher ``name`` once, its output ``got`` filled with NaN first, and check it against
    ``want`` (the baseline named ``versus``, if named) within ``tol``."""
    got.fill_(math.nan)
    run[name]()
    ratio = error_ratio(got, want, tol)
    ok = ratio <= 1.0 and not p.timed_out()
    what = f"max err {ratio:.3g} x tol {tol:.2g}" + (f" vs {versus}" if versus else "")
    what += "" if not p.timed_out() else ", timed out"
    return Result(name, ("ok, " if ok else "MISMATCH, ") + what, ok, p.flops)


def check_all(p: Problem, run: dict[str, Callable[[], None]], tol: float) -> list[Result]:
    """Run each launcher of ``run`` once, in protocol order (a signal before its waiter), and
    check it (GEMMs within ``tol`` of ``p.want``, see
    :func:`~tp_kernels.bench.tolerance.error_ratio`)."""

    def signal(name: str, channel: int) -> Result:
        word = p.pad[channel].item()
        ok = word == signals.RAISED
        check = "ok, pad word raised" if ok else f"FAILED, pad word {word} != {signals.RAISED}"
        return Result(name, check, ok)

    results = [Result(BASELINE, "reference", True, p.flops)]
    p.pad[AG_CHANNEL] = p.progress[0] = signals.RAISED  # a previous call's words
    run["barrier"]()
    cleared = p.pad[AG_CHANNEL].item() == 0 and p.progress[0].item() == 0
    check = "ok, words cleared" if cleared else "FAILED, words not cleared"
    results.append(Result("barrier", check, cleared and not p.timed_out()))
    results.append(_check_gemm(p, run, "ag_matmul_consumer", p.c, p.want, tol))
    results.append(_check_gemm(p, run, "matmul_rs_producer", p.slots[0], p.want, tol))
    results.append(signal("matmul_rs_producer's signal", RS_CHANNEL))
    p.reduced.fill_(math.nan)
    run["reduce_slots"]()
    exact = torch.equal(p.reduced, p.slots[0]) and not p.timed_out()
    check = "ok, = slot 0 bit for bit" if exact else "MISMATCH, != slot 0"
    results.append(Result("reduce_slots", check, exact, p.out_bytes, "GB/s"))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (see the module docstring)."""
    args = parse_args(argv)
    # The first call of each shape logs what it compiled and tuned (kernels/tuning.py).
    logging.basicConfig(format="%(message)s")
    logging.getLogger("tp_kernels").setLevel(logging.INFO)
    if not device_ready(_parser(), args.device, interpreted_cpu=True):
        print(NO_CUDA_MESSAGE)
        return 0
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    scaled = args.dtype in (FP8, MXFP8)
    dtype = torch.bfloat16 if scaled else DTYPES[args.dtype]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    v = versions()
    print(
        f"tp_kernels.bench.gpu_kernels on {where}: torch {v['torch']}, triton {v['triton']}; "
        f"M={args.M} N={args.N} K={args.K} {args.dtype}, world_size=1; "
        f"{args.warmup} warmup + {args.reps} timed rounds",
        flush=True,
    )
    tol = matmul_tolerance(dtype, args.K, roundings=1)
    if scaled:
        kind = Fp8Problem if args.dtype == FP8 else MxProblem
        problem = kind(args.M, args.N, args.K, args.seed, device)
        run, check, baseline = scaled_launchers(problem), check_scaled, problem.baseline
        header = _scaled_header(baseline)
    else:
        problem = Problem(args.M, args.N, args.K, dtype, args.seed, device)
        run, check, baseline, header = launchers(problem), check_all, BASELINE, HEADER
    started = time.perf_counter()
    results = check(problem, run, tol)
    print(f"checked (compiling and tuning included) in {time.perf_counter() - started:.1f} s")
    timed = [r for r in results if r.ok and r.name in run]
    times = time_providers(
        {r.name: run[r.name] for r in timed},
        rounds=args.reps,
        warmup=args.warmup,
        group=None,
        device=device,
    )
    for r in timed:
        r.times_ms = times[r.name]
    if problem.timed_out():
        failed = Result("timed calls", "FAILED, a wait timed out", False)
        results.append(failed)
    print(render_table(header, result_rows(results, baseline)))
    return exit_status([r.name for r in results if not r.ok])


if __name__ == "__main__":
    raise SystemExit(main())
