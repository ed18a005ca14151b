"""torchao's ``Float8Linear`` on the fused path: fp8 bytes on the wire, torchao's numerics.

A Float8Linear quantizes its input, its weight and, in backward, its output gradient before each
of its three GEMMs (``matmul_with_hp_or_float8_args`` in torchao/float8/float8_linear.py). Under
sequence parallelism the colwise Linear's input is gathered and the rowwise Linear's output is
reduce-scattered; here each cast is made with torchao's own functions (its scale rule, power-of-
two rounding and saturation: ``tensor_to_amax``, ``amax_to_scale``,
``hp_tensor_and_scale_to_float8``, ``hp_tensor_to_float8_dynamic``) on the local shard, with one
change: where the cast's amax spans the ranks' shards (a tensor-wise amax of a sharded tensor; a
row-wise amax along a sharded dim) the local amax is all-reduced (MAX) over the group first, as
DTensor does under PyTorch's styles. So every rank holds the fp8 values and scales torchao would
compute on the unsharded tensor, and the fused ops run the GEMMs on them:

=========================  =================================================  ===================
colwise (gathered input)   cast (dim reduced by the amax; "spans": all-reduce)  GEMM
=========================  =================================================  ===================
forward                    x [m, K]: per row (local) or tensor (spans);        fused scaled
                           w^T [K, N]: per column over K (local) or tensor     all-gather-matmul:
                           (spans)                                             fp8 rows + scales
dgrad                      dY [W*m, N]: per row over N (spans);                fused scaled
                           w^T: per row over N (spans), or tensor (spans)      matmul-reduce-
                                                                               scatter (bf16)
wgrad                      dY: per column over rows (local) / tensor (spans);  local GEMM on the
                           x: per column over the gathered rows (spans), cast  gathered fp8 (or
                           on the shard, its fp8 bytes gathered                hp) x
=========================  =================================================  ===================

=========================  =================================================  ===================
rowwise (scattered out)    cast                                                GEMM
=========================  =================================================  ===================
forward                    x [W*m, K]: per row over K (spans) / tensor;        fused scaled
                           w^T [K, N]: per column over K (spans) / tensor      matmul-reduce-
                                                                               scatter (bf16)
dgrad                      dY [m, N]: per row (local) / tensor (spans);        fused scaled all-
                           w^T: per row over N (local) / tensor (spans)        gather-matmul
wgrad                      dY: per column over the gathered rows (spans), cast  local GEMM on the
                           on the shard, its bytes gathered; x: per column     gathered dY
                           over rows (local) / tensor (spans)
=========================  =================================================  ===================

A recipe's disabled cast (``rowwise_with_gw_hp``'s weight-gradient operands) stays in high
precision: its gathered operand travels in bf16/fp32. The GEMMs are torchao's: the local ones
are ``torch.mm`` of torchao's Float8TrainingTensors; the fused ones take the same fp8 data and
dequant scales and :func:`tp_kernels.backends.scaled.scaled_mm`'s product (torchao's rule), so on
``reference`` the outputs and grads equal torchao's under PyTorch's styles bit for bit wherever
the same rows meet the same ``torch._scaled_mm`` (the reduce-scatter sums partials in fp32 in rank
order where DTensor's collective sums in the dtype: within a tolerance there).

What fuses (:func:`unfusable_reason`): a Float8Linear whose forward casts are both row-wise or
both tensor-wise and whose input-grad casts are enabled, not emulated, without inner-dim padding
and without FSDP's float8 all-gather of weights; anything else takes PyTorch's path, counted as a
fallback.

Under torch.compile the same Functions run, traced by dynamo (forward and backward, torchao's
casts on its Float8TrainingTensor included): :func:`call_for` chooses nothing while tracing, and
each communicating step (the fused gather and reduce-scatter, the amax all-reduces, the wgrad
re-gather) is a custom op of :mod:`tp_kernels.ops.scaled_compiled` that resolves its backend when
the graph runs, by the call's key, as the eager call does, and counts itself there. The styles
pass the Functions plain local tensors there (``to_local()``), so the graph holds no DTensor
inside them. Under a dispatch mode (``CommDebugMode``, fake tensors) the fused fp8 path is not
taken: PyTorch's path runs, counted as a fallback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torchao.float8.config import Float8LinearConfig, ScalingGranularity, ScalingType
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_ops import preprocess_addmm
from torchao.float8.float8_scaling_utils import (
    get_maybe_axiswise_dim,
    hp_tensor_to_float8_dynamic,
)
from torchao.float8.float8_training_tensor import (
    Float8TrainingTensor,
    GemmInputRole,
    LinearMMConfig,
    hp_tensor_and_scale_to_float8,
)
from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

from tp_kernels import deadline
from tp_kernels.backends.base import Backend, CaptureNeed
from tp_kernels.backends.choice import check_backend_name
from tp_kernels.ops import scaled_compiled
from tp_kernels.ops.capture import requires_grad
from tp_kernels.ops.comm_stats import gather_bytes, record
from tp_kernels.ops.dtensors import as_grad, dtensor_specs, local_tensor
from tp_kernels.ops.layout import flatten_rows, unflatten_rows
from tp_kernels.ops.scaled import gather_scaled, reduce_scatter_scaled, scaled_backend
from tp_kernels.tiling import ROW_SCALE_BYTES

__all__ = ["Float8ColwiseLinears", "Float8RowwiseLinear", "unfusable_reason"]


def configs(module: nn.Module) -> tuple[Float8LinearConfig, LinearMMConfig] | None:
    """The torchao configs of an fp8 Linear: torchao's Float8Linear, or an ``nn.Linear`` whose
    weight ``quantize_(..., Float8TrainingOpConfig)`` wrapped (its matmul override runs
    Float8Linear's autograd function with the configs the training config built); else None."""
    if isinstance(module, Float8Linear):
        return module.config, module.linear_mm_config
    wrappers = sys.modules.get("torchao.prototype.moe_training.tensor")
    weight = local_tensor(module.weight)
    if wrappers is not None and isinstance(weight, wrappers.Float8TrainingWeightWrapperTensor):
        return weight.config._float8_linear_config, weight.config._linear_mm_config
    return None


def plain_param(param: torch.Tensor | None) -> torch.Tensor | None:
    """A Linear's weight or bias, local, as a plain tensor: ``quantize_``'s training wrappers
    (torchao's ``TrainingWeightWrapperBaseTensor``, fp8 and MXFP8: every parameter of a converted
    Linear, its bias too) hold it as ``_data``."""
    t = local_tensor(param)
    wrappers = sys.modules.get("torchao.prototype.moe_training.tensor")
    if wrappers is not None and isinstance(t, wrappers.TrainingWeightWrapperBaseTensor):
        return t._data
    return t


def unfusable_reason(module: nn.Module) -> str | None:
    """Why ``module`` (an fp8 Linear, :func:`configs`) cannot take the fused fp8 path, or None."""
    found = configs(module)
    if found is None:
        return f"{type(module).__qualname__} is not an fp8 Linear of torchao's"
    # A subclass that keeps torchao's forward (torchtitan 0.3's Float8Linear) computes the same.
    if type(module).forward not in (nn.Linear.forward, Float8Linear.forward):
        return "a Linear subclass with its own forward is never fused"
    c = found[0]
    forward = (c.cast_config_input, c.cast_config_weight)
    if any(cc.scaling_type is ScalingType.DISABLED for cc in forward):
        return "its forward casts are disabled"
    input_grad = (c.cast_config_grad_output, c.cast_config_weight_for_grad_input)
    if any(cc.scaling_type is ScalingType.DISABLED for cc in input_grad):
        return "its input-grad casts are disabled (the fused input-grad GEMM is fp8)"
    if forward[0].scaling_granularity != forward[1].scaling_granularity:
        return "its input and weight casts differ in granularity"
    if c.emulate:
        return "it emulates fp8 GEMMs (config.emulate)"
    if c.pad_inner_dim:
        return "it pads the inner dim (config.pad_inner_dim)"
    if c.enable_fsdp_float8_all_gather:
        return "its weights are cast by FSDP's float8 all-gather"
    return None


class _Call(NamedTuple):
    """One fused fp8 call: the backend and group, the gathered (colwise) or scattered (rowwise)
    ``dim`` of ``x``, the modules' torchao config and GEMM configs (the same for every module of
    a group), and how many Linears share the gathered input (colwise).

    ``impl`` is None while torch.compile traces: then every communicating step is a custom op of
    ``ops/scaled_compiled.py``, given the group by ``group_name``, the backend by the name asked
    for (``backend``, ``""`` for the default) and the call's key (``key``: op, ``[m, K, *N_j]``,
    out dtype), by which the op resolves its backend when it runs. ``world``: the group's size."""

    impl: Backend | None
    group: dist.ProcessGroup
    dim: int
    config: Float8LinearConfig
    mm: LinearMMConfig
    num_linears: int
    world: int
    group_name: str = ""
    backend: str = ""
    key: tuple = ()

    def op_args(self, phase: str) -> tuple:
        """The trailing arguments of every custom op of ``ops/scaled_compiled.py``."""
        return (self.group_name, self.backend, *self.key, phase)


def _cast(
    t: torch.Tensor,
    cc,
    axiswise_dim: int,
    role: GemmInputRole,
    call: _Call,
    *,
    sharded_dim: int | None,
    phase: str,
) -> torch.Tensor:
    """torchao's cast of ``t`` for ``cc`` (a CastConfig) along ``axiswise_dim`` (its amax
    reduces that dim; tensor-wise: every dim), as a Float8TrainingTensor (``t`` itself when the
    cast is disabled). ``t`` is this rank's shard of a tensor sharded on ``sharded_dim`` (None:
    ``t`` is whole): when the amax reduces that dim, the local amax is all-reduced (MAX)."""
    if cc.scaling_type is ScalingType.DISABLED:
        return t
    granularity = cc.scaling_granularity
    dim = get_maybe_axiswise_dim(axiswise_dim, granularity)
    spans = sharded_dim is not None and (
        granularity is ScalingGranularity.TENSORWISE or dim % t.ndim == sharded_dim
    )
    round_pow2 = call.config.round_scales_to_power_of_2
    if not spans or call.world == 1:
        return hp_tensor_to_float8_dynamic(
            t,
            cc.target_dtype,
            call.mm,
            gemm_input_role=role,
            scaling_granularity=granularity,
            axiswise_dim=dim,
            round_scales_to_power_of_2=round_pow2,
        )
    amax = tensor_to_amax(t, scaling_granularity=granularity, axiswise_dim=dim)
    if call.impl is None:  # traced: the op counts itself when the graph runs
        amax = scaled_compiled.amax_all_reduce(amax, *call.op_args(phase))
    else:
        record(phase, "amax_all_reduce", call.impl.name, sent_bytes=amax.nbytes)
        deadline.complete(
            lambda: dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=call.group, async_op=True),
            call.group,
            "amax all-reduce",
            amax.device,
        )
    scale = amax_to_scale(amax, cc.target_dtype, round_scales_to_power_of_2=round_pow2)
    return hp_tensor_and_scale_to_float8(t, scale, cc.target_dtype, call.mm, role, dim)


