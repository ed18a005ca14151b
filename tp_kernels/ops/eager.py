"""The eager host path of the fused ops: one ``autograd.Function`` per op, calling the backend.

An eager call with plain tensors and no dispatch mode active needs none of what a
``torch.library`` custom op costs the host (mode handling, redispatch through the autograd key,
the generated autograd wrapper, dynamo's frame guard: some 100 us of Python per call on a CPU
host), so it runs here; ``torch.compile`` and dispatch modes take the custom ops of
``ops/library.py``. Both run the same math (``ops/_compute.py``), save the same tensors and
count the same calls. The caller (``ops/functional.py``) has checked, agreed and chosen the
backend, inside the forward's :func:`tp_kernels.deadline.fused_call`; backward enters its own.

Concurrency: a call's forward and backward may run on different threads (autograd's engine);
nothing here is shared between calls but the backend singletons.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tp_kernels import deadline
from tp_kernels.backends.base import Backend
from tp_kernels.ops import _compute


class AllGatherMatmul(torch.autograd.Function):
    """``apply(impl, group, return_a, save_a, a_shard [m, K], *bs [K, N_j])`` ->
    ``(A [W*m, K],) if return_a or save_a`` then ``A @ b_j [W*m, N_j]`` for each j."""

    @staticmethod
    def forward(ctx, impl: Backend, group: dist.ProcessGroup, return_a, save_a, a_shard, *bs):
        keep_a = return_a or save_a
        a, outs = _compute.all_gather_matmul(impl, a_shard, bs, group, keep_a)
        need_a, need_b = ctx.needs_input_grad[4], ctx.needs_input_grad[5:]
        ctx.impl, ctx.group, ctx.a_out, ctx.save_a = impl, group, keep_a, save_a
        ctx.need_a, ctx.need_b = need_a, need_b
        ctx.save_for_backward(
            (a if save_a else a_shard) if any(need_b) else None, *(bs if need_a else ())
        )
        ctx.set_materialize_grads(False)  # an unused output (often A) gets grad None
        return (a, *outs) if keep_a else tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        a, *bs = ctx.saved_tensors
        got = _compute.arrived_grads(grads, ctx.a_out, ctx.need_a, ctx.need_b)
        grad_bs: list[torch.Tensor | None] = [None] * len(ctx.need_b)
        grad_a_shard = None
        if not got.nothing_to_do:
            with deadline.fused_call(ctx.group, "all_gather_matmul", "backward"):
                grad_a_shard, used_grads = _compute.all_gather_matmul_backward(
                    ctx.impl,
                    ctx.group,
                    a,
                    ctx.save_a,
                    [bs[j] for j in got.used] if got.need_a else [],
                    got.grad_outs,
                    got.grad_a,
                    got.need_a,
                    got.need_b,
                )
            for j, g in zip(got.used, used_grads):
                grad_bs[j] = g
        return None, None, None, None, grad_a_shard, *grad_bs


class MatmulReduceScatter(torch.autograd.Function):
    """``apply(impl, group, avg, a [W*m, K], b [K, N], bias [N] or None)`` -> ``[m, N]``."""

    @staticmethod
    def forward(ctx, impl: Backend, group: dist.ProcessGroup, avg: bool, a, b, bias):
        out = _compute.matmul_reduce_scatter(impl, a, b, bias, group, avg)
        need = ctx.needs_input_grad[3:6]
        ctx.impl, ctx.group, ctx.avg, ctx.need = impl, group, avg, need
        ctx.save_for_backward(a if need[1] else None, b if need[0] else None)
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        if not any(ctx.need):
            return None, None, None, None, None, None
        with deadline.fused_call(ctx.group, "matmul_reduce_scatter", "backward"):
            grads = _compute.matmul_reduce_scatter_backward(
                ctx.impl, ctx.group, a, b, grad, ctx.avg, *ctx.need
            )
        return None, None, None, *grads
