"""Which backend runs a fused call: the one module that decides.

It is the only code that asks the backends whether they can run (``unavailable_reason``), take
block scales (``block_scales_reason``) or be captured (``capture_unready_reason``), consults the
cost model, times candidates and logs the choice. The ops layer asks it once per new plan
(:func:`choose`, and :func:`settle` where ``auto`` times, after the ranks agreed on the call),
per captured call (:func:`captured`) and per run of a custom op (:func:`at_run_time`); an eager
call that reuses its plan asks nothing.

**The name asked for**, first to last: the op's ``backend=`` (or the style's), the innermost
:func:`use_backend` context, :func:`set_backend`, ``TP_KERNELS_BACKEND``, and ``"auto"``. A
backend asked for by name that cannot run here raises RuntimeError saying why; so does one that
takes no block scales, for a block-scaled (MXFP8) call.

**auto**, for one call of an op (shapes as in ``backends/base.py``) on a group of ``W`` ranks:

1. **Candidates.** The backends that can run for the group and device, in the order of
   preference ``torch_symm_mem`` (CUDA only), ``symm``, ``pipelined``, ``reference``; a group of
   one takes ``reference`` (nothing to overlap). Ruled out: ``pipelined`` below one block of
   :data:`tp_kernels.tiling.MIN_TRANSFER_BLOCK_BYTES` per rank (per-message latency would
   dominate); for a block-scaled call, every backend that takes no block scales.
2. **Untimed choice**: the first candidate. It is what a call uses while its shape class has not
   been timed (under ``torch.compile``, for a scaled call, or with ``TP_KERNELS_AUTO_TIMING=0``).
   It depends on nothing measured, so every rank makes the same one.
3. **Timed choice** (eager, ``W > 1``, two candidates or more; never while torch.compile traces
   or a compiled graph runs): on the first call of a shape class, after the ranks agreed on the
   call, they agree on the largest of their predictions from :mod:`tp_kernels.cost` for this
   device and rule out every candidate predicted over :data:`RULE_OUT` times the best (the
   model's efficiencies are assumptions, so only a wide margin rules out) and, on CUDA, every
   fused one when the model predicts none of them faster than ``reference``; then every rank runs
   each remaining candidate :data:`WARMUP` + :data:`ROUNDS` times, interleaved round by
   round, without autograd; each rank takes its median per candidate; one all-reduce (max) gives
   the slowest rank's median, so all ranks see the same numbers and pick the same winner: the
   first candidate within :data:`MARGIN` of the fastest. The choice is kept for the process and
   logged at INFO on the ``tp_kernels`` logger, the model's prediction beside each measurement.
   A scaled (fp8) call times nothing: it takes the unscaled call's choice for its shape class.

**Under CUDA graph capture** nothing is chosen anew, timed or exchanged: a captured call reuses
the plan its warmup (an eager call of the same shape class) made, and a call without one raises
:class:`~tp_kernels.backends.base.CaptureUnreadyError` before any communication. The plan's
backend is asked whether it can capture the call and the backward parts autograd will run for it;
where it cannot, a choice of ``auto`` takes the first of its order that can (the timed ranking:
the winner, the other timed candidates fastest first, then those the model ruled out; else the
untimed order): the same numbers on every rank, so every rank falls to the same next capturable
backend (logged once at INFO). A backend asked for by name raises ``CaptureUnreadyError`` naming
why.

**While torch.compile traces** nothing is chosen (the settings, the context and the probes are
not traceable): the custom op chooses when the graph runs (:func:`at_run_time`), by the rules
above without timing. A dispatch mode (``CommDebugMode``, fake tensors) changes nothing: the plan
is made as an eager call's.

A shape class is (op, group, device type, dtype, number of right-hand matrices) and the power-of-
two classes of the sizes every rank shares: ``m`` (rows per rank) and ``K`` for an all-gather-
matmul, ``m`` and ``N`` for a matmul-reduce-scatter (a colwise weight's ``N`` and a rowwise
weight's ``K`` may differ by rank when uneven); shapes within a factor of two of each other share
a choice. On CUDA the timing synchronizes the device around each call; that happens once per
shape class, never on the steady-state path.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tp_kernels import config, cost, deadline, tiling
from tp_kernels.backends import base
from tp_kernels.backends.base import Backend, CaptureNeed, CaptureUnreadyError

__all__ = [
    "BACKEND_NAMES",
    "Candidates",
    "Choice",
    "Shape",
    "at_run_time",
    "available_backends",
    "captured",
    "check_backend_name",
    "choose",
    "current_backend",
    "get_backend",
    "set_backend",
    "settle",
    "unavailable_reason",
    "use_backend",
]

logger = logging.getLogger("tp_kernels")

PREFERENCE = ("torch_symm_mem", "symm", "pipelined", "reference")
RULE_OUT = 2.0
WARMUP = 1
ROUNDS = 5
# A later candidate must beat an earlier one by this factor to be chosen over it: a few calls on
# a shared machine vary by more than a few percent, and the order of preference is the better
# guess where the measurements cannot tell the candidates apart.
MARGIN = 1.05


@dataclass(frozen=True)
class Shape:
    """One call as the choice sees it: ``m`` rows per rank, ``k`` the reduction dim, ``ns`` the
    right-hand matrices' widths (an all-gather-matmul's ``N_j``; a matmul-reduce-scatter's one
    ``N``). The cost model needs each width: a GEMM's waves of tiles depend on its own ``N_j``,
    so Llama-3 70B's QKV (wq 8x wider than wk and wv) is not three GEMMs of a third each."""

    op: str
    m: int
    k: int
    ns: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def n(self) -> int:
        """The output columns, summed over the right-hand matrices."""
        return sum(self.ns)

    @property
    def num_bs(self) -> int:
        """How many right-hand matrices."""
        return len(self.ns)

    @classmethod
    def of_all_gather_matmul(cls, a_shard: torch.Tensor, bs: list[torch.Tensor]) -> Shape:
        """``a_shard`` [..., K] (any leading dims: its rows), ``bs[j]`` [K, N_j]."""
        k = a_shard.shape[-1]
        m = a_shard.numel() // k
        ns = tuple(b.shape[1] for b in bs)
        return cls("all_gather_matmul", m, k, ns, a_shard.dtype, a_shard.device)

    @classmethod
    def of_matmul_reduce_scatter(cls, a: torch.Tensor, b: torch.Tensor, world: int) -> Shape:
        """``a`` [..., K] (its rows: ``W*m``), ``b`` [K, N]."""
        k = a.shape[-1]
        m = a.numel() // k // world
        return cls("matmul_reduce_scatter", m, k, (b.shape[1],), a.dtype, a.device)

    def key(self, group: dist.ProcessGroup) -> tuple:
        # Only the sizes every rank shares: a colwise weight's N (all-gather) and a rowwise
        # weight's K (reduce-scatter) may differ by rank when they do not divide evenly, and
        # ranks that disagreed on whether a class is timed would not meet in the timing.
        shared = (self.m, self.k) if self.op == "all_gather_matmul" else (self.m, self.n)
        classes = tuple(x.bit_length() for x in shared)
        return (self.op, group.group_name, self.device.type, self.dtype, self.num_bs, classes)

    def rows_bytes(self, world: int) -> int:
        """Bytes of one rank's block that a peer receives (its shard, or one partial block)."""
        width = self.k if self.op == "all_gather_matmul" else self.n
        return self.m * width * self.dtype.itemsize


