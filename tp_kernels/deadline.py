"""One deadline for every wait of a fused op, one error when it passes, and broken groups.

Everything a fused op or style waits on (the ranks' agreement, symmetric-memory setup and growth,
signal waits, the pipelined transfers, the backward's re-gathers, ``auto``'s timing exchange) is
bounded by :func:`get_timeout` (``TP_KERNELS_TIMEOUT_S``, :func:`set_timeout`, default 300 s).

* A torch.distributed ``Work`` is waited with torch's own ``Work.wait(timeout)`` (:func:`wait`)
  where the host waits anyway: CPU tensors, and any group whose backend is not NCCL. gloo honours
  that timeout for its all-gather, all-reduce, all-to-all and point-to-point Works but not for its
  reduce-scatter, which tp_kernels therefore does not use on gloo (``backends/reference.py``). On
  an NCCL group a transfer's ``wait()`` only orders the compute stream after it and the host never
  blocks; a timeout there would block the host on every transfer and undo the overlap, so those
  waits are bounded by NCCL's own watchdog (the process group's ``timeout``; leave
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` at its default so a timed-out communicator is aborted).
* Python objects are exchanged by :func:`gather_objects`: two bounded tensor all-gathers, where
  ``all_gather_object`` would wait for the group's timeout.
* A rank's own slow, local work before a call's first wait for its peers (compiling and tuning
  the ``symm`` kernels for a new shape) is run by :func:`local_work`: its peers wait for its end
  without counting it, as long as it says on the group's store that it is still at it.
* Symmetric-memory signal waits carry the deadline themselves (:mod:`tp_kernels.symmetric_memory`
  on the host; the ``symm`` kernels record a timed-out wait in a status that the ``symm`` backend
  reads).

A wait that fails (past the deadline, or the transport saw a peer's connection close) raises
:class:`PeerTimeoutError`, the one timeout error of tp_kernels, naming the op, the pass and phase,
the group, the peers not heard from and how long it waited. The native heap and the Triton
kernels, which cannot import this module, report what timed out instead (the heap's own error, the
kernels' status record), and :mod:`tp_kernels.symmetric_memory` and the ``symm`` backend turn that
into this error. The peers not heard from are found by a roll call on the group's store: every
rank that gives up posts when its wait began and ended, under its rank and the call's number, and
waits a short grace for the others': ranks stuck in the same call find each other and name only
the absent or late ones, and a rank that arrives late (resumed after a stop) learns which peers
gave up before it.
The group is then *broken* in this process (:func:`mark_broken`; this module keeps the only
record): every later fused call on it raises at once (:func:`raise_if_broken`; its collectives
may still be half-matched in the transport, so nothing on it can be trusted); create a new group.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import itertools
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from tp_kernels import config

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "PeerTimeoutError",
    "complete",
    "fused_call",
    "gather_objects",
    "get_timeout",
    "is_broken",
    "local_work",
    "mark_broken",
    "posting",
    "raise_if_broken",
    "set_timeout",
    "wait",
]

T = TypeVar("T")
# How long a rank that gave up waits for the other ranks stuck in the same call to say so.
_ROLL_CALL_GRACE_S = 2.0


class PeerTimeoutError(TimeoutError):
    """A wait for peers ended without them: past the deadline, or their connection closed.

    Attributes (``None``/empty when unknown): ``op``, ``phase`` (``"forward"``/``"backward"``
    and what was waited for, e.g. ``"forward agreement"``), ``group`` (its name), ``peers`` (the
    group ranks not heard from), ``waited_s``, ``detail`` (the message without the call's
    op and phase).
    """

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        phase: str | None = None,
        group: str | None = None,
        peers: list[int] | None = None,
        waited_s: float | None = None,
    ) -> None:
        self.detail = message
        call = _call.get()
        if op is None and call is not None:
            op, pass_ = call
            phase = f"{pass_} {phase}" if phase else pass_
            message = f"{op} ({phase}): {message}"
        super().__init__(message)
        self.op, self.phase, self.group = op, phase, group
        self.peers = list(peers or [])
        self.waited_s = waited_s


# --- the deadline ---------------------------------------------------------------------------------

DEFAULT_TIMEOUT_S = config.TIMEOUT_S.default


def set_timeout(seconds: float) -> None:
    """Set the deadline of every wait of tp_kernels in this process, in seconds."""
    config.TIMEOUT_S.set(seconds, argument="seconds")


def get_timeout() -> float:
    """The deadline of waits: :func:`set_timeout`'s value, else ``TP_KERNELS_TIMEOUT_S``, else
    300 s (:data:`tp_kernels.config.TIMEOUT_S`)."""
    return config.TIMEOUT_S.get()


# --- fused calls and broken groups ----------------------------------------------------------------

# (op, "forward" | "backward") of the fused call this thread is in, for errors raised below it.
_call: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "tp_kernels_call", default=None
)
# group -> the error that broke it.
_broken: weakref.WeakKeyDictionary[dist.ProcessGroup, PeerTimeoutError]
_broken = weakref.WeakKeyDictionary()
# group -> fused calls entered on it: the same on every rank that made the same calls, so it
# numbers the roll call.
_calls: weakref.WeakKeyDictionary[dist.ProcessGroup, int] = weakref.WeakKeyDictionary()


_NO_MODES = contextlib.nullcontext()


def is_broken(group: dist.ProcessGroup) -> bool:
    """Whether an earlier failed wait broke ``group`` in this process."""
    return group in _broken


def mark_broken(group: dist.ProcessGroup, error: PeerTimeoutError) -> None:
    """Record that ``error`` broke ``group``: every later call on it is refused (the first
    error is the one kept and named)."""
    _broken.setdefault(group, error)


def raise_if_broken(group: dist.ProcessGroup, op: str, phase: str | None = None) -> None:
    """Refuse a call of ``op`` (in ``phase``, when known) on ``group`` at once if an earlier failed
    wait broke the group, naming that failure."""
    broken = _broken.get(group)
    if broken is None:
        return
    call = f"{op} ({phase})" if phase else op
    raise PeerTimeoutError(
        f"{call}: group {group.group_name!r} is broken by an earlier failed wait, so its peers' "
        f"state is unknown; create a new group. The failure was: {broken}",
        op=op,
        phase=phase,
        group=group.group_name,
        peers=broken.peers,
        waited_s=0.0,
    )


@contextlib.contextmanager
def fused_call(group: dist.ProcessGroup, op: str, pass_: str) -> Iterator[None]:
    """The extent of one fused call (or one of its parts) on ``group``: refuses at once on a
    broken group, names ``op`` and ``pass_`` in the deadline errors raised inside, and marks the
    group broken when one is. Dispatch modes (``CommDebugMode``, a user's) do not see the
    collectives inside: they see the fused custom op as the collective it replaces (see
    ``ops/ag_matmul.py``), not the agreement or transport under it."""
    raise_if_broken(group, op, pass_)
    _calls[group] = _calls.get(group, 0) + 1
    token = _call.set((op, pass_))
    # Entering _disable_current_modes costs microseconds even with no mode to disable.
    modes = _disable_current_modes() if torch._C._len_torch_dispatch_stack() else _NO_MODES
    try:
        with modes:
            yield
    except PeerTimeoutError as exc:
        mark_broken(group, exc)
        raise
    finally:
        _call.reset(token)


# --- bounded waits --------------------------------------------------------------------------------


def wait(
    work: dist.Work, group: dist.ProcessGroup, what: str, device: torch.device | None = None
) -> None:
    """``work.wait()`` within the deadline; on failure a :class:`PeerTimeoutError` about
    ``what`` (e.g. ``"agreement"``). ``device``: that of the Work's tensors, where the host need
    not wait: for CUDA tensors on an NCCL group the wait only orders the current stream after the
    transfer, and NCCL's watchdog bounds it."""
    if device is not None and device.type == "cuda" and "nccl" in str(dist.get_backend(group)):
        work.wait()
        return
    timeout = get_timeout()
    start = time.monotonic()
    try:
        work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        raise _failed(group, what, time.monotonic() - start, timeout, exc) from exc


@contextlib.contextmanager
def posting(group: dist.ProcessGroup, what: str) -> Iterator[None]:
    """Around the posting of collectives or transfers: the transport refuses to post on a
    connection a peer closed (it died, or gave up on this group) with a RuntimeError, which
    becomes the :class:`PeerTimeoutError` of :func:`wait`."""
    start = time.monotonic()
    try:
        yield
    except RuntimeError as exc:
        raise _failed(group, what, time.monotonic() - start, get_timeout(), exc) from exc


def complete(
    post: Callable[[], dist.Work],
    group: dist.ProcessGroup,
    what: str,
    device: torch.device | None = None,
) -> None:
    """Post a collective (``post()`` returns its Work) and wait for it: :func:`posting`, then
    :func:`wait`, for a collective whose result is needed at once."""
    with posting(group, what):
        work = post()
    wait(work, group, what, device)


def _failed(
    group: dist.ProcessGroup, what: str, waited: float, timeout: float, exc: BaseException
) -> PeerTimeoutError:
    rank = group.rank()
    now = time.time()
    roll = _roll_call(group, now - waited, now)
    if roll is None:
        peers: list[int] = []
        who = "the peers could not be told apart (the group's store did not answer)"
    else:
        silent, gone = roll
        parts = []
        if silent:
            globals_ = [dist.get_global_rank(group, r) for r in silent]
            parts.append(
                f"rank(s) {silent} of the group (global {globals_}) were not heard from in time"
            )
        if gone:
            parts.append(f"rank(s) {gone} had given up on this call before this rank waited")
        who = "; ".join(parts) or "every peer was stuck in this call too"
        peers = sorted(silent + gone)
    cause = "past the deadline" if "timed out" in str(exc).lower() else f"the transport: {exc}"
    return PeerTimeoutError(
        f"rank {rank} of group {group.group_name!r} waited {waited:.1f} s (deadline "
        f"{timeout:g} s) for its peers in the {what} and gave up ({cause}); {who}",
        phase=what,
        group=group.group_name,
        peers=peers,
        waited_s=waited,
    )


def _store(group: dist.ProcessGroup) -> dist.Store | None:
    from torch.distributed.distributed_c10d import _world

    entry = _world.pg_map.get(group)
    return None if entry is None else entry[1]


def _roll_call(
    group: dist.ProcessGroup, began: float, gave_up: float
) -> tuple[list[int], list[int]] | None:
    """``(silent, gone)`` among the other ranks of ``group``, for this rank's wait from ``began``
    to ``gave_up`` (wall clock) in the current call: *silent* ranks posted no give-up of their
    own within the grace, or began their wait only after this rank gave up (they came late);
    *gone* ranks gave up before this rank began. The rest waited with this rank. None if the
    store does not answer. Run on a daemon thread: a store whose host is stopped would hold a
    store operation until the store's own timeout."""
    store = _store(group)
    if store is None:
        return None
    rank, world = group.rank(), group.size()
    prefix = f"tp_kernels/roll_call/{_calls.get(group, 0)}/"
    others = [r for r in range(world) if r != rank]
    result: list[tuple[list[int], list[int]]] = []

    def call_roll() -> None:
        store.set(f"{prefix}{rank}", f"{began!r} {gave_up!r}")
        with contextlib.suppress(RuntimeError):  # DistStoreError on the grace's end
            store.wait([f"{prefix}{r}" for r in others], datetime.timedelta(seconds=_grace()))
        waits = {
            r: [float(t) for t in store.get(f"{prefix}{r}").split()]
            for r in others
            if store.check([f"{prefix}{r}"])
        }
        silent = [r for r in others if r not in waits or waits[r][0] > gave_up]
        result.append((silent, [r for r, (_, end) in waits.items() if end < began]))

    thread = threading.Thread(target=call_roll, daemon=True, name="tp_kernels-roll-call")
    thread.start()
    thread.join(_grace() + 1.0)
    return result[0] if result else None


def _grace() -> float:
    return min(_ROLL_CALL_GRACE_S, get_timeout())


# --- bounded object exchange ----------------------------------------------------------------------


def gather_objects(group: dist.ProcessGroup, obj: Any, what: str) -> list[Any]:
    """Every rank's picklable ``obj``, in group rank order, each exchange within the deadline
    (:func:`dist.all_gather_object` waits for the group's timeout)."""
    from tp_kernels._compat import all_gather_single

    world = group.size()
    if world == 1:
        return [obj]
    backend = str(dist.get_backend(group))
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if "nccl" in backend and "gloo" not in backend
        else torch.device("cpu")
    )
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = size.new_empty(world)
    complete(lambda: all_gather_single(sizes, size, group, async_op=True), group, what)
    longest = int(sizes.max())
    padded = data.new_zeros(longest)
    padded[: data.numel()] = data
    everyone = data.new_empty(world * longest)
    complete(lambda: all_gather_single(everyone, padded, group, async_op=True), group, what)
    rows = everyone.view(world, longest).cpu()
    return [pickle.loads(rows[r, : int(sizes[r])].numpy().tobytes()) for r in range(world)]


