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

Exit status: 0 when every check passes, 1 when one fails, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tp_kernels import config
from tp_kernels.bench import calibration, capture_check
from tp_kernels.bench.protocol import DTYPES, FP8_DTYPES, render_table
from tp_kernels.testing import LocalWorld, RankError, fp8_cases
from tp_kernels.testing.fp8_cases import ScaledAGCase, ScaledRSCase, run_scaled_case
from tp_kernels.testing.fused_cases import AGCase, RSCase, run_case
from tp_kernels.testing.numerics import FLOOR, floors_for

__all__ = [
    "NO_CUDA_MESSAGE",
    "main",
    "parse_args",
]

AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
OPS = (AG, RS)
TRITON_LABEL = "symm[triton]"
# Reported by name when absent, so a missing backend is visible; which backends run is read from
# tp_kernels.available_backends(). On one GPU the ranks share a gloo group (NCCL refuses two ranks
# on one device), over which pipelined cannot move CUDA tensors: there it reports why, as n/a.
REQUIRED = {"cuda": ("symm",), "cpu": ("symm", TRITON_LABEL, "pipelined")}
OPTIONAL = ("torch_symm_mem", "pipelined")
NO_CUDA_MESSAGE = (
    "no CUDA device: torch {torch} sees none, so there is no GPU path to check. "
    "`--device cpu` runs the same worlds on CPU tensors instead (gloo ranks, the pipelined "
    "backend, and the symm backend on its torch path and on its Triton path in Triton's "
    "interpreter, with tiny shapes) and skips the cuBLAS timing."
)
TIMING_ARGV = ["--M", "8192", "--N", "3584", "--K", "8192", "--dtype", "bf16"]
# The same Llama shape with e4m3 operands and row-wise scales, against torch._scaled_mm.
FP8_TIMING_ARGV = [*TIMING_ARGV[:-1], "fp8-rowwise"]
# The fp8 rows' dtype labels (fp8_cases.SCALINGS) and the op counters' names of their calls.
FP8_ROWS = tuple(FP8_DTYPES)
SCALED_KINDS = {"all_gather_matmul": "scaled_all_gather_matmul",
                "matmul_reduce_scatter": "scaled_matmul_reduce_scatter"}  # fmt: skip

MAX_WORLD = 4


# Shapes grow, shrink and grow again, so symm's workspace is reallocated between calls; none of
# K or N is a multiple of 16. --quick takes the first QUICK_CASES of each list.
GPU_CASES = {
    AG: (
        AGCase((2, 64, 1000), 1, (72, 136), n_step=8, return_a=True),
        AGCase((96, 1000), 0, (72,)),
        AGCase((2, 160, 1000), 1, (200, 72, 40), return_a=True),
        AGCase((3, 40, 744), 1, (72,), n_step=8),
        AGCase((4, 256, 1000), 1, (72, 264), return_a=True),
    ),
    RS: (
        RSCase((2, 64), 1, 1000, 72, k_step=8, bias=True),
        RSCase((96,), 0, 1000, 200, reduce_op="avg"),
        RSCase((2, 160), 1, 1000, 136, bias=True),
        RSCase((3, 40), 1, 744, 72, k_step=8, reduce_op="avg", bias=True),
        RSCase((4, 256), 1, 1000, 264),
    ),
}
# Tiny: the interpreter runs every 16x16x16 tile in Python.
CPU_CASES = {
    AG: (
        AGCase((2, 5, 24), 1, (9, 17), n_step=1, return_a=True),
        AGCase((7, 20), 0, (6,)),
        AGCase((3, 4, 40), 1, (33, 5), return_a=True),
    ),
    RS: (
        RSCase((2, 5), 1, 24, 9, k_step=1, bias=True),
        RSCase((7,), 0, 20, 6, reduce_op="avg"),
        RSCase((3, 4), 1, 40, 33, k_step=2, bias=True),
    ),
}
QUICK_CASES = {"cuda": 3, "cpu": 2}
# The fp8 rows' calls (forward only: fp8 tensors carry no gradient). K and N are multiples of 16
# (fp8 GEMMs, cuBLASLt's included, need it) but not of a tile (K=1008, 528; N=48, 80, 208), rows
# are not (M=2*40 per rank, 3*24, ...); a batch dim, several bs, and one reduce-scatter whose K
# differs by rank; the last case is tile-aligned.
GPU_FP8_CASES = {
    AG: (
        ScaledAGCase((2, 40, 1008), 1, (48, 208)),
        ScaledAGCase((96, 528), 0, (80,)),
        ScaledAGCase((3, 24, 1024), 1, (144, 48, 16)),
        ScaledAGCase((256, 1024), 0, (256,)),
    ),
    RS: (
        ScaledRSCase((2, 40), 1, 1008, 80, k_step=16),
        ScaledRSCase((96,), 0, 528, 208),
        ScaledRSCase((3, 24), 1, 1024, 48),
        ScaledRSCase((256,), 0, 1024, 256),
    ),
}
CPU_FP8_CASES = {
    AG: (ScaledAGCase((2, 3, 32), 1, (16, 48)), ScaledAGCase((5, 16), 0, (32,))),
    RS: (ScaledRSCase((2, 3), 1, 32, 16, k_step=16), ScaledRSCase((5,), 0, 48, 32)),
}