def _operands(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The fp8 data and dequant scales (``_scaled_mm``'s: torchao takes the reciprocal of its
    scales) of torchao's GEMM of Float8TrainingTensors ``a @ b``, as torchao prepares them (a
    tensor-wise scale beside a row-wise one repeated along its axis)."""
    a_data, a_scale, b_data, b_scale = preprocess_addmm(a, b)
    return a_data, a_scale.reciprocal(), b_data, b_scale.reciprocal()


class _PendingCast(NamedTuple):
    """A cast operand whose shard's bytes are being gathered (rows first): :meth:`wait` gives
    the gathered operand as torchao's tensor (or the high-precision one)."""

    pending: object
    like: torch.Tensor

    def wait(self) -> torch.Tensor:
        gathered = self.pending.wait()
        if not isinstance(self.like, Float8TrainingTensor):
            return gathered
        like = self.like
        return Float8TrainingTensor(
            gathered.view(like._data.dtype),
            like._scale,
            like._orig_dtype,
            like._linear_mm_config,
            like._gemm_input_role,
            like._axiswise_dim,
        )


def _gather_cast(
    shard: torch.Tensor, cc, role: GemmInputRole, call: _Call, *, phase: str
) -> _PendingCast:
    """Start gathering ``shard`` (rows of a tensor sharded on dim 0) cast for ``cc`` along dim
    0 (its amax over the gathered rows: all-reduced), as fp8 bytes (high precision when the cast
    is disabled); the gather runs while the caller computes."""
    cast = _cast(shard, cc, 0, role, call, sharded_dim=0, phase=phase)
    data = cast._data.view(torch.uint8) if isinstance(cast, Float8TrainingTensor) else cast
    data = data.contiguous()
    if call.impl is None:  # traced: gathered at once (a custom op returns a finished tensor)
        return _PendingCast(
            _Gathered(scaled_compiled.scaled_all_gather(data, *call.op_args(phase))), cast
        )
    record(phase, "all_gather", call.impl.name, sent_bytes=gather_bytes(data, call.group))
    return _PendingCast(call.impl.all_gather_async(data, call.group), cast)


