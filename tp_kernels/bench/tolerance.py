"""How the bench compares two matmuls: the tolerance of a ``K``-term product rounded to a dtype
some number of times, and an error as a multiple of a tolerance. The op benchmarks, the kernel
timings, the calibration and the overlap check all check their GEMMs by these two."""

from __future__ import annotations

import math

import torch

__all__ = ["error_ratio", "matmul_tolerance"]


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


def error_ratio(got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    """``max |got - want| / (tol * (1 + |want|))`` over all elements, computed in float64.

    At most 1 exactly when ``allclose(got, want, rtol=tol, atol=tol)``; ``inf`` when the shapes
    differ or ``got`` holds a NaN where ``want`` does not.
    """
    if got.shape != want.shape:
        return math.inf
    if not tol > 0:
        raise ValueError(f"tol: got {tol}, expected a positive tolerance")
    g, w = got.double(), want.double()
    ratio = ((g - w).abs() / (tol * (1.0 + w.abs()))).nan_to_num(nan=math.inf)
    return ratio.max().item() if ratio.numel() else 0.0