# ---------------------------------------------------------------- the comparison


# ---------------------------------------------------------------- on each rank


@dataclass(frozen=True)
class RowTask:
    """What one row runs on every rank."""

    label: str  # the backend as the table names it ("symm[triton]": symm's Triton path on CPU)
    backend: str  # the backend= name given to the ops
    op: str
    dtype: str
    cases: tuple
    device: str  # "cuda" or "cpu"
    seed: int


@dataclass
class RankRow:
    """One rank's verdict on a row: the largest error ratio and where, the fused calls the op
    counters saw on the backend, and anything wrong that is not a number."""

    ratio: float
    worst: str
    calls: int
    problems: list[str]
    unavailable: str = ""  # why this row cannot run here (an fp8 row without _scaled_mm), if so


def _rank_device(kind: str) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(0)  # every rank shares the one GPU
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _symm_triton(on: bool) -> contextlib.AbstractContextManager[None]:
    """On CPU, symm takes its Triton path while this holds (through :mod:`tp_kernels.config`,
    whose first read of ``TP_KERNELS_SYMM_TRITON`` is kept: the environment is not read again)."""
    return config.SYMM_TRITON.overriding(True) if on else contextlib.nullcontext()


def rank_backends(device_kind: str) -> dict[str, str]:
    """``{label: "ok" or why not}`` on this rank: :func:`tp_kernels.available_backends` for the
    device, then each backend's own check for this world's group (what a call with
    ``backend=name`` asks); on CPU also ``symm[triton]``, with ``config.SYMM_TRITON`` on."""
    import tp_kernels
    from tp_kernels.backends.choice import get_backend

    device = _rank_device(device_kind)
    group = dist.group.WORLD

    def status(name: str) -> str:
        try:
            why = tp_kernels.available_backends(device).get(name, "not in available_backends()")
            if why != "ok":
                return why
            reason = get_backend(name).unavailable_reason(group, device)
        except Exception as exc:  # a broken backend module is a finding, not a crash here
            return f"raised {type(exc).__name__}: {exc}"
        return "ok" if reason is None else f"cannot run on this world's gloo group: {reason}"

    statuses = {name: status(name) for name in tp_kernels.available_backends(device)}
    if device_kind == "cpu" and "symm" in statuses:
        with _symm_triton(True):
            statuses[TRITON_LABEL] = status("symm")
    return statuses


