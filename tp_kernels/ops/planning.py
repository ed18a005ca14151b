"""What every fused call does around its run: its plan (checks, backend, agreement), its count.

Planning and agreement live here, once for both ops.

A call of a shape class already seen (same argument types, shapes, dtypes, devices, dims,
options, backend asked for, settings and ``use_backend`` context, on the same group) reuses its
:class:`Plan`: the checks it passed, the backend chosen and the signature agreed are what they
were, so the host does only the agreement (one tiny collective, when consistency checks are on)
and the call. Anything else makes a new plan (check, choose, agree, raise, in that order, on every
rank). Under CUDA graph capture a call reuses its plan without the agreement, or is refused
(``ops/capture.py``).

The op modules (``ops/all_gather_matmul.py``, ``ops/matmul_reduce_scatter.py``) call :func:`plan`
with what is particular to their op, then run their one ``autograd.Function`` (the eager path: no
dispatch mode, plain tensors or DTensors) or their custom op (torch.compile, dispatch modes). This
module also keeps the helpers both need: the 2-D rows a call computes on and back, a DTensor's
local tensor and spec, the backend a custom op resolves when it runs, and :func:`comm_stats`.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import hashlib
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from tp_kernels import config, deadline
from tp_kernels._compat import all_gather_single
from tp_kernels.backends import (
    BACKEND_NAMES,
    base,
    check_backend_name,
    choose,
    current_backend,
    get_backend,
    pipelined,
    resolve,
)
from tp_kernels.backends.auto import Candidates, Shape, time_and_choose
from tp_kernels.backends.base import Backend, CaptureNeed
from tp_kernels.ops import capture
from tp_kernels.ops._checks import NotAMemberError, resolve_group

__all__ = [
    "CommStats",
    "Plan",
    "agree_across_ranks",
    "comm_stats",
    "plan",
    "record",
    "reset_comm_stats",
    "resolve_group_or_note",
]


@dataclass(frozen=True)
class Signature:
    """What every rank of the group must agree on for one fused call; its text is compared.

    Sizes that may differ per rank (a colwise weight's uneven N, a rowwise weight's uneven K) are
    left out; the per-rank settings that change the protocol are in: the backend and the
    pipelined block count (which ``auto`` may time even where it then picks another backend).
    """

    op: str
    a_shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    dim: int
    num_rhs: int
    backend: str
    options: tuple[tuple[str, object], ...]
    chunks: int | None

    def __str__(self) -> str:
        return (
            f"{self.op} a={self.a_shape} {self.dtype} {self.device} dim={self.dim} "
            f"rhs={self.num_rhs} backend={self.backend} {dict(self.options)} chunks={self.chunks}"
        )


@dataclass(frozen=True)
class Plan:
    """One shape class of calls, resolved: the normalized ``dim``, the backend (``impl`` None
    while torch.compile traces: the op resolves it when the graph runs), ``auto``'s shape, the
    agreed ``signature`` and its ``text``, whether ``auto`` chose the backend, and whether each
    later call agrees again (``checked``: consistency checks on, more than one rank)."""

    dim: int
    backend: str
    impl: Backend | None
    shape: Shape | None
    signature: Signature | None
    text: str
    auto: bool
    checked: bool


# group -> {call key -> plan}; weak, so a destroyed group's plans go with it. Bounded: a model
# whose shapes never repeat would otherwise grow it without end.
_plans: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, Plan]]
_plans = weakref.WeakKeyDictionary()
_MAX_PLANS_PER_GROUP = 1024
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def tensor_key(t: object) -> tuple:
    return (type(t), t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else (type(t),)


def _call_key(a: object, rhs: object, rest: tuple) -> tuple | None:
    """What decides a call's checks, backend and signature; None when it cannot be keyed (the
    call then takes the full path, whose checks say what is wrong; and while torch.compile
    traces, which keeps no state)."""
    if torch.compiler.is_compiling() or not isinstance(rhs, (list, tuple)):
        return None
    return (tensor_key(a), tuple(tensor_key(b) for b in rhs), *rest, config.settings_key())


def _new_plan(
    op: str,
    group: dist.ProcessGroup,
    a: object,
    backend: str | None,
    local_check: Callable[[], tuple[torch.Tensor, list[torch.Tensor], int]],
    options: dict[str, object],
) -> tuple[Plan, Candidates | None]:
    """Check locally, choose the backend, agree across ranks, raise: in that order, on every rank.

    A rank whose check fails still takes part in the agreement (with its error as its signature),
    so every rank raises together and none is left waiting. When ``auto`` wants the shape class
    timed, the candidates come back beside the plan and the caller times them after the
    agreement (every rank then knows the others make the same call). While torch.compile traces,
    the checks stay local and the choice of backend is left to the op at run time (``""`` or the
    name asked for, see :func:`runtime_backend`): the registry's state (context, environment,
    availability probes) is not traceable.
    """
    if torch.compiler.is_compiling():
        name = check_backend_name(backend, argument="backend") if backend is not None else ""
        return Plan(local_check()[2], name, None, None, None, "", False, False), None
    device = _device_of(a)
    with deadline.fused_call(group, op, "forward"):
        try:
            t, rhs, dim = local_check()
            if op == "all_gather_matmul":
                shape, agreed = Shape.of_all_gather_matmul(t, rhs), tuple(t.shape)
            else:
                shape = Shape.of_matmul_reduce_scatter(t, rhs[0], group.size())
                agreed = tuple(t.shape[:-1])  # K may differ by rank (an uneven rowwise split)
                options = {"n": rhs[0].shape[1], **options}
            asked = backend if backend is not None else current_backend()
            name, pending = choose(backend, shape, group)
            chunks = pipelined.chunks_setting()
            options_items = tuple(options.items())
            signature = Signature(
                op, agreed, t.dtype, t.device.type, dim, len(rhs), name, options_items, chunks
            )
            text, error = str(signature), None
        except (TypeError, ValueError, RuntimeError) as exc:
            text, error = f"error: {exc}", exc
        agree_across_ranks(group, op, text, device)
        if error is not None:
            raise error
    checked = group.size() > 1 and consistency_checks_on(device)
    impl = get_backend(name)
    return Plan(dim, name, impl, shape, signature, text, asked == "auto", checked), pending


def plan(
    op: str,
    group: dist.ProcessGroup,
    a: object,
    rhs: object,
    key: tuple,
    backend: str | None,
    local_check: Callable[[], tuple[torch.Tensor, list[torch.Tensor], int]],
    options: dict[str, object],
    timed_run: Callable[[Plan, str], object],
    capture_needs: Callable[[], list[CaptureNeed]],
) -> tuple[Plan, bool]:
    """The plan of an ``op`` call of ``a`` and ``rhs`` (``key``: the call's other arguments that
    decide it) on ``group``, and whether it still owes the agreement (a cached plan does when it
    is ``checked``; a new one was agreed while it was made; a captured call never agrees, see
    ``ops/capture.py``). Raises on every rank what the arguments get wrong (``local_check``).
    ``timed_run(plan, name)`` runs the call on backend ``name`` for ``auto``'s timing;
    ``capture_needs()`` is what the call and its backward need of a backend under capture."""
    if not torch.compiler.is_compiling():
        _count_as_replaced_collectives()
    cached = _plans.get(group)
    call_key = _call_key(a, rhs, key)
    found = None if cached is None or call_key is None else cached.get(call_key)
    device = _device_of(a)
    if base.capturing(device):
        if found is None:
            local_check()  # what the arguments get wrong, said locally, before the refusal
            capture.refuse_new_plan(op, group, f"a call of a new shape class ({_described(a)})")
        name, impl = capture.capture_backend(
            op, group, device, capture_needs(), found.backend, found.impl, found.shape, found.auto
        )
        return dataclasses.replace(found, backend=name, impl=impl), False
    if found is not None:
        return found, found.checked
    made, pending = _new_plan(op, group, a, backend, local_check, options)
    if pending is not None:
        name = time_and_choose(made.shape, group, pending, lambda n: timed_run(made, n))
        # Kept as a plan like any other: a later call of the shape class (the captured one of a
        # CUDA graph's warmup and capture among them) must not plan, agree or time again.
        signature = dataclasses.replace(made.signature, backend=name)
        made = dataclasses.replace(
            made, backend=name, impl=get_backend(name), signature=signature, text=str(signature)
        )
    if call_key is not None and made.impl is not None:
        cached = _plans.setdefault(group, {})
        if len(cached) >= _MAX_PLANS_PER_GROUP:
            cached.clear()
        cached[call_key] = made
    return made, False


def agree(group: dist.ProcessGroup, op: str, plan: Plan, device: torch.device) -> None:
    """The agreement a cached plan owes (inside the call's ``fused_call``)."""
    agree_across_ranks(group, op, plan.text, device)


def grads_wanted(grads: tuple[object, Sequence[object]]) -> tuple[bool, bool]:
    """Whether autograd will want the grad of the input, and of any of the parameters."""
    return capture.requires_grad([grads[0]]), capture.requires_grad(grads[1])


def _described(a: object) -> str:
    return f"{tuple(a.shape)} {a.dtype}" if isinstance(a, torch.Tensor) else type(a).__name__


def _device_of(t: object) -> torch.device:
    return t.device if isinstance(t, torch.Tensor) else torch.device("cpu")


# --- the agreement -----------------------------------------------------------------------------
#
# What ranks could disagree on (shapes, dtypes, options, the backend they resolved, a local check
# that failed on one rank only) is compared across the group by agree_across_ranks (one tiny
# all-gather of a digest) when consistency checks are on: by default for CPU tensors, not for
# CUDA tensors where the extra latency per op matters; TP_KERNELS_CHECK_CONSISTENCY=1/0 forces
# either. The first call on a group always agrees, and on the mode too, so ranks whose modes
# differ fail together there instead of one waiting in an agreement the other skips. With the
# check off, ranks that call with different shapes are a user error that the collective itself
# may or may not detect (NCCL then hangs until its watchdog timeout). Every exchange here is
# bounded by tp_kernels.deadline.
#
# A rank whose call fails before it knows its group (a group argument naming none it belongs to)
# cannot take part in the agreement: its peers end at the deadline. So that its next call does
# not pair with the call its peers are still waiting in, it carries a note of the failed call
# into its next agreement within the deadline, where the peers see it as a mismatch.

# (op, when) of a call that failed before it could reach its peers; taken by the next agreement
# within the deadline (later, the peers that waited for it have given up).
_unmatched_call: tuple[str, float] | None = None
# The groups whose first call has agreed.
_agreed: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()


def resolve_group_or_note(group: object, *, op: str) -> dist.ProcessGroup:
    """:func:`~tp_kernels.ops._checks.resolve_group`, noting a failure for the next agreement."""
    global _unmatched_call
    try:
        return resolve_group(group, op=op)
    except NotAMemberError:
        raise
    except (TypeError, ValueError):
        _unmatched_call = (op, time.monotonic())
        raise


def consistency_checks_on(device: torch.device) -> bool:
    """:data:`tp_kernels.config.CHECK_CONSISTENCY`, by default on for CPU tensors only."""
    forced = config.CHECK_CONSISTENCY.get()
    return device.type != "cuda" if forced is None else forced


@functools.lru_cache(maxsize=1024)
def _digest(signature: str) -> int:
    """7 bytes of a hash of ``signature``; cached, as a shape class's calls repeat one text."""
    return int.from_bytes(hashlib.blake2b(signature.encode(), digest_size=7).digest(), "little")


def agree_across_ranks(
    group: dist.ProcessGroup, op: str, signature: str, device: torch.device
) -> None:
    """Raise the same ValueError on every rank unless all ranks pass the same ``signature``.

    Ranks exchange a 7-byte digest of ``signature`` (one tiny all-gather); only when they differ
    are the texts gathered, so the error can say which rank called with what.
    """
    global _unmatched_call
    checks = consistency_checks_on(device)
    if group.size() == 1 or (not checks and group in _agreed):
        return
    signature += f" consistency_checks={checks}"
    if _unmatched_call is not None:
        failed_op, when = _unmatched_call
        _unmatched_call = None
        if time.monotonic() - when < deadline.get_timeout():
            signature += (
                f" (after a {failed_op} call on this rank that failed before it knew its group)"
            )
    mine = torch.tensor(
        [_digest(signature)], dtype=torch.int64, device=device if device.type == "cuda" else "cpu"
    )
    everyone = mine.new_empty(group.size())
    deadline.complete(
        lambda: all_gather_single(everyone, mine, group, async_op=True), group, "agreement"
    )
    if bool((everyone != mine).any()):
        texts = deadline.gather_objects(group, signature, "agreement")
        lines = "\n".join(f"  rank {r}: {t}" for r, t in enumerate(texts))
        raise ValueError(
            f"{op}: the ranks of group {group.group_name!r} called with different "
            f"arguments; every rank must pass the same shapes, dtypes and options:\n"
            f"{lines}"
        )
    _agreed.add(group)


# --- the eager path and the layout of a call's tensors -------------------------------------------


def eager_path(tensors: Sequence[torch.Tensor | None]) -> bool:
    """Whether a call on these (local) tensors may take its op's ``autograd.Function``: no
    dispatch mode is active (CommDebugMode, fake tensors, a user's mode see the custom op) and
    every tensor is a plain one."""
    return not torch._C._len_torch_dispatch_stack() and all(
        t is None or type(t) in _PLAIN for t in tensors
    )


def local_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``'s local tensor if it is a DTensor (no autograd node: the op's Function takes the
    DTensor itself as its argument), else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


