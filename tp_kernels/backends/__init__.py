"""The backend registry: which way of moving bytes a fused op takes.

A backend is chosen per call by, first to last: the op's ``backend=`` argument (or the style's),
the innermost :func:`use_backend` context, :func:`set_backend`, the ``TP_KERNELS_BACKEND``
environment variable, and ``"auto"``. ``"auto"`` rules out what the cost model says cannot win,
times the rest on the first call of a shape class and keeps the fastest (see
:mod:`tp_kernels.backends.auto`).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from tp_kernels import config
from tp_kernels.backends import auto
from tp_kernels.backends.base import Backend

__all__ = [
    "BACKEND_NAMES",
    "available_backends",
    "capture_order",
    "check_backend_name",
    "choose",
    "current_backend",
    "get_backend",
    "resolve",
    "set_backend",
    "use_backend",
]

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


def _unavailable(name: str, group: dist.ProcessGroup | None, device: torch.device) -> str | None:
    try:
        backend = get_backend(name)
    except ImportError as exc:  # e.g. the native extension or Triton is missing
        return f"cannot import: {exc}"
    return backend.unavailable_reason(group, device)


def available_backends(device: torch.device | str = "cpu") -> dict[str, str]:
    """``{name: "ok" or why it cannot run in this process}`` for every backend, for ``device``."""
    device = torch.device(device)
    return {name: _unavailable(name, None, device) or "ok" for name in _MODULES}


def choose(
    name: str | None, shape: auto.Shape, group: dist.ProcessGroup
) -> tuple[str, auto.Candidates | None]:
    """The concrete backend for one call of ``shape.op`` on ``group``, and the candidates ``auto``
    wants timed before it settles (``None`` when there is nothing to time: a named backend, a
    shape class already timed, one candidate, or timing off).

    ``name=None`` takes :func:`current_backend`. A named backend that cannot run raises
    RuntimeError saying why; ``"auto"`` never picks one that cannot (see
    :mod:`tp_kernels.backends.auto`).
    """
    name = check_backend_name(name, argument="backend") if name is not None else current_backend()
    if name != "auto":
        why = _unavailable(name, group, shape.device)
        if why is not None:
            raise RuntimeError(f"backend={name!r} cannot run {shape.op} here: {why}")
        return name, None
    timed = auto.cached_choice(shape, group)
    if timed is not None:
        return timed, None
    found = auto.candidates(shape, group, lambda n: _unavailable(n, group, shape.device))
    if len(found.names) > 1 and auto.timing_enabled() and not torch.compiler.is_compiling():
        return found.names[0], found
    why = "; ".join(f"{n}: {w}" for n, w in found.ruled_out.items()) or "the only candidate"
    auto.log_once(shape, group, found.names[0], f"the first candidate ({why})")
    return found.names[0], None


def capture_order(shape: auto.Shape, group: dist.ProcessGroup) -> tuple[str, ...]:
    """The backends ``auto`` may take for ``shape`` under CUDA graph capture, best first: the
    ranking its timing left (the same on every rank), else its untimed order of candidates."""
    ranked = auto.ranking(shape, group)
    if ranked is not None:
        return ranked
    return auto.candidates(shape, group, lambda n: _unavailable(n, group, shape.device)).names


def resolve(name: str | None, shape: auto.Shape, group: dist.ProcessGroup) -> str:
    """:func:`choose` without timing: the backend a call takes where it cannot time (a compiled
    graph resolving ``auto`` when it runs)."""
    return choose(name, shape, group)[0]
