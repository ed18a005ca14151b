"""What the two op benchmarks share at every ``--dtype``: their providers, the backends that can
run, their random operands and the :class:`~tp_kernels.bench.protocol.BenchCase` of one fused op.
:mod:`tp_kernels.bench.ops` (fp32, fp16, bf16) and :mod:`tp_kernels.bench.ops_fp8` (the scaled
dtypes) build their cases on it; ``ops`` registers both ops and hands a scaled ``--dtype`` to
``ops_fp8``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from tp_kernels.backends.choice import get_backend
from tp_kernels.bench.protocol import REFERENCE, ROOF, BenchCase, BenchConfig, Provider

__all__ = [
    "CAST",
    "COST_OPS",
    "FP8_OP_PROVIDERS",
    "FUSED_BACKENDS",
    "OP_PROVIDERS",
    "TORCHAO",
    "Predict",
    "op_case",
    "randn",
    "runnable_backends",
]

FUSED_BACKENDS = (REFERENCE, "pipelined", "symm", "torch_symm_mem")
OP_PROVIDERS = (*FUSED_BACKENDS, "auto", ROOF)
# Under a scaled --dtype (tp_kernels.bench.ops_fp8, which says what each one times): also the
# auto call with its casts from bf16, and torchao's Linear of the recipe under PyTorch's styles.
CAST, TORCHAO = "auto+cast", "torchao"
FP8_OP_PROVIDERS = (*FUSED_BACKENDS, "auto", CAST, TORCHAO, ROOF)
# The benchmark's name -> the op's name in tp_kernels.cost.
COST_OPS = {"ag_matmul": "all_gather_matmul", "matmul_rs": "matmul_reduce_scatter"}

Predict = Callable[[str, int, int, int, int, list[str]], tuple[dict[str, float], str]]
"""``predict(op, m, k, n, world, runnable)``: :mod:`tp_kernels.cost`'s ms per provider for one
call of the cost model's ``op`` with ``m`` rows per rank, and the table's note on them."""


def randn(
    shape: tuple[int, ...], seed: int, scale: float, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Normal values times ``scale``, drawn on the CPU in fp32 from an explicit seed, so that every
    rank can rebuild any rank's tensor and the values do not depend on the device or dtype; then
    moved to ``device`` in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
    return t.to(device=device, dtype=dtype)


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
    predict: Predict,
    block_scaled: bool = False,
    note: str = "",
) -> BenchCase:
    """The case of the fused op ``name`` (a key of :data:`COST_OPS`; any ``--dtype``):
    ``fused(backend)`` is the tp_kernels provider of ``backend``, for each runnable backend (that
    takes block scales, when ``block_scaled``) and ``auto``; ``extra`` the other providers (the
    roof among them); ``predict`` the cost model's times of the runnable ones (``M/W`` rows per
    rank) and their note; ``note`` the table's footnote on its times."""
    runnable, skipped = runnable_backends(group, device, block_scaled=block_scaled)
    providers: dict[str, Provider] = {backend: fused(backend) for backend in runnable}
    providers["auto"] = fused("auto")
    providers.update(extra)
    world = group.size()
    predicted, model_note = predict(COST_OPS[name], cfg.M // world, cfg.K, cfg.N, world, runnable)
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