def dtensor_specs(*args: torch.Tensor | None) -> list[DTensorSpec | None]:
    """The DTensor specs of ``args`` (None for a plain tensor or None): what backward needs of
    them, without keeping their data alive."""
    return [t._spec if isinstance(t, DTensor) else None for t in args]


def as_grad(grad: torch.Tensor | None, spec: DTensorSpec | None) -> torch.Tensor | None:
    """``grad`` (local) as the gradient of an argument of ``spec`` (a DTensor of that spec, as
    ``to_local``'s backward gives it; ``grad`` itself for a plain tensor)."""
    if grad is None or spec is None:
        return grad
    return DTensor(grad, copy.copy(spec), requires_grad=False)


def flatten_rows(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``t`` with ``dim`` moved first and flattened to 2-D rows ``[rows, K]``, and the leading
    shape those rows came from."""
    lead = t if dim == 0 else t.movedim(dim, 0)
    return (lead if lead.ndim == 2 else lead.reshape(-1, t.shape[-1])), lead.shape[:-1]


def restore_dim(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` (the gathered or scattered dim first, as the backends lay rows out rank-major) with
    that dim moved back to ``dim``, row-major, as PyTorch's collectives and matmuls return it:
    callers ``.view()`` results (``logits.view(-1, vocab)``). For ``dim == 0`` nothing moves; for
    another dim this is one copy of the output, O(M*N) against the matmul's O(M*N*K), that rank-
    major rows cannot avoid."""
    return t if dim == 0 else t.movedim(0, dim).contiguous()


def unflatten_rows(t: torch.Tensor, lead: Sequence[int], dim: int) -> torch.Tensor:
    """2-D rows ``t`` back to ``lead`` rows (``dim`` first) with ``dim`` moved home (``t`` itself
    for 2-D rows on dim 0: a no-op view costs the host microseconds per output)."""
    if dim == 0 and len(lead) == 1:
        return t
    return restore_dim(t.view(*lead, t.shape[-1]), dim)


# --- the custom ops' group and backend, resolved when they run ----------------------------------


def group_size(group_name: str) -> int:
    """The size of the group registered as ``group_name`` (the custom ops' fake kernels)."""
    return _resolve_process_group(group_name).size()


def runtime_backend(
    name: str, group: dist.ProcessGroup, shape: Shape, needs: Sequence[tuple[str, int]]
) -> Backend:
    """The backend a custom op runs on: the one called ``name`` (resolved when ``""`` or
    ``"auto"``: a compiled graph passes what the user asked for); under CUDA graph capture one
    that can capture ``needs`` (``(op, bytes)`` pairs, see
    :class:`~tp_kernels.backends.base.CaptureNeed`)."""
    asked_auto = name not in BACKEND_NAMES or name == "auto"
    concrete = resolve(name or None, shape, group) if asked_auto else name
    impl = get_backend(concrete)
    if base.capturing(shape.device):
        wanted = [CaptureNeed(op, nbytes, shape.dtype) for op, nbytes in needs]
        _, impl = capture.capture_backend(
            shape.op, group, shape.device, wanted, concrete, impl, shape, asked_auto
        )
    return impl


# --- CommDebugMode's count of the custom ops ------------------------------------------------------

# Each custom op and the c10d_functional collective it replaces in DTensor's path; filled by the
# op modules when they register their ops.
_replaced: dict[str, str] = {}
_counted_by_comm_debug_mode = False


def count_as_collective(op: str, collective: str) -> None:
    """Have ``CommDebugMode`` count the custom op ``tp_kernels::<op>`` as one ``collective`` (a
    ``c10d_functional`` op name), under the module that issued it."""
    _replaced[op] = collective


def _count_as_replaced_collectives() -> None:
    """Register :func:`count_as_collective`'s pairs with CommDebugMode, which keeps its registry
    in module globals (where a torch lacks them, nothing is registered). Called before every
    eager fused call, it acts once, and only once that module is loaded: importing it imports
    Triton, which must wait for ``TRITON_INTERPRET``."""
    global _counted_by_comm_debug_mode
    _comm_mode = sys.modules.get("torch.distributed.tensor.debug._comm_mode")
    if _counted_by_comm_debug_mode or _comm_mode is None:
        return
    _counted_by_comm_debug_mode = True
    counted = getattr(_comm_mode, "c10d_collective_ops", None)
    as_collective = getattr(_comm_mode, "NATIVE_TO_PY_MAPPING", None)
    if not isinstance(counted, set) or not isinstance(as_collective, dict):
        return
    for op, collective in _replaced.items():
        ours = getattr(torch.ops.tp_kernels, op)
        counted.add(ours)
        as_collective[ours] = getattr(torch.ops.c10d_functional, collective)


# --- the counters ------------------------------------------------------------------------------


class CommStats(collections.Counter):
    """Counts of the communication the fused ops (and the styles' fallbacks) ran in this
    process, keyed by ``(phase, kind, backend)``: phase ``"forward"`` or ``"backward"``; kind
    ``"all_gather_matmul"``, ``"matmul_reduce_scatter"``, ``"all_gather"`` (a plain re-gather of a
    saved shard in backward) or ``"fallback"`` (a style took PyTorch's DTensor path, backend
    ``"torch"``), ``"scaled_all_gather_matmul"``, ``"scaled_matmul_reduce_scatter"`` (fp8 calls)
    or ``"amax_all_reduce"`` (an fp8 scale that spans the group's shards). :attr:`sent_bytes`
    holds, per key, the bytes this rank put on the link for those calls (an all-gather's shard,
    a reduce-scatter's partials for the peers), where the call counts them. Counted where the
    ops run, so compiled graphs count too."""

    def __init__(self, counts: object = (), sent_bytes: object = ()) -> None:
        super().__init__(counts)
        self.sent_bytes: collections.Counter = collections.Counter(sent_bytes)

    def total(
        self, phase: str | None = None, kind: str | None = None, backend: str | None = None
    ) -> int:
        """Calls matching every filter given (``None`` matches anything)."""
        want = (phase, kind, backend)
        return sum(
            n for key, n in self.items() if all(w is None or w == k for w, k in zip(want, key))
        )

    def total_bytes(
        self, phase: str | None = None, kind: str | None = None, backend: str | None = None
    ) -> int:
        """:attr:`sent_bytes` of the calls matching every filter given."""
        want = (phase, kind, backend)
        return sum(
            n
            for key, n in self.sent_bytes.items()
            if all(w is None or w == k for w, k in zip(want, key))
        )


_counts = CommStats()
_lock = threading.Lock()  # autograd may run backward on another thread


def record(phase: str, kind: str, backend: str, *, sent_bytes: int = 0) -> None:
    with _lock:
        _counts[(phase, kind, backend)] += 1
        if sent_bytes:
            _counts.sent_bytes[(phase, kind, backend)] += sent_bytes


def gather_bytes(shard: torch.Tensor, group: dist.ProcessGroup) -> int:
    """The bytes this rank puts on the link in an all-gather of ``shard``: the shard, once for
    each peer (whether sent, or read by the peer's copy engine)."""
    return shard.numel() * shard.element_size() * (group.size() - 1)


def comm_stats() -> CommStats:
    """A snapshot of the counters since the last :func:`reset_comm_stats`."""
    with _lock:
        return CommStats(_counts, _counts.sent_bytes)


def reset_comm_stats() -> None:
    with _lock:
        _counts.clear()
        _counts.sent_bytes.clear()
