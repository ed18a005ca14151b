"""What the fused ops sent, counted: :func:`comm_stats` (public), and CommDebugMode's count.

Every fused call (and every fallback of a style to PyTorch's path) counts itself where it runs,
on the eager path and in compiled graphs alike, with the bytes this rank put on the link.
``CommDebugMode`` counts the custom ops as the collectives DTensor's path would issue in their
place (:func:`count_as_collective`).
"""

from __future__ import annotations

import collections
import sys
import threading

import torch
import torch.distributed as dist

__all__ = [
    "CommStats",
    "comm_stats",
    "count_as_collective",
    "gather_bytes",
    "record",
    "register_with_comm_debug_mode",
    "reset_comm_stats",
]


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


# --- CommDebugMode's count of the custom ops --------------------------------------------------

# Each custom op and the c10d_functional collective it replaces in DTensor's path; filled by the
# op modules when they register their ops.
_replaced: dict[str, str] = {}
_counted_by_comm_debug_mode = False


def count_as_collective(op: str, collective: str) -> None:
    """Have ``CommDebugMode`` count the custom op ``tp_kernels::<op>`` as one ``collective`` (a
    ``c10d_functional`` op name), under the module that issued it."""
    _replaced[op] = collective


def register_with_comm_debug_mode() -> None:
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