class _Gathered(NamedTuple):
    """A gather already done (the traced path's), waited on as a pending one."""

    out: torch.Tensor

    def wait(self) -> torch.Tensor:
        return self.out


def _gather_scaled(call: _Call, a, a_scale, bs, b_scales, *, fast_accum: bool, out_dtype,
                   phase: str) -> list[torch.Tensor]:  # fmt: skip
    """:func:`gather_scaled` with torchao's block product, on ``call``'s backend (traced: its
    custom op)."""
    if call.impl is None:
        return scaled_compiled.scaled_all_gather_matmul(
            a, a_scale, list(bs), list(b_scales), out_dtype, fast_accum, True,
            *call.op_args(phase),
        )  # fmt: skip
    return gather_scaled(call.impl, call.group, a, a_scale, bs, b_scales, out_dtype=out_dtype,
                         fast_accum=fast_accum, phase=phase, post_scale=True)  # fmt: skip


def _reduce_scatter_scaled(call: _Call, a, a_scale, b, b_scale, *, fast_accum: bool, out_dtype,
                           phase: str, addend=None) -> torch.Tensor:  # fmt: skip
    """:func:`reduce_scatter_scaled` with torchao's block product, on ``call``'s backend
    (traced: its custom op)."""
    if call.impl is None:
        return scaled_compiled.scaled_matmul_reduce_scatter(
            a, a_scale, b, b_scale, addend, out_dtype, fast_accum, True, *call.op_args(phase)
        )
    return reduce_scatter_scaled(call.impl, call.group, a, a_scale, b, b_scale,
                                 out_dtype=out_dtype, fast_accum=fast_accum, phase=phase,
                                 addend=addend, post_scale=True)  # fmt: skip


