"""The fp8 cases of the op benchmarks (``--dtype fp8-rowwise`` / ``fp8-tensorwise``, issue 27).

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
from tp_kernels.bench.ops import CAST, TORCHAO, matmul_tolerance, op_case
from tp_kernels.bench.protocol import REFERENCE, ROOF, BenchCase, BenchConfig, Provider

__all__ = ["ag_matmul_fp8", "fp8_predictions_ms", "fp8_tolerance", "matmul_rs_fp8"]

_AG, _RS = "all_gather_matmul", "matmul_reduce_scatter"


def fp8_tolerance(k: int, roundings: int) -> float:
    """``rtol`` = ``atol`` for two providers' bf16 outputs of the same fp8 operands: the reference's
    path rounds to bf16 ``roundings`` times (the all-gather-matmul's output once; the
    reduce-scatter's ``W`` partials and their sum), and another provider's GEMM may round once
    more (torchao's row-wise rule without fast accumulation: an unscaled bf16 product, then
    scaled; symm's Triton kernels agree with ``_scaled_mm`` within a rounding): hence
    :func:`tp_kernels.bench.ops.matmul_tolerance` of bf16 with ``roundings + 1``. The products
    themselves add no error (e4m3 has 4 significant bits: a product of two fits fp32 exactly), and
    the dequantized operands are O(1) as the bf16 benchmarks' are, so outputs are O(1)."""
    return matmul_tolerance(torch.bfloat16, k, roundings + 1)


def _require_torchao() -> None:
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            "the fp8 benchmarks (--dtype fp8-rowwise / fp8-tensorwise) need torchao: "
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


class _Casts:
    """The forward casts of a recipe on this rank: :meth:`input` ``[rows, K] -> (data, scale
    [rows, 1] or [])`` (amax over ``K``) and :meth:`weight` ``[K, N] -> (data, scale [1, N] or [])``
    (amax over ``K``), the amax all-reduced over ``mesh`` where ``input_spans`` / ``weight_spans``
    say it crosses the shards, and always when :attr:`tensorwise` (one scale of a sharded
    tensor)."""

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


def _torchao_linear(
    weight: torch.Tensor, recipe: str, mesh: Any, style: Any
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``weight [out, in]`` (the full, unsharded weight; the same on every rank) as a bias-free
    Float8Linear of ``recipe`` parallelized by PyTorch's ``style``; returns its forward without
    autograd, its output as a local tensor."""
    import warnings

    import torch.distributed.tensor.parallel as torch_tp
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor
    from torchao.float8 import convert_to_float8_training

    # torchao warns about its own deprecations on conversion; they are not this benchmark's.
    warnings.filterwarnings("ignore", module="torchao")
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
    linear = linear.to(weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    # convert_to_float8_training swaps children: wrap the Linear to convert it in place.
    holder = convert_to_float8_training(nn.Sequential(linear), config=_config(recipe))
    module = torch_tp.parallelize_module(holder[0], mesh, style)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = module(x)
        out = out.to_local() if isinstance(out, DTensor) else out
        # DTensor's collectives are asynchronous (the rowwise output's reduce-scatter): wait, or
        # the timer would stop before the collective ends.
        return out.wait() if isinstance(out, AsyncCollectiveTensor) else out

    return forward


def _randn(shape: tuple[int, ...], seed: int, scale: float, device: torch.device) -> torch.Tensor:
    # As ops._randn: fp32 on the CPU from an explicit seed, so any rank can rebuild any rank's
    # tensor; then the high-precision dtype.
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
    return t.to(device=device, dtype=torch.bfloat16)


def fp8_predictions_ms(
    op: str, m: int, k: int, n: int, world: int, device: torch.device, runnable: list[str]
) -> tuple[dict[str, float], str]:
    """:mod:`tp_kernels.cost`'s ms per provider for one fp8 call with ``m`` rows per rank, and a
    note; empty where the model has no fp8 rate for the device. As ``bench model --fp8``: the
    backends' fp8 schedules, ``torchao`` the unfused ``reference`` schedule (its all-gather moving
    bf16) plus the cast of the ``W*m`` rows it casts, ``auto+cast`` ``auto`` plus the cast of the
    rows it casts (``m`` before a gather, ``W*m`` before a reduce-scatter); the weights' casts and
    the amax all-reduces are not modeled."""
    spec = cost.device_spec(device)
    if spec is None:
        return {}, f"no description of {device} in tp_kernels.cost"
    if "fp8" not in spec.peak_tflops:
        return {}, (
            f"none: tp_kernels.cost has no fp8 rate for {spec.name}; on a CPU it measures "
            "fp32/bf16/fp16 matmuls only"
        )
    fused = cost.op_cost(op, m, k, n, world, "fp8", spec)
    unfused = cost.op_cost(op, m, k, n, world, "fp8", spec, wire="bf16" if op == _AG else None)
    times = {b: fused.backends_s[b] * 1e3 for b in runnable}
    times["auto"] = min(times.values())
    own_rows = m if op == _AG else world * m
    times[CAST] = times["auto"] + cost.quantize_s(own_rows, k, spec) * 1e3
    times[TORCHAO] = (unfused.backends_s[REFERENCE] + cost.quantize_s(world * m, k, spec)) * 1e3
    times[ROOF] = fused.compute_s * 1e3
    return times, (
        f"tp_kernels.cost for {spec.name}, fp8 (casts as one fused pass of the cast rows; "
        "weights' casts and amax all-reduces not modeled)"
    )


def _mesh(group: dist.ProcessGroup, device: torch.device) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device.type)


def ag_matmul_fp8(cfg: BenchConfig, group: dist.ProcessGroup, device: torch.device) -> BenchCase:
    """The fp8 ``ag_matmul``: ``out [M, N] = _scaled_mm(all_gather(a8 [M/W, K]), b8 [K, N])``
    (module docstring)."""
    _require_torchao()
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    recipe = cfg.fp8_recipe
    world, rank = group.size(), group.rank()
    mesh = _mesh(group, device)
    a_full = _randn((cfg.M, cfg.K), cfg.seed, 1.0, device)
    a_shard = a_full.chunk(world)[rank].contiguous()
    w = _randn((cfg.N, cfg.K), cfg.seed + 1, 1.0 / math.sqrt(cfg.K), device)  # the weight, B^T
    b = w.t()
    # Colwise: a row's amax spans K, whole on every rank; the weight's per-column amax spans K,
    # whole too. Tensor-wise scales span the shards (the gathered input; the sharded weight).
    casts = _Casts(recipe, mesh, input_spans=False, weight_spans=False)
    a8, a_scale = casts.input(a_shard)
    b8, b_scale = casts.weight(b)
    # The roof's gathered operand, cast whole: a row-wise cast of the whole is the shards' casts
    # concatenated (tests/test_fp8.py), and a tensor-wise one takes the same all-reduced amax.
    full8, full_scale = casts.input(a_full)
    fast = casts.fast_accum

    def fused(backend: str, cast: bool = False) -> Provider:
        def run() -> list[torch.Tensor]:
            a, sa, bb, sb = (
                (*casts.input(a_shard), *casts.weight(b)) if cast else (a8, a_scale, b8, b_scale)
            )
            return tp_kernels.all_gather_scaled_matmul(
                a, [bb], sa, [sb], 0, group, use_fast_accum=fast, backend=backend
            )

        return run

    torchao = _torchao_linear(
        w.repeat(world, 1), recipe, mesh, ColwiseParallel(input_layouts=Shard(0))
    )
    return op_case(
        "ag_matmul",
        cfg,
        group,
        device,
        fused=fused,
        extra={
            CAST: fused("auto", cast=True),
            TORCHAO: lambda: [torchao(a_shard)],
            ROOF: lambda: [
                torch._scaled_mm(
                    full8,
                    b8,
                    scale_a=full_scale,
                    scale_b=b_scale,
                    out_dtype=torch.bfloat16,
                    use_fast_accum=fast,
                )
            ],
        },
        shapes={"a_shard": list(a_shard.shape), "b": list(b.shape), "out": [cfg.M, cfg.N]},
        tolerance=fp8_tolerance(cfg.K, roundings=1),
        predict=functools.partial(
            fp8_predictions_ms, _AG, cfg.M // world, cfg.K, cfg.N, world, device
        ),
    )


def matmul_rs_fp8(cfg: BenchConfig, group: dist.ProcessGroup, device: torch.device) -> BenchCase:
    """The fp8 ``matmul_rs``: ``out [M/W, N]`` = rows ``r`` of the sum over ranks of
    ``_scaled_mm(a8 [M, K], b8 [K, N])`` (module docstring)."""
    _require_torchao()
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    recipe = cfg.fp8_recipe
    world, rank = group.size(), group.rank()
    mesh = _mesh(group, device)

    # Seeds and scales as the bf16 matmul_rs: rank s holds A_s [M, K] and B_s = W_s^T [K, N].
    def operands(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        seed = cfg.seed + 2 * (s + 1)
        a = _randn((cfg.M, cfg.K), seed, 1.0, device)
        return a, _randn((cfg.N, cfg.K), seed + 1, 1.0 / math.sqrt(cfg.K * world), device)

    a, w = operands(rank)
    b = w.t()
    # Rowwise: K is sharded, so a row's amax (input) and a column's amax (weight) span the ranks.
    casts = _Casts(recipe, mesh, input_spans=True, weight_spans=True)
    a8, a_scale = casts.input(a)
    b8, b_scale = casts.weight(b)
    fast = casts.fast_accum

    def fused(backend: str, cast: bool = False) -> Provider:
        def run() -> torch.Tensor:
            x, sx, bb, sb = (
                (*casts.input(a), *casts.weight(b)) if cast else (a8, a_scale, b8, b_scale)
            )
            return tp_kernels.scaled_matmul_reduce_scatter(
                x, bb, sx, sb, 0, group, use_fast_accum=fast, backend=backend
            )

        return run

    # The rowwise Linear's full weight [N, W*K]: every rank's W_s side by side (PyTorch's style
    # scatters rank 0's copy; each rank builds it the same).
    full_w = torch.cat([w if s == rank else operands(s)[1] for s in range(world)], dim=1)
    torchao = _torchao_linear(full_w, recipe, mesh, RowwiseParallel(output_layouts=Shard(0)))
    return op_case(
        "matmul_rs",
        cfg,
        group,
        device,
        fused=fused,
        extra={
            CAST: fused("auto", cast=True),
            TORCHAO: lambda: torchao(a),
            ROOF: lambda: torch._scaled_mm(
                a8,
                b8,
                scale_a=a_scale,
                scale_b=b_scale,
                out_dtype=torch.bfloat16,
                use_fast_accum=fast,
            ),
        },
        shapes={"a": list(a.shape), "b": list(b.shape), "out": [cfg.M // world, cfg.N]},
        tolerance=fp8_tolerance(cfg.K, roundings=world + 1),
        predict=functools.partial(
            fp8_predictions_ms, _RS, cfg.M // world, cfg.K, cfg.N, world, device
        ),
    )
