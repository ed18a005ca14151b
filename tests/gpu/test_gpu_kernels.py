"""The symm backend's Triton kernels compiled for this GPU, with world_size=1.

The checks of ``python -m tp_kernels.bench.gpu_kernels`` (each launcher against ``torch.mm``, the
reduction bit for bit, the signals read back) on shapes from 1x1x1 to medium, none a multiple of
a tile but the last, so a runner with a single GPU compiles and checks every kernel too. Under
torchrun each rank runs it on its own GPU, with no communication; the kernels' signalling
between GPUs is covered by the symm backend in test_gpu_fused_ops.py.
"""

from __future__ import annotations

import pytest
import torch

from tp_kernels.bench.tolerance import matmul_tolerance

pytestmark = pytest.mark.gpu

SHAPES = [(1, 1, 1), (37, 45, 29), (200, 130, 520), (1024, 768, 2048)]  # (m, n, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernels_match_torch_mm(cuda_device, dtype):
    from tp_kernels import kernels

    if kernels.INTERPRET:
        pytest.skip(
            "Triton was imported in this process with TRITON_INTERPRET=1 (tests/test_kernels.py "
            "sets it), so its kernels cannot run on a GPU here: run tests/gpu on its own"
        )
    from tp_kernels.bench import gpu_kernels

    failures = []
    for m, n, k in SHAPES:
        p = gpu_kernels.Problem(m, n, k, dtype, seed=m, device=cuda_device)
        tol = matmul_tolerance(dtype, k, roundings=1)
        results = gpu_kernels.check_all(p, gpu_kernels.launchers(p), tol)
        assert len(results) == 6, [r.name for r in results]
        failures += [f"m={m} n={n} k={k} {r.name}: {r.check}" for r in results if not r.ok]
    assert not failures, "\n".join(failures)
