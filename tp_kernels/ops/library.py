"""The fused ops as ``torch.library`` custom ops on 2-D tensors, with autograd and fake kernels.

Shapes on rank ``r`` of a group of ``W`` ranks (rank-major rows, see ``backends/base.py``)::

    tp_kernels::all_gather_matmul(a_shard [m, K], bs [K, N_j]..., return_a)
        A = all_gather(a_shard) [W*m, K];  returns [A] * return_a + [A @ b_j for each j]
      backward (one op, tp_kernels::all_gather_matmul_backward):
        G = cat_j dC_j [W*m, sum N_j],  Bcat = cat_j b_j [K, sum N_j]
        d a_shard = reduce_scatter(G @ Bcat^T + dA)          one fused matmul-reduce-scatter
        d b_j     = A^T @ dC_j                                 A saved, or gathered again while
                                                               the reduce-scatter runs
    tp_kernels::matmul_reduce_scatter(a [W*m, K], b [K, N], avg)
        C = reduce_scatter(a @ b) [m, N]  (divided by W when avg)
      backward: (G, d a) = all_gather_matmul(dC, [b^T], return_a=True)   one fused op
                G = all_gather(dC) [W*m, N],  d a = G @ b^T,  d b = a^T @ G   (dC / W when avg)

The group travels as its registered name and the backend as a name (strings), so the ops trace
under ``torch.compile`` as opaque nodes with these fake (meta) kernels. Eager calls pass the
backend already resolved; a compiled graph passes what the user asked for (``""``: the default in
force when the graph runs, or ``"auto"``) and the op resolves it when it runs.
"""

from __future__ import annotations

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from tp_kernels.backends import BACKEND_NAMES, get_backend, resolve
from tp_kernels.backends.base import Backend


def _group_size(group_name: str) -> int:
    return _resolve_process_group(group_name).size()


def _backend(name: str, op: str, group, a: torch.Tensor) -> Backend:
    if name in BACKEND_NAMES and name != "auto":
        return get_backend(name)
    return get_backend(resolve(name or None, op, group, a))


@torch.library.custom_op("tp_kernels::all_gather_matmul", mutates_args=())
def all_gather_matmul_2d(
    a_shard: torch.Tensor, bs: list[torch.Tensor], group_name: str, backend: str, return_a: bool
) -> list[torch.Tensor]:
    group = _resolve_process_group(group_name)
    a, outs = _backend(backend, "all_gather_matmul", group, a_shard).all_gather_matmul(
        a_shard.contiguous(), bs, group, return_a=return_a
    )
    return [a, *outs] if return_a else outs


@all_gather_matmul_2d.register_fake
def _(a_shard, bs, group_name, backend, return_a):
    rows = _group_size(group_name) * a_shard.shape[0]
    outs = [a_shard.new_empty((rows, b.shape[1])) for b in bs]
    return [a_shard.new_empty((rows, a_shard.shape[1])), *outs] if return_a else outs


@torch.library.custom_op("tp_kernels::matmul_reduce_scatter", mutates_args=())
def matmul_reduce_scatter_2d(
    a: torch.Tensor, b: torch.Tensor, group_name: str, backend: str, avg: bool
) -> torch.Tensor:
    group = _resolve_process_group(group_name)
    impl = _backend(backend, "matmul_reduce_scatter", group, a)
    out = impl.matmul_reduce_scatter(a.contiguous(), b, group)
    return out.div_(group.size()) if avg else out


@matmul_reduce_scatter_2d.register_fake
def _(a, b, group_name, backend, avg):
    return a.new_empty((a.shape[0] // _group_size(group_name), b.shape[1]))


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
    impl = _backend(backend, "all_gather_matmul", group, a)
    rows = a.shape[0] if a_is_gathered else a.shape[0] * group.size()
    # The gather of A for the weight grads runs while the fused matmul-reduce-scatter computes
    # the input grad.
    pending = None if a_is_gathered else impl.all_gather_async(a.contiguous(), group)
    grad_cat = torch.cat(grad_outs, dim=1) if grad_outs else a.new_zeros((rows, 0))
    b_cat = torch.cat(bs, dim=1) if bs else a.new_zeros((a.shape[1], 0))
    grad_a_shard = impl.matmul_reduce_scatter(
        grad_cat.contiguous(), b_cat.t(), group, addend=grad_a
    )
    gathered = a if pending is None else pending.wait()
    grad_bs = [gathered.t() @ g for g in grad_outs]
    return [grad_a_shard, *grad_bs]


@all_gather_matmul_backward_2d.register_fake
def _(a, bs, grad_outs, grad_a, a_is_gathered, group_name, backend):
    m = a.shape[0] // _group_size(group_name) if a_is_gathered else a.shape[0]
    return [a.new_empty((m, a.shape[1])), *(b.new_empty(b.shape) for b in bs)]


def _all_gather_matmul_setup(ctx, inputs, output):
    a_shard, bs, group_name, backend, return_a = inputs
    ctx.group_name, ctx.backend, ctx.return_a, ctx.num_bs = group_name, backend, return_a, len(bs)
    # With return_a the gathered A is alive anyway: save it instead of gathering again.
    ctx.save_for_backward(output[0] if return_a else a_shard, *bs)


def _all_gather_matmul_backward(ctx, grads):
    a, *bs = ctx.saved_tensors
    grad_a = grads[0] if ctx.return_a else None
    grad_outs = grads[1:] if ctx.return_a else grads
    used = [j for j, g in enumerate(grad_outs) if g is not None]
    grad_bs: list[torch.Tensor | None] = [None] * ctx.num_bs
    if not used and grad_a is None:
        return None, grad_bs, None, None, None
    result = all_gather_matmul_backward_2d(
        a,
        [bs[j] for j in used],
        [grad_outs[j].contiguous() for j in used],
        grad_a,
        ctx.return_a,
        ctx.group_name,
        ctx.backend,
    )
    for j, grad_b in zip(used, result[1:]):
        grad_bs[j] = grad_b
    return result[0], grad_bs, None, None, None


all_gather_matmul_2d.register_autograd(
    _all_gather_matmul_backward, setup_context=_all_gather_matmul_setup
)


def _matmul_reduce_scatter_setup(ctx, inputs, output):
    a, b, group_name, backend, avg = inputs
    ctx.group_name, ctx.backend, ctx.avg = group_name, backend, avg
    ctx.save_for_backward(a, b)


def _matmul_reduce_scatter_backward(ctx, grad):
    a, b = ctx.saved_tensors
    if ctx.avg:
        grad = grad / _group_size(ctx.group_name)
    gathered, grad_a = all_gather_matmul_2d(
        grad.contiguous(), [b.t()], ctx.group_name, ctx.backend, True
    )
    return grad_a, a.t() @ gathered, None, None, None


matmul_reduce_scatter_2d.register_autograd(
    _matmul_reduce_scatter_backward, setup_context=_matmul_reduce_scatter_setup
)
