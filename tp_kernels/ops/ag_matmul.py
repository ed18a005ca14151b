"""All-gather then matmul, fused: the public op, the styles' colwise Linears, one autograd Function.

On rank ``r`` of ``W``, with ``x`` the local shard (its rows, the gathered dim first: ``a [m, K]``)
and right-hand sides ``b_j [K, N_j]``, or ``nn.Linear`` weights ``w_j [N_j, K]`` (``b_j = w_j^T``):

=======  ==========================================================  ============================
forward  ``A = all_gather(a) [W*m, K]``; ``C_j = A @ b_j (+ bias_j)``  one fused call
dgrad    ``d a = reduce_scatter(cat_j dC_j @ cat_j b_j^T + dA)``       one fused matmul-reduce-
                                                                     scatter (``dA``: when ``A``
                                                                     was returned and used)
wgrad    ``d b_j = A^T @ dC_j`` (``d w_j = dC_j^T @ A``);              ``A`` saved, or gathered
         ``d bias_j = sum of dC_j's rows``                            again while the reduce-
                                                                     scatter runs
=======  ==========================================================  ============================

Backward computes only the gradients asked for: no reduce-scatter when ``x`` needs no grad, no
re-gather of ``A`` when no weight needs one.

Two ways in: :func:`all_gather_matmul` (the public op) and :func:`colwise_linears` (the styles'
fused Linears). Both plan the call (``ops/planning.py``) and then, on the eager path (no dispatch
mode, not compiling), run :class:`AllGatherMatmul`: one autograd node that reads the local
tensors of DTensor arguments, flattens rows, computes and returns the outputs laid out as the
input; gradients of DTensor arguments come back as DTensors of the argument's own spec, as
``to_local`` gives them. Otherwise (torch.compile, ``CommDebugMode``, fake tensors) the public op
runs the custom ops ``tp_kernels::all_gather_matmul`` and its backward ops, with fake kernels
and ``register_autograd``: torch.compile traces them as opaque nodes and CommDebugMode counts
one all-gather forward and one reduce-scatter backward, as DTensor's path would issue. Every
way runs the same math (:func:`_forward`, :func:`_backward`) and counts its calls there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from tp_kernels import deadline
from tp_kernels.backends.base import Backend
from tp_kernels.backends.choice import Shape, at_run_time, get_backend
from tp_kernels.ops import capture, planning
from tp_kernels.ops._checks import GroupLike, check_all_gather_matmul, group_size
from tp_kernels.ops.comm_stats import count_as_collective, gather_bytes, record
from tp_kernels.ops.dtensors import as_grad, dtensor_specs, eager_path, local_tensor
from tp_kernels.ops.layout import flatten_rows, unflatten_rows
from tp_kernels.ops.planning import agree, resolve_group_or_note

__all__ = ["AllGatherMatmul", "all_gather_matmul", "colwise_linears"]

_OP = "all_gather_matmul"


# --- the math, on one backend --------------------------------------------------------------------


def _forward(
    impl: Backend,
    group: dist.ProcessGroup,
    a: torch.Tensor,
    bs: Sequence[torch.Tensor],
    keep_a: bool,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """``(A if keep_a else None, [A @ b_j])`` for the shard's rows ``a [m, K]``."""
    record("forward", _OP, impl.name, sent_bytes=gather_bytes(a, group))
    return impl.all_gather_matmul(a.contiguous(), bs, group, return_a=keep_a)


