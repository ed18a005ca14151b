"""Counters of the communication the fused ops (and the styles' fallbacks) ran, per process.

Each entry counts calls by ``(phase, kind, backend)``: phase ``"forward"`` or ``"backward"``; kind
``"all_gather_matmul"``, ``"matmul_reduce_scatter"``, ``"all_gather"`` (a plain re-gather of a
saved shard in backward) or ``"fallback"`` (a style took PyTorch's DTensor path, backend
``"torch"``). They are counted where the ops run, so compiled graphs count too.
"""

from __future__ import annotations

import collections
import threading

__all__ = ["CommStats", "comm_stats", "record", "reset_comm_stats"]


class CommStats(collections.Counter):
    """A Counter keyed by ``(phase, kind, backend)``, with a filtered sum."""

    def total(
        self, phase: str | None = None, kind: str | None = None, backend: str | None = None
    ) -> int:
        """Calls matching every filter given (``None`` matches anything)."""
        want = (phase, kind, backend)
        return sum(
            n for key, n in self.items() if all(w is None or w == k for w, k in zip(want, key))
        )


_counts = CommStats()
_lock = threading.Lock()  # autograd may run backward on another thread


def record(phase: str, kind: str, backend: str) -> None:
    with _lock:
        _counts[(phase, kind, backend)] += 1


def comm_stats() -> CommStats:
    """A snapshot of the counters since the last :func:`reset_comm_stats`."""
    with _lock:
        return CommStats(_counts)


def reset_comm_stats() -> None:
    with _lock:
        _counts.clear()