def rank_row(task: RowTask) -> RankRow:
    """Run one row's calls on this rank and compare every result (see the module docstring)."""
    import tp_kernels

    if task.dtype in FP8_ROWS:
        return rank_fp8_row(task)
    device = _rank_device(task.device)
    dist_rank = dist.get_rank()
    dtype = DTYPES[task.dtype]
    ratio, worst, problems = -1.0, "-", []
    with _symm_triton(task.label == TRITON_LABEL):
        tp_kernels.reset_comm_stats()
        for i, case in enumerate(task.cases):
            seed = task.seed + 100 * i + (0 if task.op == AG else 50)
            found = run_case(
                case,
                dtype=dtype,
                device=device,
                group=dist.group.WORLD,
                seed=seed,
                backend=task.backend,
            )
            for name, g, t in zip(found.names, found.got, found.truth, strict=True):
                if g.shape != t.shape or g.dtype != dtype:
                    problems.append(
                        f"call {i + 1} {name}: {tuple(g.shape)} {g.dtype}, expected "
                        f"{tuple(t.shape)} {dtype}"
                    )
            if "a" in found.names:  # a copy: the same bits or wrong
                index = found.names.index("a")
                if not torch.equal(found.got[index], found.reference[index]):
                    problems.append(f"call {i + 1}: the returned a is not the gathered shards")
            value, name = found.worst(floors_for(task.backend))
            if value > ratio:
                ratio, worst = value, f"call {i + 1} {name}, rank {dist_rank}"
        if device.type == "cuda":
            # An asynchronous CUDA error fails this row, not the next.
            torch.cuda.synchronize(device)
        stats = tp_kernels.comm_stats()
    calls = sum(stats.total(kind=op, backend=task.backend) for op in OPS)
    return RankRow(ratio, worst, calls, problems)


def rank_fp8_row(task: RowTask) -> RankRow:
    """An fp8 row on this rank: each case's scaled call against ``torch._scaled_mm`` of the
    gathered or summed operands (:mod:`tp_kernels.testing.fp8_cases`, whose docstring argues the
    tolerance); forward only, one fused call per case."""
    import tp_kernels

    device = _rank_device(task.device)
    rowwise = fp8_cases.SCALINGS[task.dtype]
    why = fp8_cases.unavailable_reason(device, rowwise)
    if why is not None:
        return RankRow(-1.0, "-", 0, [], unavailable=why)
    ratio, worst, problems = -1.0, "-", []
    with _symm_triton(task.label == TRITON_LABEL):
        tp_kernels.reset_comm_stats()
        for i, case in enumerate(task.cases):
            seed = task.seed + 100 * i + (0 if task.op == AG else 50) + (7 if rowwise else 0)
            found = run_scaled_case(
                case,
                rowwise=rowwise,
                device=device,
                group=dist.group.WORLD,
                seed=seed,
                backend=task.backend,
            )
            for name, g, r in zip(found.names, found.got, found.reference, strict=True):
                if g.shape != r.shape or g.dtype != fp8_cases.OUT_DTYPE:
                    problems.append(
                        f"call {i + 1} {name}: {tuple(g.shape)} {g.dtype}, expected "
                        f"{tuple(r.shape)} {fp8_cases.OUT_DTYPE}"
                    )
            value, name = found.worst()
            if value > ratio:
                ratio, worst = value, f"call {i + 1} {name}, rank {dist.get_rank()}"
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stats = tp_kernels.comm_stats()
    calls = stats.total(kind=SCALED_KINDS[task.op], backend=task.backend)
    return RankRow(ratio, worst, calls, problems)


# ---------------------------------------------------------------- the driver


@dataclass
class Row:
    """One line of a world's table."""

    label: str
    op: str = "-"
    dtype: str = "-"
    result: str = "ok"  # ok, FAIL, n/a (cannot run here, and need not), skipped (not run)
    calls: str = "-"
    ratio: str = "-"
    seconds: str = "-"
    detail: str = ""
    failure: str = ""  # the full story of a FAIL, printed under the table

    @property
    def failed(self) -> bool:
        return self.result in ("FAIL", "skipped")


HEADER = ("backend", "op", "dtype", "calls", "max err/tol", "result", "s", "detail")


def render(rows: Sequence[Row]) -> str:
    """The rows as a left-aligned text table under :data:`HEADER`."""
    cells = [
        (r.label, r.op, r.dtype, r.calls, r.ratio, r.result, r.seconds, _short(r.detail))
        for r in rows
    ]
    return render_table(HEADER, cells, left=len(HEADER))


