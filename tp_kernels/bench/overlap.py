"""``python -m tp_kernels.bench.overlap``: does the symm backend overlap its copies with its GEMM?
Measured on one GPU, beside PyTorch's own fused ops.

Why: two ranks in two processes on one GPU are time-sliced, so a fused step measured that way
(27.7 ms per MLP step against 0.63 ms of matmuls) says nothing about overlap. Here the ranks
share the GPU's SMs at once, under CUDA MPS, or the copies come from local "peers".

**1. The probe** (one process, before MPS starts; :func:`probe`):

* MPS: whether ``nvidia-cuda-mps-control`` is on ``PATH``, whether a daemon already runs (its
  control pipe in the default pipe directory), ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` here, the
  SMs torch reports;
* the copy engine: a spinner (:mod:`tp_kernels.bench._spinner`, 16 programs per SM: every warp
  slot of every SM) runs for about ``--spin-ms`` on one stream; a ``--copy-mib`` device-to-device
  copy on another stream waits only for the event before the spinner. Events time both from the
  spinner's start: a copy that ends before the spinner ran beside it (the copy engine: no SM),
  one that ends after it waited for an SM;
* the copy-only bandwidth: bytes copied per second of the same copy alone (median of 5).

**2. The ranks**, started by :mod:`tp_kernels.bench.driver`. Where MPS can start, 2 ranks under
the script's own MPS daemon (:class:`~tp_kernels.bench.driver.MpsDaemon`, started within
``--mps-timeout-s`` and stopped whatever happened; no GPU setting changes), each limited to half
the SMs (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50``). Where MPS or its ranks cannot start, **local
peers**: one process whose "peer" buffers are local tensors holding what rank 1 would publish,
read by the same copier; its persistent GEMMs take half the SMs
(:data:`tp_kernels.config.SHARED_DEVICE_RANKS` 2). Under MPS a rank's GEMMs take one program per
SM of its share: all the SMs its device reports where MPS reports the share, else half of them.
The output names the mode.

**3. The rows** (:mod:`tp_kernels.bench.overlap_rows` says what each runs and how it is checked),
per op, shape and copy repeat: ``gemm``, ``copies``, ``bound`` (both at once, independent),
``unfused``, ``symm`` (the backend's fused data path), ``symm_op`` (the public op on ``symm``)
and ``torch`` (PyTorch's fused op through ``torch_symm_mem``), each checked on NaN-filled
outputs first; a row that fails says FAIL and is not timed.

``--copy-repeat k``, a test-only knob, makes every copy ``k`` copies, so that copies inside one
GPU take as long as over NVLink; ``auto`` is the probed bandwidth over :data:`NVLINK_GBPS`
(rounded, at least 1). Shapes: ``llama3-8b`` is Llama-3-8B's w1|w3 (all-gather)
and w2 (reduce-scatter) at 8192 tokens and TP 8; ``balanced`` cuts N (K) to 512 so that the GEMM
on half an H100 and the copies at NVLink speed should take about the same time (an estimate
from published peak rates; the ``gemm`` and ``copies`` rows show what they take).

Each row is timed by the protocol of ``python -m tp_kernels.bench``
(:func:`tp_kernels.bench.protocol.time_providers`: warmup, then rounds in a rotated order, each
call from a barrier to its device's synchronization, the slowest rank's time); the table shows
medians and 20th/80th percentiles, and ``host ms``: the median host time of one call started on
an idle device (synchronize, then time the call until it returns, without waiting on the
device; the slowest rank's). Per case, for each fused row (``symm``, ``symm_op``, ``torch``;
:func:`overlap_metrics`)::

    overlap efficiency = (unfused - fused) / (unfused - bound)   (1: perfect, 0: none)
    exposed comm (ms)  = fused - gemm

``--device cpu``: the same code with ``TRITON_INTERPRET=1`` (set before starting) and CPU tensors,
in this process, local peers, tiny shapes: the copier and pusher are host threads, the copies host
copies, the GEMMs interpreted, the spinner interpreted and checked. Its times mean nothing; what it
proves is that every row runs and computes the right result, so the first GPU runs code that ran.

Expected time on an H100 or H200 (not measured: no GPU has run this): the probe and each world's
start some 10-20 s each; compiling and tuning the two GEMMs at the 2 default shapes (the
first bf16 symm row took 48 s on an H200) 2-4 minutes; the timed rounds seconds. Every part has a
deadline: the probe 90 s, the MPS ranks' first allocation 60 s, the measurements ``--timeout-s``
(360 s), each MPS daemon start or stop ``--mps-timeout-s`` (30 s), each GEMM wait for a word
``--wait-timeout-s`` (60 s). ``--device cpu`` on 2 shared cores: 5-16 s.

Exit status: 0 when every check passes, 1 when one fails (or a rank fails), 2 for bad arguments.
Without CUDA and without ``--device cpu`` it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tp_kernels.bench.driver import (
    MpsDaemon,
    Ranks,
    device_ready,
    exit_status,
    rank_device,
    run_row,
)
from tp_kernels.bench.overlap_rows import OPS, ROWS, WORLD, Case, Setup, rank_hello, run_cases
from tp_kernels.bench.protocol import (
    DTYPES,
    add_timeout_argument,
    cuda_seconds_back_to_back,
    host_seconds,
    non_negative_int,
    positive_int,
    positive_number,
    render_table,
    time_cells,
    versions,
)
from tp_kernels.testing import RankError

__all__ = [
    "LOCAL",
    "MPS",
    "NO_CUDA_MESSAGE",
    "main",
    "merge",
    "mps_run",
    "overlap_metrics",
    "parse_args",
    "probe",
    "render_case",
]

NO_CUDA_MESSAGE = "no CUDA device: nothing to measure"
FUSED = ("symm", "symm_op", "torch")
MPS, LOCAL = "2 ranks under MPS", "local peers: one process"
# NVLink 4 (H100, H200): 900 GB/s both ways, 450 GB/s each way.
NVLINK_GBPS = 450.0
# (name, M, K, N) per op; see the module docstring.
GPU_SHAPES = {
    "ag_matmul": (("llama3-8b", 8192, 4096, 3584), ("balanced", 8192, 4096, 512)),
    "matmul_rs": (("llama3-8b", 8192, 1792, 4096), ("balanced", 8192, 512, 4096)),
}
CPU_SHAPES = {op: (("tiny", 32, 32, 48),) for op in OPS}
# Deadlines of the probe (compiling the spinner included) and of the MPS ranks' first allocation;
# a world's start has its own (LocalWorld's process group init).
PROBE_TIMEOUT_S, HELLO_TIMEOUT_S = 90.0, 60.0


def overlap_metrics(medians: Mapping[str, float], fused: str) -> tuple[float | None, float]:
    """``(efficiency, exposed_ms)`` of the fused row ``fused`` from the rows' medians (ms):
    ``(unfused - fused) / (unfused - bound)`` (None where ``unfused <= bound``: nothing to hide)
    and ``fused - gemm``."""
    unfused, bound, done = medians["unfused"], medians["bound"], medians[fused]
    efficiency = (unfused - done) / (unfused - bound) if unfused > bound else None
    return efficiency, done - medians["gemm"]


# ---------------------------------------------------------------------------------------------
# The probe


def probe(kind: str, spin_ms: float, copy_mib: int) -> dict[str, Any]:
    """The facts of section 1 of the module docstring, as ``{name: text or number}``."""
    from tp_kernels.bench import _spinner

    device = rank_device(kind)
    facts: dict[str, Any] = {}
    control = shutil.which("nvidia-cuda-mps-control")
    facts["mps control"] = control or "not on PATH"
    default_pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    facts["mps daemon already running"] = (default_pipe / "control").exists()
    facts["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = os.environ.get(
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "unset"
    )
    cuda = device.type == "cuda"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 2
    facts["SMs"] = sms if cuda else "n/a (cpu)"
    src = torch.randn(copy_mib << 18, device=device)  # 4-byte floats: copy_mib MiB
    dst = torch.empty_like(src)
    spun = torch.empty(sms * _spinner.PROGRAMS_PER_SM * _spinner.BLOCK, dtype=torch.int32)
    spun = spun.to(device)
    if not cuda:
        # The interpreter runs the spinner on the host: a few steps, checked; no copy engine.
        _spinner.spin(spun, 3)
        good = torch.equal(spun, _spinner.expected(sms * _spinner.PROGRAMS_PER_SM, 3))
        facts["spinner"] = "ok (checked)" if good else "FAIL: wrong result"
        facts["copy engine"] = "n/a on cpu: the copier is a host thread"
        copy_s = statistics.median(host_seconds(lambda: dst.copy_(src), 5))
    else:
        facts["spinner"], facts["copy engine"] = _copy_engine_verdict(src, dst, spun, spin_ms)
        copy_s = _median_event_s(lambda: dst.copy_(src), 5)
    facts["copy GB/s"] = src.nbytes / copy_s / 1e9
    return facts


def _median_event_s(fn: Callable[[], object], reps: int) -> float:
    # One untimed call first: the first call compiles or touches pages.
    return statistics.median(cuda_seconds_back_to_back(fn, reps, warmup=1))


def _copy_engine_verdict(
    src: torch.Tensor, dst: torch.Tensor, spun: torch.Tensor, spin_ms: float
) -> tuple[str, str]:
    from tp_kernels.bench import _spinner

    programs = spun.numel() // _spinner.BLOCK
    iters = 1 << 12  # a first guess, timed (after compiling), then scaled to spin_ms
    alone_ms = _median_event_s(lambda: _spinner.spin(spun, iters), 3) * 1e3
    iters = max(1, round(iters * spin_ms / max(alone_ms, 1e-3)))
    side = torch.cuda.Stream(src.device)
    start, spin_end, copy_end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    torch.cuda.synchronize(src.device)
    start.record()
    _spinner.spin(spun, iters)
    spin_end.record()
    side.wait_event(start)
    with torch.cuda.stream(side):
        dst.copy_(src)
        copy_end.record()
    torch.cuda.synchronize(src.device)
    spin, copy = start.elapsed_time(spin_end), start.elapsed_time(copy_end)
    good = torch.equal(spun.cpu(), _spinner.expected(programs, iters))
    spinner = f"{programs} programs x {iters} steps: {spin:.2f} ms, " + (
        "ok (checked)" if good else "FAIL: wrong result"
    )
    size = f"{src.nbytes / 2**20:.0f} MiB D2D copy"
    if copy < spin:
        verdict = f"yes: the {size} ended at {copy:.3f} ms, the spinner at {spin:.3f} ms"
    else:
        verdict = f"NO: the {size} ended at {copy:.3f} ms, after the spinner ({spin:.3f} ms)"
    return spinner, verdict


# ---------------------------------------------------------------------------------------------
# The command


def _shape(text: str) -> tuple[str, int, int, int]:
    parts = text.split(",")
    try:
        dims = [positive_int(p) for p in parts]
    except (ValueError, argparse.ArgumentTypeError):
        dims = []
    if len(dims) != 3 or dims[0] % WORLD:
        raise argparse.ArgumentTypeError(
            f"got {text!r}, expected M,K,N: three positive ints, M a multiple of {WORLD}"
        )
    return (f"{dims[0]}x{dims[1]}x{dims[2]}", *dims)


def _repeat(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except ValueError:  # not a number: argparse would only say "invalid _repeat value"
        raise argparse.ArgumentTypeError(
            f"got {text!r}, expected a positive integer or auto"
        ) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tp_kernels.bench.overlap",
        description="Measure how much of the symm backend's communication its fused GEMMs hide, "
        "on one GPU (two ranks under MPS, or local peers), beside PyTorch's fused ops.",
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (default), or cpu: the same code in Triton's interpreter on CPU tensors, "
        "local peers, tiny shapes (needs TRITON_INTERPRET=1; times mean nothing)",
    )
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="ops to measure")
    p.add_argument(
        "--shape",
        type=_shape,
        action="append",
        default=None,
        metavar="M,K,N",
        help="a shape for every op, repeatable (default: llama3-8b and balanced on cuda, "
        "32,32,48 on cpu)",
    )
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default bf16 (cuda), fp32 (cpu)")
    p.add_argument(
        "--copy-repeat",
        type=_repeat,
        nargs="+",
        default=None,
        metavar="K",
        help="test-only: copy each chunk K times, so copies inside one GPU are as slow as over a "
        f"link; 'auto': probed GB/s / {NVLINK_GBPS:g} (NVLink). One case per value "
        "(default: 1 auto on cuda, 1 2 on cpu)",
    )
    p.add_argument("--rounds", type=positive_int, default=None, help="timed rounds (30; cpu 2)")
    p.add_argument("--warmup", type=non_negative_int, default=None, help="untimed (5; cpu 1)")
    p.add_argument(
        "--host-reps", type=positive_int, default=None, help="host-time calls per row (20; cpu 2)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    p.add_argument("--spin-ms", type=positive_number, default=20.0, help="the probe's spinner time")
    p.add_argument(
        "--copy-mib", type=positive_int, default=None, help="the probe's copy (256; cpu 1)"
    )
    p.add_argument("--no-mps", action="store_true", help="local peers even where MPS could run")
    p.add_argument(
        "--mps-timeout-s", type=positive_number, default=30.0, help="each MPS daemon start/stop"
    )
    add_timeout_argument(p, 360.0, "the measurements (the ranks' whole run)")
    add_timeout_argument(p, 60.0, "each GEMM wait for a progress word", "--wait-timeout-s")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line with the device's defaults filled in; exits 2 on bad arguments."""
    args = _parser().parse_args(argv)
    gpu = args.device == "cuda"
    for name, cuda_default, cpu_default in (
        ("dtype", "bf16", "fp32"),
        ("copy_repeat", [1, "auto"], [1, 2]),
        ("rounds", 30, 2),
        ("warmup", 5, 1),
        ("host_reps", 20, 2),
        ("copy_mib", 256, 1),
    ):
        if getattr(args, name) is None:
            setattr(args, name, cuda_default if gpu else cpu_default)
    shapes = GPU_SHAPES if gpu else CPU_SHAPES
    args.shapes = {op: tuple(args.shape) if args.shape else shapes[op] for op in args.ops}
    return args


