"""The fused ops as ``torch.library`` custom ops on 2-D tensors, with autograd and fake kernels.

Shapes on rank ``r`` of a group of ``W`` ranks (rank-major rows, see ``backends/base.py``)::

    tp_kernels::all_gather_matmul(a_shard [m, K], bs [K, N_j]..., return_a, save_a)
        A = all_gather(a_shard) [W*m, K];  returns [A] if (return_a or save_a), then A @ b_j
      backward, tp_kernels::all_gather_matmul_backward:
        G = cat_j dC_j [W*m, sum N_j],  Bcat = cat_j b_j [K, sum N_j]
        d a_shard = reduce_scatter(G @ Bcat^T + dA)        one fused matmul-reduce-scatter
        d b_j     = A^T @ dC_j                               A saved (save_a), or gathered again
                                                             while the reduce-scatter runs
    tp_kernels::matmul_reduce_scatter(a [W*m, K], b [K, N], bias [N] or None, avg)
        C = reduce_scatter(a @ b) [m, N]  (divided by W when avg), then + bias (added once)
      backward, tp_kernels::matmul_reduce_scatter_backward:
        G = all_gather(dC) [W*m, N] fused with d a = G @ b^T;  d b = a^T @ G   (both / W when avg)
        d bias = sum of G's rows: the gathered grad already holds every rank's rows

The group travels as its registered name and the backend as a name (strings), so the ops trace
under ``torch.compile`` as opaque nodes with these fake (meta) kernels. Eager calls pass the
backend already resolved; a compiled graph passes what the user asked for (``""``: the default in
force when the graph runs, or ``"auto"``) and the op resolves it when it runs.
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from tp_kernels import deadline
from tp_kernels.backends import BACKEND_NAMES, get_backend, resolve
from tp_kernels.backends.auto import Shape
from tp_kernels.backends.base import Backend
from tp_kernels.ops.stats import record


def _group_size(group_name: str) -> int:
    return _resolve_process_group(group_name).size()


def _backend(name: str, group, shape: Shape) -> Backend:
    if name in BACKEND_NAMES and name != "auto":
        return get_backend(name)
    return get_backend(resolve(name or None, shape, group))


@torch.library.custom_op("tp_kernels::all_gather_matmul", mutates_args=())
def all_gather_matmul_2d(
    a_shard: torch.Tensor,
    bs: list[torch.Tensor],
    group_name: str,
    backend: str,
    return_a: bool,
    save_a: bool,
) -> list[torch.Tensor]:
    group = _resolve_process_group(group_name)
    with deadline.fused_call(group, "all_gather_matmul", "forward"):
        impl = _backend(backend, group, Shape.of_all_gather_matmul(a_shard, bs))
        record("forward", "all_gather_matmul", impl.name)
        keep_a = return_a or save_a
        a, outs = impl.all_gather_matmul(a_shard.contiguous(), bs, group, return_a=keep_a)
        return [a, *outs] if keep_a else outs


@all_gather_matmul_2d.register_fake
def _(a_shard, bs, group_name, backend, return_a, save_a):
    rows = _group_size(group_name) * a_shard.shape[0]
    outs = [a_shard.new_empty((rows, b.shape[1])) for b in bs]
    return [a_shard.new_empty((rows, a_shard.shape[1])), *outs] if return_a or save_a else outs


@torch.library.custom_op("tp_kernels::all_gather_matmul_backward", mutates_args=())
def all_gather_matmul_backward_2d(
    a: torch.Tensor,
    bs: list[torch.Tensor],
    grad_outs: list[torch.Tensor],
    grad_a: torch.Tensor | None,
    a_is_gathered: bool,
    group_name: str,
    backend: str,
) -> list[torch.Tensor]:
    group = _resolve_process_group(group_name)
    with deadline.fused_call(group, "all_gather_matmul", "backward"):
        impl = _backend(backend, group, Shape.of_all_gather_matmul(a, bs))
        rows = a.shape[0] if a_is_gathered else a.shape[0] * group.size()
        # The gather of A for the weight grads runs while the fused matmul-reduce-scatter computes
        # the input grad.
        pending = None
        if not a_is_gathered and grad_outs:
            record("backward", "all_gather", impl.name)
            pending = impl.all_gather_async(a.contiguous(), group)
        grad_cat = torch.cat(grad_outs, dim=1) if grad_outs else a.new_zeros((rows, 0))
        b_cat = torch.cat(bs, dim=1) if bs else a.new_zeros((a.shape[1], 0))
        record("backward", "matmul_reduce_scatter", impl.name)
        grad_a_shard = impl.matmul_reduce_scatter(
            grad_cat.contiguous(), b_cat.t(), group, addend=grad_a
        )
        gathered = a if pending is None else pending.wait()
        return [grad_a_shard, *(gathered.t() @ g for g in grad_outs)]


@all_gather_matmul_backward_2d.register_fake
def _(a, bs, grad_outs, grad_a, a_is_gathered, group_name, backend):
    m = a.shape[0] // _group_size(group_name) if a_is_gathered else a.shape[0]
    return [a.new_empty((m, a.shape[1])), *(b.new_empty(b.shape) for b in bs)]


def _all_gather_matmul_setup(ctx, inputs, output):
    a_shard, bs, group_name, backend, return_a, save_a = inputs
    ctx.group_name, ctx.backend, ctx.num_bs = group_name, backend, len(bs)
    ctx.a_out, ctx.save_a = return_a or save_a, save_a
    ctx.save_for_backward(output[0] if save_a else a_shard, *bs)
    # An output nobody used (the gathered A, often) gets grad None rather than a tensor of zeros
    # that backward would add into the reduce-scatter.
    ctx.set_materialize_grads(False)


def _all_gather_matmul_backward(ctx, grads):
    a, *bs = ctx.saved_tensors
    grad_a = grads[0] if ctx.a_out else None
    grad_outs = grads[1:] if ctx.a_out else grads
    used = [j for j, g in enumerate(grad_outs) if g is not None]
    grad_bs: list[torch.Tensor | None] = [None] * ctx.num_bs
    if not used and grad_a is None:
        return None, grad_bs, None, None, None, None
    result = all_gather_matmul_backward_2d(
        a,
        [bs[j] for j in used],
        [grad_outs[j].contiguous() for j in used],
        grad_a,
        ctx.save_a,
        ctx.group_name,
        ctx.backend,
    )
    for j, grad_b in zip(used, result[1:]):
        grad_bs[j] = grad_b
    return result[0], grad_bs, None, None, None, None


all_gather_matmul_2d.register_autograd(
    _all_gather_matmul_backward, setup_context=_all_gather_matmul_setup
)


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
    with deadline.fused_call(group, "matmul_reduce_scatter", "forward"):
        impl = _backend(backend, group, Shape.of_matmul_reduce_scatter(a, b, group.size()))
        record("forward", "matmul_reduce_scatter", impl.name)
        out = impl.matmul_reduce_scatter(a.contiguous(), b, group)
        if avg:
            out.div_(group.size())
        return out if bias is None else out.add_(bias)


@matmul_reduce_scatter_2d.register_fake
def _(a, b, bias, group_name, backend, avg):
    return a.new_empty((a.shape[0] // _group_size(group_name), b.shape[1]))


@torch.library.custom_op("tp_kernels::matmul_reduce_scatter_backward", mutates_args=())
def matmul_reduce_scatter_backward_2d(
    a: torch.Tensor,
    b: torch.Tensor,
    grad: torch.Tensor,
    with_bias: bool,
    group_name: str,
    backend: str,
    avg: bool,
) -> list[torch.Tensor]:
    group = _resolve_process_group(group_name)
    with deadline.fused_call(group, "matmul_reduce_scatter", "backward"):
        impl = _backend(backend, group, Shape.of_matmul_reduce_scatter(a, b, group.size()))
        record("backward", "all_gather_matmul", impl.name)
        gathered, (grad_a,) = impl.all_gather_matmul(
            grad.contiguous(), [b.t()], group, return_a=True
        )
        grad_b = a.t() @ gathered
        if avg:
            grad_a.div_(group.size())
            grad_b.div_(group.size())
        return [grad_a, grad_b, gathered.sum(0)] if with_bias else [grad_a, grad_b]


@matmul_reduce_scatter_backward_2d.register_fake
def _(a, b, grad, with_bias, group_name, backend, avg):
    grads = [a.new_empty(a.shape), b.new_empty(b.shape)]
    return [*grads, b.new_empty(b.shape[1])] if with_bias else grads


def _matmul_reduce_scatter_setup(ctx, inputs, output):
    a, b, bias, group_name, backend, avg = inputs
    ctx.group_name, ctx.backend, ctx.avg, ctx.with_bias = group_name, backend, avg, bias is not None
    ctx.save_for_backward(a, b)


def _matmul_reduce_scatter_backward(ctx, grad):
    a, b = ctx.saved_tensors
    grads = matmul_reduce_scatter_backward_2d(
        a, b, grad, ctx.with_bias, ctx.group_name, ctx.backend, ctx.avg
    )
    grad_bias = grads[2] if ctx.with_bias else None
    return grads[0], grads[1], grad_bias, None, None, None


matmul_reduce_scatter_2d.register_autograd(
    _matmul_reduce_scatter_backward, setup_context=_matmul_reduce_scatter_setup
)


_counted_by_comm_debug_mode = False


def count_as_replaced_collectives() -> None:
    """Make PyTorch's ``CommDebugMode`` count each fused op as the one collective it replaces, in
    forward and backward, under the module that issued it: an all-gather-matmul (and the
    backward of a matmul-reduce-scatter) as one ``all_gather_into_tensor``, a matmul-reduce-
    scatter (and the backward of an all-gather-matmul) as one ``reduce_scatter_tensor``, as
    DTensor's path would issue them. The backward's re-gather of a saved shard (the default,
    ``save_gathered_a=False``) is not counted: it replaces nothing in DTensor's path, which keeps
    the gathered input. CommDebugMode keeps its registry in module globals; where a torch lacks
    them, nothing is registered. Called before every eager fused call, it acts once, and only once
    that module is loaded: importing it imports Triton, which must wait for ``TRITON_INTERPRET``."""
    global _counted_by_comm_debug_mode
    _comm_mode = sys.modules.get("torch.distributed.tensor.debug._comm_mode")
    if _counted_by_comm_debug_mode or _comm_mode is None:
        return
    _counted_by_comm_debug_mode = True
    counted = getattr(_comm_mode, "c10d_collective_ops", None)
    as_collective = getattr(_comm_mode, "NATIVE_TO_PY_MAPPING", None)
    if not isinstance(counted, set) or not isinstance(as_collective, dict):
        return
    funcol = torch.ops.c10d_functional
    ours = torch.ops.tp_kernels
    for op, collective in (
        (ours.all_gather_matmul, funcol.all_gather_into_tensor),
        (ours.matmul_reduce_scatter_backward, funcol.all_gather_into_tensor),
        (ours.matmul_reduce_scatter, funcol.reduce_scatter_tensor),
        (ours.all_gather_matmul_backward, funcol.reduce_scatter_tensor),
    ):
        counted.add(op)
        as_collective[op] = collective