@dataclass(frozen=True)
class Candidates:
    """The backends worth trying, best first, and why the others are not."""

    names: tuple[str, ...]
    ruled_out: dict[str, str]
    predicted_s: dict[str, float]


@dataclass(frozen=True)
class Choice:
    """A call's backend, ``name`` and its object ``impl``; ``order``: the backends a choice of
    ``auto`` may fall to under CUDA graph capture, best first (empty for a backend asked for by
    name); ``untimed``: the candidates ``auto`` still wants timed (:func:`settle`), else None."""

    name: str
    impl: Backend
    order: tuple[str, ...] = ()
    untimed: Candidates | None = None


# shape class -> every candidate that can run, best first, as auto's timing left them.
_ranked: dict[tuple, tuple[str, ...]] = {}
_logged: set[tuple] = set()


# --- the names, the settings that ask for one, the objects ----------------------------------------

_MODULES = {
    "reference": "tp_kernels.backends.reference",
    "pipelined": "tp_kernels.backends.pipelined",
    "symm": "tp_kernels.backends.symm",
    "torch_symm_mem": "tp_kernels.backends.torch_symm_mem",
}
BACKEND_NAMES = ("auto", *_MODULES)
_loaded: dict[str, Backend] = {}


def check_backend_name(name: object, *, argument: str = "backend") -> str:
    """``name`` if it names a backend or ``"auto"``; else a ValueError naming ``argument``."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"{argument}: unknown backend {name!r}; expected one of {BACKEND_NAMES}")
    return name  # type: ignore[return-value]


def set_backend(name: str) -> None:
    """Set the process-wide default backend (``"auto"`` restores automatic choice)."""
    config.BACKEND.set(check_backend_name(name, argument="set_backend(name)"))


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Within the ``with`` block, ops and styles without an explicit backend use ``name``."""
    token = config.BACKEND_IN_CONTEXT.set(check_backend_name(name, argument="use_backend(name)"))
    try:
        yield
    finally:
        config.BACKEND_IN_CONTEXT.reset(token)


