"""A CUDA graph's semantics on the CPU: record the device work of fused calls once, replay it.

A CUDA graph captures what a step enqueues (kernel launches with their arguments, copies, stream
memory operations, the ops between them) with every address and value fixed, and a replay runs
exactly that again: nothing the host decided per call (a call number, an epoch, a buffer half, a
chunk count) is decided again. :class:`Recorder` gives the symm backend's Triton path the same
treatment on the CPU, where its device work is:

* the kernel launches (:func:`tp_kernels.kernels.barrier` and the ``launch`` of
  ``AgMatmulConsumer``, ``RsProducer`` and ``SlotReduction``, whose objects hold the operands
  and tiles the backend made them with), recorded with their exact arguments;
* the side streams' work: the copier's copies and progress words
  (:meth:`tp_kernels.backends.symm_gather.Copier.start`), the pusher's waits, copies and slot
  words (:meth:`tp_kernels.backends.symm_scatter.Pusher.run`), and their joins
  (:meth:`~tp_kernels.backends.symm_gather.Copies.join`), each recorded as the call that
  enqueues them, and replayed by enqueueing the same again (a host thread runs them, as on every
  CPU call);
* every aten op between them on the calling thread (the publish copies, the step's own math),
  recorded by a dispatch mode with its inputs and outputs; a replay runs it again and writes the
  result into the recorded output, as a graph writes into the addresses of its capture.

Host work is not recorded and not replayed: the backend's planning, its reading of the timeout
record (pinned host memory on a GPU), the launchers' argument checks. What a graph cannot
capture is an error during the recording: a host read of a tensor (``.item()``, ``bool()``)
outside that host work, a process-group collective, or a symmetric allocation (the collective
agreement of :func:`tp_kernels.symmetric_memory.get_workspace` that precedes one).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tp_kernels import kernels, symmetric_memory
from tp_kernels.backends import symm as symm_backend
from tp_kernels.backends import symm_gather, symm_scatter

# The launches, by the name counts() gives them: where each is made.
LAUNCHERS = {
    "barrier": (kernels, "barrier"),
    "ag_matmul_consumer": (kernels.AgMatmulConsumer, "launch"),
    "matmul_rs_producer": (kernels.RsProducer, "launch"),
    "reduce_slots": (kernels.SlotReduction, "launch"),
}
# Host work of the backend: run during the recording, never replayed (_made_ready: the launches'
# checks and tiles, chosen once per shape).
HOST_WORK = ("_raise_recorded_timeout", "_usable_state", "_made_ready")
# Allocations: a graph's memory is fixed at capture; replaying them would only make new memory.
_ALLOCATIONS = {"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided"}
# Ops that read a tensor on the host: what no graph can capture.
_HOST_READS = {"_local_scalar_dense", "item"}
# What no captured call may do either: talk through the process group, allocate collectively.
_FORBIDDEN = [
    (dist, name)
    for name in (
        "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
        "all_to_all_single", "barrier", "broadcast", "reduce_scatter_tensor", "send", "recv",
        "isend", "irecv", "batch_isend_irecv",
    )
] + [(symmetric_memory, "_agree")]  # fmt: skip


@dataclass
class _Item:
    kind: str  # "op", "launch", "copies", "push", "join"
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict = field(default_factory=dict)
    outs: list[torch.Tensor] = field(default_factory=list)
    start: int = -1  # a join: the item whose copies it joins
    name: str = ""  # a launch: its launcher's name (LAUNCHERS)


class Recorder(TorchDispatchMode):
    """Records the device work of what runs inside :meth:`recording`; :meth:`replay` runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[_Item] = []
        self._host = 0  # > 0 inside host work or a recorded launch/copy call: not recorded
        self._started: dict[int, int] = {}  # id(Copies) -> its item
        self._originals: dict[tuple[Any, str], Any] = {}

    # ------------------------------------------------------------------ recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._host:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _HOST_READS:
            raise AssertionError(f"a host read of a tensor while recording device work: {func}")
        out = func(*args, **kwargs)
        if name not in _ALLOCATIONS:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.items.append(_Item("op", func, args, kwargs, outs))
        return out

    @contextlib.contextmanager
    def _unrecorded(self) -> Iterator[None]:
        self._host += 1
        try:
            yield
        finally:
            self._host -= 1

    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        self._originals[(owner, name)] = original
        setattr(owner, name, make(original))

    @contextlib.contextmanager
    def recording(self) -> Iterator[Recorder]:
        """Record what runs inside (on the calling thread)."""

        def launch(original, name):
            def recorded(*args, **kwargs):
                if not self._host:
                    self.items.append(_Item("launch", original, args, kwargs, name=name))
                with self._unrecorded():
                    return original(*args, **kwargs)

            return recorded

        def host(original):
            def unrecorded(*args, **kwargs):
                with self._unrecorded():
                    return original(*args, **kwargs)

            return unrecorded

        def copies(original, kind):
            def recorded(engine, *args):
                index = len(self.items)
                self.items.append(_Item(kind, original, (engine, *args)))
                with self._unrecorded():
                    result = original(engine, *args)
                self._started[id(result)] = index
                return result

            return recorded

        def join(original):
            def recorded(copies):
                index = self._started.get(id(copies))
                if index is not None:  # copies started before the recording: host history
                    self.items.append(_Item("join", original, (), start=index))
                with self._unrecorded():
                    return original(copies)

            return recorded

        for name, (owner, attribute) in LAUNCHERS.items():
            self._patch(owner, attribute, lambda f, name=name: launch(f, name))
        for name in HOST_WORK:
            self._patch(symm_backend, name, host)
        self._patch(symm_gather.Copier, "start", lambda f: copies(f, "copies"))
        self._patch(symm_scatter.Pusher, "run", lambda f: copies(f, "push"))
        self._patch(symm_gather.Copies, "join", join)
        for owner, name in _FORBIDDEN:
            self._patch(owner, name, _forbidden)
        try:
            with self:
                yield self
        finally:
            for (owner, name), original in self._originals.items():
                setattr(owner, name, original)
            self._originals.clear()

    # ------------------------------------------------------------------ replay

    def replay(self, *, clear_words: bool = True, copy_delay_s: float = 0.0) -> None:
        """Run the recorded device work again, in its order, with its arguments.

        ``copy_delay_s``: the side streams' copies each start that much later (the consumer and
        the reduction must wait for them). ``clear_words=False`` is the control: the start
        barriers clear no word, so every progress and slot word keeps the value the previous
        replay raised, as the host-side epochs of the protocol before this one did under a
        replay (their waits compared words with values fixed at capture, which the previous
        replay had already written)."""
        started: dict[int, Any] = {}
        for index, item in enumerate(self.items):
            if item.kind == "op":
                result = item.fn(*item.args, **item.kwargs)
                news = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
                for recorded, new in zip(item.outs, news, strict=True):
                    if recorded.data_ptr() != new.data_ptr():
                        recorded.copy_(new)
            elif item.kind == "launch":
                kwargs = item.kwargs
                if not clear_words and "clear" in kwargs:
                    kwargs = {**kwargs, "clear": None}
                item.fn(*item.args, **kwargs)
            elif item.kind == "copies":
                copier, sources, a, rows, progress = item.args
                sources = [(s, _Late(shard, copy_delay_s)) for s, shard in sources]
                started[index] = item.fn(copier, sources, a, rows, progress)
            elif item.kind == "push":
                pusher, produce, pushes, progress, word = item.args
                pushes = [(d, block, _Late(slot, copy_delay_s)) for d, block, slot in pushes]
                started[index] = item.fn(pusher, produce, pushes, progress, word)
            else:
                item.fn(started.pop(item.start))
        assert not started, "copies recorded without their join"

    def counts(self) -> dict[str, int]:
        """Recorded items by kind, launches by launcher."""
        found: dict[str, int] = {}
        for item in self.items:
            key = item.name if item.kind == "launch" else item.kind
            found[key] = found.get(key, 0) + 1
        return found


def _forbidden(original):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{original.__name__} while recording device work")

    return refuse


class _Late:
    """A copy's source (a shard: its rows are read by slicing) or destination (a slot: written
    by ``copy_``) whose copy starts ``delay_s`` late."""

    def __init__(self, tensor: torch.Tensor, delay_s: float) -> None:
        self.tensor, self.delay_s, self.shape = tensor, delay_s, tensor.shape

    def __getitem__(self, rows: slice) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.tensor[rows]

    def copy_(self, other: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.tensor.copy_(other)
