"""The fused ops as ``torch.library`` custom ops on 2-D tensors, with autograd and fake kernels.

This is the path ``torch.compile`` traces and dispatch modes (``CommDebugMode``, fake tensors)
see; eager calls with none of those take the cheaper ``ops/eager.py`` (same math: both run
``ops/_compute.py``, whose docstring has the formulas). Shapes on rank ``r`` of ``W`` ranks
(rank-major rows, see ``backends/base.py``)::

    tp_kernels::all_gather_matmul(a_shard [m, K], bs [K, N_j]..., return_a, save_a)
        returns [A] if (return_a or save_a), then A @ b_j                     A = [W*m, K]
    tp_kernels::all_gather_matmul_backward(a, bs, grad_outs, grad_a, a_is_gathered, ..., need_b)
        returns d a_shard, then d b_j for each j with need_b[j]
    tp_kernels::all_gather_matmul_weight_grads(a, grad_outs, a_is_gathered, ...)
        returns d b_j for each grad given: the backward when a_shard needs no grad
    tp_kernels::matmul_reduce_scatter(a [W*m, K], b [K, N], bias [N] or None, avg)  -> [m, N]
    tp_kernels::matmul_reduce_scatter_backward(a, b, grad, ..., need_a, need_b, need_bias)
        returns d a, d b, d bias: those asked for, in that order

Forward saves for backward only what the gradients asked for will read (the shard or ``A`` for
weight grads, the weights for the input grad).

The group travels as its registered name and the backend as a name (strings), so the ops trace
under ``torch.compile`` as opaque nodes with these fake (meta) kernels. Eager calls pass the
backend already resolved; a compiled graph passes what the user asked for (``""``: the default in
force when the graph runs, or ``"auto"``) and the op resolves it when it runs.

Under CUDA graph capture each op asks its backend whether it can capture the part it runs
(``ops/capture.py``) before launching anything: a backward resolved by name (torchtitan 0.3's
Functions pass ``"auto"``) may find ``auto``'s timed choice unable to, and takes the next of
``auto``'s ranking that can, as the forward did.
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from tp_kernels import deadline
from tp_kernels.backends import BACKEND_NAMES, base, get_backend, resolve
from tp_kernels.backends.auto import Shape
from tp_kernels.backends.base import Backend, CaptureNeed
from tp_kernels.ops import _compute, capture


def _group_size(group_name: str) -> int:
    return _resolve_process_group(group_name).size()


def _backend(name: str, group, shape: Shape, needs: list[tuple[str, int]]) -> Backend:
    """The backend called ``name`` (resolved when ``""`` or ``"auto"``); under CUDA graph capture
    one that can capture ``needs`` (``(op, bytes)`` pairs, see
    :class:`~tp_kernels.backends.base.CaptureNeed`)."""
    asked_auto = name not in BACKEND_NAMES or name == "auto"
    concrete = resolve(name or None, shape, group) if asked_auto else name
    impl = get_backend(concrete)
    if base.capturing(shape.device):
        wanted = [CaptureNeed(op, nbytes, shape.dtype) for op, nbytes in needs]
        _, impl = capture.capture_backend(
            shape.op, group, shape.device, wanted, concrete, impl, shape, asked_auto
        )
    return impl


def _present(*tensors: torch.Tensor | None) -> list[torch.Tensor]:
    return [t for t in tensors if t is not None]


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
        shape = Shape.of_all_gather_matmul(a_shard, bs)
        impl = _backend(backend, group, shape, [("all_gather_matmul", a_shard.nbytes)])
        keep_a = return_a or save_a
        a, outs = _compute.all_gather_matmul(impl, a_shard, bs, group, keep_a)
        return [a, *outs] if keep_a else outs


@all_gather_matmul_2d.register_fake
def _(a_shard, bs, group_name, backend, return_a, save_a):
    rows = _group_size(group_name) * a_shard.shape[0]
    outs = [a_shard.new_empty((rows, b.shape[1])) for b in bs]
    return [a_shard.new_empty((rows, a_shard.shape[1])), *outs] if return_a or save_a else outs


def _all_gather_matmul_grads(
    a, bs, grad_outs, grad_a, a_is_gathered, group_name, backend, need_a, need_b
) -> list[torch.Tensor]:
    group = _resolve_process_group(group_name)
    with deadline.fused_call(group, "all_gather_matmul", "backward"):
        first = grad_outs[0] if grad_outs else grad_a
        k = bs[0].shape[0] if bs else (a.shape[1] if a is not None else grad_a.shape[1])
        ns = tuple(g.shape[1] for g in grad_outs)
        m = first.shape[0] // group.size()
        shape = Shape("all_gather_matmul", m, k, ns, first.dtype, first.device)
        shard = m * k * first.dtype.itemsize
        needs = [("matmul_reduce_scatter", group.size() * shard)] if need_a else []
        if any(need_b) and not a_is_gathered:
            needs.append(("all_gather", shard))
        impl = _backend(backend, group, shape, needs)
        grad_a_shard, grad_bs = _compute.all_gather_matmul_backward(
            impl, group, a, a_is_gathered, bs, grad_outs, grad_a, need_a, need_b
        )
        return _present(grad_a_shard, *grad_bs)


@torch.library.custom_op("tp_kernels::all_gather_matmul_backward", mutates_args=())
def all_gather_matmul_backward_2d(
    a: torch.Tensor | None,
    bs: list[torch.Tensor],
    grad_outs: list[torch.Tensor],
    grad_a: torch.Tensor | None,
    a_is_gathered: bool,
    group_name: str,
    backend: str,
    need_b: list[bool],
) -> list[torch.Tensor]:
    return _all_gather_matmul_grads(
        a, bs, grad_outs, grad_a, a_is_gathered, group_name, backend, True, need_b
    )


@all_gather_matmul_backward_2d.register_fake
def _(a, bs, grad_outs, grad_a, a_is_gathered, group_name, backend, need_b):
    first = grad_outs[0] if grad_outs else grad_a
    k = bs[0].shape[0] if bs else grad_a.shape[1]
    grad_a_shard = first.new_empty((first.shape[0] // _group_size(group_name), k))
    return [grad_a_shard, *_fake_weight_grads(a, grad_outs, need_b)]


@torch.library.custom_op("tp_kernels::all_gather_matmul_weight_grads", mutates_args=())
def all_gather_matmul_weight_grads_2d(
    a: torch.Tensor,
    grad_outs: list[torch.Tensor],
    a_is_gathered: bool,
    group_name: str,
    backend: str,
) -> list[torch.Tensor]:
    """``d b_j = A^T @ dC_j`` only (no input grad, so no reduce-scatter: CommDebugMode counts
    nothing, as DTensor's path issues no collective for weight grads)."""
    need_b = [True] * len(grad_outs)
    return _all_gather_matmul_grads(
        a, [], grad_outs, None, a_is_gathered, group_name, backend, False, need_b
    )


@all_gather_matmul_weight_grads_2d.register_fake
def _(a, grad_outs, a_is_gathered, group_name, backend):
    return _fake_weight_grads(a, grad_outs, [True] * len(grad_outs))


def _fake_weight_grads(a, grad_outs, need_b) -> list[torch.Tensor]:
    return [g.new_empty((a.shape[1], g.shape[1])) for g, n in zip(grad_outs, need_b) if n]


def _all_gather_matmul_setup(ctx, inputs, output):
    a_shard, bs, group_name, backend, return_a, save_a = inputs
    ctx.group_name, ctx.backend, ctx.num_bs = group_name, backend, len(bs)
    ctx.a_out, ctx.save_a = return_a or save_a, save_a
    # In setup_context torch passes needs_input_grad flat: a_shard, then each of bs, then the rest.
    need = ctx.needs_input_grad
    ctx.need_a, ctx.need_b = need[0], list(need[1 : 1 + len(bs)])
    keep = (output[0] if save_a else a_shard) if any(ctx.need_b) else None
    ctx.save_for_backward(keep, *(bs if ctx.need_a else ()))
    # An output nobody used (the gathered A, often) gets grad None rather than a tensor of zeros
    # that backward would add into the reduce-scatter.
    ctx.set_materialize_grads(False)


def _all_gather_matmul_backward(ctx, grads):
    a, *bs = ctx.saved_tensors
    got = _compute.arrived_grads(grads, ctx.a_out, ctx.need_a, ctx.need_b)
    grad_bs: list[torch.Tensor | None] = [None] * ctx.num_bs
    if got.nothing_to_do:
        return None, grad_bs, None, None, None, None
    if got.need_a:
        result = iter(
            all_gather_matmul_backward_2d(
                a,
                [bs[j] for j in got.used],
                got.grad_outs,
                got.grad_a,
                ctx.save_a,
                ctx.group_name,
                ctx.backend,
                got.need_b,
            )
        )
    else:
        wanted = [g for g, need in zip(got.grad_outs, got.need_b) if need]
        result = iter(
            all_gather_matmul_weight_grads_2d(a, wanted, ctx.save_a, ctx.group_name, ctx.backend)
        )
    grad_a_shard = next(result) if got.need_a else None
    for j, need in zip(got.used, got.need_b):
        if need:
            grad_bs[j] = next(result)
    return grad_a_shard, grad_bs, None, None, None, None


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
        shape = Shape.of_matmul_reduce_scatter(a, b, group.size())
        product = a.shape[0] * b.shape[1] * a.dtype.itemsize
        impl = _backend(backend, group, shape, [("matmul_reduce_scatter", product)])
        return _compute.matmul_reduce_scatter(impl, a, b, bias, group, avg)


@matmul_reduce_scatter_2d.register_fake
def _(a, b, bias, group_name, backend, avg):
    return a.new_empty((a.shape[0] // _group_size(group_name), b.shape[1]))


@torch.library.custom_op("tp_kernels::matmul_reduce_scatter_backward", mutates_args=())
def matmul_reduce_scatter_backward_2d(
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
    with deadline.fused_call(group, "matmul_reduce_scatter", "backward"):
        k = b.shape[0] if b is not None else a.shape[1]
        m, n = grad.shape
        shape = Shape("matmul_reduce_scatter", m, k, (n,), grad.dtype, grad.device)
        gathered = grad.nbytes
        if need_a:
            needs = [("all_gather_matmul", gathered)]
        else:
            needs = [("all_gather", gathered)] if need_b or need_bias else []
        impl = _backend(backend, group, shape, needs)
        grads = _compute.matmul_reduce_scatter_backward(
            impl, group, a, b, grad, avg, need_a, need_b, need_bias
        )
        return _present(*grads)


@matmul_reduce_scatter_backward_2d.register_fake
def _(a, b, grad, group_name, backend, avg, need_a, need_b, need_bias):
    rows = grad.shape[0] * _group_size(group_name)
    grads = [grad.new_empty((rows, b.shape[0]))] if need_a else []
    grads += [grad.new_empty((a.shape[1], grad.shape[1]))] if need_b else []
    return grads + ([grad.new_empty(grad.shape[1])] if need_bias else [])


def _matmul_reduce_scatter_setup(ctx, inputs, output):
    a, b, bias, group_name, backend, avg = inputs
    ctx.group_name, ctx.backend, ctx.avg = group_name, backend, avg
    ctx.need = tuple(ctx.needs_input_grad[:3])
    ctx.save_for_backward(a if ctx.need[1] else None, b if ctx.need[0] else None)


def _matmul_reduce_scatter_backward(ctx, grad):
    a, b = ctx.saved_tensors
    need_a, need_b, need_bias = ctx.need
    if not any(ctx.need):
        return None, None, None, None, None, None
    result = iter(
        matmul_reduce_scatter_backward_2d(
            a, b, grad, ctx.group_name, ctx.backend, ctx.avg, need_a, need_b, need_bias
        )
    )
    grads = [next(result) if need else None for need in ctx.need]
    return *grads, None, None, None


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
