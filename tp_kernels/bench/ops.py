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
with its casts from bf16 (``auto+cast``) and the roof: :mod:`tp_kernels.bench.ops_fp8`, to which
the two builders here hand a scaled ``--dtype``. What both share: :mod:`tp_kernels.bench.op_case`.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

import tp_kernels
from tp_kernels import cost
from tp_kernels.bench.op_case import FP8_OP_PROVIDERS, OP_PROVIDERS, op_case, randn
from tp_kernels.bench.ops_fp8 import ag_matmul_fp8, matmul_rs_fp8
from tp_kernels.bench.protocol import ROOF, SCALED_DTYPES, BenchCase, BenchConfig, register
from tp_kernels.bench.tolerance import matmul_tolerance


def predictions_ms(
    op: str, m: int, k: int, n: int, world: int, runnable: list[str], *, cfg: BenchConfig,
    device: torch.device,
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


@register("ag_matmul", providers=OP_PROVIDERS, fp8_providers=FP8_OP_PROVIDERS)
def ag_matmul(cfg: BenchConfig, group: dist.ProcessGroup, device: torch.device) -> BenchCase:
    """``out [M, N] = all_gather(a_shard [M/W, K], dim 0) @ b [K, N]`` on every rank (a scaled
    ``--dtype``: :func:`tp_kernels.bench.ops_fp8.ag_matmul_fp8`)."""
    if cfg.dtype in SCALED_DTYPES:
        return ag_matmul_fp8(cfg, group, device)
    world, rank = group.size(), group.rank()
    # a is the same full matrix on every rank (the roof needs it); b ~ 1/sqrt(K) keeps out O(1).
    a_full = randn((cfg.M, cfg.K), cfg.seed, 1.0, device, cfg.torch_dtype)
    a_shard = a_full.chunk(world)[rank].contiguous()
    b = randn((cfg.K, cfg.N), cfg.seed + 1, 1.0 / math.sqrt(cfg.K), device, cfg.torch_dtype)
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
        predict=functools.partial(predictions_ms, cfg=cfg, device=device),
    )


@register("matmul_rs", providers=OP_PROVIDERS, fp8_providers=FP8_OP_PROVIDERS)
def matmul_rs(cfg: BenchConfig, group: dist.ProcessGroup, device: torch.device) -> BenchCase:
    """``out [M/W, N] = reduce_scatter(a [M, K] @ b [K, N], dim 0, sum)`` on every rank (a scaled
    ``--dtype``: :func:`tp_kernels.bench.ops_fp8.matmul_rs_fp8`)."""
    if cfg.dtype in SCALED_DTYPES:
        return matmul_rs_fp8(cfg, group, device)
    world, rank = group.size(), group.rank()
    # Seeds differ per rank (each rank holds its own K-shard's product); the 1/sqrt(K*W) scale
    # keeps the sum over W ranks O(1).
    seed = cfg.seed + 2 * (rank + 1)
    a = randn((cfg.M, cfg.K), seed, 1.0, device, cfg.torch_dtype)
    b = randn((cfg.K, cfg.N), seed + 1, 1.0 / math.sqrt(cfg.K * world), device, cfg.torch_dtype)
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
        predict=functools.partial(predictions_ms, cfg=cfg, device=device),
    )
