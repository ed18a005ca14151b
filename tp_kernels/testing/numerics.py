"""Tolerances for comparing a low-precision result against a float64 truth.

The rule (one for every fused-op test): a result may be off from the float64 truth by at most twice
what the plain single-process computation in the same dtype is off by (its own rounding error),
plus a floor relative to the magnitude of the terms summed (for ``x @ y`` that is ``|x| @ |y|``,
computed by running the same float64 computation on absolute values: it bounds every rounding error
of a sum, even where the terms cancel). The floor covers what the reference rounding cannot show: a
sharded sum rounds each of the W partial sums to the dtype before adding them (W extra roundings of
half an ulp each), and a reference that happens to land exactly.

    dtype     floor (x max magnitude)  why
    float64   1e-12                  gradcheck-level: only fp64 accumulation-order noise
    float32   2e-6                   ~16 ulps: W<=4 partial roundings + accumulation-order noise
    float16   2e-3                   W<=4 partial sums, each rounded to 11 bits: 4 * 0.5 * 2^-10
    bfloat16  2e-2                   W<=4 partial sums, each rounded to 8 bits: 4 * 0.5 * 2^-7

``torch_symm_mem`` gets wider floors, :data:`TORCH_SYMM_MEM_FLOOR`, for up to W = 8 ranks (the GPU
tests run on a whole node). torch's fused reduce-scatter rounds each rank's partial product to the
dtype and sums them once in fp32 (2.13: ``torch.sum``, which accumulates fp16/bf16 in fp32 on CUDA;
2.15: a Triton kernel), which the floors above cover; but the backward's addend (the gradient of a
returned ``A``) has no place in torch's op and is reduce-scattered by the group's collective in the
dtype (W - 1 running sums rounded) and then added (one more rounding). With ``u`` half an ulp
(2^-24, 2^-11, 2^-8) and the terms' magnitude split into the product's ``P`` and the addend's
``D``, the roundings beyond the one-device computation's stay within ``u (P + (W - 1) D + P + D)
<= W u (P + D)``: 8 u at W = 8.

    dtype     floor     why
    float32   2e-6      8 * 2^-24 = 4.8e-7, inside the accumulation-order allowance above
    float16   4e-3      8 * 2^-11 = 3.9e-3
    bfloat16  4e-2      8 * 2^-8 = 3.1e-2
"""

from __future__ import annotations

import math

import torch

FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}
TORCH_SYMM_MEM_FLOOR = {**FLOOR, torch.float16: 4e-3, torch.bfloat16: 4e-2}


def floors_for(backend: str) -> dict[torch.dtype, float]:
    """The floors that ``backend``'s results are held to (see the module docstring)."""
    return TORCH_SYMM_MEM_FLOOR if backend == "torch_symm_mem" else FLOOR


def tolerance(
    truth: torch.Tensor,
    same_dtype_reference: torch.Tensor,
    magnitude: torch.Tensor,
    floors: dict[torch.dtype, float] = FLOOR,
) -> float:
    """Allowed max abs error: 2 x the reference's own error vs ``truth``, plus the dtype floor."""
    ref_err = (same_dtype_reference.double() - truth.double()).abs().max().item()
    scale = magnitude.double().abs().max().item()
    return 2.0 * ref_err + floors[same_dtype_reference.dtype] * max(scale, 1e-30)


def max_error(actual: torch.Tensor, truth: torch.Tensor) -> float:
    return (actual.double() - truth.double()).abs().max().item()


def check_close(
    name: str,
    actual: torch.Tensor,
    truth: torch.Tensor,
    same_dtype_reference: torch.Tensor,
    magnitude: torch.Tensor,
    floors: dict[torch.dtype, float] = FLOOR,
) -> str | None:
    """``None`` if ``actual`` is within :func:`tolerance`, else a one-line description."""
    if actual.shape != truth.shape:
        return f"{name}: shape {tuple(actual.shape)} != expected {tuple(truth.shape)}"
    if actual.dtype != same_dtype_reference.dtype:
        return f"{name}: dtype {actual.dtype} != expected {same_dtype_reference.dtype}"
    err = max_error(actual, truth)
    tol = tolerance(truth, same_dtype_reference, magnitude, floors)
    if not err <= tol:
        return f"{name}: max abs error {err:.3e} > tolerance {tol:.3e}"
    return None


def assert_no_failures(per_rank: list[list[str]]) -> None:
    """Fail with every rank's mismatches (the first 30) when any rank reported one."""
    lines = [f"rank {r}: {f}" for r, fails in enumerate(per_rank) for f in fails]
    assert not lines, f"{len(lines)} mismatches:\n" + "\n".join(lines[:30])


def error_ratio(
    got: torch.Tensor,
    truth: torch.Tensor,
    reference: torch.Tensor,
    magnitude: torch.Tensor,
    floors: dict[torch.dtype, float] = FLOOR,
) -> float:
    """``max|got - truth|`` over :func:`tolerance`: at most 1 is within it; ``inf`` for a wrong
    shape or dtype (against ``reference``'s), or a NaN. Empty results are within it."""
    if got.shape != truth.shape or got.dtype != reference.dtype:
        return math.inf
    if not got.numel():
        return 0.0
    ratio = max_error(got, truth) / tolerance(truth, reference, magnitude, floors)
    return math.inf if math.isnan(ratio) else ratio