def _repeats(asked: Sequence[int | str], gbps: float) -> tuple[int, ...]:
    auto = max(1, round(gbps / NVLINK_GBPS))
    return tuple(dict.fromkeys(auto if k == "auto" else k for k in asked))


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_case(case: Case, mode: str, dtype: str) -> str:
    """One case's table and its efficiency lines."""
    name, M, K, N = case.shape
    lines = [f"== {case.op} {name} M={M} K={K} N={N} {dtype} copy-repeat={case.repeat} ({mode})"]
    header = ("row", "median ms", "p20 ms", "p80 ms", "host ms", "check")
    cells = []
    for row in ROWS:
        if row in case.na:
            cells.append((row, "n/a", "-", "-", "-", case.na[row]))
            continue
        times = case.times_ms.get(row)
        verdict = ("ok, " if case.ok[row] else "FAIL, ") + case.checks[row]
        if not times:
            cells.append((row, "-", "-", "-", "-", verdict))
            continue
        cells.append((row, *time_cells(times, 3), _fmt(case.host_ms[row]), verdict))
    lines.append(render_table(header, cells))
    # The arithmetic on the printed (rounded) medians, so a reader can redo it.
    medians = {row: round(ms, 3) for row, ms in case.medians().items()}
    for fused in FUSED:
        needed = ("gemm", "bound", "unfused", fused)
        if fused in case.na or not all(row in medians for row in needed):
            why = case.na.get(fused, "a row it needs was not timed")
            lines.append(f"  {fused}: overlap efficiency n/a ({why})")
            continue
        eff, exposed = overlap_metrics(medians, fused)
        shown = "n/a (unfused <= bound: nothing to hide)" if eff is None else f"{eff:.2f}"
        lines.append(
            f"  {fused}: overlap efficiency {shown} = (unfused {medians['unfused']:.3f} - "
            f"{fused} {medians[fused]:.3f}) / (unfused {medians['unfused']:.3f} - bound "
            f"{medians['bound']:.3f}); exposed comm {exposed:.3f} ms = {fused} "
            f"{medians[fused]:.3f} - gemm {medians['gemm']:.3f}"
        )
    return "\n".join(lines)


