"""The capture rows of ``gpu_check``: a TP MLP step captured in a CUDA graph, replayed with new
inputs against eager steps, and timed both ways.

The step, on each of the ``W`` ranks of a world sharing one GPU (sequence parallel, as a
colwise Linear feeding a rowwise one)::

    x        [B, s, H]       this rank's rows of the sequence (leaf, requires grad)
    w1       [H, F]          this rank's columns of the first Linear's weight, transposed
    w2       [F, H]          this rank's rows of the second's
    h        = all_gather_matmul(x, [w1], gather_dim=1)          [B, W*s, F]
    y        = matmul_reduce_scatter(silu(h), w2, scatter_dim=1)  [B, s, H]
    backward = y.backward(gy), gy [B, s, H]: dx, dw1, dw2

Per backend (one row): three eager steps on a side stream (planning, ``auto``'s timing, the
kernels' tuning, the workspaces), the step captured with ``torch.cuda.graph`` (the error mode
torchtitan 0.3's ``CUDAGraphWrapper`` uses), then ``replays`` times: new ``x`` and ``gy`` drawn,
one eager step on them, the same copied into the graph's input tensors and the graph replayed;
``y``, ``dx``, ``dw1`` and ``dw2`` of the replay must equal the eager step's within the dtype's
floor (times the largest ``|eager|``), and no replay may return the previous replay's ``y`` (a
graph that ignored its new inputs). The op counters must see the captured step's four fused calls
(both ops, forward and backward) on the backend (``auto``: on the one it took). Then ``timed`` eager
steps and ``timed`` replays: the host's time per step (the Python that enqueues it, from an idle
device) and the device's (back to back, CUDA events around each step on the rank's stream; the
ranks share the GPU, so each rank's device time includes the other's work and, as separate
processes, the GPU's time slicing between them), medians per rank, the slowest rank's.

A backend that says it cannot be captured for the step (``Backend.capture_unready_reason`` after
the eager steps: gloo's host-side collectives, say) gets an ``n/a`` row with its reason.

On a CPU (``gpu_check --device cpu``) nothing can be captured: the same rows run with an eager
stand-in for the graph (its "replay" runs the step again), which drives this module's code and
every backend's eager step, and says so in every row; its times are host times.
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import io
import math
import pstats
import statistics
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp_kernels.bench.driver import Ranks, rank_device, run_row
from tp_kernels.bench.protocol import DTYPES, cuda_seconds_back_to_back, host_seconds, render_table

__all__ = ["CaptureRow", "CaptureTask", "capture_rank", "check_capture", "render"]

AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
FUSED_CALLS_PER_STEP = 4  # the forward's two, and the other op of each in backward
LOCAL = "local (no comm)"  # the step's matmuls alone: what the fused step's compute costs
LABELS = (LOCAL, "symm", "torch_symm_mem", "reference", "pipelined", "auto")
WARMUP_STEPS = 3
PROFILE_ENTRIES = 18


@dataclass(frozen=True)
class CaptureTask:
    """One row, run on every rank: the step's shapes (see the module docstring), the number of
    checked replays and of timed steps, and the dtype's floor of the replay-vs-eager check."""

    backend: str
    dtype: str
    device: str  # "cuda" (a CUDA graph) or "cpu" (the eager stand-in)
    batch: int
    rows: int  # s, this rank's rows of the sequence
    hidden: int
    ffn: int  # F, this rank's share of the intermediate size
    replays: int
    timed: int
    floor: float
    seed: int = 4321
    profile: bool = False  # rank 0 profiles its timed eager steps' Python (cProfile)


@dataclass
class CaptureRank:
    """One rank's findings on a row."""

    unready: str | None = None  # why the backend cannot capture the step (the row is n/a)
    error: str = ""  # the traceback of a capture or replay that raised (after eager timing)
    diff: float = 0.0  # the largest |replay - eager| / max|eager| over replays and results
    bitwise: int = 0  # replays whose four results equal the eager step's bit for bit
    stale: int = 0  # replays that returned the previous replay's y
    captured_on: dict[str, int] = dataclasses.field(default_factory=dict)  # by backend
    eager_host_us: float = math.nan
    eager_device_us: float = math.nan
    replay_host_us: float = math.nan
    replay_device_us: float = math.nan
    profile: str = ""  # rank 0's host profile of the timed eager steps (``profile``)