class Float8ColwiseLinears(torch.autograd.Function):
    """``apply(call, x, *weights, *biases)`` -> ``y_j = Float8Linear_j(all_gather(x))`` for the
    ``call.num_linears`` Linears (weights ``[N_j, K]``, biases ``[N_j]`` or None; local or
    DTensor), laid out as ``x`` with the gathered dim ``W`` times longer. See the module
    docstring's first table."""

    @staticmethod
    def forward(ctx, call: _Call, x, *params):
        n = call.num_linears
        weights = [plain_param(w) for w in params[:n]]
        biases = params[n:]
        rows, lead = flatten_rows(local_tensor(x), call.dim)
        rows = rows.contiguous()
        c = call.config
        x8 = _cast(rows, c.cast_config_input, -1, GemmInputRole.INPUT, call,
                   sharded_dim=0, phase="forward")  # fmt: skip
        w8s = [
            _cast(
                w.t(),
                c.cast_config_weight,
                0,
                GemmInputRole.WEIGHT,
                call,
                sharded_dim=1,
                phase="forward",
            )  # fmt: skip
            for w in weights
        ]
        operands = [_operands(x8, w8) for w8 in w8s]
        a, a_scale = operands[0][:2]
        outs = _gather_scaled(
            call,
            a,
            a_scale,
            [b for _, _, b, _ in operands],
            [b_scale for _, _, _, b_scale in operands],
            out_dtype=rows.dtype,
            fast_accum=call.mm.output.use_fast_accum,
            phase="forward",
        )
        outs = [out if b is None else out + plain_param(b).to(out.dtype)
                for out, b in zip(outs, biases)]  # fmt: skip
        need = ctx.needs_input_grad
        ctx.call, ctx.lead, ctx.specs = call, lead, dtensor_specs(x, *params)
        ctx.need_x, ctx.need_w, ctx.need_bias = need[1], need[2 : 2 + n], need[2 + n :]
        ctx.save_for_backward(rows if any(ctx.need_w) else None,
                              *(weights if ctx.need_x else ()))  # fmt: skip
        ctx.set_materialize_grads(False)
        gathered_lead = (call.world * lead[0], *lead[1:])
        return tuple(unflatten_rows(out, gathered_lead, call.dim) for out in outs)

    @staticmethod
    def backward(ctx, *grads):
        call, c = ctx.call, ctx.call.config
        rows, *weights = ctx.saved_tensors
        used = [j for j, g in enumerate(grads) if g is not None]
        gs = {j: flatten_rows(grads[j], call.dim)[0].contiguous() for j in used}
        need_w = [j for j in used if ctx.need_w[j]]
        gathered_x = None
        if need_w:  # gathered while the input grad's reduce-scatter runs
            gathered_x = _gather_cast(rows, c.cast_config_input_for_grad_weight,
                                      GemmInputRole.INPUT, call, phase="backward")  # fmt: skip
        grad_x = None
        if ctx.need_x and used:
            grad_x = _colwise_dgrad(call, [gs[j] for j in used], [weights[j] for j in used])
            grad_x = unflatten_rows(grad_x, ctx.lead, call.dim)
        grad_w = [None] * call.num_linears
        if need_w:
            a = gathered_x.wait()
            for j in need_w:
                g = _cast(gs[j], c.cast_config_grad_output_for_grad_weight, 0,
                          GemmInputRole.GRAD_OUTPUT, call, sharded_dim=1,
                          phase="backward")  # fmt: skip
                grad_w[j] = torch.mm(g.t(), a)
        grad_b = [gs[j].sum(0) if j in gs and need else None
                  for j, need in enumerate(ctx.need_bias)]  # fmt: skip
        return None, *map(as_grad, (grad_x, *grad_w, *grad_b), ctx.specs)


