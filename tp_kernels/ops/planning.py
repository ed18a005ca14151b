"""Every fused call's plan: its checks, its backend and the agreement of the ranks, kept.

A call of a shape class already seen (same argument types, shapes, dtypes, devices, dims,
options, backend asked for, settings and ``use_backend`` context, on the same group) reuses its
:class:`Plan`: the checks it passed, the backend chosen and the signature agreed are what they
were, so the host does only the agreement (one tiny collective, when consistency checks are on)
and the call. Anything else makes a new plan (check, choose, agree, raise, in that order, on every
rank); the backend is :mod:`tp_kernels.backends.choice`'s, asked once per new plan. Under CUDA
graph capture a call reuses its plan without the agreement, and the choice says which backend
captures it (or refuses the call).

The op modules (``ops/ag_matmul.py``, ``ops/matmul_rs.py``) call :func:`plan` with what is
particular to their op, then run their one ``autograd.Function`` (the eager path: no dispatch
mode, plain tensors or DTensors) or their custom op (torch.compile, dispatch modes).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tp_kernels import config, deadline
from tp_kernels._compat import all_gather_single
from tp_kernels.backends import base, choice, pipelined
from tp_kernels.backends.base import Backend, CaptureNeed
from tp_kernels.backends.choice import Choice, Shape, check_backend_name
from tp_kernels.ops._checks import NotAMemberError, resolve_group
from tp_kernels.ops.comm_stats import register_with_comm_debug_mode

__all__ = ["Plan", "agree", "agree_across_ranks", "plan", "resolve_group_or_note", "tensor_key"]


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
    """One shape class of calls, resolved: the normalized ``dim``, the ``backend``'s name as the
    custom ops take it, its ``choice`` (None while torch.compile traces: the op chooses when the
    graph runs, given the name asked for or ``""``), the call's ``shape`` class, the agreed
    ``signature`` and its ``text``, and whether each later call agrees again (``checked``:
    consistency checks on, more than one rank)."""

    dim: int
    backend: str
    choice: Choice | None
    shape: Shape | None
    signature: Signature | None
    text: str
    checked: bool

    @property
    def impl(self) -> Backend | None:
        """The backend object, None while torch.compile traces."""
        return None if self.choice is None else self.choice.impl


# group -> {call key -> plan}; weak, so a destroyed group's plans go with it. Bounded: a model
# whose shapes never repeat would otherwise grow it without end.
_plans: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, Plan]]
_plans = weakref.WeakKeyDictionary()
_MAX_PLANS_PER_GROUP = 1024


def tensor_key(t: object) -> tuple:
    return (type(t), t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else (type(t),)


def _call_key(a: object, rhs: object, rest: tuple) -> tuple | None:
    """What decides a call's checks, backend and signature; None when it cannot be keyed (the
    call then takes the full path, whose checks say what is wrong; and while torch.compile
    traces, which keeps no state)."""
    if torch.compiler.is_compiling() or not isinstance(rhs, (list, tuple)):
        return None
    return (tensor_key(a), tuple(tensor_key(b) for b in rhs), *rest, config.settings_key())


def _shape_of(op: str, t: torch.Tensor, rhs: list[torch.Tensor], group: dist.ProcessGroup) -> Shape:
    if op == "all_gather_matmul":
        return Shape.of_all_gather_matmul(t, rhs)
    return Shape.of_matmul_reduce_scatter(t, rhs[0], group.size())


def _new_plan(
    op: str,
    group: dist.ProcessGroup,
    a: object,
    backend: str | None,
    local_check: Callable[[], tuple[torch.Tensor, list[torch.Tensor], int]],
    options: dict[str, object],
    timed_run: Callable[[int, str], object],
) -> Plan:
    """Check locally, choose the backend, agree across ranks, raise, and let ``auto`` time: in
    that order, on every rank.

    A rank whose check fails still takes part in the agreement (with its error as its signature),
    so every rank raises together and none is left waiting. ``auto``'s timing follows the
    agreement (every rank then knows the others make the same call). While torch.compile traces,
    the checks stay local and the choice of backend is left to the op at run time (``""`` or the
    name asked for): the registry's state (context, environment, availability probes) is not
    traceable.
    """
    if torch.compiler.is_compiling():
        name = check_backend_name(backend, argument="backend") if backend is not None else ""
        return Plan(local_check()[2], name, None, None, None, "", False)
    device = _device_of(a)
    with deadline.fused_call(group, op, "forward"):
        try:
            t, rhs, dim = local_check()
            shape = _shape_of(op, t, rhs, group)
            chosen = choice.choose(backend, shape, group)
            if op == "all_gather_matmul":
                agreed = tuple(t.shape)
            else:
                agreed = tuple(t.shape[:-1])  # K may differ by rank (an uneven rowwise split)
                options = {"n": rhs[0].shape[1], **options}
            chunks = pipelined.chunks_setting()
            options_items = tuple(options.items())
            signature = Signature(
                op,
                agreed,
                t.dtype,
                t.device.type,
                dim,
                len(rhs),
                chosen.name,
                options_items,
                chunks,
            )
            text, error = str(signature), None
        except (TypeError, ValueError, RuntimeError) as exc:
            text, error = f"error: {exc}", exc
        agree_across_ranks(group, op, text, device)
        if error is not None:
            raise error
    if chosen.untimed is not None:
        chosen = choice.settle(chosen, shape, group, lambda name: timed_run(dim, name))
        signature = dataclasses.replace(signature, backend=chosen.name)
    checked = group.size() > 1 and consistency_checks_on(device)
    return Plan(dim, chosen.name, chosen, shape, signature, str(signature), checked)


def plan(
    op: str,
    group: dist.ProcessGroup,
    a: object,
    rhs: object,
    key: tuple,
    backend: str | None,
    local_check: Callable[[], tuple[torch.Tensor, list[torch.Tensor], int]],
    options: dict[str, object],
    timed_run: Callable[[int, str], object],
    capture_needs: Callable[[], list[CaptureNeed]],
) -> tuple[Plan, bool]:
    """The plan of an ``op`` call of ``a`` and ``rhs`` (``key``: the call's other arguments that
    decide it) on ``group``, and whether it still owes the agreement (a cached plan does when it
    is ``checked``; a new one was agreed while it was made; a captured call never agrees).
    Raises on every rank what the arguments get wrong (``local_check``). ``timed_run(dim, name)``
    runs the call on backend ``name`` for ``auto``'s timing; ``capture_needs()`` is what the call
    and its backward need of a backend under capture."""
    if not torch.compiler.is_compiling():
        register_with_comm_debug_mode()
    cached = _plans.get(group)
    call_key = _call_key(a, rhs, key)
    found = None if cached is None or call_key is None else cached.get(call_key)
    if base.capturing(_device_of(a)):
        return _captured(op, group, found, local_check, capture_needs), False
    if found is not None:
        return found, found.checked
    made = _new_plan(op, group, a, backend, local_check, options, timed_run)
    # Kept, timed or not: a later call of the shape class (the captured one of a CUDA graph's
    # warmup and capture among them) must not plan, agree or time again.
    if call_key is not None and made.choice is not None:
        cached = _plans.setdefault(group, {})
        if len(cached) >= _MAX_PLANS_PER_GROUP:
            cached.clear()
        cached[call_key] = made
    return made, False


def _captured(
    op: str,
    group: dist.ProcessGroup,
    found: Plan | None,
    local_check: Callable[[], tuple[torch.Tensor, list[torch.Tensor], int]],
    capture_needs: Callable[[], list[CaptureNeed]],
) -> Plan:
    """The plan of a captured call: its warmup's, with the backend that can capture the call
    (:func:`tp_kernels.backends.choice.captured`, which refuses a call with no plan)."""
    if found is None:
        t, rhs, _ = local_check()  # what the arguments get wrong, said locally, before the refusal
        choice.captured(op, None, _shape_of(op, t, rhs, group), group, [])
    chosen = choice.captured(op, found.choice, found.shape, group, capture_needs())
    return dataclasses.replace(found, backend=chosen.name, choice=chosen)


def agree(group: dist.ProcessGroup, op: str, plan: Plan, device: torch.device) -> None:
    """The agreement a cached plan owes (inside the call's ``fused_call``)."""
    agree_across_ranks(group, op, plan.text, device)


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
