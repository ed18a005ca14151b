"""One rank of test_exit.py, run as a script in its own interpreter (the abort it guards against
happens at interpreter exit, which LocalWorld's ranks skip: multiprocessing ends them with
``os._exit``).

The pattern that aborted 1 run in 15 on torch 2.15: 2 gloo ranks, backend ``symm``, float64,
the fused ops forward and backward a dozen times from autograd Functions wrapping them (as
torchtitan 0.3's linears do), with and without bias, two right-hand matrices, then
``destroy_process_group()``. Prints the number of this process's threads before
``init_process_group`` and after ``destroy_process_group``: the group's threads (gloo's, the
store's) must be gone by then.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import tp_kernels  # before the group, as a training script imports it

BACKEND = "symm"


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


class _GatherLinear(torch.autograd.Function):
    """``all_gather(x) @ w_j^T (+ bias)`` for each ``w_j``; backward by the mirror fused ops."""

    @staticmethod
    def forward(ctx, x, bias, group_name, *ws):
        ctx.group, ctx.with_bias = group_name, bias is not None
        ctx.save_for_backward(x, *ws)
        _, outs = tp_kernels.all_gather_matmul(
            x, [w.t() for w in ws], 0, group_name, backend=BACKEND
        )
        if bias is not None:
            outs[0] = outs[0] + bias
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, *ws = ctx.saved_tensors
        grad = torch.cat(grads, dim=1)
        grad_x = tp_kernels.matmul_reduce_scatter(
            grad, torch.cat(ws), 0, ctx.group, backend=BACKEND
        )
        # The weights' grads need the gathered x again (not kept): torchtitan re-gathers it.
        gathered = x.new_empty((dist.get_world_size() * x.shape[0], x.shape[1]))
        dist.all_gather_into_tensor(gathered, x)
        grad_ws = [g.t() @ gathered for g in grads]
        grad_bias = grads[0].sum(0) if ctx.with_bias else None
        return grad_x, grad_bias, None, *grad_ws


class _LinearScatter(torch.autograd.Function):
    """``reduce_scatter(x @ w^T) (+ bias)``; backward by the mirror fused op."""

    @staticmethod
    def forward(ctx, x, w, bias, group_name):
        ctx.group, ctx.with_bias = group_name, bias is not None
        ctx.save_for_backward(x, w)
        out = tp_kernels.matmul_reduce_scatter(x, w.t(), 0, group_name, backend=BACKEND)
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gathered, (grad_x,) = tp_kernels.all_gather_matmul(
            grad.contiguous(), [w], 0, ctx.group, backend=BACKEND, return_a=True
        )
        grad_bias = grad.sum(0) if ctx.with_bias else None
        return grad_x, gathered.t() @ x, grad_bias, None


def main() -> None:
    before = _threads()
    dist.init_process_group("gloo")
    group = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(dist.get_rank())

    def param(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    w_a, w_b, bias_a = param(12, 16), param(8, 16), param(12)
    w_out, bias_out = param(16, 20), param(16)
    for step in range(12):
        x = param(4, 16)
        h_a, h_b = _GatherLinear.apply(x, bias_a if step % 2 else None, group, w_a, w_b)
        h = torch.cat([h_a, h_b], dim=1)
        out = _LinearScatter.apply(h, w_out, None if step % 2 else bias_out, group)
        out.square().sum().backward()
    dist.destroy_process_group()
    print(f"threads {before} {_threads()}", flush=True)


if __name__ == "__main__":
    main()