def _short(text: str, limit: int = 110) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def summarize_rank_error(text: str) -> str:
    """The last line of each rank's traceback (deduplicated) and the hung or crashed ranks, from
    the message of a :class:`~tp_kernels.testing.RankError`."""
    found: list[str] = []
    blocks = text.split("\n--- ")
    for block in blocks[1:]:
        head, _, body = block.partition("\n")
        if head.endswith("raised:"):
            lines = [line for line in body.splitlines() if line.strip()]
            last = lines[-1].strip() if lines else "(no traceback)"
            line = f"{head[: -len(' raised:')]}: {last}"
        else:
            line = head
        if line.split(": ", 1)[-1] not in [f.split(": ", 1)[-1] for f in found]:
            found.append(line)
    return "; ".join(found) or text.splitlines()[0]


def _tail(text: str, lines: int = 14) -> str:
    """The first failing rank's traceback, last ``lines`` lines, indented."""
    first = text.split("\n--- ")
    body = first[1] if len(first) > 1 else text
    kept = body.splitlines()[-lines:]
    return "\n".join("      " + line for line in kept)


def _verdict(task: RowTask, results: list[RankRow], seconds: float) -> Row:
    unavailable = sorted({r.unavailable for r in results if r.unavailable})
    if unavailable:  # this device cannot make the reference: nothing to check, said why
        return Row(task.label, task.op, task.dtype, "n/a", detail="; ".join(unavailable))
    # Forward, then the other fused op in backward; an fp8 call is forward only.
    expected = (1 if task.dtype in FP8_ROWS else 2) * len(task.cases)
    worst = max(results, key=lambda r: r.ratio)
    problems = [p for r in results for p in r.problems]
    calls = sorted({r.calls for r in results})
    if calls != [expected]:
        problems.append(
            f"the op counters saw {calls} fused calls on {task.backend!r} per rank, expected "
            f"{expected}"
        )
    ok = worst.ratio <= 1.0 and not problems
    ratio = "inf" if math.isinf(worst.ratio) else f"{worst.ratio:.3g}"
    detail = f"worst: {worst.worst}" + (f"; {'; '.join(problems)}" if problems else "")
    return Row(
        task.label,
        task.op,
        task.dtype,
        "ok" if ok else "FAIL",
        "/".join(str(c) for c in calls),
        ratio,
        f"{seconds:.1f}",
        detail,
        "" if ok else detail,
    )


def _rank_env(
    device: str, symm_timeout_s: float, cuda_max_connections: int | None = None
) -> dict[str, str]:
    env = {"TP_KERNELS_TIMEOUT_S": f"{symm_timeout_s:g}"}
    if device == "cuda":
        # CUDA symmetric memory refuses two ranks on one device unless this is set.
        env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        if cuda_max_connections is not None:
            # Fewer hardware queues than streams: a stream wait stalls the streams that share
            # its queue (1, as Megatron-style TP overlap sets it, puts every stream in one).
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(cuda_max_connections)
    else:
        # Before Triton is first imported in the rank: the interpreter is chosen at import.
        env["TRITON_INTERPRET"] = "1"
    return env


def _labels_in_order(statuses: dict[str, str], device: str) -> list[str]:
    """Every label, required and optional names that were not listed included; the interpreted
    Triton path last (slowest)."""
    labels = list(statuses)
    for name in (*REQUIRED[device], *OPTIONAL):
        if name not in labels:
            labels.append(name)
    return sorted(labels, key=lambda label: label == TRITON_LABEL)


def _agreed(per_rank: list[dict[str, str]]) -> dict[str, str]:
    """``"ok"`` where every rank says so, else every rank's reason."""
    out: dict[str, str] = {}
    for label in per_rank[0]:
        whys = {r: s.get(label, "not listed") for r, s in enumerate(per_rank)}
        bad = {r: w for r, w in whys.items() if w != "ok"}
        reasons = sorted(set(bad.values()))
        out[label] = "ok" if not bad else "; ".join(reasons)
    return out