def current_backend() -> str:
    """The backend name in force for a call that does not name one (may be ``"auto"``)."""
    return config.BACKEND_IN_CONTEXT.get() or check_backend_name(
        config.BACKEND.get(), argument="TP_KERNELS_BACKEND"
    )


def get_backend(name: str) -> Backend:
    """The backend object called ``name`` (not ``"auto"``); imports its module on first use."""
    if name not in _MODULES:
        raise ValueError(
            f"backend: {name!r} is not a concrete backend; expected one of {tuple(_MODULES)}"
        )
    backend = _loaded.get(name)
    if backend is None:
        backend = _loaded[name] = importlib.import_module(_MODULES[name]).BACKEND
    return backend


# --- asking the backends --------------------------------------------------------------------------


def unavailable_reason(
    name: str, group: dist.ProcessGroup | None, device: torch.device
) -> str | None:
    """Why backend ``name`` cannot run for ``group`` (None: in this process at all) and tensors
    on ``device``, or None: it can."""
    try:
        backend = get_backend(name)
    except ImportError as exc:  # e.g. the native extension or Triton is missing
        return f"cannot import: {exc}"
    return backend.unavailable_reason(group, device)


def available_backends(device: torch.device | str = "cpu") -> dict[str, str]:
    """``{name: "ok" or why it cannot run in this process}`` for every backend, for ``device``."""
    device = torch.device(device)
    return {name: unavailable_reason(name, None, device) or "ok" for name in _MODULES}


def _capture_unready_reason(
    impl: Backend, group: dist.ProcessGroup, device: torch.device, needs: Sequence[CaptureNeed]
) -> str | None:
    for need in needs:
        why = impl.capture_unready_reason(group, device, need)
        if why is not None:
            return why
    return None


# --- the choice -----------------------------------------------------------------------------------


