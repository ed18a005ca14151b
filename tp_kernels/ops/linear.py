"""The fused Linears of the tensor-parallel styles: DTensor parameters in, one autograd node.

PyTorch's styles wrap every Linear in DTensor conversions, each an autograd node of its own (the
input's ``from_local``, the weight's and bias's ``to_local``, the output's ``from_local`` and
``to_local``): some 100 us of host time per Linear. On the eager path (no dispatch mode, not
compiling) tp_kernels' styles call these Functions instead: each reads the local tensors of its
DTensor arguments, runs the fused op's math (``ops/_compute.py``) with the bias, and returns the
local output, which is what PyTorch's styles hand on with ``use_local_output=True``. Gradients of
DTensor arguments come back as DTensors with the argument's own spec, as ``to_local`` gives them.

On rank ``r`` of ``W``, an ``nn.Linear`` weight ``w_j`` ``[N_j, K]`` (``b_j = w_j^T``):

================  ======================================================  ====================
colwise           ``y_j = all_gather(x, dim) @ w_j^T + bias_j``            ``[..., W*s, ..., N_j]``
  dgrad           ``dx = reduce_scatter(sum_j dy_j @ w_j)``                 one fused call
  wgrad           ``dw_j = dy_j^T @ A``, ``dbias_j = sum of dy_j's rows``   ``A`` gathered again
rowwise           ``y = reduce_scatter(x @ w^T, dim) + bias``              ``[..., M/W, ..., N]``
  dgrad           ``G = all_gather(dy)`` fused with ``dx = G @ w``
  wgrad           ``dw = G^T @ x``, ``dbias = sum of G's rows``
================  ======================================================  ====================

Only the gradients asked for are computed (``ops/_compute.py``). Checks, the backend and the
ranks' agreement come from the ops layer's plan of the same call (``ops/functional.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from tp_kernels import deadline
from tp_kernels.backends.base import Backend
from tp_kernels.ops import _compute
from tp_kernels.ops.functional import (
    agree_if_needed,
    flatten_rows,
    plan_all_gather_matmul,
    plan_matmul_reduce_scatter,
    restore_dim,
)

__all__ = ["colwise_linears", "local_tensor", "rowwise_linear"]


def local_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``'s local tensor if it is a DTensor (no autograd node: this module's Functions take
    the DTensor itself as their argument), else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _specs(*args: torch.Tensor | None) -> list[DTensorSpec | None]:
    """The DTensor specs of ``args`` (None for a plain tensor or None): what backward needs of
    them, without keeping their data alive."""
    return [t._spec if isinstance(t, DTensor) else None for t in args]


def _as_grad(grad: torch.Tensor | None, spec: DTensorSpec | None) -> torch.Tensor | None:
    """``grad`` (local) as the gradient of an argument of ``spec`` (a DTensor of that spec, as
    ``to_local``'s backward gives it; ``grad`` itself for a plain tensor)."""
    if grad is None or spec is None:
        return grad
    return DTensor(grad, copy.copy(spec), requires_grad=False)


def _flat(t: torch.Tensor, dim: int) -> torch.Tensor:
    return flatten_rows(t, dim)[0].contiguous()


def _unflat(t: torch.Tensor, lead: tuple[int, ...], dim: int) -> torch.Tensor:
    """2-D rows back to ``lead`` rows (``dim`` first) with ``dim`` moved home."""
    return restore_dim(t.view(*lead, t.shape[-1]), dim)


class _Colwise(torch.autograd.Function):
    """``apply(impl, group, dim, return_a, n, x, *weights, *biases)`` -> ``(A,)`` if return_a,
    then ``y_j`` for each of the ``n`` weights (see the module docstring)."""

    @staticmethod
    def forward(ctx, impl: Backend, group: dist.ProcessGroup, dim, return_a, n, x, *params):
        weights, biases = params[:n], params[n:]
        w_locals = [local_tensor(w) for w in weights]
        rows, lead = flatten_rows(local_tensor(x), dim)
        a, outs = _compute.all_gather_matmul(
            impl, rows, [w.t() for w in w_locals], group, keep_a=return_a
        )
        for out, bias in zip(outs, biases):
            if bias is not None:
                out.add_(local_tensor(bias))
        need = ctx.needs_input_grad
        ctx.need_x, ctx.need_w, ctx.need_bias = need[5], need[6 : 6 + n], need[6 + n :]
        ctx.impl, ctx.group, ctx.dim, ctx.lead, ctx.return_a = impl, group, dim, lead, return_a
        ctx.specs = _specs(x, *params)
        # As the fused op's default: the shard is kept and gathered again for the weight grads.
        ctx.save_for_backward(rows if any(ctx.need_w) else None, *(w_locals if ctx.need_x else ()))
        ctx.set_materialize_grads(False)
        gathered_lead = (group.size() * lead[0], *lead[1:])
        ys = [_unflat(out, gathered_lead, dim) for out in outs]
        return (_unflat(a, gathered_lead, dim), *ys) if return_a else tuple(ys)

    @staticmethod
    def backward(ctx, *grads):
        rows, *w_locals = ctx.saved_tensors
        dim, n = ctx.dim, len(ctx.need_w)
        got = _compute.arrived_grads(
            grads, ctx.return_a, ctx.need_x, ctx.need_w, lambda g: _flat(g, dim)
        )
        grad_x = grad_ws = None
        if not got.nothing_to_do:
            with deadline.fused_call(ctx.group, "all_gather_matmul", "backward"):
                grad_x, grad_ws = _compute.all_gather_matmul_backward(
                    ctx.impl,
                    ctx.group,
                    rows,
                    False,
                    [w_locals[j].t() for j in got.used] if got.need_a else [],
                    got.grad_outs,
                    got.grad_a,
                    got.need_a,
                    got.need_b,
                    as_weights=True,
                )
        grad_w: list[torch.Tensor | None] = [None] * n
        grad_bias: list[torch.Tensor | None] = [None] * n
        for i, j in enumerate(got.used):
            if grad_ws is not None:
                grad_w[j] = grad_ws[i]
            if ctx.need_bias[j]:
                grad_bias[j] = got.grad_outs[i].sum(0)
        if grad_x is not None:
            grad_x = _unflat(grad_x, ctx.lead, dim)
        grads = (grad_x, *grad_w, *grad_bias)
        return None, None, None, None, None, *map(_as_grad, grads, ctx.specs)


class _Rowwise(torch.autograd.Function):
    """``apply(impl, group, dim, x, weight, bias)`` -> ``y`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, impl: Backend, group: dist.ProcessGroup, dim, x, weight, bias):
        x_local, w_local = local_tensor(x), local_tensor(weight)
        rows, lead = flatten_rows(x_local, dim)
        out = _compute.matmul_reduce_scatter(
            impl, rows, w_local.t(), local_tensor(bias), group, False
        )
        need = ctx.needs_input_grad[3:6]
        ctx.impl, ctx.group, ctx.dim, ctx.lead, ctx.need = impl, group, dim, lead, need
        ctx.specs = _specs(x, weight, bias)
        ctx.save_for_backward(rows if need[1] else None, w_local if need[0] else None)
        return _unflat(out, (lead[0] // group.size(), *lead[1:]), dim)

    @staticmethod
    def backward(ctx, grad):
        rows, w_local = ctx.saved_tensors
        need_x, need_w, need_bias = ctx.need
        if grad is None or not any(ctx.need):
            return None, None, None, None, None, None
        with deadline.fused_call(ctx.group, "matmul_reduce_scatter", "backward"):
            grad_x, grad_w, grad_bias = _compute.matmul_reduce_scatter_backward(
                ctx.impl,
                ctx.group,
                rows,
                None if w_local is None else w_local.t(),
                _flat(grad, ctx.dim),
                False,
                need_x,
                need_w,
                need_bias,
                as_weight=True,
            )
        if grad_x is not None:
            grad_x = _unflat(grad_x, ctx.lead, ctx.dim)
        grads = (grad_x, grad_w, grad_bias)
        return None, None, None, *map(_as_grad, grads, ctx.specs)


def colwise_linears(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    gather_dim: int,
    mesh: DeviceMesh,
    backend: str | None,
    return_a: bool = False,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """``(A if return_a else None, [y_j])`` of the colwise Linears ``(weights[j], biases[j])``
    (``[N_j, K]``, ``[N_j]`` local or DTensor) on ``x`` (``[..., s, ..., K]`` local shard or
    its DTensor), gathered along ``gather_dim`` of ``mesh``; all local tensors. Eager only: the
    caller checks :func:`tp_kernels.ops.functional.eager_path`."""
    op = "all_gather_matmul"
    x_local = local_tensor(x)
    bs = [local_tensor(w).t() for w in weights]
    pg, plan, agree = plan_all_gather_matmul(
        x_local, bs, gather_dim, mesh, backend, return_a, False, (x, weights)
    )
    n = len(weights)
    with deadline.fused_call(pg, op, "forward"):
        agree_if_needed(pg, op, plan, agree, x_local.device)
        results = _Colwise.apply(plan.impl, pg, plan.dim, return_a, n, x, *weights, *biases)
    return (results[0] if return_a else None), list(results[-n:])


def rowwise_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scatter_dim: int,
    mesh: DeviceMesh,
    backend: str | None,
) -> torch.Tensor:
    """``reduce_scatter(x @ weight^T, scatter_dim) + bias`` over ``mesh`` (``x`` ``[..., K/W]``
    local or its DTensor, ``weight`` ``[N, K/W]``, ``bias`` ``[N]`` replicated), local. Eager
    only, as :func:`colwise_linears`."""
    op = "matmul_reduce_scatter"
    x_local, bias_local = local_tensor(x), local_tensor(bias)
    pg, plan, agree = plan_matmul_reduce_scatter(
        x_local,
        local_tensor(weight).t(),
        scatter_dim,
        mesh,
        "sum",
        backend,
        bias_local,
        (x, (weight, bias)),
    )
    with deadline.fused_call(pg, op, "forward"):
        agree_if_needed(pg, op, plan, agree, x_local.device)
        return _Rowwise.apply(plan.impl, pg, plan.dim, x, weight, bias)