def check_world(world_size: int, args: argparse.Namespace) -> list[Row]:
    """Every row of one world (see the module docstring)."""
    device = args.device
    cases = GPU_CASES if device == "cuda" else CPU_CASES
    fp8 = GPU_FP8_CASES if device == "cuda" else CPU_FP8_CASES
    if args.quick:
        cases = {op: c[: QUICK_CASES[device]] for op, c in cases.items()}
        fp8 = {op: c[: QUICK_CASES[device]] for op, c in fp8.items()}
    cases = {
        **{(op, False): c for op, c in cases.items()},
        **{(op, True): c for op, c in fp8.items()},
    }
    env = _rank_env(device, args.symm_timeout_s, args.cuda_max_connections)
    if device == "cuda":
        # Every rank on cuda:0, however many GPUs the machine has: each persistent GEMM takes
        # its share of the SMs (config.shared_device_ranks would guess from the GPU count).
        env["TP_KERNELS_SHARED_DEVICE_RANKS"] = str(world_size)
    world = LocalWorld(world_size, timeout_s=args.timeout_s, env=env)
    try:
        try:
            statuses = _agreed(world.run(rank_backends, device))
        except RankError as exc:
            return [
                Row(
                    "(world)",
                    result="FAIL",
                    detail=summarize_rank_error(str(exc)),
                    failure=str(exc),
                )
            ]
        rows = []
        for label in _labels_in_order(statuses, device):
            if args.backends and label not in args.backends:
                continue
            status = statuses.get(label, "not registered in tp_kernels.available_backends()")
            if status != "ok":
                required = label in REQUIRED[device]
                why = f"{'required, but ' if required else ''}not available: {status}"
                rows.append(
                    Row(
                        label,
                        result="FAIL" if required else "n/a",
                        detail=why,
                        failure=why if required else "",
                    )
                )
                continue
            rows += _backend_rows(world, label, cases, args)
        return rows
    finally:
        world.close()


def _backend_rows(world: LocalWorld, label: str, cases: dict, args: argparse.Namespace) -> list:
    backend = "symm" if label == TRITON_LABEL else label
    rows: list[Row] = []
    broken = ""
    for op in OPS:
        for dtype in args.dtypes:
            if broken:
                rows.append(Row(label, op, dtype, "skipped", detail=broken))
                continue
            op_cases = cases[(op, dtype in FP8_ROWS)]
            task = RowTask(label, backend, op, dtype, op_cases, args.device, seed=1234)
            started = time.perf_counter()
            try:
                results = world.run(rank_row, task)
            except RankError as exc:
                # The world was torn down (the next run starts a fresh one); the backend's state
                # in it is unknown, so its remaining rows here are not run.
                seconds = time.perf_counter() - started
                summary = summarize_rank_error(str(exc))
                rows.append(
                    Row(
                        label,
                        op,
                        dtype,
                        "FAIL",
                        seconds=f"{seconds:.1f}",
                        detail=f"raised: {summary}",
                        failure=f"raised: {summary}\n{_tail(str(exc))}",
                    )
                )
                broken = f"not run: {label} raised in {op} {dtype} in this world"
                continue
            row = _verdict(task, results, time.perf_counter() - started)
            rows.append(row)
            print(f"[world {world.world_size}] {label} {op} {dtype}: {row.result}", flush=True)
    return rows


def check_capture_rows(args: argparse.Namespace) -> list[str]:
    """The capture rows (:mod:`tp_kernels.bench.capture_check`) with 2 ranks; what failed."""
    world_size = 2
    env = _rank_env(args.device, args.symm_timeout_s, args.cuda_max_connections)
    if args.device == "cuda":
        env["TP_KERNELS_SHARED_DEVICE_RANKS"] = str(world_size)
    print(
        f"\n== a TP MLP step captured and replayed, world of {world_size} ranks "
        f"({'cuda:0, shared' if args.device == 'cuda' else 'cpu: an eager stand-in'})",
        flush=True,
    )
    started = time.perf_counter()
    rows = capture_check.check_capture(
        world_size,
        device=args.device,
        env=env,
        timeout_s=args.timeout_s,
        floors={name: FLOOR[dtype] for name, dtype in DTYPES.items()},
        backends=args.backends,
        quick=args.quick,
        profile=args.host_profile,
    )
    print(f"({time.perf_counter() - started:.0f} s)")
    print(capture_check.render(rows), flush=True)
    return [f"capture: {row.label}: {row.detail}" for row in rows if row.failed]


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


