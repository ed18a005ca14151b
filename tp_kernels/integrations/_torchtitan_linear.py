"""tp_kernels' fused ops behind torchtitan 0.3's three collective linears.

Drop-in replacements for ``AllGatherLinear``, ``AllGatherLinearMulti`` and ``LinearReduceScatter``
of ``torchtitan/distributed/linear.py``, which ``torchtitan.models.common.dist_gemm``'s fused
modules call by their module-global names (see :mod:`tp_kernels.integrations.torchtitan`). Same
arguments and results, on plain local tensors over the ``R`` ranks of ``group``, rows
sequence-major (dim 0 rank-major)::

    AllGatherLinear.apply(x [M/R, K], w [N/R, K], bias [N/R] or None, group, group_name)
        y [M, N/R] = all_gather(x) @ w^T (+ bias)
    AllGatherLinearMulti.apply(x [M/R, K], wa [Na/R, K], wb [Nb/R, K], group, group_name)
        (all_gather(x) @ wa^T [M, Na/R], all_gather(x) @ wb^T [M, Nb/R]), one gather
    LinearReduceScatter.apply(x [M, K/R], w [N, K/R], bias [N] or None, group, group_name)
        y [M/R, N] = reduce_scatter(x @ w^T) (+ bias, added once)

Forward is one :func:`tp_kernels.all_gather_matmul` or :func:`tp_kernels.matmul_reduce_scatter`
(any backend, any process group, CPU included). Backward is the backward half of the same op, what
tp_kernels' own autograd runs (``torch.ops.tp_kernels.*_backward``)::

    gather side   dx = reduce_scatter(cat(dy_j) @ cat(w_j))      one fused matmul-reduce-scatter
                  dw_j = (all_gather(x)^T @ dy_j)^T               x gathered again meanwhile
                  dbias = dy.sum(0)                               dy holds every row
    scatter side  G = all_gather(dy) fused with dx = G @ w        one fused all-gather-matmul
                  dw = G^T @ x,  dbias = G.sum(0)                 no further communication

What backward keeps: ``x`` as given (for the weight grads) and the weights (for the input grad),
each only where that grad is asked for (``needs_input_grad``: frozen weights, an input without
grad), and only those grads are computed. On the gather side ``x`` is ``M*K/R`` elements, as many
as torchtitan's K-slice of the gathered ``x``; torchtitan cuts and copies that
slice in forward and re-gathers it along K after the input grad's reduce-scatter, where here the
re-gather of ``x`` itself runs while the reduce-scatter computes, with no transposed copy. The
weight grads are computed in the input dtype (a CUDA bf16 GEMM accumulates in fp32 and rounds
once, as torchtitan's ``out_dtype=torch.float32`` then cast does); the bias grad of the scatter
side sums the gathered ``dy``, the value torchtitan's all-reduce of per-rank sums gives.

The backend is the one in force when forward runs (:func:`tp_kernels.use_backend`,
:func:`tp_kernels.set_backend`); backward uses the same name, whichever thread autograd runs it on.

Each class is registered with ``spmd_types.register_autograd_function``: under spmd_types' type
checker its ``typecheck_forward`` runs instead of ``apply`` and asserts the types on the TP axis
(``S(0)`` rows in, ``S(1)`` columns out on the gather side; ``S(1)`` in, ``S(0)`` out, bias ``R``
on the scatter side; the other mesh axes pass through from ``x``), since as ordinary local ops the
collectives inside would get the wrong (local) rule. Importing this module needs ``spmd_types``
(a torchtitan 0.3 dependency).
"""

from __future__ import annotations

import contextvars
import functools
import logging
from collections.abc import Callable, Sequence

import spmd_types as spmd
import torch
import torch.nn as nn

from tp_kernels import styles
from tp_kernels.backends.choice import current_backend
from tp_kernels.ops import all_gather_matmul, matmul_reduce_scatter
from tp_kernels.ops.comm_stats import record

__all__ = ["AllGatherLinear", "AllGatherLinearMulti", "LinearReduceScatter"]

logger = logging.getLogger("tp_kernels")


def _gather_forward(ctx, x, weights, group) -> list[torch.Tensor]:
    """``[all_gather(x) @ w^T for w in weights]`` [M, N_j/R]; keeps what backward needs: ``x``
    for the weight grads, the weights for the input grad (``ctx.needs_input_grad``)."""
    backend = current_backend()
    _, outs = all_gather_matmul(x, [w.t() for w in weights], 0, group, backend=backend)
    need = ctx.needs_input_grad
    ctx.need_x, ctx.need_w = need[0], list(need[1 : 1 + len(weights)])
    ctx.group_name, ctx.backend = group.group_name, backend
    ctx.save_for_backward(x if any(ctx.need_w) else None, *(weights if ctx.need_x else ()))
    return outs