def _colwise_dgrad(
    call: _Call, grad_outs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]
) -> torch.Tensor:
    """``reduce_scatter(sum_j dY_j @ w_j)`` [m, K] with torchao's casts: the first Linear's
    product in the fused call, the others' (local GEMMs) added to it before the scatter."""
    c = call.config
    products = []
    for g, w in zip(grad_outs, weights):
        g8 = _cast(g, c.cast_config_grad_output, -1, GemmInputRole.GRAD_OUTPUT, call,
                   sharded_dim=1, phase="backward")  # fmt: skip
        w8 = _cast(w.t(), c.cast_config_weight_for_grad_input, -1, GemmInputRole.WEIGHT, call,
                   sharded_dim=1, phase="backward")  # fmt: skip
        products.append((g8, w8.t()))
    addend = None
    for g8, w8_t in products[1:]:
        product = torch.mm(g8, w8_t)
        addend = product if addend is None else addend + product
    g8, w8_t = products[0]
    a, a_scale, b, b_scale = _operands(g8, w8_t)
    return _reduce_scatter_scaled(
        call,
        a,
        a_scale,
        b,
        b_scale,
        out_dtype=grad_outs[0].dtype,
        fast_accum=call.mm.grad_input.use_fast_accum,
        phase="backward",
        addend=addend,
    )


BIAS_SUM_BYTES = torch.float32.itemsize  # a rank's column sum of dY, gathered by bias_grad


def bias_grad(call, grad_rows: torch.Tensor) -> torch.Tensor:
    """``d bias [N]`` of a rowwise Linear whose output is scattered: the sum of every rank's rows
    of ``dY`` (``grad_rows``, this rank's). Each rank's fp32 column sums are gathered (one
    ``[W, N]`` gather) and added in rank order, so every rank holds the same replicated grad.
    ``call``: this module's or :mod:`tp_kernels.mxfp8`'s (its ``impl`` and ``group``; traced
    when ``impl`` is None)."""
    partial = grad_rows.float().sum(0, keepdim=True)
    if call.impl is None:
        sums = scaled_compiled.scaled_all_gather(partial, *call.op_args("backward"))
    else:
        sent = gather_bytes(partial, call.group)
        record("backward", "all_gather", call.impl.name, sent_bytes=sent)
        sums = call.impl.all_gather_async(partial, call.group).wait()
    return sums.sum(0).to(grad_rows.dtype)


