"""``python -m tp_kernels.bench.gpu_check``: the GPU path of both fused ops, with several ranks on
one GPU, checked against float64; then the kernels' tile GEMMs timed against cuBLAS.

What runs (``--device cuda``, the default, on a machine with one GPU):

0. Before anything runs, the facts a first run of ``torch_symm_mem`` depends on, read in this
   process (:func:`print_first_contact_facts`): the schemas of ``torch.ops.symm_mem``'s
   ``fused_all_gather_matmul`` and ``fused_matmul_reduce_scatter``, whether ``cuda:0`` reports
   multicast (``has_multicast_support``, which picks torch's multicast all-gather), torch's
   symmetric-memory backend for it, and ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES`` here and in
   the ranks' environment.
1. For each world size of ``--worlds`` (default 2, then 4), a
   :class:`~tp_kernels.testing.LocalWorld` of that many local ranks. Their process group is gloo,
   since NCCL refuses two ranks on one GPU; every rank calls ``torch.cuda.set_device(0)`` and works
   on ``cuda:0``, and the ranks' environment has ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` so
   that CUDA symmetric memory accepts ranks that share a device, and ``TP_KERNELS_TIMEOUT_S`` so
   that no symm wait is longer than ``--symm-timeout-s``. The backends come from
   :func:`tp_kernels.available_backends`: each one listed as ``"ok"`` for the device (and for the
   world's group) runs; ``symm`` must run, a backend that cannot gets a row saying why
   (``pipelined``: gloo's send/recv carry host memory only, so on one GPU it cannot run;
   ``torch_symm_mem`` where torch lacks its ops).
2. For each backend, op and dtype (fp32, bf16, fp16) one row: a sequence of calls of the public op
   (:func:`tp_kernels.all_gather_matmul` or :func:`tp_kernels.matmul_reduce_scatter`), forward and
   backward, over shapes that are not multiples of 16 or of a tile (K=1000 and 744, N=72, 136,
   ..., a different N for each ``b`` and for each rank, a different K for each rank in the
   reduce-scatter), with a batch dim (``gather_dim``/``scatter_dim`` 1 of ``[B, S, K]``),
   ``return_a`` with a gradient fed into the returned ``a``, several ``bs``, a bias and
   ``reduce_op="avg"``. Shapes shrink and grow again, so symm's workspace grows between calls;
   each call is 2 fused calls (forward, then the other op in backward), so symm runs 60
   consecutive calls per world (36 with ``--quick``), alternating its two buffer halves.
2b. The fp8 rows (dtype ``fp8-rowwise`` and ``fp8-tensorwise``; ``--dtypes`` without them leaves
   them out), per backend and op: calls of the public scaled ops
   (:func:`tp_kernels.all_gather_scaled_matmul`, :func:`tp_kernels.scaled_matmul_reduce_scatter`),
   forward only (fp8 tensors carry no gradient): e4m3 operands, row-wise (``a_scale`` per row,
   ``b_scale [1, N]``) or tensor-wise scales, bf16 out, ``use_fast_accum=False``; K and N
   multiples of 16 (fp8 GEMMs need it) but not of a tile (K=1008, 528; N=48, 80, 208), a batch
   dim, several ``bs``, a reduce-scatter whose K differs by rank, and one tile-aligned case. Each
   result is compared with ``torch._scaled_mm`` of the gathered (summed) operands computed on the
   rank, within two bf16 roundings plus the fp32 accumulation bound for the all-gather, three for
   the reduce-scatter (:mod:`tp_kernels.testing.fp8_cases` argues it); one fused call per call.
   A device whose ``torch._scaled_mm`` refuses a scaling (no fp8 GEMMs; no row-wise ones) gets
   n/a rows saying so.
3. The capture rows (:mod:`tp_kernels.bench.capture_check`; ``--skip-capture`` leaves them out,
   ``--capture-only`` runs nothing else): with 2 ranks, a TP MLP step per backend captured in a
   CUDA graph after three eager steps, replayed 20 times with new inputs against eager steps on
   the same inputs, and timed both ways (host and device time per step); a ``local (no comm)``
   row times the step's matmuls alone; ``--host-profile`` prints rank 0's cProfile of each
   row's eager steps. On ``--device cpu`` an eager stand-in takes the graph's place.
4. The tile-GEMM timing: :func:`tp_kernels.bench.gpu_kernels.main` at M=8192 N=3584 K=8192 bf16,
   in this process once the worlds are gone (``--skip-timing`` leaves it out); then, when
   ``--dtypes`` has ``fp8-rowwise``, ``gpu_kernels --dtype fp8-rowwise`` at the same shape: the
   consumer and producer GEMMs in fp8 (e4m3, row-wise scales, bf16 out) against
   ``torch._scaled_mm`` (cuBLASLt), ``_scaled_mm`` first checked against the fp32 product and
   each kernel against ``_scaled_mm``.
5. The cost model's calibration (:func:`tp_kernels.bench.calibration.run`; ``--skip-timing``
   leaves it out too), timed on the device by events: device-to-device copies of chunk sizes,
   and at the Llama shapes the all-gather's consumer kernel launched as rank 0 of 8 with every
   progress word already raised, so that no tile waits, each launch first checked against
   ``torch.mm``; and ``torch.mm`` (cuBLAS) at the same shapes. The model's ``gemm_efficiency``,
   ``tile_overhead_s`` and ``copy_latency_s`` fitted from them are printed beside the assumed
   figures and cuBLAS's fit, with the ``bench model`` command that uses them.

What is checked, on every rank, for every call (the fp8 rows: 2b above): the results and gradients
of :func:`tp_kernels.testing.fused_cases.run_case` (its docstring has each formula), whose whole
problem is drawn from a seed so that each rank rebuilds every rank's shards.

Each result is compared with the same formula in float64 on the rank (the truth), by the rule of
the fused-op tests (:mod:`tp_kernels.testing.numerics`, which argues each dtype's floor;
``torch_symm_mem`` rows get its wider floors: its backward's addend is reduced outside torch's op,
in the dtype). The table shows, per row, the largest ``max|got - truth| / tolerance`` over every
result, call and rank; a row passes when it is at most 1, nothing had the wrong shape or dtype,
and the op counters (:func:`tp_kernels.comm_stats`) saw exactly 2 fused calls per call on that
backend (fp8 rows: 1, counted as the scaled op's).

Nothing waits forever: every row has a deadline (``--timeout-s``, 120 s: the first symm row of
a world compiles and tunes the Triton kernels); a rank that raises, crashes or misses it
fails that row with its error, the world is torn down and started again for the next row, and
the backend's remaining rows in that world are skipped (its state there is unknown). A rank that
raises ends the row within seconds; a rank that crashes while a peer waits for it in a gloo
collective costs the whole deadline (the survivor is only stopped then).

``--device cpu`` (no GPU needed) runs what can run on a CPU: the same worlds of gloo ranks on CPU
tensors, every backend that is available there, and symm twice: on its default torch path, and as
``symm[triton]`` on its Triton path in Triton's interpreter (the ranks' environment has
``TRITON_INTERPRET=1`` from the start, before Triton is imported, and
``config.SYMM_TRITON`` is overridden for those rows: a row of a path that cannot run says why and
fails), the fp8 rows included (oneDNN's ``_scaled_mm`` is their reference there); tiny shapes,
the interpreter is slow. The cuBLAS timing (bf16 and fp8) is skipped with a
line saying why. Without CUDA and without ``--device cpu`` it says there is no CUDA device and
exits 0.

Expected time. On one H200 (measured 2026-12-04, benchmarks/README.md): the 2-rank world with
``--quick --dtypes bf16 fp32`` took 195 s, of which symm's first bf16 row 48 s (compiling and
autotuning) and its fp32 row its whole 120 s deadline (fp32 autotuning alone takes ~35 s per key);
other rows under 10 s; the capture rows about a minute; the bf16 tile-GEMM check 6 s. Not measured
yet: the 4-rank world, the calibration, the fp8 rows and the fp8 GEMM timing (no GPU has run
them), a full run (estimate: 5-10 minutes, plus up to one deadline
per world for each backend that hangs). ``--quick`` runs 3 calls per row instead of 5, 10 timed GEMM
calls instead of 50 and 5 timed calibration runs instead of 20; ``--worlds 2`` and ``--dtypes`` trim
further. ``--device cpu`` on 2 cores (measured, on a shared machine): 1.3-2.3 min in all, of
which the 2-rank world 24-39 s and the 4-rank world 52-95 s (starting it ~17 s; each
interpreted Triton row 2-8 s); ``--quick --worlds 2`` 30-40 s; the fp8 rows alone (``--quick
--worlds 2 --dtypes fp8-rowwise fp8-tensorwise --skip-capture``) 25 s, start-up included.

``--cuda-max-connections 1`` (worth a second run on first contact, ``--backends symm --worlds
2 --skip-timing``, about a minute) gives the ranks ``CUDA_DEVICE_MAX_CONNECTIONS=1``, as
Megatron-style TP overlap sets it: every stream of a rank shares one hardware queue, where a
stream wait enqueued ahead of the work it waits for (the reduce-scatter pusher's
``cuStreamWaitValue32`` before its producer) would never end.

Where it lives: the ranks start and each row runs on them by :mod:`tp_kernels.bench.driver`; the
per-op rows (steps 1-2b) are :mod:`tp_kernels.bench.fused_rows`, the capture rows
:mod:`tp_kernels.bench.capture_check`, the timing :mod:`tp_kernels.bench.gpu_kernels` and
:mod:`tp_kernels.bench.calibration`; this module is the command and the order of its steps.

Exit status: 0 when every check passes, 1 when one fails, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
from collections.abc import Sequence

import torch

from tp_kernels.bench import calibration, capture_check
from tp_kernels.bench.driver import Ranks, device_ready
from tp_kernels.bench.fused_rows import OPTIONAL, REQUIRED, TRITON_LABEL, check_world, render
from tp_kernels.bench.protocol import DTYPES, FP8_DTYPES, add_timeout_argument
from tp_kernels.testing.numerics import FLOOR

__all__ = [
    "NO_CUDA_MESSAGE",
    "main",
    "parse_args",
]

NO_CUDA_MESSAGE = (
    "no CUDA device: torch {torch} sees none, so there is no GPU path to check. "
    "`--device cpu` runs the same worlds on CPU tensors instead (gloo ranks, the pipelined "
    "backend, and the symm backend on its torch path and on its Triton path in Triton's "
    "interpreter, with tiny shapes) and skips the cuBLAS timing."
)
TIMING_ARGV = ["--M", "8192", "--N", "3584", "--K", "8192", "--dtype", "bf16"]
# The same Llama shape with e4m3 operands and row-wise scales, against torch._scaled_mm.
FP8_TIMING_ARGV = [*TIMING_ARGV[:-1], "fp8-rowwise"]
MAX_WORLD = 4


def _ranks(args: argparse.Namespace) -> Ranks:
    return Ranks(args.device, args.timeout_s, args.symm_timeout_s, args.cuda_max_connections)


def check_worlds(args: argparse.Namespace) -> list[str]:
    """The per-op rows (:mod:`tp_kernels.bench.fused_rows`) of each world of ``--worlds``, a
    table per world; what failed."""
    failed: list[str] = []
    for world_size in args.worlds:
        started = time.perf_counter()
        rows = check_world(
            _ranks(args), world_size, dtypes=args.dtypes, backends=args.backends, quick=args.quick
        )
        where = "cuda:0, shared" if args.device == "cuda" else "cpu"
        print(f"\n== world of {world_size} ranks ({where}), {time.perf_counter() - started:.0f} s")
        print(render(rows))
        for row in rows:
            if row.result == "FAIL":
                print(f"  FAIL {row.label} {row.op} {row.dtype}: {row.failure}")
            if row.failed:
                failed.append(f"world {world_size}: {row.label} {row.op} {row.dtype}")
        sys.stdout.flush()
    return failed


def check_capture_rows(args: argparse.Namespace) -> list[str]:
    """The capture rows (:mod:`tp_kernels.bench.capture_check`) with 2 ranks; what failed."""
    world_size = 2
    print(
        f"\n== a TP MLP step captured and replayed, world of {world_size} ranks "
        f"({'cuda:0, shared' if args.device == 'cuda' else 'cpu: an eager stand-in'})",
        flush=True,
    )
    started = time.perf_counter()
    rows = capture_check.check_capture(
        _ranks(args),
        world_size,
        floors={name: FLOOR[dtype] for name, dtype in DTYPES.items()},
        backends=args.backends,
        quick=args.quick,
        profile=args.host_profile,
    )
    print(f"({time.perf_counter() - started:.0f} s)")
    print(capture_check.render(rows), flush=True)
    return [f"capture: {row.label}: {row.detail}" for row in rows if row.failed]


def check_timing(args: argparse.Namespace) -> list[str]:
    """On a GPU, the tile GEMMs against cuBLAS (bf16; fp8 when ``--dtypes`` has
    ``fp8-rowwise``), then the cost model's calibration; elsewhere a line saying why not. What
    failed."""
    if args.device == "cpu":
        print(
            "\ncuBLAS timing skipped: --device cpu has no cuBLAS and no GPU to time the "
            "tile GEMMs on (bf16, and fp8 against torch._scaled_mm)"
        )
        return []
    if args.skip_timing:
        print("\ncuBLAS timing skipped (--skip-timing)")
        return []
    failed = []
    if not time_gemms(args.quick):
        failed.append("tile GEMM timing (gpu_kernels)")
    if "fp8-rowwise" not in args.dtypes:
        print("\nfp8 GEMM timing skipped: --dtypes has no fp8-rowwise")
    elif not time_gemms(args.quick, FP8_TIMING_ARGV):
        failed.append("fp8 GEMM timing (gpu_kernels --dtype fp8-rowwise)")
    if not calibration.run(args.quick):
        failed.append("cost-model calibration")
    return failed


def time_gemms(quick: bool, argv: Sequence[str] = TIMING_ARGV) -> bool:
    """The tile GEMMs against cuBLAS, by :func:`tp_kernels.bench.gpu_kernels.main` with ``argv``
    (:data:`TIMING_ARGV`, or :data:`FP8_TIMING_ARGV`: the fp8 GEMMs against
    ``torch._scaled_mm``); True if its checks passed."""
    argv = [*argv, *(["--warmup", "2", "--reps", "10"] if quick else [])]
    print(f"\n== tile GEMMs vs cuBLAS: python -m tp_kernels.bench.gpu_kernels {' '.join(argv)}")
    try:
        from tp_kernels.bench import gpu_kernels

        status = gpu_kernels.main(argv)
    except SystemExit as exc:  # its argument errors
        status = exc.code
    except Exception as exc:  # a broken launcher is a failed check, reported, not a crash
        print(f"FAIL: gpu_kernels raised {type(exc).__name__}: {exc}", flush=True)
        return False
    print(f"gpu_kernels exit status {status}: {'ok' if status == 0 else 'FAIL'}", flush=True)
    return status == 0


def _versions(device: str) -> str:
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = "not installed"
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "none (--device cpu)"
    return (
        f"torch {torch.__version__}, triton {triton_version}, python {sys.version.split()[0]}, "
        f"GPU: {gpu}"
    )


def print_first_contact_facts(ranks: Ranks) -> None:
    """What a first run of torch's fused ops on ``ranks.device`` depends on, printed before
    anything runs (see :func:`tp_kernels.backends.torch_symm_mem.first_contact_facts`), and what
    the ranks' environment sets of it."""
    from tp_kernels.backends import torch_symm_mem

    where = torch.device("cuda", 0) if ranks.device == "cuda" else torch.device("cpu")
    print(f"\n== torch's symmetric memory, as torch_symm_mem will find it on {where}")
    for what, value in torch_symm_mem.first_contact_facts(where):
        print(f"  {what}: {value}")
    for name, value in ranks.env().items():
        print(f"  the ranks' environment sets {name}={value}")
    sys.stdout.flush()


