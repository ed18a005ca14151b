"""Every setting of tp_kernels in one place: its environment variable, its default, its setter.

- :data:`BACKEND`: ``TP_KERNELS_BACKEND``, default ``"auto"``; ``tp_kernels.set_backend(name)``
  (and, per call or block, ``backend=`` and ``use_backend``).
- :data:`TIMEOUT_S`: ``TP_KERNELS_TIMEOUT_S``, default 300 s; ``tp_kernels.set_timeout(s)``.
- :data:`PIPELINE_CHUNKS`: ``TP_KERNELS_PIPELINE_CHUNKS``, default chosen from the shape;
  ``tp_kernels.backends.pipelined.set_chunks(n)``.
- :data:`CHECK_CONSISTENCY`: ``TP_KERNELS_CHECK_CONSISTENCY`` (1/0), default on for CPU tensors
  and off for CUDA ones; ``CHECK_CONSISTENCY.set(True/False)``.
- :data:`SYMM_TRITON`: ``TP_KERNELS_SYMM_TRITON`` (1/0), default off (the symm backend's Triton
  kernels on CPU, under ``TRITON_INTERPRET=1``; always on for CUDA); ``SYMM_TRITON.set(...)``.
- :data:`SYMM_CHUNKS`: ``TP_KERNELS_SYMM_CHUNKS`` (1 to :data:`SYMM_MAX_CHUNKS`), default the cost
  model's fastest for the device and shape; ``SYMM_CHUNKS.set(n)``. Local to a rank (each
  rank's consumer waits only for its own copies), so not agreed on.
- :data:`AUTO_TIMING`: ``TP_KERNELS_AUTO_TIMING`` (1/0), default on; ``AUTO_TIMING.set(...)``.
- :data:`SHARED_DEVICE_RANKS`: ``TP_KERNELS_SHARED_DEVICE_RANKS`` (a positive int), default
  :func:`shared_device_ranks`'s guess from ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES``;
  ``SHARED_DEVICE_RANKS.set(n)``. Local to a rank (it sizes this rank's launches only).
- :data:`TUNING_CACHE`: ``TP_KERNELS_TUNING_CACHE`` (a folder, or ``0`` for none), default
  ``~/.cache/tp_kernels/tuning``: where the kernels keep the tile configs they chose per shape
  (``kernels/tuning.py``); ``TUNING_CACHE.set(path or None)``. Local to a rank.
- ``TRITON_INTERPRET``: Triton's own variable, read by Triton when it is first imported.

Each setting is read from the environment once, on first use, and a setter overrides it for the
process; a value the environment gives that cannot be parsed raises, naming the variable, at every
use until it is fixed or overridden. Settings that change the protocol (backend, chunks,
consistency mode) are part of what ranks agree on before a fused call, so ranks that differ fail
together. ``Setting.reset()`` forgets the override and the value read (for tests).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = [
    "AUTO_TIMING",
    "BACKEND",
    "BACKEND_IN_CONTEXT",
    "CHECK_CONSISTENCY",
    "PIPELINE_CHUNKS",
    "SHARED_DEVICE_RANKS",
    "SYMM_CHUNKS",
    "SYMM_MAX_CHUNKS",
    "SYMM_TRITON",
    "Setting",
    "TIMEOUT_S",
    "TUNING_CACHE",
    "shared_device_ranks",
]

T = TypeVar("T")
_UNSET = object()
# Bumped by every set() and reset(): what is computed from settings and cached (the ops layer's
# call plans) is keyed by it, so a changed setting is seen at the next call.
_generation = 0


def generation() -> int:
    """A number that changes whenever any setting is set or reset."""
    return _generation


# The innermost ``tp_kernels.use_backend`` block's backend (None outside every one): BACKEND's
# override for one context (a thread, a task), set only by ``use_backend``.
BACKEND_IN_CONTEXT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tp_kernels_backend", default=None
)


def settings_key() -> tuple[int, str | None]:
    """What a decision cached from the settings depends on (the ops layer's call plans): the
    :func:`generation` and the ``use_backend`` block in force."""
    return _generation, BACKEND_IN_CONTEXT.get()


class Setting(Generic[T]):
    """One setting: ``env`` parsed by ``parse(raw, env)`` (which raises ValueError/TypeError
    naming ``env`` and what it needs), else ``default``; :meth:`set` (checked by
    ``check(value, argument)``) overrides both."""

    def __init__(
        self,
        env: str,
        default: T,
        parse: Callable[[str, str], T],
        check: Callable[[object, str], T],
    ) -> None:
        self.env, self.default, self._parse, self._check = env, default, parse, check
        self._override: object = _UNSET
        self._read: object = _UNSET

    def get(self) -> T:
        if self._override is not _UNSET:
            return self._override  # type: ignore[return-value]
        if self._read is _UNSET:
            raw = os.environ.get(self.env)
            self._read = self.default if raw is None or raw == "" else self._parse(raw, self.env)
        return self._read  # type: ignore[return-value]

    def set(self, value: T, *, argument: str = "value") -> None:
        global _generation
        self._override = self._check(value, argument)
        _generation += 1

    def reset(self) -> None:
        global _generation
        self._override = self._read = _UNSET
        _generation += 1

    @contextlib.contextmanager
    def overriding(self, value: T, *, argument: str = "value") -> Iterator[None]:
        """:meth:`set` for the block; then the setting is what it was before (an override, or the
        environment's value)."""
        global _generation
        saved = self._override
        self.set(value, argument=argument)
        try:
            yield
        finally:
            self._override = saved
            _generation += 1

    def __repr__(self) -> str:
        return f"Setting({self.env}={self.get()!r})"


def _parse_flag(raw: str, env: str) -> bool:
    if raw in ("1", "true", "True"):
        return True
    if raw in ("0", "false", "False"):
        return False
    raise ValueError(f"{env}: got {raw!r}, expected 1 or 0")


def _check_flag(value: object, argument: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{argument}: expected True or False, got {value!r}")
    return value


def check_seconds(value: object, argument: str) -> float:
    """``value`` as seconds if it is a positive, finite number; else an error naming
    ``argument``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{argument}: expected a number of seconds, got {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"{argument}: expected a positive, finite number of seconds, got {value!r}"
        )
    return float(value)


def _parse_seconds(raw: str, env: str) -> float:
    try:
        value: object = float(raw)
    except ValueError:
        value = raw
    return check_seconds(value, env)


def _check_chunks(value: object, argument: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{argument}: expected a positive int or None, got {value!r}")
    return value


def _parse_chunks(raw: str, env: str) -> int:
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{env}: got {raw!r}, expected a positive integer")
    return int(raw)


SYMM_MAX_CHUNKS = 4
"""Most chunks per peer shard of the symm all-gather's copies (its progress words per shard)."""


def _check_symm_chunks(value: object, argument: str) -> int | None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= SYMM_MAX_CHUNKS
    ):
        raise ValueError(
            f"{argument}: expected an int from 1 to {SYMM_MAX_CHUNKS} or None, got {value!r}"
        )
    return value


def _parse_symm_chunks(raw: str, env: str) -> int | None:
    if not raw.isdigit():
        raise ValueError(f"{env}: got {raw!r}, expected an integer from 1 to {SYMM_MAX_CHUNKS}")
    return _check_symm_chunks(int(raw), env)


def _parse_backend(raw: str, env: str) -> str:
    return raw  # the name itself is checked by tp_kernels.backends where it is used


def _check_backend(value: object, argument: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{argument}: expected a backend name, got {value!r}")
    return value  # the name itself is checked by tp_kernels.backends where it is used


def _check_consistency(value: object, argument: str) -> bool | None:
    return None if value is None else _check_flag(value, argument)


BACKEND: Setting[str] = Setting("TP_KERNELS_BACKEND", "auto", _parse_backend, _check_backend)
"""The backend of a call that names none (``backends.current_backend``)."""

TIMEOUT_S: Setting[float] = Setting("TP_KERNELS_TIMEOUT_S", 300.0, _parse_seconds, check_seconds)
"""The deadline of every wait (``tp_kernels.deadline``)."""

PIPELINE_CHUNKS: Setting[int | None] = Setting(
    "TP_KERNELS_PIPELINE_CHUNKS", None, _parse_chunks, _check_chunks
)
"""Row blocks per peer transfer of the pipelined backend; None: chosen from the shape."""

CHECK_CONSISTENCY: Setting[bool | None] = Setting(
    "TP_KERNELS_CHECK_CONSISTENCY",
    None,
    _parse_flag,
    _check_consistency,
)
"""Whether ranks agree on every call's arguments; None: for CPU tensors, not for CUDA ones."""

SYMM_TRITON: Setting[bool] = Setting("TP_KERNELS_SYMM_TRITON", False, _parse_flag, _check_flag)
"""The symm backend's Triton kernels on CPU too (under ``TRITON_INTERPRET=1``; always on CUDA)."""

SYMM_CHUNKS: Setting[int | None] = Setting(
    "TP_KERNELS_SYMM_CHUNKS", None, _parse_symm_chunks, _check_symm_chunks
)
"""Chunks per peer shard of the symm all-gather's copies; None: the count the cost model predicts
fastest for the device and shape (``backends.symm_gather.chunks_per_shard``)."""

AUTO_TIMING: Setting[bool] = Setting("TP_KERNELS_AUTO_TIMING", True, _parse_flag, _check_flag)
"""Whether ``auto`` times its candidates once per shape class (else: its first candidate)."""

SHARED_DEVICE_RANKS: Setting[int | None] = Setting(
    "TP_KERNELS_SHARED_DEVICE_RANKS", None, _parse_chunks, _check_chunks
)
"""How many ranks run their kernels on this rank's GPU at once; each persistent GEMM then takes
at most its share of the SMs (``kernels._shared.persistent_programs``). None: see
:func:`shared_device_ranks`."""


def _parse_folder(raw: str, env: str) -> str | None:
    return None if raw == "0" else raw


def _check_folder(value: object, argument: str) -> str | None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{argument}: expected a folder (str or path) or None, got {value!r}")
    return None if value is None else os.fspath(value)


TUNING_CACHE: Setting[str | None] = Setting(
    "TP_KERNELS_TUNING_CACHE", "~/.cache/tp_kernels/tuning", _parse_folder, _check_folder
)
"""The folder of the kernels' tuning files (one per GPU model, Triton and torch); None: the
choices are kept in memory only (``kernels/tuning.py``)."""

# torch's CUDA symmetric memory accepts ranks on one device (host and device index) only with it.
ALLOW_OVERLAPPING_DEVICES = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"


def shared_device_ranks(visible_devices: int) -> int:
    """:data:`SHARED_DEVICE_RANKS`, or when unset a guess: 1 unless
    ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` (without it symmetric memory refuses ranks that
    share a device), else this host's ranks (``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``, else 2)
    spread over the ``visible_devices`` GPUs this process sees, rounded up. The guess errs toward
    sharing (a rank given too few SMs is slower; ranks given too many can starve each other's
    copies until the deadline): ranks that each see only their own GPU under one index
    (``CUDA_VISIBLE_DEVICES``) with the variable set should set this to 1, and ranks that all use
    one of several GPUs (as ``gpu_check`` does) to their number."""
    ranks = SHARED_DEVICE_RANKS.get()
    if ranks is not None:
        return ranks
    if os.environ.get(ALLOW_OVERLAPPING_DEVICES) != "1":
        return 1
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or "2"
    local_ranks = int(local) if local.isdigit() and int(local) > 0 else 2
    return max(1, -(-local_ranks // max(1, visible_devices)))