def _draw(task: CaptureTask, salt: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """This rank's ``x`` and ``gy`` of draw ``salt``: fp32 on the CPU, rounded once to the dtype."""
    gen = torch.Generator().manual_seed(task.seed + 1000 * salt + dist.get_rank())
    shape = (task.batch, task.rows, task.hidden)
    dtype = DTYPES[task.dtype]
    return tuple(
        (torch.randn(*shape, generator=gen) / 4).to(device=device, dtype=dtype) for _ in range(2)
    )


def _mlp_step(
    x: torch.Tensor, gy: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, backend: str
) -> torch.Tensor:
    """The module docstring's step; returns ``y`` (the gradients land in ``.grad``). ``LOCAL``:
    the same matmuls with no communication (the rank's shard repeated for the gathered rows, its
    own slice of its partial product for the reduced one): the step's compute alone."""
    import tp_kernels

    group = dist.group.WORLD
    if backend == LOCAL:
        p = F.silu(x.repeat(1, group.size(), 1) @ w1) @ w2
        y = p[:, : x.shape[1]]
    else:
        _, (h,) = tp_kernels.all_gather_matmul(x, [w1], 1, group, backend=backend)
        y = tp_kernels.matmul_reduce_scatter(F.silu(h), w2, 1, group, backend=backend)
    y.backward(gy)
    return y.detach()


class _EagerStandIn:
    """What a CPU has instead of a CUDA graph: "capturing" runs the step once and keeps it;
    "replaying" runs it again, writing its results into the tensors the capture returned."""

    def __init__(self, step: Callable[[], list[torch.Tensor]]) -> None:
        self._step = step
        self.outputs = step()

    def replay(self) -> None:
        results = self._step()
        with torch.no_grad():
            for kept, new in zip(self.outputs, results, strict=True):
                kept.copy_(new)


class _Graph:
    """The step captured in a CUDA graph; :attr:`outputs` are the graph's result tensors."""

    def __init__(self, step: Callable[[], list[torch.Tensor]]) -> None:
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph, capture_error_mode="thread_local"):
            self.outputs = step()

    def replay(self) -> None:
        self._graph.replay()


@contextlib.contextmanager
def _profiled(on: bool) -> Iterator[Callable[[], str]]:
    """With ``on``, cProfile the block; yields a function returning its top entries by own
    time (the host's Python and the calls into torch, Triton and the driver it waits in)."""
    profiler = cProfile.Profile() if on else None
    text: list[str] = []
    if profiler is not None:
        profiler.enable()
    try:
        yield lambda: "".join(text)
    finally:
        if profiler is not None:
            profiler.disable()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(PROFILE_ENTRIES)
            text.append(out.getvalue())


def _median_us(values: Sequence[float]) -> float:
    return statistics.median(values) * 1e6


def _time(fn: Callable[[], object], n: int, device: torch.device) -> tuple[float, float]:
    """Medians, in us, of the host's time per call of ``fn`` and of the device's. Host: ``n``
    calls, each from an idle device (synchronized first, outside the time), so that a full launch
    queue never blocks the host inside a call. Device: ``n`` calls back to back, as training runs
    them, each between CUDA events on the rank's stream. The ranks start each loop together (a
    barrier)."""
    dist.barrier()
    host = host_seconds(fn, n, before=torch.cuda.synchronize if device.type == "cuda" else None)
    if device.type != "cuda":
        return _median_us(host), _median_us(host)
    torch.cuda.synchronize()
    dist.barrier()
    return _median_us(host), _median_us(cuda_seconds_back_to_back(fn, n))


def _unavailable_reason(backend: str, device: torch.device) -> str | None:
    """Why the backend cannot run the step on this world's group at all, or None."""
    import tp_kernels
    from tp_kernels.backends.choice import get_backend

    if backend in ("auto", LOCAL):  # auto takes whichever of the others can
        return None
    why = tp_kernels.available_backends(device).get(backend, "not registered")
    if why != "ok":
        return f"not available: {why}"
    why = get_backend(backend).unavailable_reason(dist.group.WORLD, device)
    return None if why is None else f"cannot run on this world's group: {why}"


def _unready_reason(task: CaptureTask, device: torch.device, x: torch.Tensor) -> str | None:
    """Why the backend cannot capture the step's calls now (after the eager steps), or None;
    ``auto`` answers for itself inside the captured call."""
    from tp_kernels.backends.base import CaptureNeed
    from tp_kernels.backends.choice import get_backend

    if task.backend in ("auto", LOCAL) or device.type != "cuda":
        return None
    group, impl = dist.group.WORLD, get_backend(task.backend)
    world = group.size()
    product = task.batch * world * task.rows * task.hidden * x.element_size()
    needs = (
        CaptureNeed(AG, x.nbytes, x.dtype),
        CaptureNeed(RS, product, x.dtype),
        CaptureNeed("all_gather", x.nbytes, x.dtype),
    )
    for need in needs:
        why = impl.capture_unready_reason(group, device, need)
        if why is not None:
            return f"cannot be captured: {need.op}: {why}"
    return None


