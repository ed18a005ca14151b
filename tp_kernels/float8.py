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
compute on the unsharded tensor, and the fused ops run the GEMMs on them. The fused call
(:class:`_Call`) supplies these casts and GEMMs to the pattern's Function of
:mod:`tp_kernels.quantized_linears`:

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
from torchao.float8.config import CastConfig, Float8LinearConfig, ScalingGranularity, ScalingType
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
from tp_kernels.ops.comm_stats import gather_bytes, record
from tp_kernels.ops.dtensors import local_tensor
from tp_kernels.ops.scaled import gather_scaled, reduce_scatter_scaled, scaled_backend
from tp_kernels.quantized_linears import (
    BIAS_SUM_BYTES,
    GEMM_PHASE,
    Gemm,
    WgradOperand,
    call_shape,
    grads_needed,
)
from tp_kernels.tiling import ROW_SCALE_BYTES

__all__ = ["call_for", "configs", "unfusable_reason"]


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

    # The hooks of tp_kernels/quantized_linears.py's Functions (its QuantizedCall): torchao's
    # casts and GEMMs of Float8TrainingTensors (``matmul_with_hp_or_float8_args``).

    def cast_rows(self, rows: torch.Tensor, *, gemm: Gemm, sharded_dim: int) -> torch.Tensor:
        c = self.config
        if gemm == "forward":
            return _cast(rows, c.cast_config_input, -1, GemmInputRole.INPUT, self,
                         sharded_dim=sharded_dim, phase="forward")  # fmt: skip
        return _cast(rows, c.cast_config_grad_output, -1, GemmInputRole.GRAD_OUTPUT, self,
                     sharded_dim=sharded_dim, phase="backward")  # fmt: skip

    def cast_weight(self, w: torch.Tensor, *, gemm: Gemm, sharded_dim: int) -> torch.Tensor:
        # torchao casts w^T [K, N], sharded along w's other dim.
        c, w_t, sharded_t = self.config, w.t(), 1 - sharded_dim
        if gemm == "forward":
            return _cast(w_t, c.cast_config_weight, 0, GemmInputRole.WEIGHT, self,
                         sharded_dim=sharded_t, phase="forward")  # fmt: skip
        w8_t = _cast(w_t, c.cast_config_weight_for_grad_input, -1, GemmInputRole.WEIGHT, self,
                     sharded_dim=sharded_t, phase="backward")  # fmt: skip
        return w8_t.t()

    def gather_matmul(
        self, left: torch.Tensor, rights: list[torch.Tensor], *, gemm: Gemm
    ) -> list[torch.Tensor]:
        """:func:`gather_scaled` with torchao's product (traced: its custom op)."""
        operands = [_operands(left, right) for right in rights]
        a, a_scale = operands[0][:2]
        bs = [b for _, _, b, _ in operands]
        b_scales = [b_scale for _, _, _, b_scale in operands]
        out_dtype, fast_accum, phase = left._orig_dtype, self._fast_accum(gemm), GEMM_PHASE[gemm]
        if self.impl is None:
            return scaled_compiled.scaled_all_gather_matmul(
                a, a_scale, bs, b_scales, out_dtype, fast_accum, True, *self.op_args(phase)
            )
        return gather_scaled(self.impl, self.group, a, a_scale, bs, b_scales, out_dtype=out_dtype,
                             fast_accum=fast_accum, phase=phase, post_scale=True)  # fmt: skip

    def matmul_reduce_scatter(
        self, left: torch.Tensor, right: torch.Tensor, *, gemm: Gemm,
        addend: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """:func:`reduce_scatter_scaled` with torchao's product (traced: its custom op)."""
        a, a_scale, b, b_scale = _operands(left, right)
        out_dtype, fast_accum, phase = left._orig_dtype, self._fast_accum(gemm), GEMM_PHASE[gemm]
        if self.impl is None:
            return scaled_compiled.scaled_matmul_reduce_scatter(
                a, a_scale, b, b_scale, addend, out_dtype, fast_accum, True, *self.op_args(phase)
            )
        return reduce_scatter_scaled(self.impl, self.group, a, a_scale, b, b_scale,
                                     out_dtype=out_dtype, fast_accum=fast_accum, phase=phase,
                                     addend=addend, post_scale=True)  # fmt: skip

    def token_layout(self, t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return rows  # a per-column scale is the same in any order of the rows

    def start_wgrad_gather(self, t: torch.Tensor, *, operand: WgradOperand) -> _PendingCast:
        cc, role = self._wgrad_cast(operand)
        return _gather_cast(t, cc, role, self, phase="backward")

    def cast_for_wgrad(self, t: torch.Tensor, *, operand: WgradOperand) -> torch.Tensor:
        cc, role = self._wgrad_cast(operand)
        return _cast(t, cc, 0, role, self, sharded_dim=1, phase="backward")

    def weight_grad(self, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(grad.t(), x)

    def _fast_accum(self, gemm: Gemm) -> bool:
        return (self.mm.output if gemm == "forward" else self.mm.grad_input).use_fast_accum

    def _wgrad_cast(self, operand: WgradOperand) -> tuple[CastConfig, GemmInputRole]:
        c = self.config
        if operand == "input":
            return c.cast_config_input_for_grad_weight, GemmInputRole.INPUT
        return c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT


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
    world = group.size()
    op, m, k, ns = call_shape(modules, x, world, colwise=colwise)
    out_dtype = x.dtype

    def needs() -> list[CaptureNeed]:
        grads = grads_needed(modules, x, colwise=colwise)
        return _capture_needs(config, colwise, m, k, max(ns), out_dtype, world, **grads)

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
    grad's gather of ``[N]`` fp32 sums (:func:`tp_kernels.quantized_linears.bias_grad`)."""

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
