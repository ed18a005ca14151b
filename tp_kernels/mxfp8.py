"""torchao's MXFP8 Linears on the fused path: e4m3 bytes and their e8m0 block scales on the wire.

torchao's MXFP8 training (``torchao.prototype.moe_training``: ``MXFP8Linear``, and the weights
``quantize_(model, MXFP8TrainingOpConfig...)`` wraps in ``MXFP8TrainingWeightWrapperTensor``)
quantizes each operand of a Linear's three GEMMs in blocks of 32 elements along the GEMM's
reduction dim, one power-of-two (e8m0) scale per block (``mx_mm`` in
torchao/prototype/moe_training/mxfp8_linear.py). Under sequence parallelism every such block
lies within one rank's shard, so every cast is made on the shard with torchao's own functions
(``MXTensor.to_mx`` and its dim-1 cast, RCEIL or FLOOR as the recipe says) and no scale needs an
all-reduce:

=========================  ==================================================  =================
colwise (gathered input)   cast (blocks of 32 along)                           GEMM
=========================  ==================================================  =================
forward                    x [m, K]: K (the row: local); w [N, K]: K           fused all-gather-
                                                                               matmul: e4m3 rows
                                                                               + e8m0 scales
dgrad                      dY [W*m, N]: N (local); w: N                        fused matmul-
                                                                               reduce-scatter
                                                                               (partials hp)
wgrad                      dY: M (local); x: M, cast on the shard (whole        local GEMM on the
                           blocks when m % 32 == 0), its bytes gathered        gathered x
                           (``wgrad_with_hp``: hp x gathered, hp GEMM)
=========================  ==================================================  =================

=========================  ==================================================  =================
rowwise (scattered out)    cast                                                GEMM
=========================  ==================================================  =================
forward                    x [W*m, K_r]: K_r; w [N, K_r]: K_r                  fused matmul-
                                                                               reduce-scatter
dgrad                      dY [m, N]: N (local); w: N                          fused all-gather-
                                                                               matmul
wgrad                      dY: M, cast on the shard, its bytes gathered;       local GEMM on the
                           x: M (local)                                        gathered dY
=========================  ==================================================  =================

The fused call (:class:`_Call`) supplies these casts and GEMMs to the pattern's Function of
:mod:`tp_kernels.quantized_linears`. A gathered row moves ``K`` e4m3 bytes and ``K / 32`` scale
bytes, padded to 16 (:func:`tp_kernels.tiling.mx_row_bytes`: 0.52 of a bf16 row); a gather
along M moves each column's bytes and scales the same way. The GEMMs are torchao's:
``torch.mm`` of its ``MXTensor``\\ s, on the rows a backend hands over
(:class:`tp_kernels.backends.scaled.BlockScaling`), so on ``reference`` a fused call equals
torchao's unsharded Linear wherever the same rows meet the same GEMM (the reduce-scatter sums
partials in fp32 in rank order: within a rounding there).

What fuses (:func:`unfusable_reason`): block size 32, e4m3 elements, every shard a whole number
of 32-token blocks (``m % 32 == 0``; else the call takes PyTorch's path, counted: padding would
move and cast rows torchao never sees), the features a multiple of 32 (torchao's own
requirement), eagerly (under torch.compile or a dispatch mode PyTorch's path runs, counted), on a
backend that takes block scales (``torch_symm_mem`` does not: named, the call falls back; under
``auto`` the next backend of its ranking runs it).

Under PyTorch's own styles, ``quantize_``'s wrapped weights become DTensors whose local tensor
is the wrapper: DTensor dispatches below ``__torch_function__``, where the wrapper's matmul
override lives, so those Linears run in high precision there (measured with torchao 0.18). The
fused path quantizes them as torchao does on one GPU, so it is compared with the unsharded model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor
from torchao.prototype.mx_formats.config import (
    MXFP8Dim0CastKernelChoice,
    MXFP8Dim1CastKernelChoice,
    ScaleCalculationMode,
)
from torchao.prototype.mx_formats.mx_tensor import MXTensor
from torchao.prototype.mx_formats.utils import _to_mxfp8_dim1_kernel_wrapper
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

from tp_kernels.backends.base import Backend, CaptureNeed
from tp_kernels.backends.choice import current_backend, get_backend
from tp_kernels.backends.scaled import BlockScaling, pack_mx_rows, unpack_mx_rows
from tp_kernels.ops.comm_stats import gather_bytes, record
from tp_kernels.ops.dtensors import local_tensor
from tp_kernels.ops.scaled import run_gather, run_reduce_scatter, scaled_backend
from tp_kernels.quantized_linears import (
    BIAS_SUM_BYTES,
    GEMM_PHASE,
    Gemm,
    WgradOperand,
    call_shape,
    grads_needed,
)
from tp_kernels.tiling import MX_BLOCK, mx_row_bytes

__all__ = [
    "Recipe",
    "all_gather_mx_matmul",
    "call_for",
    "cast_rows",
    "mx_matmul_reduce_scatter",
    "recipe_of",
    "unfusable_reason",
]

_E4M3 = torch.float8_e4m3fn


class Recipe(NamedTuple):
    """What an MXFP8 Linear's casts and GEMMs are (torchao's ``mx_mm`` arguments that vary)."""

    kernel_preference: KernelPreference
    scaling_mode: ScaleCalculationMode
    wgrad_with_hp: bool


def _weight(module: nn.Module) -> torch.Tensor:
    return local_tensor(module.weight)


def recipe_of(module: nn.Module) -> Recipe | None:
    """The recipe of an MXFP8 Linear (torchao's ``MXFP8Linear``, or an ``nn.Linear`` whose weight
    ``quantize_`` wrapped for MXFP8 training), else None."""
    if isinstance(module, MXFP8Linear):
        return Recipe(module.kernel_preference, module.scale_calculation_mode,
                      module.wgrad_with_hp)  # fmt: skip
    weight = _weight(module)
    if isinstance(weight, MXFP8TrainingWeightWrapperTensor):
        c = weight.config
        return Recipe(c.kernel_preference, c.scale_calculation_mode, c.wgrad_with_hp)
    return None


def unfusable_reason(module: nn.Module) -> str | None:
    """Why ``module`` (an MXFP8 Linear) never takes the fused MXFP8 path, or None."""
    if recipe_of(module) is None:
        return f"{type(module).__qualname__} is not an MXFP8 Linear torchao's recipes make"
    # A subclass that keeps torchao's forward (torchtitan 0.3's MXFP8Linear) computes the same.
    if type(module).forward not in (nn.Linear.forward, MXFP8Linear.forward):
        return "a Linear subclass with its own forward is never fused"
    k = _weight(module).shape[1]
    if k % MX_BLOCK:
        return f"its input features ({k}) are not a multiple of the MX block ({MX_BLOCK})"
    return None


def call_unfusable_reason(
    modules: Sequence[nn.Module], x: torch.Tensor, dim: int, backend: str | None, world: int,
    *, colwise: bool,
) -> str | None:  # fmt: skip
    """Why this call (local ``x``, gathered or scattered along ``dim``) of MXFP8 Linears
    ``modules`` takes PyTorch's path, or None."""
    _, run = _tokens(x, dim)
    if not colwise:  # x holds every rank's tokens; its output shard's are gathered in backward
        run //= world
    if run % MX_BLOCK:
        return (f"its shard holds runs of {run} consecutive tokens, not whole MX blocks of "
                f"{MX_BLOCK} (the weight grad's cast along them would span ranks)")  # fmt: skip
    widths = [_weight(mod).shape[0] for mod in modules] + [x.shape[-1]]
    if any(n % MX_BLOCK for n in widths):
        return f"a GEMM dim of {widths} is not a multiple of the MX block ({MX_BLOCK})"
    name = backend if backend is not None else current_backend()
    if name != "auto":
        why = get_backend(name).block_scales_reason
        if why is not None:
            return f"backend={name!r}: {why}"
    return None