def capture_rank(task: CaptureTask) -> CaptureRank:
    """Run one row on this rank (see the module docstring)."""
    device = rank_device(task.device)
    unavailable = _unavailable_reason(task.backend, device)
    if unavailable is not None:
        return CaptureRank(unready=unavailable)
    dtype = DTYPES[task.dtype]
    gen = torch.Generator().manual_seed(task.seed + dist.get_rank())
    weights = [
        (torch.randn(*shape, generator=gen) / shape[0] ** 0.5).to(device=device, dtype=dtype)
        for shape in ((task.hidden, task.ffn), (task.ffn, task.hidden))
    ]
    w1, w2 = (w.requires_grad_() for w in weights)
    x_in, gy_in = _draw(task, 0, device)
    x_in.requires_grad_()

    def step() -> list[torch.Tensor]:
        # Gradients are set, not accumulated: a captured backward writes them in place on replay.
        x_in.grad = w1.grad = w2.grad = None
        y = _mlp_step(x_in, gy_in, w1, w2, task.backend)
        return [y, x_in.grad, w1.grad, w2.grad]

    def eager(x: torch.Tensor, gy: torch.Tensor) -> list[torch.Tensor]:
        x = x.detach().clone().requires_grad_()
        w1.grad = w2.grad = None
        y = _mlp_step(x, gy, w1, w2, task.backend)
        return [y, x.grad, w1.grad, w2.grad]

    side = torch.cuda.Stream() if device.type == "cuda" else None
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        if side is not None:  # torch's rule for capturing autograd: warm up on a side stream
            side.wait_stream(torch.cuda.default_stream(device))
        for _ in range(WARMUP_STEPS):
            step()
    if side is not None:
        torch.cuda.default_stream(device).wait_stream(side)
    unready = _unready_reason(task, device, x_in)
    if unready is not None:
        return CaptureRank(unready=unready)

    found = CaptureRank()
    x, gy = _draw(task, 0, device)
    with _profiled(task.profile and dist.get_rank() == 0) as profile:
        found.eager_host_us, found.eager_device_us = _time(lambda: eager(x, gy), task.timed, device)
    found.profile = profile()
    try:
        _capture_and_replay(task, device, step, eager, (x_in, gy_in), found)
    except Exception:
        found.error = traceback.format_exc()
    return found


def _capture_and_replay(
    task: CaptureTask,
    device: torch.device,
    step: Callable[[], list[torch.Tensor]],
    eager: Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]],
    inputs: tuple[torch.Tensor, torch.Tensor],
    found: CaptureRank,
) -> None:
    """Capture ``step``, check ``task.replays`` replays against ``eager``, time the replays."""
    import tp_kernels

    tp_kernels.reset_comm_stats()
    graph = _Graph(step) if device.type == "cuda" else _EagerStandIn(step)
    stats = tp_kernels.comm_stats()
    found.captured_on = {name: _fused_calls(stats, name) for name in {key[2] for key in stats}}
    x_in, gy_in = inputs
    previous_y = None
    for i in range(1, task.replays + 1):
        x, gy = _draw(task, i, device)
        expected = eager(x, gy)
        with torch.no_grad():
            x_in.copy_(x)
            gy_in.copy_(gy)
        graph.replay()
        got = graph.outputs
        if previous_y is not None and torch.equal(got[0], previous_y):
            found.stale += 1
        previous_y = got[0].clone()
        same = True
        for g, e in zip(got, expected, strict=True):
            scale = e.abs().max().float().clamp_min(torch.finfo(torch.float32).tiny)
            found.diff = max(found.diff, ((g.float() - e.float()).abs().max() / scale).item())
            same &= torch.equal(g, e)
        found.bitwise += same
    found.replay_host_us, found.replay_device_us = _time(graph.replay, task.timed, device)
    if device.type == "cuda":
        torch.cuda.synchronize()  # an asynchronous CUDA error fails this row, not the next


def _fused_calls(stats, backend: str) -> int:
    return sum(stats.total(kind=op, backend=backend) for op in (AG, RS))


@dataclass
class CaptureRow:
    """One line of the capture table, and what is printed under it."""

    label: str
    result: str  # ok, FAIL, n/a
    detail: str = ""
    cells: tuple[str, ...] = ("-",) * 7
    failure: str = ""  # the rank's traceback of a FAIL
    profile: str = ""  # rank 0's host profile, when asked for

    @property
    def failed(self) -> bool:
        return self.result == "FAIL"


HEADER = (
    "backend",
    "captured calls",
    "replay vs eager",
    "bitwise",
    "eager host us",
    "eager device us",
    "replay host us",
    "replay device us",
    "result",
    "detail",
)
TIMES = ("eager_host_us", "eager_device_us", "replay_host_us", "replay_device_us")


