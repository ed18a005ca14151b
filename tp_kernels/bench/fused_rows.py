"""``gpu_check``'s rows of the fused ops: per world, backend, op and dtype, calls of the public op
run on every rank and checked against float64 (fp8: against ``torch._scaled_mm``); what each row
runs and checks is in :mod:`tp_kernels.bench.gpu_check`'s docstring (steps 1, 2 and 2b)."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tp_kernels import config
from tp_kernels.bench.driver import Ranks, error_tail, rank_device, run_row, summarize_rank_error
from tp_kernels.bench.protocol import DTYPES, FP8_DTYPES, render_table
from tp_kernels.testing import LocalWorld, fp8_cases
from tp_kernels.testing.fp8_cases import ScaledAGCase, ScaledRSCase, run_scaled_case
from tp_kernels.testing.fused_cases import AGCase, RSCase, run_case
from tp_kernels.testing.numerics import floors_for

__all__ = [
    "AG",
    "OPS",
    "OPTIONAL",
    "QUICK_CASES",
    "REQUIRED",
    "RS",
    "TRITON_LABEL",
    "RankRow",
    "Row",
    "RowTask",
    "check_world",
    "rank_backends",
    "rank_row",
    "render",
]

AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
OPS = (AG, RS)
TRITON_LABEL = "symm[triton]"
# Reported by name when absent, so a missing backend is visible; which backends run is read from
# tp_kernels.available_backends(). On one GPU the ranks share a gloo group (NCCL refuses two ranks
# on one device), over which pipelined cannot move CUDA tensors: there it reports why, as n/a.
REQUIRED = {"cuda": ("symm",), "cpu": ("symm", TRITON_LABEL, "pipelined")}
OPTIONAL = ("torch_symm_mem", "pipelined")
# The fp8 rows' dtype labels (fp8_cases.SCALINGS) and the op counters' names of their calls.
FP8_ROWS = tuple(FP8_DTYPES)
SCALED_KINDS = {"all_gather_matmul": "scaled_all_gather_matmul",
                "matmul_reduce_scatter": "scaled_matmul_reduce_scatter"}  # fmt: skip

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

    device = rank_device(device_kind)
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
    """Run one row's calls on this rank and compare every result. A float dtype: each case
    forward and backward against its float64 truth (:func:`tp_kernels.testing.fused_cases.
    run_case`, two fused calls per case); an fp8 dtype: each case's scaled call against
    ``torch._scaled_mm`` of the gathered or summed operands (:mod:`tp_kernels.testing.fp8_cases`,
    whose docstring argues the tolerance; forward only, one fused call per case)."""
    import tp_kernels

    device = rank_device(task.device)
    scaled = task.dtype in FP8_ROWS
    if scaled:
        rowwise = fp8_cases.SCALINGS[task.dtype]
        why = fp8_cases.unavailable_reason(device, rowwise)
        if why is not None:
            return RankRow(-1.0, "-", 0, [], unavailable=why)
        run = functools.partial(run_scaled_case, rowwise=rowwise)
        out_dtype, kinds, salt = fp8_cases.OUT_DTYPE, (SCALED_KINDS[task.op],), 7 if rowwise else 0
    else:
        run = functools.partial(run_case, dtype=DTYPES[task.dtype])
        out_dtype, kinds, salt = DTYPES[task.dtype], OPS, 0
    ratio, worst, problems = -1.0, "-", []
    with _symm_triton(task.label == TRITON_LABEL):
        tp_kernels.reset_comm_stats()
        for i, case in enumerate(task.cases):
            seed = task.seed + 100 * i + (0 if task.op == AG else 50) + salt
            found = run(
                case, device=device, group=dist.group.WORLD, seed=seed, backend=task.backend
            )
            # The shape and dtype each result should have: its truth's (fp8: its reference's).
            wanted = found.reference if scaled else found.truth
            for name, g, w in zip(found.names, found.got, wanted, strict=True):
                if g.shape != w.shape or g.dtype != out_dtype:
                    problems.append(
                        f"call {i + 1} {name}: {tuple(g.shape)} {g.dtype}, expected "
                        f"{tuple(w.shape)} {out_dtype}"
                    )
            if "a" in found.names:  # a copy: the same bits or wrong
                index = found.names.index("a")
                if not torch.equal(found.got[index], found.reference[index]):
                    problems.append(f"call {i + 1}: the returned a is not the gathered shards")
            value, name = found.worst() if scaled else found.worst(floors_for(task.backend))
            if value > ratio:
                ratio, worst = value, f"call {i + 1} {name}, rank {dist.get_rank()}"
        if device.type == "cuda":
            # An asynchronous CUDA error fails this row, not the next.
            torch.cuda.synchronize(device)
        stats = tp_kernels.comm_stats()
    calls = sum(stats.total(kind=kind, backend=task.backend) for kind in kinds)
    return RankRow(ratio, worst, calls, problems)


# ---------------------------------------------------------------- a world's rows


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


def check_world(
    ranks: Ranks,
    world_size: int,
    *,
    dtypes: Sequence[str],
    backends: Sequence[str] | None = None,
    quick: bool = False,
) -> list[Row]:
    """Every row of one world of ``world_size`` ranks: per backend (``backends``, default every
    one), op and dtype of ``dtypes``; ``quick``: the first :data:`QUICK_CASES` calls of each."""
    device = ranks.device
    cases = GPU_CASES if device == "cuda" else CPU_CASES
    fp8 = GPU_FP8_CASES if device == "cuda" else CPU_FP8_CASES
    if quick:
        cases = {op: c[: QUICK_CASES[device]] for op, c in cases.items()}
        fp8 = {op: c[: QUICK_CASES[device]] for op, c in fp8.items()}
    cases = {
        **{(op, False): c for op, c in cases.items()},
        **{(op, True): c for op, c in fp8.items()},
    }
    world = ranks.world(world_size)
    try:
        found = run_row(world, rank_backends, device)
        if found.per_rank is None:
            summary = summarize_rank_error(found.error)
            return [Row("(world)", result="FAIL", detail=summary, failure=found.error)]
        statuses = _agreed(found.per_rank)
        rows = []
        for label in _labels_in_order(statuses, device):
            if backends and label not in backends:
                continue
            status = statuses.get(label, "not registered in tp_kernels.available_backends()")
            if status != "ok":
                required = label in REQUIRED[device]
                why = f"{'required, but ' if required else ''}not available: {status}"
                result, failure = ("FAIL", why) if required else ("n/a", "")
                rows.append(Row(label, result=result, detail=why, failure=failure))
                continue
            rows += _backend_rows(world, device, label, cases, dtypes)
        return rows
    finally:
        world.close()


def _backend_rows(
    world: LocalWorld, device: str, label: str, cases: dict, dtypes: Sequence[str]
) -> list[Row]:
    backend = "symm" if label == TRITON_LABEL else label
    rows: list[Row] = []
    broken = ""
    for op in OPS:
        for dtype in dtypes:
            if broken:
                rows.append(Row(label, op, dtype, "skipped", detail=broken))
                continue
            op_cases = cases[(op, dtype in FP8_ROWS)]
            task = RowTask(label, backend, op, dtype, op_cases, device, seed=1234)
            found = run_row(world, rank_row, task)
            if found.per_rank is None:
                # The world was torn down (the next run starts a fresh one); the backend's state
                # in it is unknown, so its remaining rows here are not run.
                summary = summarize_rank_error(found.error)
                rows.append(
                    Row(
                        label,
                        op,
                        dtype,
                        "FAIL",
                        seconds=f"{found.seconds:.1f}",
                        detail=f"raised: {summary}",
                        failure=f"raised: {summary}\n{error_tail(found.error)}",
                    )
                )
                broken = f"not run: {label} raised in {op} {dtype} in this world"
                continue
            row = _verdict(task, found.per_rank, found.seconds)
            rows.append(row)
            print(f"[world {world.world_size}] {label} {op} {dtype}: {row.result}", flush=True)
    return rows