class _Call(NamedTuple):
    """One fused MXFP8 call: its backend, group and size, the gathered (colwise) or scattered
    (rowwise) ``dim`` of ``x``, the Linears' recipe (one for all of them) and how many Linears
    share the gathered input (colwise)."""

    impl: Backend
    group: dist.ProcessGroup
    world: int
    dim: int
    recipe: Recipe
    num_linears: int

    # The hooks of tp_kernels/quantized_linears.py's Functions (its QuantizedCall): torchao's
    # ``mx_mm`` casts and GEMMs of MXTensors, every cast on the shard.

    def cast_rows(self, rows: torch.Tensor, *, gemm: Gemm, sharded_dim: int) -> MXTensor:
        return cast_rows(rows, self.recipe)  # blocks along the row: never across ranks

    def cast_weight(self, w: torch.Tensor, *, gemm: Gemm, sharded_dim: int) -> MXTensor:
        if gemm == "forward":
            return cast_rows(w, self.recipe).t()
        return _dim1(w, self.recipe).t()

    def gather_matmul(self, left: MXTensor, rights: list[MXTensor], *, gemm: Gemm) -> list:
        return _gather(self.impl, self.group, left, rights, phase=GEMM_PHASE[gemm])

    def matmul_reduce_scatter(
        self, left: MXTensor, right: MXTensor, *, gemm: Gemm, addend: torch.Tensor | None = None
    ) -> torch.Tensor:
        return _reduce_scatter(self.impl, self.group, left, right, phase=GEMM_PHASE[gemm],
                               addend=addend)  # fmt: skip

    def token_layout(self, t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return t  # torchao's token order, and the runs of it this rank holds, are t's layout

    def start_wgrad_gather(self, t: torch.Tensor, *, operand: WgradOperand) -> _PendingTokens:
        return _gather_tokens(self, t, phase="backward")

    def cast_for_wgrad(self, t: torch.Tensor, *, operand: WgradOperand) -> torch.Tensor:
        return _token_cast(t.reshape(-1, t.shape[-1]).contiguous(), self.recipe)

    def weight_grad(self, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return _wgrad(grad, x, self.recipe)


def call_for(
    modules: Sequence[nn.Module],
    x: torch.Tensor,
    dim: int,
    group: dist.ProcessGroup,
    backend: str | None,
    *,
    colwise: bool,
) -> _Call:
    """The :class:`_Call` of fused MXFP8 Linears ``modules`` on the local ``x``."""
    recipe = recipe_of(modules[0])
    world = group.size()
    op, m, k, ns = call_shape(modules, x, world, colwise=colwise)

    def needs() -> list[CaptureNeed]:
        grads = grads_needed(modules, x, colwise=colwise)
        return _capture_needs(recipe, colwise, m, k, max(ns), x.dtype, world, **grads)

    impl = scaled_backend(backend, group, op, m, k, ns, x.dtype, x.device, needs,
                          block_scaled=True)  # fmt: skip
    return _Call(impl, group, world, dim, recipe, len(modules))


def _capture_needs(
    recipe: Recipe, colwise: bool, m: int, k: int, n: int, out_dtype: torch.dtype, world: int,
    *, grad_x: bool, grad_w: bool, grad_b: bool,
) -> list[CaptureNeed]:  # fmt: skip
    """What a fused MXFP8 call and the backward parts autograd will run for it need of a backend
    under CUDA graph capture (``m`` local tokens, ``K`` the input's features, ``n`` the widest
    output): the gathers of packed rows, the reduce-scatters of ``[W*m, .]`` partials, the weight
    grad operand's gather along the tokens (``C`` rows of ``m`` tokens packed, or ``m`` high
    precision rows) and the rowwise bias grad's sums."""

    def tokens(width: int) -> int:
        if recipe.wgrad_with_hp:
            return m * width * out_dtype.itemsize
        return width * mx_row_bytes(m)

    def _mx_gemm(op: str, nbytes: int) -> CaptureNeed:
        return CaptureNeed(op, nbytes, _E4M3, block_scaled=True)

    product = world * m * out_dtype.itemsize
    if colwise:  # forward gather of x [m, K]; dgrad scatter of [W*m, K]; x gathered for wgrad
        needs = [_mx_gemm("all_gather_matmul", m * mx_row_bytes(k))]
        if grad_x:
            needs.append(_mx_gemm("matmul_reduce_scatter", product * k))
        if grad_w:
            needs.append(CaptureNeed("all_gather", tokens(k), _E4M3))
        return needs
    # forward scatter of [W*m, N]; dgrad gather of dY [m, N]; dY gathered for wgrad
    needs = [_mx_gemm("matmul_reduce_scatter", product * n)]
    if grad_x:
        needs.append(_mx_gemm("all_gather_matmul", m * mx_row_bytes(n)))
    if grad_w:
        needs.append(CaptureNeed("all_gather", tokens(n), _E4M3))
    if grad_b:
        needs.append(CaptureNeed("all_gather", BIAS_SUM_BYTES * n, torch.float32))
    return needs


# torchao's mx_mm casts dim-0 operands with its Triton kernel (the torch cast where emulated)
# and dim-1 operands with its CUDA kernel.
_DIM0_KERNEL = MXFP8Dim0CastKernelChoice.TRITON
_DIM1_KERNEL = MXFP8Dim1CastKernelChoice.CUDA


def cast_rows(t: torch.Tensor, recipe: Recipe) -> MXTensor:
    """``t`` cast in blocks along its last dim, as torchao's ``mx_mm`` casts its dim-0 operands."""
    return MXTensor.to_mx(t, _E4M3, MX_BLOCK, recipe.scaling_mode, recipe.kernel_preference,
                          mxfp8_dim0_cast_kernel_choice=_DIM0_KERNEL)  # fmt: skip


def _dim1(t: torch.Tensor, recipe: Recipe) -> MXTensor:
    """``t.t()`` cast in blocks along ``t``'s first dim (``[cols, rows]``), as torchao's
    ``mx_mm`` casts its dim-1 operands: the torch cast where emulated, its CUDA kernel else."""
    kp, mode = recipe.kernel_preference, recipe.scaling_mode
    if kp == KernelPreference.EMULATED:
        return MXTensor.to_mx(t.t().contiguous(), _E4M3, MX_BLOCK, mode, kp,
                              mxfp8_dim0_cast_kernel_choice=_DIM0_KERNEL)  # fmt: skip
    return _to_mxfp8_dim1_kernel_wrapper(t, MX_BLOCK, _E4M3, t.dtype, kp, _DIM1_KERNEL, mode)


def _token_cast(t: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """A weight grad's operand ``t [M, C]``: ``t`` itself under ``wgrad_with_hp``, else
    :func:`_dim1`'s ``[C, M]`` cast along the tokens."""
    return t if recipe.wgrad_with_hp else _dim1(t, recipe)


def _wgrad(grad: torch.Tensor, x: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """``dY^T @ x`` [N, K] as torchao's ``mx_mm`` makes the weight grad, from
    :func:`_token_cast`'s forms of ``dY [M, N]`` and ``x [M, K]``."""
    return torch.mm(grad.t(), x) if recipe.wgrad_with_hp else torch.mm(grad, x.t())


def _like(data: torch.Tensor, scale: torch.Tensor, like: MXTensor) -> MXTensor:
    """An MXTensor of ``data`` and ``scale`` (rows of ``like``, or its gathered form) cast as
    ``like`` is."""
    return MXTensor(data, scale, like.elem_dtype, like.block_size, like.orig_dtype,
                    like.kernel_preference, None, False)  # fmt: skip


def _products(
    left: MXTensor, rights: Sequence[MXTensor], a_scale: torch.Tensor | None = None
) -> BlockScaling:
    """The backends' face of torchao's GEMMs ``rows of left @ rights[j]`` (``rights[j]`` an
    ``[K, N_j]`` MXTensor), for rows handed over as their e4m3 data and e8m0 scales (packed
    rows, or ``a_scale`` beside a reduce-scatter's ``a``); with each right-hand side's scales
    as the Triton GEMMs take them, ``[N_j, K / 32]`` (an ``[K, N_j]`` MXTensor is the
    transpose of a cast along K: its scales transposed back are that cast's, a view of
    contiguous memory)."""

    def product(right: MXTensor):
        return lambda data, scale: torch.mm(_like(data, scale, left), right)

    return BlockScaling(
        a_scale,
        tuple(product(r) for r in rights),
        tuple(r.scale.t().contiguous() for r in rights),
        left.orig_dtype,
    )


def _gather(
    impl: Backend, group: dist.ProcessGroup, x: MXTensor, rights: Sequence[MXTensor], *, phase: str
) -> list:
    """``[gathered rows of x @ rights[j]]``: the fused all-gather-matmul of ``x``'s packed rows."""
    shard = pack_mx_rows(x.qdata, x.scale)
    bs = [r.qdata for r in rights]
    return run_gather(impl, group, shard, bs, _products(x, rights), phase=phase)


def _reduce_scatter(
    impl: Backend, group: dist.ProcessGroup, x: MXTensor, right: MXTensor, *, phase: str,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """This rank's rows of the sum over ranks of ``x @ right (+ addend)``: the fused
    matmul-reduce-scatter."""
    scaling = _products(x, [right], x.scale)
    return run_reduce_scatter(impl, group, x.qdata, right.qdata, scaling, phase=phase,
                              addend=addend)  # fmt: skip


def all_gather_mx_matmul(
    x: MXTensor, rights: Sequence[MXTensor], group: dist.ProcessGroup, *,
    backend: str | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """``[all_gather(x) @ rights[j]]`` ``[W*m, N_j]`` of ready MXFP8 operands: this rank's rows
    ``x [m, K]`` (:func:`cast_rows`) and ``rights[j] [K, N_j]`` (a weight ``[N_j, K]`` cast by
    :func:`cast_rows`, transposed): the colwise forward's fused call (counted under "forward"),
    on ``backend`` or the one in force, by the block-scaled rule of
    :func:`tp_kernels.ops.scaled.scaled_backend`."""
    m, k = x.qdata.shape
    ns = [r.qdata.shape[1] for r in rights]
    impl = scaled_backend(backend, group, "scaled_all_gather_matmul", m, k, ns, x.orig_dtype,
                          x.qdata.device, block_scaled=True)  # fmt: skip
    return _gather(impl, group, x, rights, phase="forward")


def mx_matmul_reduce_scatter(
    x: MXTensor, right: MXTensor, group: dist.ProcessGroup, *, backend: str | None = None
) -> torch.Tensor:
    """This rank's ``[m, N]`` rows of the sum over ranks of ``x [W*m, K] @ right [K, N]`` of
    ready MXFP8 operands (as :func:`all_gather_mx_matmul`'s): the rowwise forward's fused call
    (counted under "forward")."""
    rows, k = x.qdata.shape
    n = right.qdata.shape[1]
    impl = scaled_backend(backend, group, "scaled_matmul_reduce_scatter", rows // group.size(), k,
                          [n], x.orig_dtype, x.qdata.device, block_scaled=True)  # fmt: skip
    return _reduce_scatter(impl, group, x, right, phase="forward")


def _tokens(t: torch.Tensor, dim: int) -> tuple[int, int]:
    """``(outer, run)`` of a token tensor ``t`` (``[..., C]``, sharded on ``dim``) in torchao's
    order, the row-major flattening ``t.reshape(-1, C)``: ``outer`` runs of ``run`` consecutive
    tokens, each run within this rank's shard."""
    outer = math.prod(t.shape[:dim])
    return outer, t.numel() // t.shape[-1] // outer


class _PendingTokens(NamedTuple):
    """A weight grad operand's gather along the tokens, in flight (:func:`_gather_tokens`):
    ``like`` is this rank's cast ``[C, outer*run]`` (its rows packed), or None for high
    precision ``[outer*run, C]`` rows."""

    pending: object
    like: MXTensor | None
    world: int
    outer: int

    def wait(self) -> torch.Tensor:
        """The gathered operand in torchao's token order (every rank's run of each outer index
        side by side): ``[outer*W*run, C]``, or the MXTensor ``[C, outer*W*run]``."""
        gathered = self.pending.wait()
        w, outer = self.world, self.outer
        if self.like is None:
            c = gathered.shape[-1]
            return gathered.view(w, outer, -1, c).transpose(0, 1).reshape(-1, c)
        rows, cols = self.like.qdata.shape
        data, scale = unpack_mx_rows(gathered, cols)

        def in_order(t: torch.Tensor) -> torch.Tensor:  # [W*C, outer*r] -> [C, outer*W*r]
            return t.view(w, rows, outer, -1).permute(1, 2, 0, 3).reshape(rows, -1)

        return _like(in_order(data), in_order(scale), self.like)


def _gather_tokens(call: _Call, t: torch.Tensor, *, phase: str) -> _PendingTokens:
    """Start gathering the token tensor ``t`` (``[..., C]``, this rank's shard along
    ``call.dim``) as a weight grad's operand: :func:`_token_cast` of the gathered tokens in
    torchao's order, cast on the shard (each block of 32 tokens lies in one run of the shard:
    :func:`call_unfusable_reason`), its bytes and scales gathered; high precision under
    ``wgrad_with_hp``. Runs while the caller computes."""
    outer, _ = _tokens(t, call.dim)
    flat = t.reshape(-1, t.shape[-1]).contiguous()
    cast = _token_cast(flat, call.recipe)
    like = None if cast is flat else cast
    data = flat if like is None else pack_mx_rows(like.qdata.contiguous(), like.scale.contiguous())
    record(phase, "all_gather", call.impl.name, sent_bytes=gather_bytes(data, call.group))
    return _PendingTokens(call.impl.all_gather_async(data, call.group), like, call.world, outer)