def _calls_problem(task: CaptureTask, captured: list[dict[str, int]]) -> str:
    """What is wrong with the fused calls counted while capturing, or ``""``: the step's four
    on the backend (``auto``: on one backend; ``LOCAL``: none)."""
    on = sorted({name for c in captured for name in c if c[name]})
    want = 0 if task.backend == LOCAL else FUSED_CALLS_PER_STEP
    backend_ok = (
        not on if task.backend == LOCAL else (len(on) == 1 and task.backend in ("auto", on[0]))
    )
    if backend_ok and all(sum(c.values()) == want for c in captured):
        return ""
    return f"the op counters saw {captured} fused calls while capturing, expected {want}"


def _verdict(task: CaptureTask, results: list[CaptureRank], kind: str) -> CaptureRow:
    unready = sorted({r.unready for r in results if r.unready is not None})
    if unready:
        return CaptureRow(task.backend, "n/a", "; ".join(unready))
    times = [f"{max(getattr(r, name) for r in results):.0f}" for name in TIMES]
    errors = [r.error for r in results if r.error]
    if errors:
        last = errors[0].strip().splitlines()[-1]
        return CaptureRow(
            task.backend,
            "FAIL",
            f"capture or replay raised: {last}",
            ("-", "-", "-", *times),
            failure=errors[0],
            profile=results[0].profile,
        )
    problems = [p for p in [_calls_problem(task, [r.captured_on for r in results])] if p]
    diff = max(r.diff for r in results)
    if not diff <= task.floor:
        problems.append(f"a replay differs from its eager step by {diff:.3g} > {task.floor:g}")
    stale = max(r.stale for r in results)
    if stale:
        problems.append(f"{stale} replays returned the previous replay's y")
    calls = results[0].captured_on
    cells = (
        f"{sum(calls.values())} on {','.join(n for n in sorted(calls) if calls[n]) or '-'}",
        f"{diff:.2g}",
        f"{min(r.bitwise for r in results)}/{task.replays}",
        *times,
    )
    detail = "; ".join(problems) or (
        "eager stand-in on cpu: nothing captured, times are the host's" if kind == "cpu" else ""
    )
    return CaptureRow(
        task.backend,
        "FAIL" if problems else "ok",
        detail,
        cells,
        failure=detail if problems else "",
        profile=results[0].profile,
    )


def render(rows: Sequence[CaptureRow]) -> str:
    """The rows as a text table under :data:`HEADER`, then each FAIL's story and each host
    profile."""
    cells = [(r.label, *r.cells, r.result, r.detail[:160]) for r in rows]
    text = [render_table(HEADER, cells, left=1)]
    for row in rows:
        if row.failure:
            text.append(f"\n  FAIL {row.label}:\n" + _indent(row.failure.strip()))
        if row.profile:
            text.append(f"\n  host profile of {row.label}'s eager steps, rank 0:\n")
            text.append(_indent(row.profile.strip()))
    return "\n".join(text)


def _indent(text: str, lines: int = 40) -> str:
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


def check_capture(
    ranks: Ranks,
    world_size: int,
    *,
    floors: dict[str, float],
    backends: Sequence[str] | None = None,
    quick: bool = False,
    profile: bool = False,
) -> list[CaptureRow]:
    """Every capture row (one per label of :data:`LABELS`, or of ``backends``) in one world of
    ``world_size`` of ``ranks``; ``floors`` maps a dtype's name to its
    replay-vs-eager floor; ``profile`` adds rank 0's host profile of the eager steps. A rank that
    raises outside the capture fails its row; the world restarts for the next."""
    device = ranks.device
    if device == "cuda":
        shape = {"batch": 2, "rows": 1024, "hidden": 2048, "ffn": 4096, "dtype": "bf16"}
        counts = {"replays": 20, "timed": 10 if quick else 30}
    else:
        shape = {"batch": 2, "rows": 4, "hidden": 16, "ffn": 24, "dtype": "fp32"}
        counts = {"replays": 3, "timed": 3}
    rows: list[CaptureRow] = []
    with ranks.world(world_size) as world:
        for label in LABELS:
            if backends and label not in backends and label != LOCAL:
                continue
            task = CaptureTask(
                label,
                device=device,
                floor=floors[shape["dtype"]],
                profile=profile,
                **shape,
                **counts,
            )
            found = run_row(world, capture_rank, task)
            if found.per_rank is None:
                lines = [line for line in found.error.splitlines() if line.strip()]
                last = lines[-1] if lines else found.error
                row = CaptureRow(label, "FAIL", f"raised: {last}", failure=found.error)
            else:
                row = _verdict(task, found.per_rank, device)
            if row.failure:
                world.close()  # a failed capture can leave a rank's CUDA state unusable
            print(f"[capture, world {world_size}] {label}: {row.result} ({found.seconds:.0f} s)")
            rows.append(row)
    return rows