def _backward(
    impl: Backend,
    group: dist.ProcessGroup,
    saved: torch.Tensor | None,
    saved_is_gathered: bool,
    bs: Sequence[torch.Tensor],
    grad_outs: Sequence[torch.Tensor],
    grad_a: torch.Tensor | None,
    need_a: bool,
    need_b: Sequence[bool],
    *,
    linear_weights: bool,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """``(d a or None, [d b_j or None])`` for the ``grad_outs`` given (``dC_j [W*m, N_j]``, with
    ``bs[j]`` and ``need_b[j]`` beside each; ``bs`` may be empty when ``need_a`` is false).
    ``saved``: the shard's rows ``[m, K]`` or, when ``saved_is_gathered``, ``A``; read only for a
    weight grad. ``grad_a``: ``dA`` or None. With ``linear_weights`` each weight grad is that of
    the Linear weight ``w_j = b_j^T``: ``dC_j^T @ A [N_j, K]``, row-major as a parameter's."""
    pending = None
    if any(need_b) and not saved_is_gathered:
        # The gather of A for the weight grads runs while the fused matmul-reduce-scatter
        # computes the input grad.
        record("backward", "all_gather", impl.name)
        pending = impl.all_gather_async(saved.contiguous(), group)
    grad_shard = None
    if need_a:
        if grad_outs:
            grad_cat = torch.cat(list(grad_outs), dim=1) if len(grad_outs) > 1 else grad_outs[0]
            b_cat = torch.cat(list(bs), dim=1) if len(bs) > 1 else bs[0]
        else:  # only the returned A was used: reduce-scatter dA alone
            grad_cat = grad_a.new_zeros((grad_a.shape[0], 0))
            b_cat = grad_a.new_zeros((grad_a.shape[1], 0))
        record("backward", "matmul_reduce_scatter", impl.name)
        grad_shard = impl.matmul_reduce_scatter(
            grad_cat.contiguous(), b_cat.t(), group, addend=grad_a
        )
    gathered = saved if pending is None else pending.wait()
    grad_bs = [
        (g.t() @ gathered if linear_weights else gathered.t() @ g) if need else None
        for g, need in zip(grad_outs, need_b)
    ]
    return grad_shard, grad_bs


@dataclass(frozen=True)
class _ArrivedGrads:
    """What a backward received and must compute: ``grad_a`` (``dA`` or None), ``used`` (the
    indices ``j`` whose ``dC_j`` arrived) with ``grad_outs`` (those ``dC_j`` as 2-D rows) and
    ``need_b`` (whether each needs its weight grad), and ``need_a`` (the input grad, when it is
    wanted and some grad arrived)."""

    grad_a: torch.Tensor | None
    used: list[int]
    grad_outs: list[torch.Tensor]
    need_b: list[bool]
    need_a: bool

    @property
    def nothing_to_do(self) -> bool:
        return not self.need_a and not any(self.need_b)


def _arrived_grads(
    grads: Sequence[torch.Tensor | None],
    a_returned: bool,
    need_a: bool,
    need_b: Sequence[bool],
    as_rows: Callable[[torch.Tensor], torch.Tensor],
) -> _ArrivedGrads:
    """Sort a backward's incoming ``grads`` (``dA`` first when ``a_returned``, then each
    ``dC_j``, None for an output nobody used) by what forward's ``need_a``/``need_b`` asked;
    ``as_rows`` brings each to the contiguous 2-D rows the math takes."""
    grad_a = grads[0] if a_returned else None
    grad_outs = grads[1:] if a_returned else grads
    used = [j for j, g in enumerate(grad_outs) if g is not None]
    return _ArrivedGrads(
        None if grad_a is None else as_rows(grad_a),
        used,
        [as_rows(grad_outs[j]) for j in used],
        [need_b[j] for j in used],
        need_a and (bool(used) or grad_a is not None),
    )


# --- the eager path: one autograd Function -------------------------------------------------------


class _Call(NamedTuple):
    """One eager call, as :class:`AllGatherMatmul` takes it: the backend and group, the gathered
    ``dim`` of ``x``, the number of right-hand sides, whether ``A`` is returned and whether it is
    saved for backward (else the shard is, and gathered again there), and whether the right-hand
    sides are ``nn.Linear`` weights ``[N_j, K]`` rather than ``b_j [K, N_j]``."""

    impl: Backend
    group: dist.ProcessGroup
    dim: int
    num_rhs: int
    return_a: bool
    save_gathered_a: bool
    linear_weights: bool


class AllGatherMatmul(torch.autograd.Function):
    """``apply(call, x, *rhs, *biases)`` -> ``(A,)`` if ``call.return_a``, then ``C_j`` for each
    of the ``call.num_rhs`` right-hand sides (plus ``biases[j]`` where given: zero or
    ``num_rhs`` of them, None for none), each laid out as ``x`` with the gathered dim ``W``
    times longer. ``x``, the right-hand sides and the biases may be DTensors (their local
    tensors are used). See the module docstring."""

    @staticmethod
    def forward(ctx, call: _Call, x, *params):
        n = call.num_rhs
        rhs = [local_tensor(p) for p in params[:n]]
        biases = params[n:]
        rows, lead = flatten_rows(local_tensor(x), call.dim)
        bs = [w.t() for w in rhs] if call.linear_weights else rhs
        a, outs = _forward(call.impl, call.group, rows, bs, call.return_a or call.save_gathered_a)
        for out, bias in zip(outs, biases):
            if bias is not None:
                out.add_(local_tensor(bias))
        need = ctx.needs_input_grad
        ctx.call, ctx.lead, ctx.specs = call, lead, dtensor_specs(x, *params)
        ctx.need_x, ctx.need_rhs, ctx.need_bias = need[1], need[2 : 2 + n], need[2 + n :]
        saved = (a if call.save_gathered_a else rows) if any(ctx.need_rhs) else None
        ctx.save_for_backward(saved, *(rhs if ctx.need_x else ()))
        # An output nobody used (the gathered A, often) gets grad None rather than a tensor of
        # zeros that backward would add into the reduce-scatter.
        ctx.set_materialize_grads(False)
        gathered_lead = (call.group.size() * lead[0], *lead[1:])
        ys = [unflatten_rows(out, gathered_lead, call.dim) for out in outs]
        if call.return_a:
            return (unflatten_rows(a, gathered_lead, call.dim), *ys)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        saved, *rhs = ctx.saved_tensors
        got = _arrived_grads(
            grads,
            call.return_a,
            ctx.need_x,
            ctx.need_rhs,
            lambda g: flatten_rows(g, call.dim)[0].contiguous(),
        )
        grad_x, grad_rhs = None, [None] * call.num_rhs
        grad_bias = [None] * len(ctx.need_bias)
        if not got.nothing_to_do:
            bs = [rhs[j] for j in got.used] if got.need_a else []
            with deadline.fused_call(call.group, _OP, "backward"):
                grad_x, grads_used = _backward(
                    call.impl,
                    call.group,
                    saved,
                    call.save_gathered_a,
                    [w.t() for w in bs] if call.linear_weights else bs,
                    got.grad_outs,
                    got.grad_a,
                    got.need_a,
                    got.need_b,
                    linear_weights=call.linear_weights,
                )
            for j, g in zip(got.used, grads_used):
                grad_rhs[j] = g
        for i, j in enumerate(got.used):
            if j < len(ctx.need_bias) and ctx.need_bias[j]:
                grad_bias[j] = got.grad_outs[i].sum(0)
        if grad_x is not None:
            grad_x = unflatten_rows(grad_x, ctx.lead, call.dim)
        return None, *map(as_grad, (grad_x, *grad_rhs, *grad_bias), ctx.specs)


# --- the two ways in -----------------------------------------------------------------------------


def _plan(
    x: object,
    bs: object,
    gather_dim: object,
    group: dist.ProcessGroup,
    backend: str | None,
    return_a: bool,
    save_gathered_a: bool,
    grads: tuple[object, Sequence[object]],
) -> tuple[planning.Plan, bool]:
    """:func:`tp_kernels.ops.planning.plan` of a call (``grads``: the input and the weights as
    autograd sees them, DTensors where ``x`` and ``bs`` are their local tensors)."""
    keep_a = return_a or save_gathered_a
    return planning.plan(
        _OP,
        group,
        x,
        bs,
        (gather_dim, backend, return_a, save_gathered_a),
        backend,
        lambda: check_all_gather_matmul(x, bs, gather_dim),
        {"return_a": return_a, "save": save_gathered_a},
        lambda dim, name: get_backend(name).all_gather_matmul(
            flatten_rows(x, dim)[0].contiguous(), bs, group, return_a=keep_a
        ),
        lambda: capture.all_gather_matmul_needs(
            x, save_gathered_a, group.size(), *capture.grads_wanted(grads)
        ),
    )


def all_gather_matmul(
    a_shard: torch.Tensor,
    bs: Sequence[torch.Tensor],
    gather_dim: int,
    group: GroupLike,
    *,
    backend: str | None = None,
    return_a: bool = False,
    save_gathered_a: bool = False,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """All-gather ``a_shard`` along ``gather_dim`` and multiply the result by each of ``bs``.

    On each of the ``W`` ranks of ``group``, with ``a_shard`` of shape ``[..., s, ..., K]``
    (``s`` at ``gather_dim``, any dim but the last) and ``bs[j]`` of shape ``[K, N_j]``::

        a = cat([a_shard of rank 0, ..., rank W-1], dim=gather_dim)     [..., W*s, ..., K]
        returns (a if return_a else None, [a @ b for b in bs])          [..., W*s, ..., N_j]

    Differentiable in ``a_shard`` and every ``b``. Backward: ``d a_shard`` is one fused
    matmul-reduce-scatter of ``cat(d out_j) @ cat(bs)^T`` (plus ``d a`` when ``a`` was returned
    and used); ``d b_j = a^T @ d out_j``. ``save_gathered_a=False`` (default) keeps only the shard
    for backward and gathers it again there, overlapped with the reduce-scatter: ``W`` times less
    saved memory than keeping ``a``; ``True`` saves ``a`` and skips that gather.

    ``group``: a ProcessGroup, a 1-D DeviceMesh, a group name or None (the default group).
    ``backend``: ``"reference"``, ``"pipelined"``, ``"symm"``, ``"torch_symm_mem"``, ``"auto"``
    or ``None`` (the current default, see :func:`tp_kernels.set_backend`). Mirrors
    ``torch.ops.symm_mem.fused_all_gather_matmul``.
    """
    pg = resolve_group_or_note(group, op=_OP)
    plan, owed = _plan(
        a_shard, bs, gather_dim, pg, backend, return_a, save_gathered_a, (a_shard, bs)
    )
    if plan.impl is not None and eager_path((a_shard, *bs)):
        call = _Call(
            impl=plan.impl,
            group=pg,
            dim=plan.dim,
            num_rhs=len(bs),
            return_a=return_a,
            save_gathered_a=save_gathered_a,
            linear_weights=False,
        )
        with deadline.fused_call(pg, _OP, "forward"):
            if owed:
                agree(pg, _OP, plan, a_shard.device)
            results = AllGatherMatmul.apply(call, a_shard, *bs)
        return (results[0] if return_a else None), list(results[-len(bs) :])
    if owed:  # never while torch.compile traces: a traced call's plan is new
        with deadline.fused_call(pg, _OP, "forward"):
            agree(pg, _OP, plan, a_shard.device)
    a_rows, lead = flatten_rows(a_shard, plan.dim)
    results = all_gather_matmul_2d(
        a_rows, list(bs), pg.group_name, plan.backend, return_a, save_gathered_a
    )
    gathered_lead = (pg.size() * lead[0], *lead[1:])
    outs = [unflatten_rows(t, gathered_lead, plan.dim) for t in results[-len(bs) :]]
    return (unflatten_rows(results[0], gathered_lead, plan.dim) if return_a else None), outs


def colwise_linears(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    gather_dim: int,
    group: dist.ProcessGroup,
    backend: str | None,
    *,
    return_a: bool = False,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """``(A if return_a else None, [y_j])`` of the colwise Linears ``(weights[j], biases[j])``
    (``[N_j, K]``, ``[N_j]`` or None; local or DTensor) on ``x`` (``[..., s, ..., K]`` local shard
    or its DTensor), gathered along ``gather_dim`` over ``group``: ``y_j = A @ w_j^T + bias_j``,
    all local tensors. Eager only: the caller has checked :func:`.dtensors.eager_path`."""
    x_local = local_tensor(x)
    bs = [local_tensor(w).t() for w in weights]
    plan, owed = _plan(x_local, bs, gather_dim, group, backend, return_a, False, (x, weights))
    n = len(weights)
    call = _Call(
        impl=plan.impl,
        group=group,
        dim=plan.dim,
        num_rhs=n,
        return_a=return_a,
        save_gathered_a=False,  # as the fused op's default: the shard is gathered again
        linear_weights=True,
    )
    with deadline.fused_call(group, _OP, "forward"):
        if owed:
            agree(group, _OP, plan, x_local.device)
        results = AllGatherMatmul.apply(call, x, *weights, *biases)
    return (results[0] if return_a else None), list(results[-n:])


# --- the custom ops: torch.compile and dispatch modes --------------------------------------------
#
# On 2-D rows; the group travels as its registered name and the backend as a name, so the ops
# trace as opaque nodes with these fake kernels. Eager calls pass the backend already resolved; a
# compiled graph passes what the user asked for ("": the default in force when the graph runs, or
# "auto") and the op has it chosen when it runs (choice.at_run_time), under CUDA graph capture
# too: a backward resolved by name (torchtitan 0.3's Functions pass "auto") may find auto's timed
# choice unable to capture it, and takes the next of auto's ranking that can, as the forward did.
#
#   tp_kernels::all_gather_matmul(a [m, K], bs [K, N_j]..., return_a, save_a)
#       -> [A] if (return_a or save_a), then A @ b_j
#   tp_kernels::all_gather_matmul_backward(saved, bs, grad_outs, grad_a, saved_is_gathered, ...,
#       need_b) -> d a, then d b_j for each j with need_b[j]
#   tp_kernels::all_gather_matmul_weight_grads(saved, grad_outs, saved_is_gathered, ...)
#       -> d b_j for each grad given: the backward when the input needs no grad


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
    with deadline.fused_call(group, _OP, "forward"):
        shape = Shape.of_all_gather_matmul(a_shard, bs)
        impl = at_run_time(backend, shape, group, [(_OP, a_shard.nbytes)])
        keep_a = return_a or save_a
        a, outs = _forward(impl, group, a_shard, bs, keep_a)
        return [a, *outs] if keep_a else outs


@all_gather_matmul_2d.register_fake
def _(a_shard, bs, group_name, backend, return_a, save_a):
    rows = group_size(group_name) * a_shard.shape[0]
    outs = [a_shard.new_empty((rows, b.shape[1])) for b in bs]
    return [a_shard.new_empty((rows, a_shard.shape[1])), *outs] if return_a or save_a else outs


def _backward_2d(
    saved, bs, grad_outs, grad_a, saved_is_gathered, group_name, backend, *, need_a, need_b
) -> list[torch.Tensor]:
    group = _resolve_process_group(group_name)
    with deadline.fused_call(group, _OP, "backward"):
        first = grad_outs[0] if grad_outs else grad_a
        k = bs[0].shape[0] if bs else (saved.shape[1] if saved is not None else grad_a.shape[1])
        ns = tuple(g.shape[1] for g in grad_outs)
        m = first.shape[0] // group.size()
        shape = Shape(_OP, m, k, ns, first.dtype, first.device)
        shard = m * k * first.dtype.itemsize
        needs = [("matmul_reduce_scatter", group.size() * shard)] if need_a else []
        if any(need_b) and not saved_is_gathered:
            needs.append(("all_gather", shard))
        impl = at_run_time(backend, shape, group, needs)
        grad_shard, grad_bs = _backward(
            impl,
            group,
            saved,
            saved_is_gathered,
            bs,
            grad_outs,
            grad_a,
            need_a,
            need_b,
            linear_weights=False,
        )
        return [t for t in (grad_shard, *grad_bs) if t is not None]


@torch.library.custom_op("tp_kernels::all_gather_matmul_backward", mutates_args=())
def _backward_op(
    saved: torch.Tensor | None,
    bs: list[torch.Tensor],
    grad_outs: list[torch.Tensor],
    grad_a: torch.Tensor | None,
    saved_is_gathered: bool,
    group_name: str,
    backend: str,
    need_b: list[bool],
) -> list[torch.Tensor]:
    return _backward_2d(
        saved,
        bs,
        grad_outs,
        grad_a,
        saved_is_gathered,
        group_name,
        backend,
        need_a=True,
        need_b=need_b,
    )


@_backward_op.register_fake
def _(saved, bs, grad_outs, grad_a, saved_is_gathered, group_name, backend, need_b):
    first = grad_outs[0] if grad_outs else grad_a
    k = bs[0].shape[0] if bs else grad_a.shape[1]
    grad_shard = first.new_empty((first.shape[0] // group_size(group_name), k))
    return [grad_shard, *_fake_weight_grads(saved, grad_outs, need_b)]


@torch.library.custom_op("tp_kernels::all_gather_matmul_weight_grads", mutates_args=())
def _weight_grads_op(
    saved: torch.Tensor,
    grad_outs: list[torch.Tensor],
    saved_is_gathered: bool,
    group_name: str,
    backend: str,
) -> list[torch.Tensor]:
    """``d b_j = A^T @ dC_j`` only (no input grad, so no reduce-scatter: CommDebugMode counts
    nothing, as DTensor's path issues no collective for weight grads)."""
    need_b = [True] * len(grad_outs)
    return _backward_2d(
        saved,
        [],
        grad_outs,
        None,
        saved_is_gathered,
        group_name,
        backend,
        need_a=False,
        need_b=need_b,
    )


@_weight_grads_op.register_fake
def _(saved, grad_outs, saved_is_gathered, group_name, backend):
    return _fake_weight_grads(saved, grad_outs, [True] * len(grad_outs))


def _fake_weight_grads(saved, grad_outs, need_b) -> list[torch.Tensor]:
    return [g.new_empty((saved.shape[1], g.shape[1])) for g, n in zip(grad_outs, need_b) if n]


def _setup_context(ctx, inputs, output):
    a_shard, bs, group_name, backend, return_a, save_a = inputs
    ctx.group_name, ctx.backend, ctx.num_bs = group_name, backend, len(bs)
    ctx.a_returned, ctx.save_a = return_a or save_a, save_a
    # In setup_context torch passes needs_input_grad flat: a_shard, then each of bs, then the rest.
    need = ctx.needs_input_grad
    ctx.need_a, ctx.need_b = need[0], list(need[1 : 1 + len(bs)])
    saved = (output[0] if save_a else a_shard) if any(ctx.need_b) else None
    ctx.save_for_backward(saved, *(bs if ctx.need_a else ()))
    ctx.set_materialize_grads(False)  # as AllGatherMatmul


def _autograd_backward(ctx, grads):
    saved, *bs = ctx.saved_tensors
    got = _arrived_grads(grads, ctx.a_returned, ctx.need_a, ctx.need_b, torch.Tensor.contiguous)
    grad_bs: list[torch.Tensor | None] = [None] * ctx.num_bs
    if got.nothing_to_do:
        return None, grad_bs, None, None, None, None
    if got.need_a:
        used_bs = [bs[j] for j in got.used]
        result = iter(
            _backward_op(
                saved,
                used_bs,
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
        result = iter(_weight_grads_op(saved, wanted, ctx.save_a, ctx.group_name, ctx.backend))
    grad_a_shard = next(result) if got.need_a else None
    for j, need in zip(got.used, got.need_b):
        if need:
            grad_bs[j] = next(result)
    return grad_a_shard, grad_bs, None, None, None, None


all_gather_matmul_2d.register_autograd(_autograd_backward, setup_context=_setup_context)
count_as_collective("all_gather_matmul", "all_gather_into_tensor")
count_as_collective("all_gather_matmul_backward", "reduce_scatter_tensor")
