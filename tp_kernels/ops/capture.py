"""Fused calls under CUDA graph capture: what a captured call needs, and reserving it beforehand.

A captured call is replayed on every later step without its host code, so while it is captured it
may launch only stream-ordered work: no host synchronization, no allocation outside the stream's
order, no exchange on the host (agreement, object exchange, ``auto``'s timing). Whether a call is
captured is asked once per call and only for CUDA tensors
(:func:`tp_kernels.backends.base.capturing`, looked up on its module at each call: tests
replace it to capture CPU tensors). Under capture ``ops/planning.py`` reuses the plan an eager
call of the shape class made and skips the agreement; the backend is the one
:func:`tp_kernels.backends.choice.captured` says can capture what this module says the call and
the backward parts autograd will run for it need. :func:`reserve` makes, outside capture, what a
backend would otherwise make on a call's first use.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tp_kernels import deadline
from tp_kernels.backends import base
from tp_kernels.backends.base import CaptureNeed, CaptureUnreadyError
from tp_kernels.backends.choice import BACKEND_NAMES, get_backend, unavailable_reason
from tp_kernels.ops._checks import GroupLike, resolve_group

__all__ = ["CaptureUnreadyError", "reserve"]


def requires_grad(tensors: Sequence[object]) -> bool:
    """Whether autograd will want a grad of any of ``tensors`` (given as the caller holds them:
    a DTensor parameter, not its local tensor, says whether it needs one)."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


def grads_wanted(grads: tuple[object, Sequence[object]]) -> tuple[bool, bool]:
    """Whether autograd will want the grad of the input, and of any of the parameters."""
    return requires_grad([grads[0]]), requires_grad(grads[1])


def all_gather_matmul_needs(
    a_shard: torch.Tensor, save_gathered_a: bool, world: int, grad_a: bool, grad_b: bool
) -> list[CaptureNeed]:
    """The forward's need, then those of the backward parts autograd will run: the input grad's
    (``grad_a``) reduce-scatter of ``[W*m, K]``, the weight grads' (``grad_b``) re-gather of the
    shard."""
    dtype, nbytes = a_shard.dtype, a_shard.nbytes
    needs = [CaptureNeed("all_gather_matmul", nbytes, dtype)]
    if grad_a:
        needs.append(CaptureNeed("matmul_reduce_scatter", world * nbytes, dtype))
    if grad_b and not save_gathered_a:
        needs.append(CaptureNeed("all_gather", nbytes, dtype))
    return needs


def matmul_reduce_scatter_needs(
    a: torch.Tensor, n: int, world: int, grad_a: bool, grad_b: bool
) -> list[CaptureNeed]:
    """The forward's need (the ``[W*m, n]`` product), then the backward's gather of the ``[m, n]``
    grad: fused with the input grad's matmul (``grad_a``), or alone for the weight and bias grads
    (``grad_b``)."""
    dtype = a.dtype
    product = a.numel() // a.shape[-1] * n * dtype.itemsize
    needs = [CaptureNeed("matmul_reduce_scatter", product, dtype)]
    if grad_a:
        needs.append(CaptureNeed("all_gather_matmul", product // world, dtype))
    elif grad_b:
        needs.append(CaptureNeed("all_gather", product // world, dtype))
    return needs


def reserve(
    group: GroupLike,
    nbytes: int,
    *,
    device: torch.device | str | None = None,
    backends: Sequence[str] | None = None,
) -> None:
    """Make every workspace the backends keep for ``group`` large enough for fused calls whose
    largest buffer has up to ``nbytes`` (an all-gather-matmul's shard, a matmul-reduce-scatter's
    ``[W*m, N]`` product, in bytes), so that such calls can be captured in a CUDA graph without a
    warmup of their shape. Collective: every rank of ``group`` calls it with the same arguments,
    outside capture. ``device``: that of the calls' tensors (default: the current CUDA device,
    else the CPU); ``backends``: the backends to prepare (default: every one available for
    ``group`` and ``device``)."""
    op = "reserve"
    pg = resolve_group(group, op=op)
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"{op}: nbytes must be an int >= 0, got {nbytes!r}")
    if device is None:
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    device = torch.device(device)
    if base.capturing(device):
        raise CaptureUnreadyError(
            f"{op}: called while a CUDA graph is being captured; growing a workspace is "
            "collective and allocates, so call it before the capture"
        )
    if backends is None:
        names = [
            n for n in BACKEND_NAMES if n != "auto" and unavailable_reason(n, pg, device) is None
        ]
    else:
        if isinstance(backends, str):
            raise TypeError(f"{op}: backends must be a list of names, got the string {backends!r}")
        names = list(backends)
        for name in names:
            get_backend(name)  # a ValueError naming it when it is no backend
            why = unavailable_reason(name, pg, device)
            if why is not None:
                raise RuntimeError(f"{op}: backend {name!r} cannot run here: {why}")
    with deadline.fused_call(pg, op, "setup"):
        for name in names:
            get_backend(name).reserve(pg, device, nbytes)
