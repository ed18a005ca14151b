"""The scaled cases of the op benchmarks: ``--dtype fp8-rowwise`` / ``fp8-tensorwise`` (issue 27)
and ``--dtype mxfp8`` (issue 36), one code by operand kind (:class:`_Fp8Operands`,
:class:`_MXOperands`).

On each rank ``r`` of ``W`` (``K`` and ``N`` multiples of 16, which ``torch._scaled_mm`` needs and
the CLI checks), with ``cast`` torchao's dynamic cast to ``float8_e4m3fn`` (``x8 = x * s``,
saturated; dequant scale ``1/s``) for the recipe: one scale per row of ``A`` and per column of
``B`` (``rowwise``, power-of-two scales) or one each (``tensorwise``), amaxes taken over the
whole (unsharded) tensor, as DTensor does under PyTorch's styles::

    ag_matmul:  A [M, K] bf16 (the same on every rank), B [K, N] bf16
                a8_r, a_scale_r = rows r of cast(A)       [M/W, K] e4m3, [M/W, 1] or []
                b8, b_scale     = cast(B)                 [K, N] e4m3,   [1, N] or []
                out = _scaled_mm(all_gather(a8_r), b8, all_gather(a_scale_r), b_scale)  [M, N]
    matmul_rs:  A_r [M, K], B_r [K, N] bf16 (different on every rank: rank r's slice of the
                reduction dim of A = cat_r A_r [M, W*K], B = cat_r B_r [W*K, N])
                a8_r, a_scale_r = columns r of cast(A)    [M, K],        [M, 1] or []
                b8_r, b_scale   = rows r of cast(B)       [K, N],        [1, N] or []
                out = rows r of sum_r _scaled_mm(a8_r, b8_r, a_scale_r, b_scale)    [M/W, N]

``_scaled_mm`` in bf16 with fast accumulation (torchao's forward GEMM setting), ``2*M*N*K`` flops
per rank for every provider. The providers and what each one's timed region holds:

* ``reference``, ``pipelined``, ``symm``, ``torch_symm_mem``, ``auto``: tp_kernels' public scaled
  ops (:func:`tp_kernels.all_gather_scaled_matmul`, :func:`tp_kernels.scaled_matmul_reduce_scatter`)
  on the ready fp8 operands: the collective and the GEMMs only (as torch's fused scaled ops are
  used: the caller owns the casts).
* ``auto+cast``: the same call on ``auto`` preceded by this rank's casts from bf16, made with
  torchao's ``hp_tensor_to_float8_dynamic``: the input shard's and the weight's (torchao casts the
  weight on every forward too), with an all-reduce (MAX) of the amax where a scale spans ranks
  (tensor-wise scales; a row's or column's amax over the sharded ``K`` of ``matmul_rs``), as
  tp_kernels' Float8Linear path does. Beside ``torchao`` this is the fair row: both start from
  bf16 tensors.
* ``torchao``: what users run today: torchao's ``Float8Linear`` (``Float8LinearConfig.
  from_recipe_name(recipe)``, ``convert_to_float8_training``) parallelized with PyTorch's
  ``ColwiseParallel(input_layouts=Shard(0))`` (``ag_matmul``: ``x = A``'s rows ``r`` in, the bf16
  gather, then the casts of all ``M`` gathered rows and of the weight, the GEMM) or
  ``RowwiseParallel(output_layouts=Shard(0))`` (``matmul_rs``: the casts with their amax
  all-reduces, the GEMM, DTensor's reduce-scatter of bf16 partials), forward only under
  ``torch.no_grad``, DTensor's dispatch included. Its weight is ``B``: the colwise Linear's
  ``[W*N, K]`` weight is ``B^T`` repeated, so that each rank's shard is ``B^T`` and its local
  output ``[M, N]``; the rowwise Linear's ``[N, W*K]`` weight is ``cat_r B_r^T``.
* ``roof``: ``_scaled_mm`` of the full ``[M, K] x [K, N]`` operands (``ag_matmul``: the gathered
  ``a8``; ``matmul_rs``: the rank's own), no communication and no cast.

``--dtype mxfp8`` (``K`` and ``N`` multiples of 32): the same, with torchao's MXFP8 recipe
(RCEIL): every operand cast by ``MXTensor.to_mx`` in blocks of 32 along ``K`` with an e8m0
scale each (:func:`tp_kernels.mxfp8.cast_rows`), on each rank's own rows: no block spans ranks,
so no amax is all-reduced. The fused providers are tp_kernels' block-scaled path on ready MX
operands (:func:`tp_kernels.mxfp8.all_gather_mx_matmul`, :func:`~tp_kernels.mxfp8.
mx_matmul_reduce_scatter`: the packed rows, ``mx_row_bytes(K)`` each, on the wire) on each
backend that takes block scales (``torch_symm_mem`` does not: skipped, named); ``torchao`` is
``MXFP8Linear`` under the same PyTorch styles (its communication in bf16, as torchtitan's MXFP8
TP); ``roof`` torchao's MX GEMM (``torch.mm`` of the MXTensors). torchao's kernels are AUTO on
a CUDA GPU of compute capability 10.x and EMULATED elsewhere (the table says which): emulated
times are not MXFP8 speeds.

The check: every provider against ``reference``. The fp8 operands and scales are the same bytes
for every provider (torchao's casts of the same tensors with the same amaxes; ``torchao`` and
``auto+cast`` make them again, by the same functions), and an e4m3 x e4m3 product is exact in
fp32, so outputs differ only by fp32 accumulation order and bf16 roundings:
:func:`fp8_tolerance`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import tp_kernels
from tp_kernels import cost
from tp_kernels.bench.op_case import CAST, TORCHAO, op_case, randn
from tp_kernels.bench.protocol import MXFP8, REFERENCE, ROOF, BenchCase, BenchConfig, Provider
from tp_kernels.bench.tolerance import matmul_tolerance

__all__ = ["ag_matmul_fp8", "fp8_predictions_ms", "fp8_tolerance", "matmul_rs_fp8"]

_AG, _RS = "all_gather_matmul", "matmul_reduce_scatter"


def fp8_tolerance(k: int, roundings: int) -> float:
    """``rtol`` = ``atol`` for two providers' bf16 outputs of the same fp8 operands: the reference's
    path rounds to bf16 ``roundings`` times (the all-gather-matmul's output once; the
    reduce-scatter's ``W`` partials and their sum), and another provider's GEMM may round once
    more (torchao's row-wise rule without fast accumulation: an unscaled bf16 product, then
    scaled; symm's Triton kernels agree with ``_scaled_mm`` within a rounding): hence
    :func:`tp_kernels.bench.tolerance.matmul_tolerance` of bf16 with ``roundings + 1``. The products
    themselves add no error (e4m3 has 4 significant bits: a product of two fits fp32 exactly), and
    the dequantized operands are O(1) as the bf16 benchmarks' are, so outputs are O(1)."""
    return matmul_tolerance(torch.bfloat16, k, roundings + 1)


def _require_torchao() -> None:
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            "the fp8 benchmarks (--dtype fp8-rowwise / fp8-tensorwise / mxfp8) need torchao: "
            "pip install 'tp_kernels[fp8]'"
        ) from e


def _config(recipe: str) -> Any:
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig.from_recipe_name(recipe)


def _cast(
    t: torch.Tensor, cc: Any, config: Any, role: Any, axiswise_dim: int, mesh: Any | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's cast of ``t`` for cast config ``cc`` (its amax reduces ``axiswise_dim``, or every
    dim tensor-wise), the amax all-reduced (MAX) over ``mesh`` when not None (the scale spans the
    ranks' shards): ``(fp8 data, dequant scale)``, the scale as ``_scaled_mm`` takes it (torchao
    keeps the reciprocal)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    granularity = cc.scaling_granularity
    dim = axiswise_dim if granularity is ScalingGranularity.AXISWISE else None
    f8 = hp_tensor_to_float8_dynamic(
        t,
        cc.target_dtype,
        LinearMMConfig(),
        reduce_amax=mesh is not None,
        gemm_input_role=role,
        device_mesh=mesh,
        scaling_granularity=granularity,
        axiswise_dim=dim,
        round_scales_to_power_of_2=config.round_scales_to_power_of_2,
    )
    return f8._data, f8._scale.reciprocal()


class _Fp8Operands:
    """The operands of an fp8 recipe on this rank and what each provider does with them.
    :meth:`input` ``[rows, K] -> (data, scale [rows, 1] or [])`` (amax over ``K``) and
    :meth:`weight` ``[K, N] -> (data, scale [1, N] or [])`` (amax over ``K``) are the forward
    casts, the amax all-reduced over ``mesh`` where ``input_spans`` / ``weight_spans`` say it
    crosses the shards, and always when :attr:`tensorwise` (one scale of a sharded tensor);
    :meth:`gather` and :meth:`reduce_scatter` the public scaled ops, :meth:`product` the roof's
    ``_scaled_mm``, :meth:`linear` torchao's Float8Linear."""

    cost_dtype = "fp8"
    block_scaled = False
    note = ""

    def __init__(self, recipe: str, mesh: Any, *, input_spans: bool, weight_spans: bool) -> None:
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_training_tensor import GemmInputRole

        self.config = _config(recipe)
        self.tensorwise = (
            self.config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE
        )
        self._roles = GemmInputRole.INPUT, GemmInputRole.WEIGHT
        self._input_mesh = mesh if input_spans or self.tensorwise else None
        self._weight_mesh = mesh if weight_spans or self.tensorwise else None

    @property
    def fast_accum(self) -> bool:
        return self.config.gemm_config_output.use_fast_accum

    def input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cc = self.config.cast_config_input
        return _cast(x, cc, self.config, self._roles[0], -1, self._input_mesh)

    def weight(self, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # b [K, N] is the Linear's weight transposed, as torchao casts it (a column-major view:
        # the layout _scaled_mm wants for its second operand).
        cc = self.config.cast_config_weight
        return _cast(b, cc, self.config, self._roles[1], 0, self._weight_mesh)

    def gather(self, a: Any, b: Any, group: dist.ProcessGroup, backend: str) -> list[torch.Tensor]:
        (data, scale), (b_data, b_scale) = a, b
        return tp_kernels.all_gather_scaled_matmul(
            data, [b_data], scale, [b_scale], 0, group, use_fast_accum=self.fast_accum,
            backend=backend,
        )  # fmt: skip

    def reduce_scatter(
        self, a: Any, b: Any, group: dist.ProcessGroup, backend: str
    ) -> torch.Tensor:
        (data, scale), (b_data, b_scale) = a, b
        return tp_kernels.scaled_matmul_reduce_scatter(
            data, b_data, scale, b_scale, 0, group, use_fast_accum=self.fast_accum,
            backend=backend,
        )  # fmt: skip

    def product(self, a: Any, b: Any) -> torch.Tensor:
        (data, scale), (b_data, b_scale) = a, b
        return torch._scaled_mm(
            data, b_data, scale_a=scale, scale_b=b_scale, out_dtype=torch.bfloat16,
            use_fast_accum=self.fast_accum,
        )  # fmt: skip

    def linear(self, weight: torch.Tensor) -> nn.Module:
        """A bias-free Float8Linear of the recipe holding ``weight [out, in]``."""
        from torchao.float8 import convert_to_float8_training

        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
        linear = linear.to(weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
        # convert_to_float8_training swaps children: wrap the Linear to convert it in place.
        return convert_to_float8_training(nn.Sequential(linear), config=self.config)[0]


def _mx_kernels(device: torch.device) -> tuple[Any, str]:
    """torchao's kernel preference for MXFP8 on ``device`` and why: AUTO (its sm_100 kernels)
    on a CUDA GPU of compute capability 10.x, else EMULATED (torch's ops on the dequantized
    values: MX runs natively on Blackwell only)."""
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 10:
        return KernelPreference.AUTO, "torchao's AUTO kernels (sm_100)"
    where = "a CPU" if device.type == "cpu" else torch.cuda.get_device_name(device)
    return KernelPreference.EMULATED, (
        f"EMULATED: torchao's MX casts and GEMMs in torch's ops, {where} has no MX tensor cores; "
        "these times are not MXFP8 speeds"
    )


class _MXOperands:
    """The operands of torchao's MXFP8 recipe (RCEIL scales, as ``MXFP8Linear``'s default) on
    this rank: :meth:`input` ``[rows, K]`` and :meth:`weight` ``[K, N]`` each cast in blocks of
    32 along ``K`` (:func:`tp_kernels.mxfp8.cast_rows`: local on every rank, no all-reduce),
    the fused calls of :mod:`tp_kernels.mxfp8` (its block-scaled path), the roof torchao's MX
    GEMM, :meth:`linear` torchao's ``MXFP8Linear``; the face of :class:`_Fp8Operands`."""

    cost_dtype = "mxfp8"
    block_scaled = True

    def __init__(self, device: torch.device) -> None:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode

        from tp_kernels.mxfp8 import Recipe

        kernels, self.note = _mx_kernels(device)
        self.recipe = Recipe(kernels, ScaleCalculationMode.RCEIL, wgrad_with_hp=False)

    def input(self, x: torch.Tensor) -> Any:
        from tp_kernels.mxfp8 import cast_rows

        return cast_rows(x, self.recipe)

    def weight(self, b: torch.Tensor) -> Any:
        # b [K, N] is the weight [N, K] transposed: its rows cast along K, as torchao's mx_mm.
        return self.input(b.t()).t()

    def gather(self, a: Any, b: Any, group: dist.ProcessGroup, backend: str) -> list[torch.Tensor]:
        from tp_kernels.mxfp8 import all_gather_mx_matmul

        return all_gather_mx_matmul(a, [b], group, backend=backend)

    def reduce_scatter(
        self, a: Any, b: Any, group: dist.ProcessGroup, backend: str
    ) -> torch.Tensor:
        from tp_kernels.mxfp8 import mx_matmul_reduce_scatter

        return mx_matmul_reduce_scatter(a, b, group, backend=backend)

    def product(self, a: Any, b: Any) -> torch.Tensor:
        return torch.mm(a, b)

    def linear(self, weight: torch.Tensor) -> nn.Module:
        """A bias-free ``MXFP8Linear`` of the recipe holding ``weight [out, in]``."""
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

        out_features, in_features = weight.shape
        linear = MXFP8Linear(
            in_features, out_features, bias=False, kernel_preference=self.recipe.kernel_preference,
            scale_calculation_mode=self.recipe.scaling_mode, device=weight.device,
            dtype=weight.dtype,
        )  # fmt: skip
        with torch.no_grad():
            linear.weight.copy_(weight)
        return linear


_Operands = _Fp8Operands | _MXOperands


def _operands(
    cfg: BenchConfig, mesh: Any, device: torch.device, *, input_spans: bool, weight_spans: bool
) -> _Operands:
    """The operands of ``cfg.dtype``; ``input_spans`` / ``weight_spans``: whether an fp8 row's or
    column's amax crosses the shards (an MX block never does)."""
    if cfg.dtype == MXFP8:
        return _MXOperands(device)
    return _Fp8Operands(cfg.fp8_recipe, mesh, input_spans=input_spans, weight_spans=weight_spans)


def _torchao_linear(
    module: nn.Module, mesh: Any, style: Any
) -> Callable[[torch.Tensor], torch.Tensor]:
    """torchao's ``module`` (the full, unsharded weight; the same on every rank) parallelized by
    PyTorch's ``style``; returns its forward without autograd, its output as a local tensor."""
    import warnings

    import torch.distributed.tensor.parallel as torch_tp
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    # torchao warns about its own deprecations; they are not this benchmark's.
    warnings.filterwarnings("ignore", module="torchao")
    module = torch_tp.parallelize_module(module, mesh, style)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = module(x)
        out = out.to_local() if isinstance(out, DTensor) else out
        # DTensor's collectives are asynchronous (the rowwise output's reduce-scatter): wait, or
        # the timer would stop before the collective ends.
        return out.wait() if isinstance(out, AsyncCollectiveTensor) else out

    return forward


def fp8_predictions_ms(
    op: str, m: int, k: int, n: int, world: int, runnable: list[str], *, device: torch.device,
    dtype: str = "fp8",
) -> tuple[dict[str, float], str]:  # fmt: skip
    """:mod:`tp_kernels.cost`'s ms per provider for one ``dtype`` ("fp8" or "mxfp8") call with
    ``m`` rows per rank, and a note; empty where the model has no rate of ``dtype`` for the
    device. As ``bench model --fp8`` / ``--mxfp8``: the backends' scaled schedules (those the
    model has: MXFP8's are ``reference``, ``pipelined`` and on a GPU ``symm``), ``torchao``
    the unfused ``reference`` schedule (its all-gather moving bf16) plus the cast of the
    ``W*m`` rows it casts, ``auto+cast`` ``auto`` plus the cast of the rows it casts (``m``
    before a gather, ``W*m`` before a reduce-scatter); the weights' casts and fp8's amax
    all-reduces are not modeled."""
    spec = cost.device_spec(device)
    if spec is None:
        return {}, f"no description of {device} in tp_kernels.cost"
    if dtype not in spec.peak_tflops:
        return {}, (
            f"none: tp_kernels.cost has no {dtype} rate for {spec.name}; on a CPU it measures "
            "fp32/bf16/fp16 matmuls only"
        )
    fused = cost.op_cost(op, m, k, n, world, dtype, spec)
    unfused = cost.op_cost(op, m, k, n, world, dtype, spec, wire="bf16" if op == _AG else None)
    times = {b: fused.backends_s[b] * 1e3 for b in runnable if b in fused.backends_s}
    times["auto"] = min(times.values())
    own_rows = m if op == _AG else world * m
    times[CAST] = times["auto"] + cost.quantize_s(own_rows, k, spec, dtype) * 1e3
    cast_all = cost.quantize_s(world * m, k, spec, dtype)
    times[TORCHAO] = (unfused.backends_s[REFERENCE] + cast_all) * 1e3
    times[ROOF] = fused.compute_s * 1e3
    return times, (
        f"tp_kernels.cost for {spec.name}, {dtype} (casts as one fused pass of the cast rows; "
        "weights' casts and amax all-reduces not modeled)"
    )


def _mesh(group: dist.ProcessGroup, device: torch.device) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device.type)


def _fp8_case(
    name: str,
    cfg: BenchConfig,
    group: dist.ProcessGroup,
    device: torch.device,
    operands: _Operands,
    fused: Callable[..., Provider],
    *,
    torchao: Provider,
    roof: Provider,
    shapes: dict[str, list[int]],
    roundings: int,
) -> BenchCase:
    """The scaled op ``name``'s case: the fused providers (``fused(backend, cast=False)``), the
    fused call with its casts, torchao's Linear and the roof, within ``roundings`` roundings to
    bf16; the cost model's times and the table's note from ``operands``."""
    return op_case(
        name,
        cfg,
        group,
        device,
        fused=fused,
        extra={CAST: fused("auto", cast=True), TORCHAO: torchao, ROOF: roof},
        shapes=shapes,
        tolerance=fp8_tolerance(cfg.K, roundings=roundings),
        predict=functools.partial(fp8_predictions_ms, device=device, dtype=operands.cost_dtype),
        block_scaled=operands.block_scaled,
        note=operands.note,
    )


def ag_matmul_fp8(cfg: BenchConfig, group: dist.ProcessGroup, device: torch.device) -> BenchCase:
    """The scaled ``ag_matmul``: ``out [M, N] = all_gather(a8 [M/W, K]) @ b8 [K, N]`` scaled
    (module docstring)."""
    _require_torchao()
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    world, rank = group.size(), group.rank()
    mesh = _mesh(group, device)
    bf16 = cfg.torch_dtype  # the high-precision tensors, before their casts
    a_full = randn((cfg.M, cfg.K), cfg.seed, 1.0, device, bf16)
    a_shard = a_full.chunk(world)[rank].contiguous()
    w = randn((cfg.N, cfg.K), cfg.seed + 1, 1.0 / math.sqrt(cfg.K), device, bf16)  # the weight, B^T
    b = w.t()
    # Colwise: a row's amax spans K, whole on every rank; the weight's per-column amax spans K,
    # whole too. Tensor-wise scales span the shards (the gathered input; the sharded weight).
    operands = _operands(cfg, mesh, device, input_spans=False, weight_spans=False)
    a8, b8 = operands.input(a_shard), operands.weight(b)
    # The roof's gathered operand, cast whole: a row-wise (or MX) cast of the whole is the
    # shards' casts concatenated (tests/test_fp8.py, tests/test_mxfp8.py), and a tensor-wise one
    # takes the same all-reduced amax.
    full8 = operands.input(a_full)

    def fused(backend: str, cast: bool = False) -> Provider:
        def run() -> list[torch.Tensor]:
            a, bb = (operands.input(a_shard), operands.weight(b)) if cast else (a8, b8)
            return operands.gather(a, bb, group, backend)

        return run

    style = ColwiseParallel(input_layouts=Shard(0))
    torchao = _torchao_linear(operands.linear(w.repeat(world, 1)), mesh, style)
    return _fp8_case(
        "ag_matmul",
        cfg,
        group,
        device,
        operands,
        fused,
        torchao=lambda: [torchao(a_shard)],
        roof=lambda: [operands.product(full8, b8)],
        shapes={"a_shard": list(a_shard.shape), "b": list(b.shape), "out": [cfg.M, cfg.N]},
        roundings=1,
    )


def matmul_rs_fp8(cfg: BenchConfig, group: dist.ProcessGroup, device: torch.device) -> BenchCase:
    """The scaled ``matmul_rs``: ``out [M/W, N]`` = rows ``r`` of the sum over ranks of
    ``a8 [M, K] @ b8 [K, N]`` scaled (module docstring)."""
    _require_torchao()
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    world, rank = group.size(), group.rank()
    mesh = _mesh(group, device)

    # Seeds and scales as the bf16 matmul_rs: rank s holds A_s [M, K] and B_s = W_s^T [K, N].
    def operands_of(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        seed = cfg.seed + 2 * (s + 1)
        a = randn((cfg.M, cfg.K), seed, 1.0, device, cfg.torch_dtype)
        w = randn((cfg.N, cfg.K), seed + 1, 1.0 / math.sqrt(cfg.K * world), device, cfg.torch_dtype)
        return a, w

    a, w = operands_of(rank)
    b = w.t()
    # Rowwise: K is sharded, so an fp8 row's amax (input) and a column's amax (weight) span the
    # ranks (an MX block of 32 along K lies in the rank's K).
    operands = _operands(cfg, mesh, device, input_spans=True, weight_spans=True)
    a8, b8 = operands.input(a), operands.weight(b)

    def fused(backend: str, cast: bool = False) -> Provider:
        def run() -> torch.Tensor:
            x, bb = (operands.input(a), operands.weight(b)) if cast else (a8, b8)
            return operands.reduce_scatter(x, bb, group, backend)

        return run

    # The rowwise Linear's full weight [N, W*K]: every rank's W_s side by side (PyTorch's style
    # scatters rank 0's copy; each rank builds it the same).
    full_w = torch.cat([w if s == rank else operands_of(s)[1] for s in range(world)], dim=1)
    style = RowwiseParallel(output_layouts=Shard(0))
    torchao = _torchao_linear(operands.linear(full_w), mesh, style)
    return _fp8_case(
        "matmul_rs",
        cfg,
        group,
        device,
        operands,
        fused,
        torchao=lambda: torchao(a),
        roof=lambda: operands.product(a8, b8),
        shapes={"a": list(a.shape), "b": list(b.shape), "out": [cfg.M // world, cfg.N]},
        roundings=world + 1,
    )
