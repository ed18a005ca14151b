"""The timing protocol of ``python -m tp_kernels.bench``, its statistics, table and JSON report.

A benchmark (see :func:`register`) sets up, on every rank of a process group, a :class:`BenchCase`:
named providers that each compute the same result from the same inputs in their own way, and a
baseline among them (``reference`` unless the case names another). Then :func:`run_case`

1. checks correctness: each provider's output on rank ``r`` against the baseline provider's
   output on rank ``r`` (``allclose`` with the case's tolerance); the verdict is agreed over ranks,
   and a provider that fails is reported and not timed;
2. runs ``warmup`` untimed iterations of every provider;
3. runs ``rounds`` rounds; in round ``i`` every provider runs once, in the provider order rotated
   left by ``i`` (so none always runs first, right after the others warmed caches or clocks). Each
   run is timed on each rank from the moment the group leaves a barrier to the moment the rank's
   work is done (``torch.cuda.synchronize`` on CUDA), and the next barrier follows;
4. takes, per round and provider, the maximum of the per-rank times (one ``all_reduce(MAX)``): a
   collective op is as slow as its slowest rank;
5. reports the median, 20th and 80th percentile of those per-round times;
6. when the case has a ``probe``, calls it once per timed provider, one provider at a time, for
   measurements that must not overlap another provider's run (memory, communication counters).

Everything :func:`run_case` returns is plain Python data (picklable, JSON-ready), identical on
every rank.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "BENCHMARKS",
    "REFERENCE",
    "ROOF",
    "BenchCase",
    "BenchConfig",
    "Benchmark",
    "FP8_DTYPES",
    "FP8_HIGH_PRECISION",
    "MXFP8",
    "SCALED_DTYPES",
    "add_timeout_argument",
    "check_outputs",
    "cuda_seconds_back_to_back",
    "format_table",
    "host_seconds",
    "machine_info",
    "percentile",
    "positive_number",
    "register",
    "render_table",
    "rotated",
    "run_case",
    "select_providers",
    "summarize",
    "time_cells",
    "time_providers",
    "versions",
]

REFERENCE = "reference"
ROOF = "roof"

Provider = Callable[[], Any]
"""Runs the benchmarked computation once on this rank and returns its output: a tensor, a
(possibly nested) list or tuple of tensors, or ``None`` entries that are ignored."""

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}

FP8_DTYPES: dict[str, str] = {"fp8-rowwise": "rowwise", "fp8-tensorwise": "tensorwise"}
"""``--dtype`` names of the fp8 benchmarks -> torchao's recipe name (its forward casts): e4m3
operands with one fp32 scale per row of ``A`` and per column of ``B`` (``rowwise``) or one each
(``tensorwise``); the high-precision tensors (inputs before their cast, outputs) are
:data:`FP8_HIGH_PRECISION`. Kept apart from :data:`DTYPES`, whose names the GPU tools take too."""

FP8_HIGH_PRECISION = torch.bfloat16

MXFP8 = "mxfp8"
"""``--dtype`` name of the MXFP8 benchmarks (issue 36): e4m3 operands with one e8m0 scale per 32
elements along ``K`` (torchao's MXFP8 recipes), high-precision tensors as the fp8 dtypes'."""

SCALED_DTYPES: tuple[str, ...] = (*FP8_DTYPES, MXFP8)
"""Every ``--dtype`` whose GEMM operands are scaled e4m3: the benchmarks that take one take all."""


@dataclass(frozen=True)
class BenchConfig:
    """The knobs every benchmark receives.

    ``M``, ``K``, ``N`` are the problem sizes; each benchmark documents how it reads them (the op
    benchmarks: a ``[M, K] @ [K, N]`` product whose rows are sharded over ranks). ``sizes``
    overrides sizes that a benchmark names itself (``llama_block``: batch, seq, dim, ...); each
    benchmark documents its keys and rejects unknown ones.
    """

    M: int
    K: int
    N: int
    dtype: str = "fp32"
    rounds: int = 10
    warmup: int = 3
    seed: int = 0
    sizes: Mapping[str, int] = field(default_factory=dict)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of the benchmark's tensors; for an fp8 ``dtype`` the high-precision one
        (inputs before their cast to fp8, and outputs)."""
        if self.dtype in SCALED_DTYPES:
            return FP8_HIGH_PRECISION
        return DTYPES[self.dtype]

    @property
    def fp8_recipe(self) -> str | None:
        """torchao's recipe of an fp8 ``dtype`` (:data:`FP8_DTYPES`), else None."""
        return FP8_DTYPES.get(self.dtype)


@dataclass
class BenchCase:
    """One benchmark set up on one rank: providers that compute the same thing, and its size.

    Attributes:
        name: the benchmark's name.
        flops: floating-point operations of one provider call on one rank (for GFLOP/s).
        shapes: tensor shapes on one rank, for the report.
        providers: runnable providers, in table order; must include ``baseline``.
        tolerance: ``rtol`` and ``atol`` of the correctness check.
        skipped: providers this benchmark knows but cannot run here, with the reason.
        unchecked: providers whose output is not comparable with the baseline's (the
            compute-only :data:`ROOF` computes a different quantity); timed, never checked.
        baseline: the provider the others are checked against and whose median the speedup
            column divides; it always runs.
        rate: ``(unit, count)``: one provider call processes ``count`` ``unit``s on one rank;
            adds a ``<unit>/s`` column (``count / median``) and a ``<unit>_per_s`` field.
        probe: ``probe(name)`` runs provider ``name`` once more and returns extra fields for its
            record (e.g. memory); it must return the same on every rank (agreeing over the group
            itself).
        probe_columns: ``{field: header}``: numeric probe fields shown as table columns.
        predicted_ms: ``{provider: ms}``: :mod:`tp_kernels.cost`'s prediction for this machine,
            shown beside each measured row (providers the model does not cover are left out).
        model_note: what the prediction covers and for which device (a footnote of the table).
        note: what the measured times are, where it is not plain (e.g. emulated kernels): a
            footnote of the table.
    """

    name: str
    flops: float
    shapes: dict[str, list[int]]
    providers: dict[str, Provider]
    tolerance: float
    skipped: dict[str, str] = field(default_factory=dict)
    unchecked: frozenset[str] = frozenset({ROOF})
    baseline: str = REFERENCE
    rate: tuple[str, float] | None = None
    probe: Callable[[str], dict[str, Any]] | None = None
    probe_columns: dict[str, str] = field(default_factory=dict)
    predicted_ms: dict[str, float] = field(default_factory=dict)
    model_note: str = ""
    note: str = ""


Builder = Callable[[BenchConfig, dist.ProcessGroup, torch.device], BenchCase]


@dataclass(frozen=True)
class Benchmark:
    """A registered benchmark: ``build(cfg, group, device)`` returns this rank's :class:`BenchCase`;
    ``providers`` names every provider it may offer (to validate ``--providers`` up front) and
    ``fp8_providers`` those it offers under a scaled ``--dtype`` (:data:`SCALED_DTYPES`; None: it
    takes none)."""

    name: str
    build: Builder
    providers: tuple[str, ...]
    fp8_providers: tuple[str, ...] | None = None

    def providers_for(self, dtype: str) -> tuple[str, ...] | None:
        """The providers offered under ``dtype``; None when the benchmark does not take it."""
        return self.fp8_providers if dtype in SCALED_DTYPES else self.providers


BENCHMARKS: dict[str, Benchmark] = {}


def register(
    name: str, providers: Sequence[str], *, fp8_providers: Sequence[str] | None = None
) -> Callable[[Builder], Builder]:
    """Decorator that adds a benchmark builder to :data:`BENCHMARKS` under ``name``;
    ``fp8_providers``: its providers under an fp8 ``--dtype`` (None: it takes none)."""
    for offered in (providers, fp8_providers or [REFERENCE]):
        if REFERENCE not in offered:
            raise ValueError(f"benchmark {name!r}: providers {list(offered)} lack {REFERENCE!r}")

    def add(build: Builder) -> Builder:
        if name in BENCHMARKS:
            raise ValueError(f"benchmark {name!r} is registered twice")
        fp8 = None if fp8_providers is None else tuple(fp8_providers)
        BENCHMARKS[name] = Benchmark(name, build, tuple(providers), fp8)
        return build

    return add


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an int >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_number(text: str) -> float:
    """An argparse type: a finite float > 0."""
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_timeout_argument(
    parser: argparse.ArgumentParser, default_s: float, what: str, flag: str = "--timeout-s"
) -> None:
    """``flag``: the deadline of ``what``, a positive number of seconds."""
    parser.add_argument(
        flag,
        type=positive_number,
        default=default_s,
        help=f"deadline of {what}, seconds (default {default_s:g})",
    )


def rotated(names: Sequence[str], shift: int) -> list[str]:
    """``names`` rotated left by ``shift``: the provider order of round ``shift``."""
    if not names:
        return []
    k = shift % len(names)
    return [*names[k:], *names[:k]]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, interpolating linearly between the closest
    ranks: ``sorted[i] + f * (sorted[i+1] - sorted[i])`` with ``i + f = q/100 * (n - 1)``."""
    if not values:
        raise ValueError("percentile: values is empty; need at least one value")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile: q={q} is outside [0, 100]")
    ordered = sorted(values)
    pos = q / 100.0 * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (pos - lo) * (ordered[hi] - ordered[lo])


def summarize(times_ms: Sequence[float]) -> dict[str, float]:
    """``{"median_ms", "p20_ms", "p80_ms"}`` of per-round times in milliseconds."""
    return {
        "median_ms": statistics.median(times_ms),
        "p20_ms": percentile(times_ms, 20),
        "p80_ms": percentile(times_ms, 80),
    }


def time_cells(times_ms: Sequence[float], digits: int) -> tuple[str, str, str]:
    """A table's ``median``, ``p20`` and ``p80`` cells of per-round times (ms), ``digits``
    decimals each."""
    stats = summarize(times_ms)
    median, p20, p80 = (f"{stats[key]:.{digits}f}" for key in ("median_ms", "p20_ms", "p80_ms"))
    return median, p20, p80


def cuda_seconds_back_to_back(
    fn: Callable[[], object], runs: int, *, warmup: int = 0
) -> list[float]:
    """The device seconds of each of ``runs`` calls of ``fn`` on the current stream, after
    ``warmup`` untimed calls: CUDA events around each call, recorded back to back and synchronized
    once at the end, so each call's host work overlaps the previous call on the device wherever the
    host launches faster than the device runs (as a training loop does)."""
    for _ in range(warmup):
        fn()
    events = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def host_seconds(
    fn: Callable[[], object], runs: int, *, before: Callable[[], object] | None = None
) -> list[float]:
    """The host seconds of each of ``runs`` calls of ``fn``, from the moment ``before()`` returns
    (outside the clock: a synchronize, so that a full launch queue never blocks the host inside a
    call; a barrier, so that the ranks start together) to the moment ``fn`` returns; the device
    may finish the call after the clock stops."""
    times = []
    for _ in range(runs):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _device_sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _tensors(out: Any) -> list[torch.Tensor]:
    if out is None:
        return []
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in _tensors(item)]
    raise TypeError(f"a provider returned {type(out).__name__}; expected tensors, lists or None")


def _max_error(got: Any, want: Any, tol: float) -> tuple[bool, float]:
    """``(allclose(got, want, rtol=tol, atol=tol), max |got - want|)``; ``inf`` error when the
    structure, shapes or dtypes differ, or an output holds NaN."""
    got_t, want_t = _tensors(got), _tensors(want)
    if len(got_t) != len(want_t):
        return False, math.inf
    ok, err = True, 0.0
    for g, w in zip(got_t, want_t, strict=True):
        if g.shape != w.shape or g.dtype != w.dtype:
            return False, math.inf
        if g.numel() == 0:
            continue
        # A NaN anywhere counts as an infinite error (max() would silently skip it).
        diff = (g.double() - w.double()).abs().nan_to_num(nan=math.inf)
        err = max(err, diff.max().item())
        ok = ok and bool((diff <= tol + tol * w.double().abs()).all().item())
    return ok, err


def check_outputs(
    case: BenchCase, names: Sequence[str], group: dist.ProcessGroup, device: torch.device
) -> dict[str, dict[str, Any]]:
    """Run every provider in ``names`` once and compare its output with the baseline's.

    Returns ``{name: {"checked": bool, "ok": bool, "max_abs_err": float}}`` agreed over ranks:
    ``ok`` is False when any rank's output is not ``allclose``; ``max_abs_err`` is the maximum over
    ranks. Unchecked providers still run once (so a crash shows here) and report ``ok=True``.
    """
    want = case.providers[case.baseline]()
    local_bad, local_err = [], []
    for name in names:
        got = want if name == case.baseline else case.providers[name]()
        if name in case.unchecked:
            ok, err = True, 0.0
        else:
            ok, err = _max_error(got, want, case.tolerance)
        local_bad.append(0.0 if ok else 1.0)
        local_err.append(err)
    flags = torch.tensor([*local_bad, *local_err], dtype=torch.float64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    flags = flags.cpu().tolist()
    n = len(names)
    return {
        name: {
            "checked": name not in case.unchecked,
            "ok": flags[i] == 0.0,
            "max_abs_err": flags[n + i],
        }
        for i, name in enumerate(names)
    }


def time_providers(
    providers: dict[str, Provider],
    *,
    rounds: int,
    warmup: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Time every provider ``rounds`` times, interleaved and rotated; per-round times in ms, each
    the maximum over the ranks of ``group``. ``group=None``: this process alone (no barrier, no
    maximum), for benchmarks of one device without a process group.

    ``clock`` returns seconds; tests pass a fake one.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    sync = _device_sync(device)
    names = list(providers)
    for i in range(warmup):
        for name in rotated(names, i):
            providers[name]()
    local = torch.zeros(rounds, len(names), dtype=torch.float64)
    column = {name: j for j, name in enumerate(names)}

    def fence() -> None:
        sync()
        if group is not None:
            dist.barrier(group=group)
            sync()

    for i in range(rounds):
        for name in rotated(names, i):
            fence()
            start = clock()
            providers[name]()
            sync()
            local[i, column[name]] = (clock() - start) * 1e3
    fence()
    slowest = local
    if group is not None:
        slowest = local.to(device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        slowest = slowest.cpu()
    return {name: slowest[:, column[name]].tolist() for name in names}


def select_providers(
    case: BenchCase, requested: Sequence[str] | None
) -> tuple[list[str], dict[str, str]]:
    """The providers of ``case`` to run (table order) and the skipped ones with the reason.

    ``requested=None`` runs every runnable provider. The baseline always runs: the correctness
    check and the speedup column are relative to it.
    """
    if case.baseline not in case.providers:
        raise ValueError(f"benchmark {case.name!r} offers no {case.baseline!r} provider")
    wanted = set(case.providers) | set(case.skipped) if requested is None else set(requested)
    wanted.add(case.baseline)
    names = [name for name in case.providers if name in wanted]
    skipped = {name: why for name, why in case.skipped.items() if name in wanted}
    return names, skipped


def run_case(
    case: BenchCase,
    cfg: BenchConfig,
    group: dist.ProcessGroup,
    device: torch.device,
    requested: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Check, warm up and time ``case`` on every rank of ``group``; return its result record.

    The record: ``name``, ``flops``, ``shapes``, ``tolerance``, ``baseline``, ``rate``
    (``{unit, per_call}`` or None), ``skipped`` (``{name: why}``), ``mismatches``
    (``{name: max_abs_err}`` of providers that failed the check, not timed), ``columns`` (the
    case's ``probe_columns``) and ``providers``:
    ``{name: {median_ms, p20_ms, p80_ms, times_ms, checked, max_abs_err}}``, plus
    ``<unit>_per_s`` when the case has a ``rate`` and the probe's fields when it has a ``probe``.
    """
    names, skipped = select_providers(case, requested)
    checks = check_outputs(case, names, group, device)
    good = [name for name in names if checks[name]["ok"]]
    mismatches = {name: checks[name]["max_abs_err"] for name in names if not checks[name]["ok"]}
    times = time_providers(
        {name: case.providers[name] for name in good},
        rounds=cfg.rounds,
        warmup=cfg.warmup,
        group=group,
        device=device,
    )
    records = {
        name: {
            **summarize(times[name]),
            "times_ms": times[name],
            "checked": checks[name]["checked"],
            "max_abs_err": checks[name]["max_abs_err"],
            "model_ms": case.predicted_ms.get(name),
        }
        for name in good
    }
    for name, rec in records.items():
        if case.rate is not None:
            unit, count = case.rate
            rec[f"{unit}_per_s"] = (
                count / (rec["median_ms"] * 1e-3) if rec["median_ms"] > 0 else 0.0
            )
        if case.probe is not None:
            rec.update(case.probe(name))
    return {
        "name": case.name,
        "flops": case.flops,
        "shapes": case.shapes,
        "tolerance": case.tolerance,
        "baseline": case.baseline,
        "rate": None if case.rate is None else {"unit": case.rate[0], "per_call": case.rate[1]},
        "skipped": skipped,
        "mismatches": mismatches,
        "columns": dict(case.probe_columns),
        "model_note": case.model_note,
        "note": case.note,
        "providers": records,
    }


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1) -> str:
    """``header`` and ``rows`` (cells of equal count) as aligned text: the first ``left`` columns
    left-aligned, the rest right-aligned, two spaces apart, no trailing spaces."""
    lines = [tuple(header), *(tuple(row) for row in rows)]
    for i, row in enumerate(lines):
        if len(row) != len(header):
            raise ValueError(f"rows[{i - 1}]: got {len(row)} cells, expected {len(header)}")
    widths = [max(len(row[c]) for row in lines) for c in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(width) if c < left else cell.rjust(width)
            for c, (cell, width) in enumerate(zip(row, widths))
        ).rstrip()
        for row in lines
    )