def _gather_backward(ctx, grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, list]:
    """``(dx [M/R, K] or None, [dw_j [N_j/R, K] or None])`` from the output grads ``dy_j``
    [M, N_j/R], each computed only if asked for."""
    x, *weights = ctx.saved_tensors
    grads = [g.contiguous() for g in grads]
    ops = torch.ops.tp_kernels
    if ctx.need_x:  # x is this rank's rows: gathered again (a_is_gathered=False)
        grad_x, *grad_bs = ops.all_gather_matmul_backward(
            x, [w.t() for w in weights], grads, None, False, ctx.group_name, ctx.backend, ctx.need_w
        )
    elif any(ctx.need_w):  # weight grads only: no reduce-scatter
        wanted = [g for g, need in zip(grads, ctx.need_w) if need]
        grad_x = None
        grad_bs = ops.all_gather_matmul_weight_grads(x, wanted, False, ctx.group_name, ctx.backend)
    else:
        return None, [None] * len(ctx.need_w)
    present = iter(grad_bs)
    return grad_x, [next(present).t().contiguous() if need else None for need in ctx.need_w]


def _typechecked(
    fn: type[torch.autograd.Function],
    args: tuple,
    inputs: Sequence[tuple[torch.Tensor | None, object]],
    out_type: object,
):
    """``fn.apply(*args)`` with ``inputs`` (tensor, type on the TP axis) asserted before and
    every output asserted to have ``x``'s (``args[0]``'s) types with ``out_type`` on the TP axis
    after."""
    x, group = args[0], args[-2]
    for tensor, tp_type in inputs:
        if tensor is not None:
            spmd.assert_type(tensor, {group: tp_type})
    result = fn.apply(*args)
    want = {**spmd.get_local_type(x), group: out_type}
    for out in result if isinstance(result, tuple) else (result,):
        spmd.assert_type(out, want)
    return result


@spmd.register_autograd_function
class AllGatherLinear(torch.autograd.Function):
    """``y [M, N/R] = all_gather(x [M/R, K]) @ w^T (+ bias)``, ``w [N/R, K]`` (module docstring)."""

    # group_name is in torchtitan's signature; tp_kernels' ops take the group itself.
    @staticmethod
    def forward(ctx, x, w, bias, group, group_name):
        (y,) = _gather_forward(ctx, x, [w], group)
        ctx.need_bias = bias is not None and ctx.needs_input_grad[2]
        return y if bias is None else y.add_(bias)

    @staticmethod
    def backward(ctx, grad_y):
        grad_x, (grad_w,) = _gather_backward(ctx, [grad_y])
        grad_bias = grad_y.sum(0) if ctx.need_bias else None
        return grad_x, grad_w, grad_bias, None, None

    @staticmethod
    def typecheck_forward(x, w, bias, group, group_name):
        """x ``S(0)``, w ``S(0)`` (stored ``[N, K]``: output features are dim 0), bias ``S(0)``
        on the TP axis; y ``S(1)``."""
        args = (x, w, bias, group, group_name)
        return _typechecked(
            AllGatherLinear, args, [(x, spmd.S(0)), (w, spmd.S(0)), (bias, spmd.S(0))], spmd.S(1)
        )


@spmd.register_autograd_function
class AllGatherLinearMulti(torch.autograd.Function):
    """One gather of ``x [M/R, K]`` feeding ``wa [Na/R, K]`` and ``wb [Nb/R, K]`` (no bias)."""

    @staticmethod
    def forward(ctx, x, wa, wb, group, group_name):
        ya, yb = _gather_forward(ctx, x, [wa, wb], group)
        return ya, yb

    @staticmethod
    def backward(ctx, grad_ya, grad_yb):
        grad_x, (grad_wa, grad_wb) = _gather_backward(ctx, [grad_ya, grad_yb])
        return grad_x, grad_wa, grad_wb, None, None

    @staticmethod
    def typecheck_forward(x, wa, wb, group, group_name):
        """x, wa, wb ``S(0)`` on the TP axis; both outputs ``S(1)``."""
        args = (x, wa, wb, group, group_name)
        return _typechecked(
            AllGatherLinearMulti,
            args,
            [(x, spmd.S(0)), (wa, spmd.S(0)), (wb, spmd.S(0))],
            spmd.S(1),
        )