def print_first_contact_facts(
    device: str, symm_timeout_s: float, cuda_max_connections: int | None = None
) -> None:
    """What a first run of torch's fused ops depends on, printed before anything runs (see
    :func:`tp_kernels.backends.torch_symm_mem.first_contact_facts`), and what the ranks'
    environment sets of it."""
    from tp_kernels.backends import torch_symm_mem

    where = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    print(f"\n== torch's symmetric memory, as torch_symm_mem will find it on {where}")
    for what, value in torch_symm_mem.first_contact_facts(where):
        print(f"  {what}: {value}")
    for name, value in _rank_env(device, symm_timeout_s, cuda_max_connections).items():
        print(f"  the ranks' environment sets {name}={value}")
    sys.stdout.flush()


def _world_size(text: str) -> int:
    value = int(text)
    if not 2 <= value <= MAX_WORLD:
        raise argparse.ArgumentTypeError(f"must be between 2 and {MAX_WORLD}, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
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
        choices=[*DTYPES, *FP8_ROWS],
        nargs="+",
        default=[*DTYPES, *FP8_ROWS],
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
    p.add_argument(
        "--timeout-s",
        type=_seconds,
        default=120.0,
        help="deadline of one row on every rank, compiling included (default 120)",
    )
    p.add_argument(
        "--cuda-max-connections",
        type=int,
        choices=range(1, 33),
        metavar="N",
        help="CUDA_DEVICE_MAX_CONNECTIONS of the ranks (default: the driver's, 8); 1 puts every "
        "stream in one hardware queue, where a stream wait ahead of the work it waits for "
        "would never end",
    )
    p.add_argument(
        "--symm-timeout-s",
        type=_seconds,
        default=60.0,
        help="TP_KERNELS_TIMEOUT_S of the ranks: symm's signal waits (default 60)",
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
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print(NO_CUDA_MESSAGE.format(torch=torch.__version__))
            return 0
        if os.environ.get("TRITON_INTERPRET") == "1":
            # The ranks and gpu_kernels would inherit it, and the interpreter runs no CUDA tensor.
            _parser().error("TRITON_INTERPRET=1 is set: unset it to check the GPU")
    print(f"tp_kernels.bench.gpu_check --device {args.device}: {_versions(args.device)}")
    quick = " (--quick)" if args.quick else ""
    print(f"worlds {args.worlds}, dtypes {args.dtypes}{quick}; gloo process groups", flush=True)
    print_first_contact_facts(args.device, args.symm_timeout_s, args.cuda_max_connections)
    failed: list[str] = []
    for world_size in [] if args.capture_only else args.worlds:
        started = time.perf_counter()
        rows = check_world(world_size, args)
        where = "cuda:0, shared" if args.device == "cuda" else "cpu"
        print(f"\n== world of {world_size} ranks ({where}), {time.perf_counter() - started:.0f} s")
        print(render(rows))
        for row in rows:
            if row.result == "FAIL":
                print(f"  FAIL {row.label} {row.op} {row.dtype}: {row.failure}")
            if row.failed:
                failed.append(f"world {world_size}: {row.label} {row.op} {row.dtype}")
        sys.stdout.flush()
    if not args.skip_capture:
        failed += check_capture_rows(args)
    if args.capture_only:
        pass
    elif args.device == "cpu":
        print(
            "\ncuBLAS timing skipped: --device cpu has no cuBLAS and no GPU to time the "
            "tile GEMMs on (bf16, and fp8 against torch._scaled_mm)"
        )
    elif args.skip_timing:
        print("\ncuBLAS timing skipped (--skip-timing)")
    else:
        if not time_gemms(args.quick):
            failed.append("tile GEMM timing (gpu_kernels)")
        if "fp8-rowwise" not in args.dtypes:
            print("\nfp8 GEMM timing skipped: --dtypes has no fp8-rowwise")
        elif not time_gemms(args.quick, FP8_TIMING_ARGV):
            failed.append("fp8 GEMM timing (gpu_kernels --dtype fp8-rowwise)")
    timing = args.device == "cuda" and not (args.skip_timing or args.capture_only)
    if timing and not calibration.run(args.quick):
        failed.append("cost-model calibration")
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
