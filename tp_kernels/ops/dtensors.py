"""A fused call's DTensor arguments: their local tensors and specs, their grads as DTensors, and
whether a call's tensors are plain enough for the eager path.

The op modules' ``autograd.Function``s take DTensor arguments themselves (one autograd node, no
``to_local`` conversions), read their local tensors, and hand back each argument's gradient with
its own spec, as ``to_local``'s backward would.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = ["as_grad", "dtensor_specs", "eager_path", "local_tensor"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


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