# --- a rank's own slow work, uncounted --------------------------------------------------------

# How often a rank in local_work says on the store that it is still at it, and how often a peer
# looks: a second is far below any deadline, and the store sees a few operations per second.
_BEAT_S = 1.0
_LOOK_S = 0.02
# group -> local_work calls on it: the same on every rank that made the same calls.
_local_works: weakref.WeakKeyDictionary[dist.ProcessGroup, int] = weakref.WeakKeyDictionary()


def local_work(group: dist.ProcessGroup, what: str, work: Callable[[], T]) -> T:
    """``work()`` (this rank's own slow, local work, e.g. compiling and tuning kernels for a shape
    the group has not run), returned once every rank of ``group`` has done its own, so that no
    wait after it counts anyone's: a rank whose work takes minutes must not run a waiting peer
    past its deadline. Every rank calls it at the same point of the same call (the ``symm``
    backend: a call shape's first call on the group, before its start barrier).

    While ``work`` runs, this rank beats on the group's store every :data:`_BEAT_S`; a peer
    waits for its end as long as it beats, and gives up (:class:`PeerTimeoutError`) only on a
    rank that neither finished nor beat within the deadline (a rank that died, or never came).
    A rank whose work raised says so, and its peers raise a RuntimeError naming it at once, as
    it raises its own error: nobody reaches the call's first wait. Without a store (never seen:
    every c10d group has one) it is ``work()``."""
    store = _store(group)
    if group.size() == 1 or store is None:
        return work()
    _local_works[group] = number = _local_works.get(group, 0) + 1
    prefix = f"tp_kernels/local_work/{number}/"
    rank = group.rank()
    others = [r for r in range(group.size()) if r != rank]
    done = threading.Event()

    def beat() -> None:
        for count in itertools.count():
            store.set(f"{prefix}beat/{rank}", str(count))
            if done.wait(_BEAT_S):
                return

    beating = threading.Thread(target=beat, daemon=True, name="tp_kernels-local-work")
    beating.start()
    try:
        result = work()
    except BaseException as exc:
        done.set()
        store.set(f"{prefix}done/{rank}", f"failed: {type(exc).__name__}: {exc}")
        raise
    finally:
        done.set()
        beating.join()
    store.set(f"{prefix}done/{rank}", "ok")
    _await_peers(group, store, prefix, others, what)
    return result


