"""torchao's low-precision Linears on the fused path: one ``autograd.Function`` per pattern.

A sequence-parallel colwise Linear gathers its input (forward: fused all-gather-matmul; dgrad:
fused matmul-reduce-scatter), a rowwise Linear scatters its output (forward: fused
matmul-reduce-scatter; dgrad: fused all-gather-matmul); in both the weight grad's operand that
spans the gathered rows (the colwise input, the rowwise output grad) is gathered while the dgrad's
fused call runs. That skeleton is the same for every kind of low-precision Linear; what a kind
changes is how each operand is cast and how the fused calls and the weight grad multiply the
casts. So :class:`ColwiseLinears` and :class:`RowwiseLinear` run the skeleton and ask the call
(a :class:`QuantizedCall`: ``tp_kernels/float8.py``'s for torchao's Float8Linear,
``tp_kernels/mxfp8.py``'s for its MXFP8 Linears) for each of those steps, as torchao's float8 TP
styles override only the hooks that change.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Literal, NamedTuple, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from tp_kernels.backends.base import Backend
from tp_kernels.ops import scaled_compiled
from tp_kernels.ops.capture import requires_grad
from tp_kernels.ops.comm_stats import gather_bytes, record
from tp_kernels.ops.dtensors import as_grad, dtensor_specs, local_tensor
from tp_kernels.ops.layout import flatten_rows, unflatten_rows

__all__ = [
    "BIAS_SUM_BYTES",
    "GEMM_PHASE",
    "CallShape",
    "ColwiseLinears",
    "QuantizedCall",
    "RowwiseLinear",
    "bias_grad",
    "call_shape",
    "grads_needed",
    "plain_param",
]

Gemm = Literal["forward", "dgrad"]  # which of a Linear's GEMMs a cast or a fused call is for
WgradOperand = Literal["input", "grad_output"]  # which operand of the weight grad ``dY^T @ x``
GEMM_PHASE: dict[Gemm, str] = {"forward": "forward", "dgrad": "backward"}  # comm_stats' phase


class Pending(Protocol):
    """A gather in flight: :meth:`wait` gives the gathered operand."""

    def wait(self) -> torch.Tensor: ...


class QuantizedCall(Protocol):
    """One fused call of low-precision Linears: its backend and group, and the casts and
    products of its kind. ``dim``: the gathered (colwise) or scattered (rowwise) dim of ``x``;
    ``num_linears``: how many Linears share the gathered input (colwise); ``impl`` is None while
    torch.compile traces (fp8 only: each communicating step is then a custom op)."""

    impl: Backend | None
    group: dist.ProcessGroup
    dim: int
    world: int
    num_linears: int

    def cast_rows(self, rows: torch.Tensor, *, gemm: Gemm, sharded_dim: int) -> torch.Tensor:
        """The left operand of ``gemm``: ``rows`` (the input in forward, the output grad in
        dgrad), sharded over the ranks along ``sharded_dim``, cast along its last dim."""

    def cast_weight(self, w: torch.Tensor, *, gemm: Gemm, sharded_dim: int) -> torch.Tensor:
        """The right operand of ``gemm`` from the weight ``w [N, K]`` (sharded along
        ``sharded_dim``): ``[K, N]`` cast along K in forward, ``[N, K]`` cast along N in dgrad."""

    def gather_matmul(
        self, left: torch.Tensor, rights: list[torch.Tensor], *, gemm: Gemm
    ) -> list[torch.Tensor]:
        """``[all_gather(left) @ rights[j]]``: the fused all-gather-matmul of cast operands."""

    def matmul_reduce_scatter(
        self, left: torch.Tensor, right: torch.Tensor, *, gemm: Gemm,
        addend: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """This rank's rows of ``sum over ranks of left @ right (+ addend)``: the fused
        matmul-reduce-scatter of cast operands."""

    def token_layout(self, t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The form of a token tensor in which this kind's weight grad reads it: ``t`` as laid
        out, or ``rows`` (``flatten_rows(t, dim)``)."""

    def start_wgrad_gather(self, t: torch.Tensor, *, operand: WgradOperand) -> Pending:
        """Start gathering ``t`` (:meth:`token_layout`'s form) cast as the weight grad's
        ``operand``; it runs while the caller computes."""

    def cast_for_wgrad(self, t: torch.Tensor, *, operand: WgradOperand) -> torch.Tensor:
        """``t`` (:meth:`token_layout`'s form, every row of this rank's columns) cast as the
        weight grad's ``operand``."""

    def weight_grad(self, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``dY^T @ x`` ``[N, K]`` from the weight grad's cast operands."""


class CallShape(NamedTuple):
    """What keys a fused call of Linears: its scaled op, ``m`` the local rows of the operand a
    rank gathers or gets back scattered, ``k`` the input's features, ``ns`` each Linear's output
    features (on this rank)."""

    op: str
    m: int
    k: int
    ns: list[int]


def call_shape(
    modules: Sequence[nn.Module], x: torch.Tensor, world: int, *, colwise: bool
) -> CallShape:
    """The :class:`CallShape` of Linears ``modules`` on the local ``x`` (colwise: this rank's
    rows, gathered; rowwise: every rank's rows, scattered)."""
    k = x.shape[-1]
    rows = x.numel() // k
    ns = [local_tensor(mod.weight).shape[0] for mod in modules]
    if colwise:
        return CallShape("scaled_all_gather_matmul", rows, k, ns)
    return CallShape("scaled_matmul_reduce_scatter", rows // world, k, ns)


def grads_needed(
    modules: Sequence[nn.Module], x: torch.Tensor, *, colwise: bool
) -> dict[str, bool]:
    """Which grads a call's backward computes, as the kind's capture needs take them:
    ``grad_x``, ``grad_w`` and ``grad_b`` (a rowwise bias grad gathers; a colwise one is local)."""
    return {
        "grad_x": requires_grad([x]),
        "grad_w": requires_grad([mod.weight for mod in modules]),
        "grad_b": not colwise and requires_grad([mod.bias for mod in modules]),
    }


def plain_param(param: torch.Tensor | None) -> torch.Tensor | None:
    """A Linear's weight or bias, local, as a plain tensor: ``quantize_``'s training wrappers
    (torchao's ``TrainingWeightWrapperBaseTensor``, fp8 and MXFP8: every parameter of a converted
    Linear, its bias too) hold it as ``_data``."""
    t = local_tensor(param)
    wrappers = sys.modules.get("torchao.prototype.moe_training.tensor")
    if wrappers is not None and isinstance(t, wrappers.TrainingWeightWrapperBaseTensor):
        return t._data
    return t


class ColwiseLinears(torch.autograd.Function):
    """``apply(call, x, *weights, *biases)`` -> ``y_j = Linear_j(all_gather(x))`` for the
    ``call.num_linears`` low-precision Linears (weights ``[N_j, K]``, biases ``[N_j]`` or None;
    local or DTensor), laid out as ``x`` with the gathered dim ``W`` times longer."""

    @staticmethod
    def forward(ctx, call: QuantizedCall, x, *params):
        n = call.num_linears
        weights = [plain_param(w) for w in params[:n]]
        biases = params[n:]
        x_local = local_tensor(x)
        rows, lead = flatten_rows(x_local, call.dim)
        rows = rows.contiguous()
        left = call.cast_rows(rows, gemm="forward", sharded_dim=0)
        rights = [call.cast_weight(w, gemm="forward", sharded_dim=0) for w in weights]
        outs = call.gather_matmul(left, rights, gemm="forward")
        outs = [out if b is None else out + plain_param(b).to(out.dtype)
                for out, b in zip(outs, biases)]  # fmt: skip
        need = ctx.needs_input_grad
        ctx.call, ctx.lead, ctx.specs = call, lead, dtensor_specs(x, *params)
        ctx.need_x, ctx.need_w, ctx.need_bias = need[1], need[2 : 2 + n], need[2 + n :]
        saved_x = call.token_layout(x_local, rows) if any(ctx.need_w) else None
        ctx.save_for_backward(saved_x, *(weights if ctx.need_x else ()))
        ctx.set_materialize_grads(False)
        gathered_lead = (call.world * lead[0], *lead[1:])
        return tuple(unflatten_rows(out, gathered_lead, call.dim) for out in outs)

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        x, *weights = ctx.saved_tensors
        used = [j for j, g in enumerate(grads) if g is not None]
        gs = {j: flatten_rows(grads[j], call.dim)[0].contiguous() for j in used}
        need_w = [j for j in used if ctx.need_w[j]]
        gathered_x = None
        if need_w:  # gathered while the input grad's reduce-scatter runs
            gathered_x = call.start_wgrad_gather(x, operand="input")
        grad_x = None
        if ctx.need_x and used:
            grad_x = _colwise_dgrad(call, [gs[j] for j in used], [weights[j] for j in used])
            grad_x = unflatten_rows(grad_x, ctx.lead, call.dim)
        grad_w = [None] * call.num_linears
        if need_w:
            x_all = gathered_x.wait()
            for j in need_w:
                g = call.token_layout(grads[j], gs[j])
                grad_w[j] = call.weight_grad(call.cast_for_wgrad(g, operand="grad_output"), x_all)
        grad_b = [gs[j].sum(0) if j in gs and need else None
                  for j, need in enumerate(ctx.need_bias)]  # fmt: skip
        return None, *map(as_grad, (grad_x, *grad_w, *grad_b), ctx.specs)


def _colwise_dgrad(
    call: QuantizedCall, grad_outs: list[torch.Tensor], weights: list[torch.Tensor]
) -> torch.Tensor:
    """``reduce_scatter(sum_j dY_j @ w_j)`` [m, K]: the first Linear's product in the fused
    call, the others' (local GEMMs of the casts) added to it before the scatter."""
    products = [
        (call.cast_rows(g, gemm="dgrad", sharded_dim=1),
         call.cast_weight(w, gemm="dgrad", sharded_dim=0))
        for g, w in zip(grad_outs, weights)
    ]  # fmt: skip
    addend = None
    for g, w in products[1:]:
        product = torch.mm(g, w)
        addend = product if addend is None else addend + product
    return call.matmul_reduce_scatter(*products[0], gemm="dgrad", addend=addend)


BIAS_SUM_BYTES = torch.float32.itemsize  # a rank's column sum of dY, gathered by bias_grad


def bias_grad(call: QuantizedCall, grad_rows: torch.Tensor) -> torch.Tensor:
    """``d bias [N]`` of a rowwise Linear whose output is scattered: the sum of every rank's rows
    of ``dY`` (``grad_rows``, this rank's). Each rank's fp32 column sums are gathered (one
    ``[W, N]`` gather) and added in rank order, so every rank holds the same replicated grad."""
    partial = grad_rows.float().sum(0, keepdim=True)
    if call.impl is None:  # traced: the custom op (fp8's ``op_args``)
        sums = scaled_compiled.scaled_all_gather(partial, *call.op_args("backward"))
    else:
        sent = gather_bytes(partial, call.group)
        record("backward", "all_gather", call.impl.name, sent_bytes=sent)
        sums = call.impl.all_gather_async(partial, call.group).wait()
    return sums.sum(0).to(grad_rows.dtype)


class RowwiseLinear(torch.autograd.Function):
    """``apply(call, x, weight, bias)`` -> this rank's rows (along ``call.dim``) of the
    low-precision ``Linear(x)`` summed over the group, plus ``bias``: ``x [..., K_r]`` sharded on
    its last dim (``weight [N, K_r]``, local or DTensor; ``bias [N]``, replicated, or None), the
    result ``[..., s, ..., N]`` with ``s`` the scattered dim's size over ``W``."""

    @staticmethod
    def forward(ctx, call: QuantizedCall, x, weight, bias):
        w = plain_param(weight)
        x_local = local_tensor(x)
        rows, lead = flatten_rows(x_local, call.dim)
        rows = rows.contiguous()
        left = call.cast_rows(rows, gemm="forward", sharded_dim=1)
        right = call.cast_weight(w, gemm="forward", sharded_dim=1)
        out = call.matmul_reduce_scatter(left, right, gemm="forward")
        if bias is not None:  # added once, after the sum
            out = out + plain_param(bias).to(out.dtype)
        need = ctx.needs_input_grad
        ctx.call, ctx.lead, ctx.specs = call, lead, dtensor_specs(x, weight, bias)
        ctx.need_x, ctx.need_w, ctx.need_bias = need[1], need[2], need[3]
        saved_x = call.token_layout(x_local, rows) if ctx.need_w else None
        ctx.save_for_backward(saved_x, w if ctx.need_x else None)
        return unflatten_rows(out, (lead[0] // call.world, *lead[1:]), call.dim)

    @staticmethod
    def backward(ctx, grad):
        call = ctx.call
        x, w = ctx.saved_tensors
        g = flatten_rows(grad, call.dim)[0].contiguous()
        gathered_g = None
        if ctx.need_w:  # gathered while the input grad's fused call runs
            gathered_g = call.start_wgrad_gather(call.token_layout(grad, g), operand="grad_output")
        grad_x = grad_w = None
        if ctx.need_x:
            left = call.cast_rows(g, gemm="dgrad", sharded_dim=0)
            right = call.cast_weight(w, gemm="dgrad", sharded_dim=1)
            (grad_rows,) = call.gather_matmul(left, [right], gemm="dgrad")
            grad_x = unflatten_rows(grad_rows, ctx.lead, call.dim)
        if ctx.need_w:
            x_cast = call.cast_for_wgrad(x, operand="input")
            grad_w = call.weight_grad(gathered_g.wait(), x_cast)
        grad_b = bias_grad(call, g) if ctx.need_bias else None
        return None, *map(as_grad, (grad_x, grad_w, grad_b), ctx.specs)