def choose(
    asked: str | None,
    shape: Shape,
    group: dist.ProcessGroup,
    *,
    may_time: bool = True,
    block_scaled: bool = False,
) -> Choice:
    """The backend of a new plan of ``shape.op`` on ``group`` (``asked=None``: the name in force).

    A choice of ``auto`` that wants its shape class timed comes back with ``untimed`` set: the
    caller runs :func:`settle` once the ranks agreed on the call (``may_time=False``, as for a
    scaled call or a compiled graph's run, never asks it). ``block_scaled``: an MXFP8 call. Raises
    RuntimeError where a backend asked for by name cannot run the call."""
    name = check_backend_name(asked, argument="backend") if asked is not None else current_backend()
    if name != "auto":
        impl = get_backend(name)
        why = impl.block_scales_reason if block_scaled else None
        why = why or unavailable_reason(name, group, shape.device)
        if why is not None:
            raise RuntimeError(f"backend={name!r} cannot run {shape.op} here: {why}")
        return Choice(name, impl)
    ranked = _ranked.get(shape.key(group))
    if ranked is not None:  # timed in this process
        order = _block_scaled(ranked, block_scaled)
        return Choice(order[0], get_backend(order[0]), order)
    found = candidates(shape, group, block_scaled=block_scaled)
    first = get_backend(found.names[0])
    timing = may_time and timing_enabled() and not torch.compiler.is_compiling()
    if len(found.names) > 1 and timing:
        return Choice(first.name, first, found.names, found)
    why = "; ".join(f"{n}: {w}" for n, w in found.ruled_out.items()) or "the only candidate"
    log_once(shape, group, first.name, f"the first candidate ({why})")
    return Choice(first.name, first, found.names)


def _block_scaled(names: tuple[str, ...], block_scaled: bool) -> tuple[str, ...]:
    """``names`` less, for a block-scaled call, every backend that takes no block scales."""
    if not block_scaled:
        return names
    return tuple(n for n in names if get_backend(n).block_scales_reason is None)


def settle(
    chosen: Choice, shape: Shape, group: dist.ProcessGroup, run: Callable[[str], object]
) -> Choice:
    """``chosen`` with ``auto``'s timing done (step 3 of the module docstring): rule out what the
    model says cannot win, time ``run(name)`` for every other candidate on every rank, agree on
    the slowest rank's medians, keep and log the winner. Collective: every rank of ``group``
    calls it for the same shape class with the same candidates, after agreeing on the call."""
    if chosen.untimed is None:
        return chosen
    with deadline.fused_call(group, shape.op, "forward"):
        ranked = _time_and_choose(shape, group, chosen.untimed, run)
    return Choice(ranked[0], get_backend(ranked[0]), ranked)


def captured(
    op: str,
    chosen: Choice | None,
    shape: Shape,
    group: dist.ProcessGroup,
    needs: Sequence[CaptureNeed],
) -> Choice:
    """The backend of a captured call of ``op`` whose warmup chose ``chosen`` (None: it made no
    plan): ``chosen`` when it can capture every one of ``needs``; for ``auto``, the first of its
    order that can (logged once at INFO); else :class:`CaptureUnreadyError`, before anything is
    launched. Every rank captures the same step with the same plans, so all raise together."""
    if chosen is None:
        raise CaptureUnreadyError(
            f"{op}: a call of a new shape class ({_described(shape)}) on group "
            f"{group.group_name!r} has no plan yet, and it is being captured in a CUDA graph: "
            "making a plan agrees with the other ranks on the host (and may time auto's "
            "candidates), which a graph cannot capture; nothing was launched. Run one eager step "
            "with the same shapes before capturing (torchtitan's CUDA graph wrapper does: its "
            "first call is eager)"
        )
    why = _capture_unready_reason(chosen.impl, group, shape.device, needs)
    if why is None:
        return chosen
    tried = {chosen.name: why}
    for other in chosen.order:
        if other in tried:
            continue
        impl = get_backend(other)
        tried[other] = _capture_unready_reason(impl, group, shape.device, needs)
        if tried[other] is None:
            log_once(
                shape,
                group,
                other,
                f"under CUDA graph capture {chosen.name} (the warmup's choice) cannot run it "
                f"({why}); {other} is the next of auto's order that can",
            )
            return Choice(other, impl, chosen.order)
    reasons = "; ".join(f"{n}: {w}" for n, w in tried.items())
    raise CaptureUnreadyError(
        f"{op}: backend {chosen.name!r} cannot be captured in a CUDA graph for this call on group "
        f"{group.group_name!r} ({reasons}); nothing was launched"
    )


def _described(shape: Shape) -> str:
    return f"m={shape.m}, K={shape.k}, N={list(shape.ns)}, {shape.dtype}"


