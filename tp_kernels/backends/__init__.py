"""The backend registry: which way of moving bytes a fused op takes.

A backend is chosen per call by, first to last: the op's ``backend=`` argument (or the style's),
the innermost :func:`use_backend` context, :func:`set_backend`, the ``TP_KERNELS_BACKEND``
environment variable, and ``"auto"``. ``"auto"`` picks the fastest backend that can run for the
group, device and shape (see :func:`resolve`) and logs its choice once per (op, group, shape class)
at INFO on the ``tp_kernels`` logger. Its order: ``reference`` for a group of one; on CUDA
``torch_symm_mem`` (PyTorch's fused ops), then ``symm``; on the CPU ``symm``; then ``pipelined``,
or ``reference`` when a per-rank block is too small to pipeline.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from tp_kernels.backends.base import Backend

__all__ = [
    "BACKEND_NAMES",
    "available_backends",
    "check_backend_name",
    "current_backend",
    "get_backend",
    "resolve",
    "set_backend",
    "use_backend",
]

logger = logging.getLogger("tp_kernels")

_MODULES = {
    "reference": "tp_kernels.backends.reference",
    "pipelined": "tp_kernels.backends.pipelined",
    "symm": "tp_kernels.backends.symm",
    "torch_symm_mem": "tp_kernels.backends.torch_symm_mem",
}
BACKEND_NAMES = ("auto", *_MODULES)

_process_default: str | None = None
_context: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tp_kernels_backend", default=None
)
_logged_choices: set[tuple] = set()


def check_backend_name(name: object, *, argument: str = "backend") -> str:
    """``name`` if it names a backend or ``"auto"``; else a ValueError naming ``argument``."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"{argument}: unknown backend {name!r}; expected one of {BACKEND_NAMES}")
    return name  # type: ignore[return-value]


def set_backend(name: str) -> None:
    """Set the process-wide default backend (``"auto"`` restores automatic choice)."""
    global _process_default
    _process_default = check_backend_name(name, argument="set_backend(name)")


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Within the ``with`` block, ops and styles without an explicit backend use ``name``."""
    token = _context.set(check_backend_name(name, argument="use_backend(name)"))
    try:
        yield
    finally:
        _context.reset(token)


def current_backend() -> str:
    """The backend name in force for a call that does not name one (may be ``"auto"``)."""
    name = _context.get() or _process_default
    if name is None:
        env = os.environ.get("TP_KERNELS_BACKEND")
        name = check_backend_name(env, argument="TP_KERNELS_BACKEND") if env else "auto"
    return name


def get_backend(name: str) -> Backend:
    """The backend object called ``name`` (not ``"auto"``); imports its module on first use."""
    if name not in _MODULES:
        raise ValueError(
            f"backend: {name!r} is not a concrete backend; expected one of {tuple(_MODULES)}"
        )
    return importlib.import_module(_MODULES[name]).BACKEND


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


def _auto_choice(op: str, group: dist.ProcessGroup, a: torch.Tensor) -> tuple[str, str]:
    if group.size() == 1:
        return "reference", "world size 1: there is nothing to overlap"
    why_not_torch = None
    if a.device.type == "cuda":
        # PyTorch's own fused ops come before our Triton kernels (symm) until ours are measured
        # faster on the user's GPU. On the CPU they cannot run, so CPU choices are unchanged.
        why_not_torch = _unavailable("torch_symm_mem", group, a.device)
        if why_not_torch is None:
            return "torch_symm_mem", "PyTorch's fused symmetric-memory ops can run for this group"
    why_not_symm = _unavailable("symm", group, a.device)
    if why_not_symm is None:
        why = "symmetric memory is available for this group"
        if why_not_torch is not None:
            why += f" (torch_symm_mem unavailable: {why_not_torch})"
        return "symm", why
    unavailable = f"symm unavailable ({why_not_symm})"
    if why_not_torch is not None:
        unavailable += f", torch_symm_mem unavailable ({why_not_torch})"
    # Below one block per peer there is nothing to overlap the transfer with.
    shard_bytes = (
        a.numel() * a.element_size() // (group.size() if op == "matmul_reduce_scatter" else 1)
    )
    from tp_kernels.backends.pipelined import _MIN_BLOCK_BYTES

    if shard_bytes < _MIN_BLOCK_BYTES:
        return "reference", (
            f"{unavailable}; the {shard_bytes} B per-rank "
            f"block is below {_MIN_BLOCK_BYTES} B, too small to pipeline"
        )
    return "pipelined", unavailable


def resolve(name: str | None, op: str, group: dist.ProcessGroup, a: torch.Tensor) -> str:
    """The concrete backend for one call of ``op`` with input ``a`` on ``group``.

    ``name=None`` takes :func:`current_backend`. A named backend that cannot run raises
    RuntimeError saying why; ``"auto"`` never picks one that cannot.
    """
    name = check_backend_name(name, argument="backend") if name is not None else current_backend()
    if name != "auto":
        why = _unavailable(name, group, a.device)
        if why is not None:
            raise RuntimeError(f"backend={name!r} cannot run {op} here: {why}")
        return name
    chosen, why = _auto_choice(op, group, a)
    key = (op, group.group_name, a.device.type, a.dtype, a.numel().bit_length(), chosen)
    if key not in _logged_choices:
        _logged_choices.add(key)
        logger.info(
            "auto backend for %s on group %s (%s %s, shape %s): %s, because %s",
            op,
            group.group_name,
            a.device.type,
            a.dtype,
            tuple(a.shape),
            chosen,
            why,
        )
    return chosen
