"""The fused-op microbenchmarks: ``ag_matmul`` and ``matmul_rs``.

On each rank ``r`` of ``W`` ranks (``M`` divisible by ``W``, which the CLI checks):

* ``ag_matmul``: ``a_shard [M/W, K]``, ``b [K, N]`` -> ``out = all_gather(a_shard, dim 0) @ b``
  ``[M, N]``;
* ``matmul_rs``: ``a [M, K]``, ``b [K, N]`` (both different on every rank) ->
  ``out = reduce_scatter(a @ b, dim 0, sum)`` ``[M/W, N]``.

Providers: ``reference``, ``pipelined``, ``symm``, ``torch_symm_mem`` (the :mod:`tp_kernels`
backends, each where it can run for the group and device; ``torch_symm_mem`` is PyTorch's
``torch.ops.symm_mem`` fused ops behind tp_kernels' op), ``auto`` (tp_kernels' choice, timed on its
first call, which the warmup covers) and ``roof``: the same ``[M, K] @ [K, N]`` matmul with no
communication, the compute-only limit. Every provider does ``2*M*N*K`` flops per rank. Beside each
the cost model's prediction for this device (:func:`tp_kernels.cost.device_spec`): a backend's
expected time, ``auto``'s the best of the runnable backends', ``roof``'s the compute alone.

``--dtype fp8-rowwise`` / ``fp8-tensorwise`` / ``mxfp8``: the same two products with e4m3
operands and torchao's scales on tp_kernels' scaled ops (MXFP8: its block-scaled path), against
torchao's ``Float8Linear`` or ``MXFP8Linear`` under PyTorch's styles (``torchao``), ``auto``
with its casts from bf16 (``auto+cast``) and the roof: :mod:`tp_kernels.bench.ops_fp8`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

import tp_kernels
from tp_kernels import cost
from tp_kernels.backends.choice import get_backend
from tp_kernels.bench.protocol import (
    REFERENCE,
    ROOF,
    SCALED_DTYPES,
    BenchCase,
    BenchConfig,
    Provider,
    register,
)

FUSED_BACKENDS = (REFERENCE, "pipelined", "symm", "torch_symm_mem")
OP_PROVIDERS = (*FUSED_BACKENDS, "auto", ROOF)
# Under a scaled --dtype (tp_kernels.bench.ops_fp8, which says what each one times): also the
# auto call with its casts from bf16, and torchao's Linear of the recipe under PyTorch's styles.
CAST, TORCHAO = "auto+cast", "torchao"
FP8_OP_PROVIDERS = (*FUSED_BACKENDS, "auto", CAST, TORCHAO, ROOF)


def matmul_tolerance(dtype: torch.dtype, k: int, roundings: int) -> float:
    """``rtol`` = ``atol`` for comparing two implementations of a ``K``-term matmul (accumulated in
    fp32) whose path to the result rounds to ``dtype`` ``roundings`` times.

    The inputs are scaled so that output elements are O(1). The reference's own error per element
    is about: half an ulp (``eps/2``) per rounding to ``dtype`` (all-gather -> matmul: the output,
    once; matmul -> reduce-scatter: each of the ``W`` partial products, then their sum), plus the
    fp32 accumulation error over ``K`` terms, whose standard deviation for random inputs is about
    ``sqrt(K) * eps32``; ``8 sqrt(K) eps32`` bounds the largest of ~1e7 such elements (a 6-sigma
    Gaussian tail, with margin). Another implementation errs as much, possibly in the other
    direction: hence twice that. Values at K=2048: fp32 1 rounding -> 8.7e-5; fp16 3 roundings ->
    3.0e-3; bf16 3 roundings -> 2.4e-2.
    """
    own = roundings * torch.finfo(dtype).eps / 2 + 8 * math.sqrt(k) * torch.finfo(torch.float32).eps
    return 2 * own


def _randn(
    shape: tuple[int, ...], seed: int, scale: float, cfg: BenchConfig, device: torch.device
) -> torch.Tensor:
    # Generated on the CPU in fp32 with an explicit seed, so every rank can rebuild any rank's
    # tensor and the values do not depend on the device or dtype.
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
    return t.to(device=device, dtype=cfg.torch_dtype)


def runnable_backends(
    group: dist.ProcessGroup, device: torch.device, *, block_scaled: bool = False
) -> tuple[list[str], dict[str, str]]:
    """The backends of :data:`FUSED_BACKENDS` that can run for ``group`` on ``device`` (and take
    block scales, when ``block_scaled``), and why each of the others cannot."""
    runnable, skipped = [], {}
    for backend in FUSED_BACKENDS:
        impl = get_backend(backend)
        why = impl.unavailable_reason(group, device)
        if why is None and block_scaled:
            why = impl.block_scales_reason
        if why is None:
            runnable.append(backend)
        else:
            skipped[backend] = why
    return runnable, skipped


def predictions_ms(
    op: str, m: int, k: int, n: int, world: int, cfg: BenchConfig, device: torch.device,
    runnable: list[str],
) -> tuple[dict[str, float], str]:  # fmt: skip
    """:mod:`tp_kernels.cost`'s ms per provider for one call with ``m`` rows per rank, and a note
    naming the device description; empty where the model does not describe the device."""
    spec = cost.device_spec(device)
    if spec is None:
        return {}, f"no description of {device} in tp_kernels.cost"
    predicted = cost.op_cost(op, m, k, n, world, cfg.dtype, spec)
    times = {b: predicted.backends_s[b] * 1e3 for b in runnable}
    times["auto"] = min(times.values())
    times[ROOF] = predicted.compute_s * 1e3
    return times, f"tp_kernels.cost for {spec.name}"


def op_case(
    name: str,
    cfg: BenchConfig,
    group: dist.ProcessGroup,
    device: torch.device,
    *,
    fused: Callable[[str], Provider],
    extra: dict[str, Provider],
    shapes: dict[str, list[int]],
    tolerance: float,
    predict: Callable[[list[str]], tuple[dict[str, float], str]],
    block_scaled: bool = False,
    note: str = "",
) -> BenchCase:
    """The case of one fused op (any ``--dtype``): ``fused(backend)`` is the tp_kernels provider
    of ``backend``, for each runnable backend (that takes block scales, when ``block_scaled``)
    and ``auto``; ``extra`` the other providers (the roof among them); ``predict(runnable)`` the
    cost model's times and their note; ``note`` the table's footnote on its times."""
    runnable, skipped = runnable_backends(group, device, block_scaled=block_scaled)
    providers: dict[str, Provider] = {backend: fused(backend) for backend in runnable}
    providers["auto"] = fused("auto")
    providers.update(extra)
    predicted, model_note = predict(runnable)
    return BenchCase(
        name=name,
        flops=2.0 * cfg.M * cfg.N * cfg.K,
        shapes=shapes,
        providers=providers,
        tolerance=tolerance,
        skipped=skipped,
        predicted_ms=predicted,
        model_note=model_note,
        note=note,
    )


@register("ag_matmul", providers=OP_PROVIDERS, fp8_providers=FP8_OP_PROVIDERS)
def ag_matmul(cfg: BenchConfig, group: dist.ProcessGroup, device: torch.device) -> BenchCase:
    """``out [M, N] = all_gather(a_shard [M/W, K], dim 0) @ b [K, N]`` on every rank (a scaled
    ``--dtype``: :func:`tp_kernels.bench.ops_fp8.ag_matmul_fp8`)."""
    if cfg.dtype in SCALED_DTYPES:
        from tp_kernels.bench.ops_fp8 import ag_matmul_fp8

        return ag_matmul_fp8(cfg, group, device)
    world, rank = group.size(), group.rank()
    # a is the same full matrix on every rank (the roof needs it); b ~ 1/sqrt(K) keeps out O(1).
    a_full = _randn((cfg.M, cfg.K), cfg.seed, 1.0, cfg, device)
    a_shard = a_full.chunk(world)[rank].contiguous()
    b = _randn((cfg.K, cfg.N), cfg.seed + 1, 1.0 / math.sqrt(cfg.K), cfg, device)
    return op_case(
        "ag_matmul",
        cfg,
        group,
        device,
        fused=lambda backend: (
            lambda: tp_kernels.all_gather_matmul(a_shard, [b], 0, group, backend=backend)[1]
        ),
        extra={ROOF: lambda: [a_full @ b]},
        shapes={"a_shard": list(a_shard.shape), "b": list(b.shape), "out": [cfg.M, cfg.N]},
        tolerance=matmul_tolerance(cfg.torch_dtype, cfg.K, roundings=1),
        predict=functools.partial(
            predictions_ms, "all_gather_matmul", cfg.M // world, cfg.K, cfg.N, world, cfg, device
        ),
    )


@register("matmul_rs", providers=OP_PROVIDERS, fp8_providers=FP8_OP_PROVIDERS)
def matmul_rs(cfg: BenchConfig, group: dist.ProcessGroup, device: torch.device) -> BenchCase:
    """``out [M/W, N] = reduce_scatter(a [M, K] @ b [K, N], dim 0, sum)`` on every rank (a scaled
    ``--dtype``: :func:`tp_kernels.bench.ops_fp8.matmul_rs_fp8`)."""
    if cfg.dtype in SCALED_DTYPES:
        from tp_kernels.bench.ops_fp8 import matmul_rs_fp8

        return matmul_rs_fp8(cfg, group, device)
    world, rank = group.size(), group.rank()
    # Seeds differ per rank (each rank holds its own K-shard's product); the 1/sqrt(K*W) scale
    # keeps the sum over W ranks O(1).
    seed = cfg.seed + 2 * (rank + 1)
    a = _randn((cfg.M, cfg.K), seed, 1.0, cfg, device)
    b = _randn((cfg.K, cfg.N), seed + 1, 1.0 / math.sqrt(cfg.K * world), cfg, device)
    return op_case(
        "matmul_rs",
        cfg,
        group,
        device,
        fused=lambda backend: (
            lambda: tp_kernels.matmul_reduce_scatter(a, b, 0, group, backend=backend)
        ),
        extra={ROOF: lambda: a @ b},
        shapes={"a": list(a.shape), "b": list(b.shape), "out": [cfg.M // world, cfg.N]},
        tolerance=matmul_tolerance(cfg.torch_dtype, cfg.K, roundings=world + 1),
        predict=functools.partial(
            predictions_ms,
            "matmul_reduce_scatter",
            cfg.M // world,
            cfg.K,
            cfg.N,
            world,
            cfg,
            device,
        ),  # fmt: skip
    )