def _fmt_shapes(shapes: dict[str, list[int]]) -> str:
    return "  ".join(f"{k}[{','.join(map(str, v))}]" for k, v in shapes.items())


def _fmt_number(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else "-"


def format_table(result: dict[str, Any], meta: dict[str, Any]) -> str:
    """The result of :func:`run_case` as a text table with a one-line header.

    Columns: provider, median/p20/p80 (ms), the cost model's prediction (ms), GFLOP/s (``flops /
    median``, per rank), ``<unit>/s`` when the record has a ``rate`` (``per_call / median``),
    speedup vs the baseline (``baseline_median / median``), % of roof (``roof_median / median``),
    then the record's probe ``columns``.
    """
    provs = result["providers"]
    baseline = result.get("baseline", REFERENCE)
    rate = result.get("rate")
    columns = result.get("columns", {})
    ref = provs.get(baseline, {}).get("median_ms")
    roof = provs.get(ROOF, {}).get("median_ms")
    lines = [
        f"== {result['name']}  {_fmt_shapes(result['shapes'])}  {meta['dtype']}  "
        f"world={meta['world_size']} ({meta['pg_backend']})  rounds={meta['rounds']} "
        f"warmup={meta['warmup']}",
    ]
    rate_header = [] if rate is None else [f"{rate['unit']}/s"]
    header = (
        "provider", "median ms", "p20 ms", "p80 ms", "model ms", "GFLOP/s", *rate_header,
        f"vs {baseline}", "% of roof", *columns.values(),
    )  # fmt: skip
    rows = []
    for name, rec in provs.items():
        med = rec["median_ms"]
        rate_cell = (
            [] if rate is None else [f"{rec[rate['unit'] + '_per_s']:.0f}" if med > 0 else "-"]
        )
        probed = [_fmt_number(rec.get(key)) for key in columns]
        rows.append(
            (
                name,
                f"{med:.3f}",
                f"{rec['p20_ms']:.3f}",
                f"{rec['p80_ms']:.3f}",
                f"{rec['model_ms']:.3f}" if rec.get("model_ms") is not None else "-",
                f"{result['flops'] / (med * 1e-3) / 1e9:.1f}" if med > 0 else "-",
                *rate_cell,
                f"{ref / med:.2f}x" if ref and med > 0 else "-",
                f"{100.0 * roof / med:.1f}%" if roof and med > 0 else "-",
                *probed,
            )
        )
    lines.append(render_table(header, rows))
    if result.get("model_note"):
        lines.append(f"  (model ms: {result['model_note']})")
    if result.get("note"):
        lines.append(f"  ({result['note']})")
    for name, why in result["skipped"].items():
        lines.append(f"  (skipped {name}: {why})")
    for name, err in result["mismatches"].items():
        lines.append(
            f"  !!! MISMATCH: {name} differs from {baseline} (max |diff| = {err:.3g}, "
            f"tolerance {result['tolerance']:.3g}); not timed"
        )
    return "\n".join(lines)


def machine_info(device: torch.device) -> dict[str, Any]:
    """Platform, CPU count and (on CUDA) the GPU name of this process."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }
    return info


def versions() -> dict[str, str | None]:
    """Versions of python, torch, triton (``None`` when not importable) and tp_kernels."""
    import tp_kernels

    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton_version,
        "tp_kernels": tp_kernels.__version__,
    }