class Float8RowwiseLinear(torch.autograd.Function):
    """``apply(call, x, weight, bias)`` -> this rank's rows (along ``call.dim``) of
    ``Float8Linear(x)`` summed over the group, plus ``bias``: ``x [..., K_r]`` sharded on its
    last dim (``weight [N, K_r]``, local or DTensor; ``bias [N]``, replicated, or None), the
    result ``[..., s, ..., N]`` with ``s`` the scattered dim's size over ``W``. See the module
    docstring's second table."""

    @staticmethod
    def forward(ctx, call: _Call, x, weight, bias):
        w = plain_param(weight)
        rows, lead = flatten_rows(local_tensor(x), call.dim)
        rows = rows.contiguous()
        c = call.config
        x8 = _cast(rows, c.cast_config_input, -1, GemmInputRole.INPUT, call,
                   sharded_dim=1, phase="forward")  # fmt: skip
        w8 = _cast(w.t(), c.cast_config_weight, 0, GemmInputRole.WEIGHT, call,
                   sharded_dim=0, phase="forward")  # fmt: skip
        a, a_scale, b, b_scale = _operands(x8, w8)
        out = _reduce_scatter_scaled(
            call,
            a,
            a_scale,
            b,
            b_scale,
            out_dtype=rows.dtype,
            fast_accum=call.mm.output.use_fast_accum,
            phase="forward",
        )
        if bias is not None:  # added once, after the sum
            out = out + plain_param(bias).to(out.dtype)
        need = ctx.needs_input_grad
        ctx.call, ctx.lead, ctx.specs = call, lead, dtensor_specs(x, weight, bias)
        ctx.need_x, ctx.need_w, ctx.need_bias = need[1], need[2], need[3]
        ctx.save_for_backward(rows if ctx.need_w else None, w if ctx.need_x else None)
        return unflatten_rows(out, (lead[0] // call.world, *lead[1:]), call.dim)

    @staticmethod
    def backward(ctx, grad):
        call, c = ctx.call, ctx.call.config
        rows, w = ctx.saved_tensors
        g = flatten_rows(grad, call.dim)[0].contiguous()
        gathered_g = None
        if ctx.need_w:  # gathered while the input grad's fused call runs
            cc = c.cast_config_grad_output_for_grad_weight
            gathered_g = _gather_cast(g, cc, GemmInputRole.GRAD_OUTPUT, call, phase="backward")
        grad_x = grad_w = None
        if ctx.need_x:
            g8 = _cast(g, c.cast_config_grad_output, -1, GemmInputRole.GRAD_OUTPUT, call,
                       sharded_dim=0, phase="backward")  # fmt: skip
            w8 = _cast(w.t(), c.cast_config_weight_for_grad_input, -1, GemmInputRole.WEIGHT,
                       call, sharded_dim=0, phase="backward")  # fmt: skip
            a, a_scale, b, b_scale = _operands(g8, w8.t())
            (grad_rows,) = _gather_scaled(
                call,
                a,
                a_scale,
                [b],
                [b_scale],
                out_dtype=g.dtype,
                fast_accum=call.mm.grad_input.use_fast_accum,
                phase="backward",
            )
            grad_x = unflatten_rows(grad_rows, ctx.lead, call.dim)
        if ctx.need_w:
            x8 = _cast(rows, c.cast_config_input_for_grad_weight, 0, GemmInputRole.INPUT, call,
                       sharded_dim=1, phase="backward")  # fmt: skip
            grad_w = torch.mm(gathered_g.wait().t(), x8)
        grad_b = bias_grad(call, g) if ctx.need_bias else None
        return None, *map(as_grad, (grad_x, grad_w, grad_b), ctx.specs)


def call_for(
    modules: Sequence[nn.Module],
    x: torch.Tensor,
    dim: int,
    group: dist.ProcessGroup,
    backend: str | None,
    *,
    colwise: bool,
) -> _Call:
    """The :class:`_Call` of fused fp8 Linears ``modules`` (sharing one config) on the local
    ``x`` with its gathered or scattered ``dim``."""
    config, mm = configs(modules[0])
    k = x.shape[-1]
    m = x.numel() // k if colwise else x.numel() // k // group.size()
    ns = [local_tensor(mod.weight).shape[0] for mod in modules]
    out_dtype = x.dtype
    op = "scaled_all_gather_matmul" if colwise else "scaled_matmul_reduce_scatter"

    def needs() -> list[CaptureNeed]:
        grad_x = requires_grad([x])
        grad_w = requires_grad([mod.weight for mod in modules])
        grad_b = not colwise and requires_grad([mod.bias for mod in modules])
        return _capture_needs(config, colwise, m, k, max(ns), out_dtype, group.size(),
                              grad_x=grad_x, grad_w=grad_w, grad_b=grad_b)  # fmt: skip

    world = group.size()
    if torch.compiler.is_compiling():
        # Nothing is chosen while tracing (the backend registry's state is not traceable): the
        # custom ops resolve the backend by the call's key when the graph runs.
        name = check_backend_name(backend, argument="backend") if backend is not None else ""
        key = (op, [m, k, *ns], out_dtype)
        return _Call(None, group, dim, config, mm, len(modules), world,
                     group.group_name, name, key)  # fmt: skip
    impl = scaled_backend(backend, group, op, m, k, ns, out_dtype, x.device, needs)
    return _Call(impl, group, dim, config, mm, len(modules), world)


def _capture_needs(
    c: Float8LinearConfig, colwise: bool, m: int, k: int, n: int, out_dtype: torch.dtype,
    world: int, *, grad_x: bool, grad_w: bool, grad_b: bool,
) -> list[CaptureNeed]:  # fmt: skip
    """What a fused fp8 call and the backward parts autograd will run for it need of a backend
    under CUDA graph capture (``m`` local rows, ``K`` the input's features, ``n`` the widest
    output): the gather of fp8 rows (``+16`` bytes a row where each carries its scale), the
    reduce-scatter of ``[W*m, .]`` ``out_dtype`` partials, the wgrad operand's re-gather
    (fp8 bytes, or high precision where the recipe disables that cast) and the rowwise bias
    grad's gather of ``[N]`` fp32 sums (:func:`bias_grad`)."""

    def row_bytes(width: int, cc) -> int:
        rowwise = cc.scaling_granularity is ScalingGranularity.AXISWISE
        return width + ROW_SCALE_BYTES if rowwise else width

    def wgrad_bytes(width: int, cc) -> int:
        hp = cc.scaling_type is ScalingType.DISABLED
        return m * width * (out_dtype.itemsize if hp else 1)

    fp8 = c.cast_config_input.target_dtype
    product = world * m * out_dtype.itemsize
    if colwise:  # forward gather of x [m, K]; dgrad scatter of [W*m, K]; x re-gathered
        needs = [CaptureNeed("all_gather_matmul", m * row_bytes(k, c.cast_config_input), fp8)]
        if grad_x:
            needs.append(CaptureNeed("matmul_reduce_scatter", product * k, fp8))
        if grad_w:
            wgrad = wgrad_bytes(k, c.cast_config_input_for_grad_weight)
            needs.append(CaptureNeed("all_gather", wgrad, fp8))
        return needs
    # forward scatter of [W*m, N]; dgrad gather of dY [m, N]; dY re-gathered
    needs = [CaptureNeed("matmul_reduce_scatter", product * n, fp8)]
    if grad_x:
        dy_rows = m * row_bytes(n, c.cast_config_grad_output)
        needs.append(CaptureNeed("all_gather_matmul", dy_rows, fp8))
    if grad_w:
        wgrad = wgrad_bytes(n, c.cast_config_grad_output_for_grad_weight)
        needs.append(CaptureNeed("all_gather", wgrad, fp8))
    if grad_b:
        needs.append(CaptureNeed("all_gather", BIAS_SUM_BYTES * n, torch.float32))
    return needs