@spmd.register_autograd_function
class LinearReduceScatter(torch.autograd.Function):
    """``y [M/R, N] = reduce_scatter(x [M, K/R] @ w^T) (+ bias [N])``, ``w [N, K/R]``."""

    @staticmethod
    def forward(ctx, x, w, bias, group, group_name):
        backend = current_backend()
        y = matmul_reduce_scatter(x, w.t(), 0, group, backend=backend, bias=bias)
        ctx.need = (*ctx.needs_input_grad[:2], bias is not None and ctx.needs_input_grad[2])
        ctx.group_name, ctx.backend = group.group_name, backend
        need_x, need_w, _ = ctx.need
        ctx.save_for_backward(x if need_w else None, w if need_x else None)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        if not any(ctx.need):
            return None, None, None, None, None
        x, w = ctx.saved_tensors
        present = iter(
            torch.ops.tp_kernels.matmul_reduce_scatter_backward(
                x,
                None if w is None else w.t(),
                grad_y.contiguous(),
                ctx.group_name,
                ctx.backend,
                False,  # a sum, not a mean
                *ctx.need,
            )
        )
        grad_x, grad_b, grad_bias = (next(present) if need else None for need in ctx.need)
        grad_w = None if grad_b is None else grad_b.t().contiguous()
        return grad_x, grad_w, grad_bias, None, None

    @staticmethod
    def typecheck_forward(x, w, bias, group, group_name):
        """x ``S(1)``, w ``S(1)`` (stored ``[N, K]``: input features are dim 1), bias ``R`` on
        the TP axis; y ``S(0)``."""
        args = (x, w, bias, group, group_name)
        return _typechecked(
            LinearReduceScatter, args, [(x, spmd.S(1)), (w, spmd.S(1)), (bias, spmd.R)], spmd.S(0)
        )


# ---- torchao's low-precision children: the fused fp8 and MXFP8 paths ----------------------------
#
# torchtitan 0.3's fused modules pass their children's ``.weight`` to the three Functions, so a
# child that torchtitan's float8 or MXFP8 converter made a Float8Linear or an MXFP8Linear would be
# multiplied in high precision (its casts never run). Under patched() the modules' forwards run
# inside :func:`owned_forward`, which makes the module known here; the names the modules call are
# :class:`Routed` objects, which send a call whose weights all belong to fusable low-precision
# children of one kind and config (``quantize_``'s wrapped weights included) to the fused
# Functions of tp_kernels/quantized_linears.py on that kind's call (tp_kernels/float8.py,
# tp_kernels/mxfp8.py) and any other call to the Functions above. torchtitan's own forwards
# (their reshaping, their fallbacks) run unchanged.

_owner: contextvars.ContextVar[nn.Module | None] = contextvars.ContextVar(
    "tp_kernels_dist_gemm_owner", default=None
)
_reported: set[tuple[str, str]] = set()