def _await_peers(
    group: dist.ProcessGroup, store: dist.Store, prefix: str, others: list[int], what: str
) -> None:
    """Wait until every rank of ``others`` posted its end of the local work under ``prefix``;
    a rank's silence (no end, no new beat) counts against the deadline from its last beat."""
    timeout, began = get_timeout(), time.monotonic()
    heard = dict.fromkeys(others, (None, began))  # rank -> (its last beat, when it was seen)
    while True:
        pending = []
        for r in others:
            if store.check([f"{prefix}done/{r}"]):
                outcome = store.get(f"{prefix}done/{r}").decode()
                if outcome != "ok":
                    raise RuntimeError(
                        f"rank {r} of group {group.group_name!r} failed while {what}, so this "
                        f"call cannot run on it: {outcome}"
                    )
            else:
                pending.append(r)
        if not pending:
            return
        now = time.monotonic()
        for r in pending:
            key = f"{prefix}beat/{r}"
            beat = store.get(key) if store.check([key]) else None
            if beat != heard[r][0]:
                heard[r] = (beat, now)
        silent = [r for r in pending if now - heard[r][1] > timeout]
        if silent:
            waited = now - began
            raise PeerTimeoutError(
                f"rank {group.rank()} of group {group.group_name!r} waited {waited:.1f} s "
                f"(deadline {timeout:g} s) for rank(s) {silent} while {what}: they neither "
                f"finished nor said they were still at it for {timeout:g} s",
                phase=what,
                group=group.group_name,
                peers=silent,
                waited_s=waited,
            )
        time.sleep(_LOOK_S)