def _world_size(text: str) -> int:
    value = int(text)
    if not 2 <= value <= MAX_WORLD:
        raise argparse.ArgumentTypeError(f"must be between 2 and {MAX_WORLD}, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tp_kernels.bench.gpu_check",
        description="Check both fused ops, forward and backward, with 2 and 4 ranks on one GPU, "
        "through every backend that can run, against float64; then time the kernels' tile "
        "GEMMs against cuBLAS.",
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (default: every rank on cuda:0), or cpu: what can run without a "
        "GPU (CPU tensors, symm's Triton path in the interpreter)",
    )
    p.add_argument(
        "--worlds",
        type=_world_size,
        nargs="+",
        default=[2, 4],
        metavar="W",
        help=f"world sizes to run, in order (2..{MAX_WORLD}; default: 2 4)",
    )
    p.add_argument(
        "--dtypes",
        choices=[*DTYPES, *FP8_DTYPES],
        nargs="+",
        default=[*DTYPES, *FP8_DTYPES],
        help="the rows' dtypes (default: all): fp32, fp16, bf16 check both ops forward and "
        "backward against float64; fp8-rowwise and fp8-tensorwise check the scaled ops "
        "(e4m3, bf16 out) against torch._scaled_mm, and fp8-rowwise adds the fp8 GEMM timing",
    )
    p.add_argument(
        "--backends",
        nargs="+",
        metavar="NAME",
        help="only these backends (default: every one tp_kernels.available_backends "
        f"lists; on cpu also {TRITON_LABEL})",
    )
    p.add_argument(
        "--quick", action="store_true", help="fewer calls per row and fewer timed GEMM calls"
    )
    p.add_argument(
        "--skip-timing",
        action="store_true",
        help="leave out the tile-GEMM timing and the calibration",
    )
    p.add_argument(
        "--skip-capture",
        action="store_true",
        help="leave out the capture rows (a TP MLP step captured and replayed, 2 ranks)",
    )
    p.add_argument(
        "--capture-only",
        action="store_true",
        help="run only the capture rows (no per-op worlds, no timing)",
    )
    p.add_argument(
        "--host-profile",
        action="store_true",
        help="print rank 0's cProfile of each capture row's eager steps (where the host's time "
        "per step goes)",
    )
    add_timeout_argument(p, 120.0, "one row on every rank, compiling included")
    p.add_argument(
        "--cuda-max-connections",
        type=int,
        choices=range(1, 33),
        metavar="N",
        help="CUDA_DEVICE_MAX_CONNECTIONS of the ranks (default: the driver's, 8); 1 puts every "
        "stream in one hardware queue, where a stream wait ahead of the work it waits for "
        "would never end",
    )
    add_timeout_argument(
        p, 60.0, "symm's signal waits (the ranks' TP_KERNELS_TIMEOUT_S)", "--symm-timeout-s"
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; exits with status 2 on bad arguments."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.backends:
        import tp_kernels

        known = set(tp_kernels.available_backends()) | set(REQUIRED[args.device]) | set(OPTIONAL)
        unknown = sorted(set(args.backends) - known)
        if unknown:
            parser.error(f"--backends: unknown {unknown}; known here: {sorted(known)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (see the module docstring)."""
    args = parse_args(argv)
    # The ranks and gpu_kernels would inherit TRITON_INTERPRET=1 from here.
    if not device_ready(_parser(), args.device, interpreted_cpu=False):
        print(NO_CUDA_MESSAGE.format(torch=torch.__version__))
        return 0
    print(f"tp_kernels.bench.gpu_check --device {args.device}: {_versions(args.device)}")
    quick = " (--quick)" if args.quick else ""
    print(f"worlds {args.worlds}, dtypes {args.dtypes}{quick}; gloo process groups", flush=True)
    print_first_contact_facts(_ranks(args))
    steps = [] if args.capture_only else [check_worlds]
    steps += [] if args.skip_capture else [check_capture_rows]
    steps += [] if args.capture_only else [check_timing]
    failed = [failure for step in steps for failure in step(args)]
    if failed:
        print(f"\nFAIL: {len(failed)} failed or skipped: " + "; ".join(failed))
        return 1
    print("\nPASS: every check passed")
    return 0


if __name__ == "__main__":
    # Run through the imported module, so that what the ranks unpickle (tasks, rank functions)
    # has the module's real name rather than __main__.
    from tp_kernels.bench.gpu_check import main as _main

    raise SystemExit(_main())