def owned_forward(forward: Callable) -> Callable:
    """``forward`` of a dist_gemm module class, run with the module made known to the
    :class:`Routed` names its calls reach."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        token = _owner.set(self)
        try:
            return forward(self, *args, **kwargs)
        finally:
            _owner.reset(token)

    wrapper.tp_kernels_wraps = forward  # what unpatch() puts back (and tests check)
    return wrapper


def _quantized_children(
    weights: Sequence[torch.Tensor],
) -> tuple[str | None, list[nn.Module] | None, str]:
    """``(kind, children, "")`` when the low-precision children (``"float8"`` or ``"mxfp8"``) of
    the running module owning ``weights`` may take their kind's fused path; ``(kind, None, why)``
    when some weight is a low-precision Linear's but the call cannot; ``(None, None, "")`` when
    none is (the high-precision path, nothing ignored)."""
    owner = _owner.get()
    if owner is None:
        return None, None, ""
    by_weight = {id(c.weight): c for c in owner.children() if isinstance(c, nn.Linear)}
    mods = [by_weight.get(id(w)) for w in weights]
    kinds = [None if m is None else styles._quantized_kind(m) for m in mods]
    kind = next((k for k in kinds if k is not None), None)
    if kind is None:
        return None, None, ""
    if len(set(kinds)) > 1:
        return kind, None, f"its weights mix Linears of kinds {sorted(map(str, set(kinds)))}"
    for m in mods:
        why = styles._quantized_unfusable(kind, m)
        if why is not None:
            return kind, None, why
    if len({styles._quantized_config(m, kind) for m in mods}) > 1:
        return kind, None, "its low-precision Linears differ in torchao config"
    if torch.compiler.is_compiling():
        return kind, None, "a low-precision Linear fuses here on the eager path only (not compiled)"
    return kind, mods, ""


def _call_unfusable_reason(kind: str, mods: list[nn.Module], x, group, *, colwise: bool):
    """Why this call of fusable ``kind`` children on the local rows ``x`` (gathered or scattered
    along dim 0) takes the high-precision path, or None: MXFP8's blocks must not span ranks
    (:func:`tp_kernels.mxfp8.call_unfusable_reason`); an fp8 call always fuses."""
    if kind != "mxfp8":
        return None
    from tp_kernels import mxfp8

    world = group.size()
    return mxfp8.call_unfusable_reason(mods, x, 0, current_backend(), world, colwise=colwise)


def _quantized_ignored(name: str, kind: str, why: str) -> None:
    """Count a call whose low-precision weights are multiplied in high precision (what
    torchtitan's own Functions do with every one); log each reason once."""
    record("forward", "fallback", "torch")
    owner = type(_owner.get()).__qualname__
    if (owner, why) not in _reported:
        _reported.add((owner, why))
        logger.warning(
            "%s: %s runs in high precision, its %s Linears' casts not applied: %s",
            owner,
            name,
            kind,
            why,
        )


def _types_in(x, inputs, group) -> dict:
    """Assert ``inputs`` ((tensor, type on the TP axis)); the types of an output (``x``'s, the
    TP axis to be set)."""
    for tensor, tp_type in inputs:
        if tensor is not None:
            spmd.assert_type(tensor, {group: tp_type})
    return spmd.get_local_type(x)


@functools.cache
def _fused_functions() -> tuple[type, type]:
    """The low-precision Linears' fused Functions (``tp_kernels/quantized_linears.py``: one per
    pattern, every kind's call), registered with spmd_types' checker under the types of the
    Functions above."""
    from tp_kernels.quantized_linears import ColwiseLinears, RowwiseLinear

    @spmd.register_autograd_function
    class Gather(ColwiseLinears):
        """:class:`AllGatherLinear` / :class:`AllGatherLinearMulti`'s contract, low precision."""

        @staticmethod
        def typecheck_forward(call, x, *params):
            n = call.num_linears
            want = _types_in(x, [(x, spmd.S(0)), *((p, spmd.S(0)) for p in params)], call.group)
            outs = Gather.apply(call, x, *params)
            for out in outs:
                spmd.assert_type(out, {**want, call.group: spmd.S(1)})
            assert len(outs) == n
            return outs

    @spmd.register_autograd_function
    class Scatter(RowwiseLinear):
        """:class:`LinearReduceScatter`'s contract, low precision (the replicated bias added
        once, after the scatter, as LinearReduceScatter adds it)."""

        @staticmethod
        def typecheck_forward(call, x, weight, bias):
            want = _types_in(x, [(x, spmd.S(1)), (weight, spmd.S(1))], call.group)
            out = Scatter.apply(call, x, weight, bias)
            spmd.assert_type(out, {**want, call.group: spmd.S(0)})
            return out

    Gather.__name__ = Gather.__qualname__ = "ColwiseLinearsGather"
    Scatter.__name__ = Scatter.__qualname__ = "RowwiseLinearScatter"
    return Gather, Scatter


class Routed:
    """What patched() binds a dist_gemm name to: ``apply`` with the Function's arguments runs
    the fused fp8 or MXFP8 path when the weights are fusable low-precision Linears' (see above),
    else ``function`` (tp_kernels' Function of that name)."""

    def __init__(self, function: type[torch.autograd.Function]) -> None:
        self.function = function
        self.__name__ = self.__qualname__ = function.__name__

    def __repr__(self) -> str:
        return f"<tp_kernels {self.__name__}, fp8 / MXFP8 for torchao's low-precision weights>"

    def apply(self, x, *args):
        group = args[-2]
        multi = self.function is AllGatherLinearMulti
        colwise = self.function is not LinearReduceScatter
        weights = args[:2] if multi else args[:1]
        kind, mods, why = _quantized_children(weights)
        if mods is not None:
            why = _call_unfusable_reason(kind, mods, x, group, colwise=colwise) or ""
        if mods is None or why:
            if why:
                _quantized_ignored(self.__name__, kind, why)
            return self.function.apply(x, *args)
        path = styles._quantized_path(kind)
        call = path.call_for(mods, x, 0, group, current_backend(), colwise=colwise)
        gather, scatter = _fused_functions()
        if multi:
            return gather.apply(call, x, *weights, None, None)
        bias = args[1]
        if colwise:
            (y,) = gather.apply(call, x, weights[0], bias)
            return y
        return scatter.apply(call, x, weights[0], bias)
