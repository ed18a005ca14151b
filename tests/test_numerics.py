"""The tolerance rule every fused-op check uses (``tp_kernels.testing.numerics``): the suite, the
GPU tests and ``gpu_check``."""

from __future__ import annotations

import math

import pytest
import torch

from tp_kernels.testing.numerics import FLOOR, TORCH_SYMM_MEM_FLOOR, error_ratio, floors_for


def test_error_ratio():
    truth = torch.tensor([[1.0, -2.0], [3.0, 0.5]], dtype=torch.float64)
    mag = truth.abs()
    exact = truth.to(torch.bfloat16)  # these values are exact in bf16
    assert error_ratio(exact, truth, exact, mag) == 0.0
    # Off by half the floor (2e-2 x max|mag| = 0.06) with an exact reference: ratio 0.5.
    off = exact.clone()
    off[0, 0] += 0.03125  # a bf16 step at 1.0 is 2^-7; 1.03125 is exact
    assert error_ratio(off, truth, exact, mag) == pytest.approx(0.03125 / 0.06)
    assert error_ratio(exact[:1], truth, exact, mag) == math.inf
    assert error_ratio(exact.float(), truth, exact, mag) == math.inf
    nan = exact.clone()
    nan[1, 1] = math.nan
    assert error_ratio(nan, truth, exact, mag) == math.inf


def test_torch_symm_mem_is_held_to_its_own_floors():
    """Its backward's addend is reduce-scattered in the dtype and added outside torch's op: up to
    8 half-ulps beyond the one-device computation, where the other backends have 4."""
    assert floors_for("torch_symm_mem") is TORCH_SYMM_MEM_FLOOR
    assert all(floors_for(name) is FLOOR for name in ("symm", "pipelined", "reference"))
    truth = torch.tensor([[1.0, -2.0], [3.0, 0.5]], dtype=torch.float64)
    exact = truth.to(torch.bfloat16)
    off = exact.clone()
    off[1, 0] += 0.0625  # 3.0625 is exact in bf16: over symm's 0.06, inside torch_symm_mem's 0.12
    assert error_ratio(off, truth, exact, truth.abs(), floors_for("symm")) > 1.0
    ratio = error_ratio(off, truth, exact, truth.abs(), floors_for("torch_symm_mem"))
    assert ratio == pytest.approx(0.0625 / 0.12)
    assert TORCH_SYMM_MEM_FLOOR[torch.float32] == FLOOR[torch.float32]
