"""The cost model's calibration: one GPU's copy and GEMM rates timed, fitted to the model's
figures (:class:`tp_kernels.cost.DeviceSpec`) and printed beside the assumed ones.

``gpu_check`` runs it (:func:`run`) after its other checks. Timed on the device by events
(:func:`measure`): device-to-device copies of the copy-engine all-gather's chunk sizes, and at
the Llama shapes (:data:`GEMMS`) the all-gather's consumer kernel
(:func:`tp_kernels.kernels.ag_matmul_consumer`) launched as rank 0 of :data:`WORLD` with every
progress word already raised, so that no tile waits, each launch first checked against
``torch.mm``; and ``torch.mm`` (cuBLAS) at the same shapes. :func:`fit` fits
``gemm_efficiency`` and ``tile_overhead_s`` from the consumer's time per wave of its tuned
tiles, and ``copy_latency_s`` from the copies; :func:`report` prints them beside the assumed
figures and cuBLAS's fit (the model gives cuBLAS's tiles the same figures), with the ``bench
model`` command that uses them. The cost model only reads figures: nothing here is on
``auto``'s path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tp_kernels import cost, signals
from tp_kernels.bench.protocol import cuda_seconds_back_to_back, render_table
from tp_kernels.bench.tolerance import error_ratio, matmul_tolerance

__all__ = [
    "CHUNK_MIB",
    "GEMMS",
    "WORLD",
    "GemmTiming",
    "Timings",
    "fit",
    "fit_copies",
    "fit_line",
    "fit_tiles",
    "measure",
    "report",
    "run",
]

# --------------------------------------------------------------------------------------------
# The fit: the model's figures from timed copies and GEMM launches.


def fit_line(xs: Sequence[float], ys: Sequence[float], *, argument: str) -> tuple[float, float]:
    """Least squares ``y = a + b * x`` through the points: ``(a, b)``; ``argument`` names the
    samples in the error raised when fewer than two distinct ``x`` leave the line undefined."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(
            f"{argument}: got {len(xs)} samples at {len(set(xs))} distinct sizes, expected at "
            "least two sizes to fit a rate and a fixed cost"
        )
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def fit_copies(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """``(GB/s, latency s)`` of copies timed as ``(bytes, seconds)``: ``seconds = latency +
    bytes / rate``."""
    latency, per_byte = fit_line(
        [b for b, _ in samples], [t for _, t in samples], argument="copy samples"
    )
    if per_byte <= 0:
        raise ValueError(f"copy samples: time does not grow with size ({samples})")
    return 1 / per_byte / 1e9, max(latency, 0.0)


@dataclass(frozen=True)
class GemmTiming:
    """One GEMM launch timed on a GPU: ``rows x k x n`` in ``seconds``, run as ``waves`` rounds of
    ``bm x bn`` tiles (the most tiles one SM ran: ``ceil(tiles / programs)``)."""

    rows: int
    k: int
    n: int
    seconds: float
    bm: int
    bn: int
    waves: int

    @classmethod
    def in_whole_waves(
        cls, rows: int, k: int, n: int, seconds: float, sms: int, bm: int = 128, bn: int = 256
    ) -> GemmTiming:
        """A GEMM whose tiles are not known (cuBLAS's), taken as ``bm x bn`` tiles (default: the
        model's largest) in ``ceil(tiles / sms)`` waves."""
        waves = math.ceil(math.ceil(rows / bm) * math.ceil(n / bn) / sms)
        return cls(rows, k, n, seconds, bm, bn, waves)


def _tile_rate(bm: int, bn: int) -> float:
    """A ``bm x bn`` tile's rate relative to the largest: that of the model's tile shape
    (:data:`tp_kernels.cost.TILES`) whose reuse ``bm*bn / (bm+bn)`` (flops per element loaded)
    is nearest, so a transposed tile rates as its transpose and a tile off the menu as its
    nearest kin."""
    reuse = bm * bn / (bm + bn)
    return min(cost.TILES, key=lambda t: abs(t[0] * t[1] / (t[0] + t[1]) - reuse))[2]


def fit_tiles(
    samples: Sequence[GemmTiming], device: cost.DeviceSpec, dtype: str = "bf16"
) -> tuple[float, float]:
    """``(gemm_efficiency, tile_overhead_s)`` from timed GEMM launches.

    The model's tile takes ``tile_overhead_s + 2*BM*BN*k / (peak per SM * gemm_efficiency *
    rate)`` (``rate``: the tile shape's, :func:`_tile_rate`), so ``seconds / waves`` is a line in
    ``2*BM*BN*k / rate`` whose slope gives the efficiency and whose intercept the overhead; the
    samples need at least two distinct values of it (two ``k``)."""
    if device.sms is None:
        raise ValueError(f"device: {device.name} has no SMs, so no tiles to fit")
    flops = [2.0 * s.bm * s.bn * s.k / _tile_rate(s.bm, s.bn) for s in samples]
    per_wave = [s.seconds / s.waves for s in samples]
    overhead, per_flop = fit_line(flops, per_wave, argument="GEMM samples")
    if per_flop <= 0:
        raise ValueError(f"GEMM samples: time does not grow with K ({samples})")
    per_sm = device.peak_tflops[dtype] * 1e12 / device.sms
    return 1 / per_flop / per_sm, max(overhead, 0.0)


def fit(
    device: cost.DeviceSpec,
    copies: Sequence[tuple[int, float]],
    tiles: Sequence[GemmTiming],
    dtype: str = "bf16",
) -> tuple[cost.DeviceSpec, float]:
    """``device`` with ``gemm_efficiency``, ``tile_overhead_s`` (:func:`fit_tiles` of ``tiles``,
    the consumer kernel's launches) and ``copy_latency_s`` (:func:`fit_copies`) fitted from one
    GPU's timings, each source saying so, and the copies' fitted rate (GB/s: a copy within one
    GPU, an upper bound of a copy over the link, so ``link_gb_s`` stays the datasheet's)."""
    efficiency, overhead = fit_tiles(tiles, device, dtype)
    rate, latency = fit_copies(copies)
    where = "fitted by tp_kernels.bench.gpu_check on this GPU"
    consumer = f"{where} (the all-gather consumer kernel's tiles at the Llama shapes)"
    sources = {
        **device.sources,
        "gemm_efficiency": consumer,
        "tile_overhead_s": consumer,
        "copy_latency_s": f"{where} (device-to-device copies of chunk sizes)",
    }
    fitted = dataclasses.replace(
        device,
        gemm_efficiency=efficiency,
        tile_overhead_s=overhead,
        copy_latency_s=latency,
        sources=sources,
    )
    return fitted, rate


# --------------------------------------------------------------------------------------------
# The measurement, on the device.

# Device-to-device copies the size of the copy-engine all-gather's chunks (MiB): a Llama shard is
# 4-32 MiB at 8192 tokens and TP=8 (m=1024 rows of K=2048..16384 bf16), cut into a few chunks.
CHUNK_MIB = (1, 2, 4, 8, 16, 32)
# The consumer's GEMMs at the Llama-3 shapes, 8192 tokens, TP=8: W*m x K x N_j of 8B's w1,
# 70B's w1, 70B's w2 and 405B's w1 (four K, so the fit separates the rate from the overhead).
GEMMS = (
    (8192, 4096, 1792),
    (8192, 8192, 3584),
    (8192, 3584, 8192),
    (8192, 16384, 6656),
)
# The consumer is timed as rank 0 of the Llama shapes' TP=8 world: its gathered A [W*m, K] is 8
# shards of m rows, each peer tile acquiring its progress word (already raised), as in a call
# whose copies keep ahead of the tiles.
WORLD = 8
# No tile of a calibration launch waits: one that passes this deadline means wrong arguments.
WAIT_S = 5.0
# ``timer(fn, reps)``: the median seconds of ``reps`` runs of ``fn``.
Timer = Callable[[Callable[[], object], int], float]


@dataclass(frozen=True)
class Timings:
    """What :func:`measure` timed: ``copies`` as ``(bytes, seconds)``, and per GEMM shape the
    consumer kernel's launch and ``torch.mm``'s (cuBLAS, its tiles taken as 128x256)."""

    copies: list[tuple[int, float]]
    consumer: list[GemmTiming]
    cublas: list[GemmTiming]


def _cuda_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median device seconds of ``fn`` on the current stream over ``reps`` runs after two, timed
    back to back (:func:`~tp_kernels.bench.protocol.cuda_seconds_back_to_back`), so each run's host
    work (the launcher's checks, the tuner's lookup) overlaps the previous run on the device."""
    times = sorted(cuda_seconds_back_to_back(fn, reps, warmup=2))
    return times[len(times) // 2]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_consumer(
    a: torch.Tensor, b: torch.Tensor, want: torch.Tensor, world_size: int, timer: Timer, reps: int
) -> GemmTiming:
    """The consumer's first launch (the one whose peer tiles wait for the copies: ``WAIT``) of
    ``a`` [W*m, K] @ ``b`` [K, N] as rank 0 of ``world_size``, one chunk per shard, every
    progress word already raised: each peer tile acquires its word and finds its rows
    landed, so no tile waits and the time is the tiles'. Run once and checked first (against
    ``want`` within one rounding to the dtype, and no wait past :data:`WAIT_S`), then timed by
    ``timer(fn, reps)``; its tiles are those the tuner chose for the shape."""
    from tp_kernels import kernels
    from tp_kernels.kernels._shared import persistent_programs

    rows, k = a.shape
    n, m = b.shape[1], rows // world_size
    progress = torch.full((world_size,), signals.RAISED, dtype=torch.int32, device=a.device)
    status = kernels.new_status(world_size, a.device)
    out = torch.full_like(want, math.nan)

    def launch() -> None:
        kernels.ag_matmul_consumer(
            a, [b], [out], progress=progress, chunk_rows=m, status=status, rank=0,
            world_size=world_size, timeout_s=WAIT_S,
        )  # fmt: skip

    launch()  # the first launch of a shape also compiles and tunes
    _synchronize(a.device)
    if status.any():
        raise RuntimeError(
            f"the consumer at {rows}x{k}x{n}: a tile waited past {WAIT_S} s for a progress word "
            "already raised; its launch arguments are wrong"
        )
    tol = matmul_tolerance(a.dtype, k, roundings=1)
    ratio = error_ratio(out, want, tol)
    if not ratio <= 1.0:
        raise RuntimeError(
            f"the consumer at {rows}x{k}x{n}: its output differs from torch.mm by {ratio:.3g} x "
            f"the tolerance {tol:.2g}"
        )
    seconds = timer(launch, reps)
    # The config of the launches just run: the tuner's choice for the shape, made by the first.
    consumer = kernels.AgMatmulConsumer(a, [b], [out], chunk_rows=m, rank=0, world_size=world_size)
    tile = consumer.launches[0].config.kwargs
    bm, bn = tile["BLOCK_M"], tile["BLOCK_N"]
    tiles = world_size * math.ceil(m / bm) * math.ceil(n / bn)
    programs = min(tiles, persistent_programs(a.device))
    return GemmTiming(rows, k, n, seconds, bm, bn, math.ceil(tiles / programs))


def measure(
    quick: bool,
    *,
    device: torch.device | None = None,
    timer: Timer | None = None,
    gemms: Sequence[tuple[int, int, int]] = GEMMS,
    chunk_mib: Sequence[int] = CHUNK_MIB,
    world_size: int = WORLD,
) -> Timings:
    """On ``device`` (default ``cuda:0``), timed by ``timer(fn, reps)`` (default
    :func:`_cuda_seconds`): a device-to-device ``copy_`` per size of ``chunk_mib`` (MiB), and
    per ``(rows, k, n)`` of ``gemms`` bf16 ``A [rows, k] @ W^T`` (``W [n, k]``, a Linear's
    weight, normal / sqrt(k)) by the consumer kernel (:func:`_time_consumer`, as rank 0 of
    ``world_size``) and by ``torch.mm``, medians of ``reps`` runs (5 with ``quick``, else 20).
    Raises if the consumer's check fails. A test runs it on the CPU, under Triton's
    interpreter, with tiny shapes and a host clock."""
    from tp_kernels.kernels._shared import persistent_programs

    device = torch.device("cuda", 0) if device is None else device
    timer = _cuda_seconds if timer is None else timer
    reps = 5 if quick else 20
    src = torch.empty(max(chunk_mib) << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copies = [
        (mib << 20, timer(lambda n=mib << 20: dst[:n].copy_(src[:n]), reps)) for mib in chunk_mib
    ]
    consumer, cublas = [], []
    gen = torch.Generator(device=device).manual_seed(1234)
    sms = persistent_programs(device)  # one per SM on a GPU
    for rows, k, n in gemms:
        a = torch.randn(rows, k, generator=gen, device=device).to(torch.bfloat16)
        b = (torch.randn(n, k, generator=gen, device=device) / math.sqrt(k)).to(torch.bfloat16).t()
        want = torch.mm(a, b)
        consumer.append(_time_consumer(a, b, want, world_size, timer, reps))
        out = torch.empty_like(want)
        seconds = timer(lambda a=a, b=b, out=out: torch.mm(a, b, out=out), reps)
        cublas.append(GemmTiming.in_whole_waves(rows, k, n, seconds, sms))
    return Timings(copies, consumer, cublas)


def _gemm_lines(what: str, timings: Sequence[GemmTiming]) -> str:
    return f"{what}:" + "".join(
        f"\n  {t.rows}x{t.k}x{t.n} {t.seconds * 1e3:.3f} ms "
        f"({2 * t.rows * t.k * t.n / t.seconds / 1e12:.0f} TFLOP/s; {t.bm}x{t.bn} tiles, "
        f"{t.waves} waves, {t.seconds / t.waves * 1e6:.1f} us each)"
        for t in timings
    )


def report(device: cost.DeviceSpec, timings: Timings) -> str:
    """The fitted figures beside the assumed ones (:func:`fit`, from the consumer's launches),
    cuBLAS's fit beside them (the model gives cuBLAS's tiles the same figures), the samples they
    come from, and the ``bench model`` command that uses them."""
    fitted, copy_gb_s = fit(device, timings.copies, timings.consumer)
    names = ("gemm_efficiency", "tile_overhead_s", "copy_latency_s")
    try:  # beside the figures, not one of them: a cuBLAS that fits no line fails nothing
        cublas = [f"{x:.3g}" for x in fit_tiles(timings.cublas, device)]
    except ValueError as exc:
        cublas = [f"no fit: {exc}"] * 2
    link = device.link_gb_s * device.link_efficiency
    rows = [
        (name, f"{getattr(device, name):.3g}", f"{getattr(fitted, name):.3g}", theirs)
        for name, theirs in zip(names, [*cublas, ""])
    ]
    rows.append(("copy rate GB/s", f"{link:.0f} (NVLink)", f"{copy_gb_s:.0f} (within one GPU)", ""))
    header = ("figure", f"assumed ({device.name})", "fitted here", "cuBLAS (torch.mm)")
    copies = ", ".join(f"{b >> 20} MiB {t * 1e6:.1f} us" for b, t in timings.copies)
    lines = [
        render_table(header, rows, left=1),
        f"copies: {copies}",
        _gemm_lines(f"consumer (rank 0 of {WORLD}, no wait)", timings.consumer),
        _gemm_lines("cuBLAS (torch.mm, tiles assumed)", timings.cublas),
    ]
    params = " ".join(f"--param {name}={getattr(fitted, name):.3g}" for name in names)
    lines.append(f"the model with these: python -m tp_kernels.bench model {params}")
    return "\n".join(lines)


def run(quick: bool) -> bool:
    """``gpu_check``'s calibration step: measure (:func:`measure`) on ``cuda:0`` and print
    :func:`report`; True unless it raised (reported, not a crash)."""
    print("\n== the cost model's figures, fitted on this GPU (tp_kernels.bench.calibration)")
    device = cost.device_spec(torch.device("cuda", 0))
    if device is None:
        device = cost.DEVICES["h100"]
        print(f"{torch.cuda.get_device_name(0)} is not in tp_kernels.cost: beside the H100's")
    try:
        print(report(device, measure(quick)), flush=True)
    except Exception as exc:
        print(f"FAIL: the calibration raised {type(exc).__name__}: {exc}", flush=True)
        return False
    return True