def at_run_time(
    asked: str, shape: Shape, group: dist.ProcessGroup, needs: Sequence[tuple[str, int]]
) -> Backend:
    """The backend a custom op runs on: the one called ``asked`` (an eager plan's choice), else
    (``""`` or ``"auto"``: a compiled graph passes what the user asked for) the choice made now,
    untimed; under CUDA graph capture one that can capture ``needs`` (``(op, bytes)`` pairs, see
    :class:`~tp_kernels.backends.base.CaptureNeed`)."""
    if asked in ("", "auto"):
        chosen = choose(asked or None, shape, group, may_time=False)
    else:
        chosen = Choice(asked, get_backend(asked))
    if base.capturing(shape.device):  # looked up at each call: tests replace it
        wanted = [CaptureNeed(op, nbytes, shape.dtype) for op, nbytes in needs]
        chosen = captured(shape.op, chosen, shape, group, wanted)
    return chosen.impl


# --- auto: the candidates, the model, the timing --------------------------------------------------


def timing_enabled() -> bool:
    """``TP_KERNELS_AUTO_TIMING`` (default 1): ``0`` keeps ``auto`` to its untimed choice."""
    return config.AUTO_TIMING.get()


def candidates(shape: Shape, group: dist.ProcessGroup, *, block_scaled: bool = False) -> Candidates:
    """The backends that can run for this call, best first (step 1 of the module docstring,
    before the model: what is left here is the same on every rank of a uniform group)."""
    if group.size() == 1:
        return Candidates(("reference",), {"*": "world size 1: there is nothing to overlap"}, {})
    ruled_out: dict[str, str] = {}
    names = []
    for name in PREFERENCE:
        if name == "torch_symm_mem" and shape.device.type != "cuda":
            continue  # PyTorch's symmetric-memory ops run on CUDA only; not worth a probe
        why = unavailable_reason(name, group, shape.device)
        refused = block_scaled and why is None and get_backend(name).block_scales_reason
        if why is not None:
            ruled_out[name] = f"unavailable: {why}"
        elif refused:
            ruled_out[name] = f"takes no block scales: {refused}"
        else:
            names.append(name)
    block = shape.rows_bytes(group.size())
    if "pipelined" in names and block < tiling.MIN_TRANSFER_BLOCK_BYTES:
        names.remove("pipelined")
        ruled_out["pipelined"] = (
            f"the {block} B per-rank block is below {tiling.MIN_TRANSFER_BLOCK_BYTES} B, too small "
            "to pipeline"
        )
    return Candidates(tuple(names), ruled_out, {})


def _agreed_max(values: list[float], group: dist.ProcessGroup, device: torch.device) -> list[float]:
    """The element-wise maximum of ``values`` over the ranks of ``group`` (one all-reduce)."""
    local = torch.tensor(values, dtype=torch.float64)
    if "nccl" in str(dist.get_backend(group)):
        local = local.to(device)
    deadline.complete(
        lambda: dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group, async_op=True),
        group,
        "auto backend choice",
    )
    return local.cpu().tolist()


def _ruled_out_by_model(shape: Shape, group: dist.ProcessGroup, found: Candidates) -> Candidates:
    """``found`` less what the model rules out. Predictions from a measured device (the CPU)
    differ a little from rank to rank, so the ranks first agree on the largest of each."""
    local = _predicted_s(shape, group.size())
    if not local:
        return found
    predicted = dict(
        zip(found.names, _agreed_max([local[n] for n in found.names], group, shape.device))
    )
    best = min(predicted.values())
    names, ruled_out = [], dict(found.ruled_out)
    # On CUDA the model simulates the schedules as built: where no fused one beats the unfused
    # one, fusion is ruled out (on a CPU its latencies are estimates, so the timing decides).
    unfused = predicted.get("reference")
    fused = [predicted[n] for n in found.names if n != "reference"]
    no_fusion = (
        shape.device.type == "cuda"
        and unfused is not None
        and bool(fused)
        and min(fused) >= unfused
    )
    for name in found.names:
        if no_fusion and name != "reference":
            ruled_out[name] = (
                f"the model predicts {predicted[name] * 1e3:.3g} ms, no fused backend beating "
                f"reference's {unfused * 1e3:.3g} ms"
            )
        elif predicted[name] > RULE_OUT * best:
            ruled_out[name] = (
                f"the model predicts {predicted[name] * 1e3:.3g} ms, over {RULE_OUT}x the best "
                f"{best * 1e3:.3g} ms"
            )
        else:
            names.append(name)
    return Candidates(tuple(names), ruled_out, predicted)