def merge(per_rank: Sequence[Sequence[Case]]) -> list[Case]:
    """The ranks' cases as one: a row's check text is that of each rank that failed it (rank 0's
    where none did), its host time the slowest rank's; times and verdicts are already agreed."""
    merged = []
    for cases in zip(*per_rank, strict=True):
        first = replace(cases[0], checks=dict(cases[0].checks))
        for row in first.checks:
            failed = [
                f"rank {r}: {c.checks[row]}" for r, c in enumerate(cases) if not c.local_ok[row]
            ]
            first.checks[row] = " | ".join(failed) or first.checks[row]
        first.host_ms = {row: max(c.host_ms[row] for c in cases) for row in first.host_ms}
        merged.append(first)
    return merged


def mps_run(
    args: argparse.Namespace, setup: Setup, control: str, full_sms: int | None
) -> tuple[str, list[Case]] | None:
    """The cases on 2 ranks under this script's MPS daemon (``control``: the control program;
    ``full_sms``: the GPU's SM count, None on the CPU), or None (printed why) where MPS or its
    ranks cannot start. On the CPU (tests, with a stand-in control program) the same steps run
    on CPU ranks."""
    daemon = MpsDaemon(control, args.mps_timeout_s)
    why = daemon.start()
    if why is not None:
        daemon.stop()
        print(f"MPS: cannot start ({why})")
        return None
    world = Ranks(args.device, args.timeout_s, mps=daemon).world(WORLD)
    try:
        hello = run_row(world, rank_hello, setup.device, timeout_s=HELLO_TIMEOUT_S)
        if hello.per_rank is None:
            print(f"MPS: started, but its ranks could not: {hello.error.splitlines()[0]}")
            return None
        for r, h in enumerate(hello.per_rank):
            print(
                f"MPS rank {r}: {h['sms']} SMs reported (the GPU has {full_sms}), "
                f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={h['percentage']}"
            )
        # Where MPS reports each rank its share, its persistent GEMMs take all it reports.
        shared = WORLD if all(h["sms"] == full_sms for h in hello.per_rank) else 1
        print(f"persistent GEMMs: one program per SM of 1/{shared} of the SMs reported")
        return MPS, merge(world.run(run_cases, replace(setup, shared_ranks=shared), True))
    finally:
        world.close()
        print(f"MPS daemon stopped ({daemon.stop()})")


