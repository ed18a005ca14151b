"""Matmul then reduce-scatter, fused: the public op, the styles' rowwise Linear, one Function.

On rank ``r`` of ``W``, with ``x`` the local input (its rows, the scattered dim first:
``a [W*m, K]``, ``K`` this rank's part of the contraction) and ``b [K, N]``, or an ``nn.Linear``
weight ``w [N, K]`` (``b = w^T``):

=======  ========================================================  ==============================
forward  ``C = reduce_scatter(a @ b) [m, N]`` (``/ W`` when avg)    one fused call; ``bias`` is
         ``+ bias``                                                added once, after the sum
dgrad    ``G = all_gather(dC) [W*m, N]`` fused with ``d a = G @ b^T``  one fused all-gather-matmul
wgrad    ``d b = a^T @ G`` (``d w = G^T @ a``);                     (both ``/ W`` when avg)
         ``d bias = sum of G's rows``
=======  ========================================================  ==============================

Backward computes only the gradients asked for: no all-gather-matmul when ``x`` needs no grad,
no gather of ``dC`` at all when neither weight nor bias needs a grad either.

Two ways in, :func:`matmul_reduce_scatter` and :func:`rowwise_linear`, as in
``ops/ag_matmul.py`` (whose docstring says how the eager :class:`MatmulReduceScatter` and the
custom ops ``tp_kernels::matmul_reduce_scatter`` and ``..._backward`` divide the work; CommDebugMode
counts one reduce-scatter forward and one all-gather backward).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from tp_kernels import deadline
from tp_kernels.backends.base import Backend
from tp_kernels.backends.choice import Shape, at_run_time, get_backend
from tp_kernels.ops import capture, planning
from tp_kernels.ops._checks import GroupLike, check_matmul_reduce_scatter, group_size
from tp_kernels.ops.comm_stats import count_as_collective, record
from tp_kernels.ops.dtensors import as_grad, dtensor_specs, eager_path, local_tensor
from tp_kernels.ops.layout import flatten_rows, unflatten_rows
from tp_kernels.ops.planning import agree, resolve_group_or_note

__all__ = ["MatmulReduceScatter", "matmul_reduce_scatter", "rowwise_linear"]

_OP = "matmul_reduce_scatter"


# --- the math, on one backend --------------------------------------------------------------------


def _forward(
    impl: Backend,
    group: dist.ProcessGroup,
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    avg: bool,
) -> torch.Tensor:
    """This rank's ``[m, N]`` slice of ``sum over ranks of a @ b`` (``/ W`` when ``avg``),
    ``+ bias``."""
    record("forward", _OP, impl.name)
    out = impl.matmul_reduce_scatter(a.contiguous(), b, group)
    if avg:
        out.div_(group.size())
    return out if bias is None else out.add_(bias)


def _backward(
    impl: Backend,
    group: dist.ProcessGroup,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    grad: torch.Tensor,
    avg: bool,
    need_a: bool,
    need_b: bool,
    need_bias: bool,
    *,
    linear_weight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(d a, d b, d bias)``, each None unless asked for; ``a`` is read only for ``d b`` and
    ``b`` only for ``d a``. With ``linear_weight``, ``d w = G^T @ a [N, K]`` for the Linear
    weight ``w = b^T`` in place of ``d b``."""
    keep_gathered = need_b or need_bias
    grad_a = gathered = None
    if need_a:
        record("backward", "all_gather_matmul", impl.name)
        gathered, (grad_a,) = impl.all_gather_matmul(
            grad.contiguous(), [b.t()], group, return_a=keep_gathered
        )
    elif keep_gathered:
        record("backward", "all_gather", impl.name)
        gathered = impl.all_gather_async(grad.contiguous(), group).wait()
    grad_b = (gathered.t() @ a if linear_weight else a.t() @ gathered) if need_b else None
    if avg:
        for g in (grad_a, grad_b):
            if g is not None:
                g.div_(group.size())
    grad_bias = gathered.sum(0) if need_bias else None
    return grad_a, grad_b, grad_bias


# --- the eager path: one autograd Function -------------------------------------------------------


class _Call(NamedTuple):
    """One eager call, as :class:`MatmulReduceScatter` takes it: the backend and group, the
    scattered ``dim`` of ``x``, whether the sum is a mean, and whether the right-hand side is an
    ``nn.Linear`` weight ``[N, K]`` rather than ``b [K, N]``."""

    impl: Backend
    group: dist.ProcessGroup
    dim: int
    avg: bool
    linear_weight: bool