def _predicted_s(shape: Shape, world: int) -> dict[str, float]:
    spec = cost.device_spec(shape.device)
    dtype = cost.DTYPE_NAMES.get(shape.dtype)
    if spec is None or dtype is None:
        return {}
    # An uneven split's empty shard as one column: the model needs widths >= 1, and this rank
    # must still predict, to meet its peers in the agreement that follows.
    ns = tuple(max(n, 1) for n in shape.ns)
    return cost.op_cost(shape.op, shape.m, shape.k, sum(ns), world, dtype, spec, ns=ns).backends_s


def _time_and_choose(
    shape: Shape, group: dist.ProcessGroup, found: Candidates, run: Callable[[str], object]
) -> tuple[str, ...]:
    """Every candidate of ``found`` that can run, the winner first (see :func:`settle`)."""
    runnable = found.names
    found = _ruled_out_by_model(shape, group, found)
    names = found.names
    if len(names) == 1:
        why = "the only candidate the model leaves"
        return _keep(shape, group, why, found, names + _rest(runnable, names))
    samples: dict[str, list[float]] = {name: [] for name in names}
    sync = torch.cuda.synchronize if shape.device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        for round_ in range(WARMUP + ROUNDS):
            for name in names:
                sync()
                start = time.perf_counter()
                run(name)
                sync()
                if round_ >= WARMUP:
                    samples[name].append(time.perf_counter() - start)
    slowest = _agreed_max([statistics.median(samples[n]) for n in names], group, shape.device)
    best = min(slowest)
    winner = next(n for n, t in zip(names, slowest) if t <= MARGIN * best)
    model = found.predicted_s
    measured = ", ".join(
        f"{n} {t * 1e3:.3g} ms" + (f" (model {model[n] * 1e3:.3g} ms)" if model else "")
        for n, t in zip(names, slowest)
    )
    why = f"timed fastest on the slowest rank: {measured}"
    timed = sorted(names, key=lambda n: (n != winner, slowest[names.index(n)]))
    return _keep(shape, group, why, found, (*timed, *_rest(runnable, timed)))


def _rest(runnable: tuple[str, ...], ranked: Sequence[str]) -> tuple[str, ...]:
    """The candidates of ``runnable`` not in ``ranked``, in ``runnable``'s order (of preference)."""
    return tuple(n for n in runnable if n not in ranked)


def _keep(
    shape: Shape, group: dist.ProcessGroup, why: str, found: Candidates, ranked: tuple[str, ...]
) -> tuple[str, ...]:
    """Keep ``ranked`` (the winner first) for the shape class and log the winner."""
    _ranked[shape.key(group)] = ranked
    if found.ruled_out:
        why += "; ruled out: " + "; ".join(f"{n} ({w})" for n, w in found.ruled_out.items())
    log_once(shape, group, ranked[0], why)
    return ranked


def log_once(shape: Shape, group: dist.ProcessGroup, chosen: str, why: str) -> None:
    """Log ``auto``'s choice at INFO, once per (shape class, choice)."""
    key = (*shape.key(group), chosen)
    if key in _logged:
        return
    _logged.add(key)
    logger.info(
        "auto backend for %s on group %s (%s %s, m=%d K=%d N=%d): %s, because %s",
        shape.op,
        group.group_name,
        shape.device.type,
        shape.dtype,
        shape.m,
        shape.k,
        shape.n,
        chosen,
        why,
    )