def _alone(
    args: argparse.Namespace, timeout_s: float, fn: Callable[..., Any], *fn_args: Any
) -> Any:
    """``fn(*fn_args)`` within ``timeout_s``: on the CPU in this process (where the tests patch
    what it calls), on CUDA in a process of its own, as the ranks are, so that this one never
    holds a CUDA context."""
    if args.device == "cpu":
        return fn(*fn_args)
    with Ranks(args.device, timeout_s).world(1) as world:
        return world.run(fn, *fn_args)[0]


def _measure_all(args: argparse.Namespace) -> tuple[dict[str, Any], str, list[Case]]:
    """The probe (printed as it comes), then every case: under MPS where it runs, else on local
    peers. Returns the probe's facts, the mode and the cases."""
    facts = _alone(args, PROBE_TIMEOUT_S, probe, args.device, args.spin_ms, args.copy_mib)
    print("== probe")
    for key, value in facts.items():
        print(f"  {key}: {_fmt(value, 1) if isinstance(value, float) else value}", flush=True)
    setup = Setup(
        device=args.device, dtype=args.dtype, shapes=args.shapes,
        repeats=_repeats(args.copy_repeat, facts["copy GB/s"]), rounds=args.rounds,
        warmup=args.warmup, host_reps=args.host_reps, seed=args.seed,
        wait_timeout_s=args.wait_timeout_s,
    )  # fmt: skip
    control = facts["mps control"]
    outcome = None
    if args.device == "cuda" and not args.no_mps and control != "not on PATH":
        outcome = mps_run(args, setup, control, facts["SMs"])
    if outcome is None:
        outcome = LOCAL, _alone(args, args.timeout_s, run_cases, setup, False)
    return facts, *outcome


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (see the module docstring)."""
    args = parse_args(argv)
    if not device_ready(_parser(), args.device, interpreted_cpu=True):
        print(NO_CUDA_MESSAGE)
        return 0
    v = versions()
    print(
        f"tp_kernels.bench.overlap on {args.device}: torch {v['torch']}, triton {v['triton']}; "
        f"{args.dtype}, {args.warmup} warmup + {args.rounds} rounds, {args.host_reps} host reps"
    )
    started = time.perf_counter()
    try:
        facts, mode, cases = _measure_all(args)
    except RankError as exc:  # a rank raised, crashed or missed its deadline: no table to show
        print(f"ERROR: {exc}", file=sys.stderr)
        return 1
    for case in cases:
        print(render_case(case, mode, args.dtype))
    print(f"done in {time.perf_counter() - started:.1f} s")
    failed = [f"{c.op}/{c.shape[0]}/x{c.repeat}/{row}" for c in cases for row in c.failed]
    if "FAIL" in str(facts.get("spinner", "")):
        failed.append("probe/spinner")
    return exit_status(failed, "the tables above")


if __name__ == "__main__":
    # Run through the imported module, so that what a rank unpickles (the probe) has the module's
    # real name rather than __main__.
    from tp_kernels.bench.overlap import main as _main

    raise SystemExit(_main())