class MatmulReduceScatter(torch.autograd.Function):
    """``apply(call, x, rhs, bias)`` -> ``C`` laid out as ``x`` with the scattered dim ``W``
    times shorter and ``N`` features (``bias`` None for none). ``x``, ``rhs`` and ``bias`` may be
    DTensors (their local tensors are used). See the module docstring."""

    @staticmethod
    def forward(ctx, call: _Call, x, rhs, bias):
        rhs_local = local_tensor(rhs)
        rows, lead = flatten_rows(local_tensor(x), call.dim)
        b = rhs_local.t() if call.linear_weight else rhs_local
        out = _forward(call.impl, call.group, rows, b, local_tensor(bias), call.avg)
        need = ctx.needs_input_grad[1:4]
        ctx.call, ctx.lead, ctx.need, ctx.specs = call, lead, need, dtensor_specs(x, rhs, bias)
        ctx.save_for_backward(rows if need[1] else None, b if need[0] else None)
        return unflatten_rows(out, (lead[0] // call.group.size(), *lead[1:]), call.dim)

    @staticmethod
    def backward(ctx, grad):
        call = ctx.call
        rows, b = ctx.saved_tensors
        if grad is None or not any(ctx.need):
            return None, None, None, None
        with deadline.fused_call(call.group, _OP, "backward"):
            grads = _backward(
                call.impl,
                call.group,
                rows,
                b,
                flatten_rows(grad, call.dim)[0].contiguous(),
                call.avg,
                *ctx.need,
                linear_weight=call.linear_weight,
            )
        grad_x, grad_rhs, grad_bias = grads
        if grad_x is not None:
            grad_x = unflatten_rows(grad_x, ctx.lead, call.dim)
        return None, *map(as_grad, (grad_x, grad_rhs, grad_bias), ctx.specs)


# --- the two ways in -----------------------------------------------------------------------------


def _plan(
    x: object,
    b: object,
    scatter_dim: object,
    group: dist.ProcessGroup,
    reduce_op: object,
    backend: str | None,
    bias: object,
    grads: tuple[object, tuple[object, object]],
) -> tuple[planning.Plan, bool]:
    """:func:`tp_kernels.ops.planning.plan` of a call (``grads``: the input, then the weight and
    bias, as autograd sees them)."""
    bias_key = None if bias is None else planning.tensor_key(bias)
    return planning.plan(
        _OP,
        group,
        x,
        (b,),
        (scatter_dim, reduce_op, bias_key, backend),
        backend,
        lambda: _as_rhs_list(
            check_matmul_reduce_scatter(x, b, scatter_dim, reduce_op, group, bias)
        ),
        {"reduce_op": reduce_op, "bias": bias is not None},
        lambda dim, name: get_backend(name).matmul_reduce_scatter(
            flatten_rows(x, dim)[0].contiguous(), b, group
        ),
        lambda: capture.matmul_reduce_scatter_needs(
            x, b.shape[1], group.size(), *capture.grads_wanted(grads)
        ),
    )


def _as_rhs_list(args: tuple[torch.Tensor, torch.Tensor, int]) -> tuple:
    a, b, dim = args
    return a, [b], dim


def matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    scatter_dim: int,
    group: GroupLike,
    *,
    reduce_op: str = "sum",
    backend: str | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multiply ``a`` by ``b`` and reduce-scatter the product along ``scatter_dim``.

    On each of the ``W`` ranks of ``group``, with ``a`` of shape ``[..., M, ..., K]`` (``M`` at
    ``scatter_dim``, any dim but the last, divisible by ``W``) and ``b`` of shape ``[K, N]``::

        c = sum over ranks of (a @ b)   (mean when reduce_op="avg")      [..., M, ..., N]
        returns this rank's slice of c along scatter_dim (+ bias)        [..., M/W, ..., N]

    ``bias`` (optional, ``[N]``, the same on every rank) is added once, after the reduction: the
    replicated bias of a rowwise-parallel Linear. Differentiable in ``a``, ``b`` and ``bias``.
    Backward: ``g = all_gather(d out)`` fused with ``d a = g @ b^T`` (one all-gather-matmul),
    ``d b = a^T @ g`` and ``d bias = g`` summed over its rows (no extra communication).
    Mirrors ``torch.ops.symm_mem.fused_matmul_reduce_scatter``.
    """
    avg = reduce_op == "avg"
    pg = resolve_group_or_note(group, op=_OP)
    plan, owed = _plan(a, b, scatter_dim, pg, reduce_op, backend, bias, (a, (b, bias)))
    if plan.impl is not None and eager_path((a, b, bias)):
        call = _Call(impl=plan.impl, group=pg, dim=plan.dim, avg=avg, linear_weight=False)
        with deadline.fused_call(pg, _OP, "forward"):
            if owed:
                agree(pg, _OP, plan, a.device)
            return MatmulReduceScatter.apply(call, a, b, bias)
    if owed:  # never while torch.compile traces: a traced call's plan is new
        with deadline.fused_call(pg, _OP, "forward"):
            agree(pg, _OP, plan, a.device)
    rows, lead = flatten_rows(a, plan.dim)
    out = matmul_reduce_scatter_2d(rows, b, bias, pg.group_name, plan.backend, avg)
    return unflatten_rows(out, (lead[0] // pg.size(), *lead[1:]), plan.dim)


def rowwise_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scatter_dim: int,
    group: dist.ProcessGroup,
    backend: str | None,
) -> torch.Tensor:
    """``reduce_scatter(x @ weight^T, scatter_dim) + bias`` over ``group`` (``x [..., K/W]``,
    ``weight [N, K/W]``, ``bias [N]`` replicated or None; local or DTensor), local. Eager only,
    as :func:`tp_kernels.ops.ag_matmul.colwise_linears`."""
    x_local, bias_local = local_tensor(x), local_tensor(bias)
    b = local_tensor(weight).t()
    grads = (x, (weight, bias))
    plan, owed = _plan(x_local, b, scatter_dim, group, "sum", backend, bias_local, grads)
    call = _Call(impl=plan.impl, group=group, dim=plan.dim, avg=False, linear_weight=True)
    with deadline.fused_call(group, _OP, "forward"):
        if owed:
            agree(group, _OP, plan, x_local.device)
        return MatmulReduceScatter.apply(call, x, weight, bias)


# --- the custom ops: torch.compile and dispatch modes (see ops/ag_matmul.py) ---------------------
#
#   tp_kernels::matmul_reduce_scatter(a [W*m, K], b [K, N], bias [N] or None, avg) -> [m, N]
#   tp_kernels::matmul_reduce_scatter_backward(a, b, grad, ..., need_a, need_b, need_bias)
#       -> d a, d b, d bias: those asked for, in that order


@torch.library.custom_op("tp_kernels::matmul_reduce_scatter", mutates_args=())
def matmul_reduce_scatter_2d(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    backend: str,
    avg: bool,
) -> torch.Tensor:
    group = _resolve_process_group(group_name)
    with deadline.fused_call(group, _OP, "forward"):
        shape = Shape.of_matmul_reduce_scatter(a, b, group.size())
        product = a.shape[0] * b.shape[1] * a.dtype.itemsize
        impl = at_run_time(backend, shape, group, [(_OP, product)])
        return _forward(impl, group, a, b, bias, avg)


@matmul_reduce_scatter_2d.register_fake
def _(a, b, bias, group_name, backend, avg):
    return a.new_empty((a.shape[0] // group_size(group_name), b.shape[1]))


@torch.library.custom_op("tp_kernels::matmul_reduce_scatter_backward", mutates_args=())
def _backward_op(
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    grad: torch.Tensor,
    group_name: str,
    backend: str,
    avg: bool,
    need_a: bool,
    need_b: bool,
    need_bias: bool,
) -> list[torch.Tensor]:
    group = _resolve_process_group(group_name)
    with deadline.fused_call(group, _OP, "backward"):
        k = b.shape[0] if b is not None else a.shape[1]
        m, n = grad.shape
        shape = Shape(_OP, m, k, (n,), grad.dtype, grad.device)
        if need_a:
            needs = [("all_gather_matmul", grad.nbytes)]
        else:
            needs = [("all_gather", grad.nbytes)] if need_b or need_bias else []
        impl = at_run_time(backend, shape, group, needs)
        grads = _backward(
            impl, group, a, b, grad, avg, need_a, need_b, need_bias, linear_weight=False
        )
        return [g for g in grads if g is not None]


@_backward_op.register_fake
def _(a, b, grad, group_name, backend, avg, need_a, need_b, need_bias):
    rows = grad.shape[0] * group_size(group_name)
    grads = [grad.new_empty((rows, b.shape[0]))] if need_a else []
    grads += [grad.new_empty((a.shape[1], grad.shape[1]))] if need_b else []
    return grads + ([grad.new_empty(grad.shape[1])] if need_bias else [])


def _setup_context(ctx, inputs, output):
    a, b, bias, group_name, backend, avg = inputs
    ctx.group_name, ctx.backend, ctx.avg = group_name, backend, avg
    ctx.need = tuple(ctx.needs_input_grad[:3])
    ctx.save_for_backward(a if ctx.need[1] else None, b if ctx.need[0] else None)


def _autograd_backward(ctx, grad):
    a, b = ctx.saved_tensors
    if not any(ctx.need):
        return None, None, None, None, None, None
    result = iter(_backward_op(a, b, grad, ctx.group_name, ctx.backend, ctx.avg, *ctx.need))
    grads = [next(result) if need else None for need in ctx.need]
    return *grads, None, None, None


matmul_reduce_scatter_2d.register_autograd(_autograd_backward, setup_context=_setup_context)
count_as_collective("matmul_reduce_scatter", "reduce_scatter_tensor")
count_as_collective("matmul_reduce_scatter_backward", "all_gather_into_tensor")
