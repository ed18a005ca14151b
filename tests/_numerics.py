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
"""

from __future__ import annotations

import torch

FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def tolerance(
    truth: torch.Tensor, same_dtype_reference: torch.Tensor, magnitude: torch.Tensor
) -> float:
    """Allowed max abs error: 2 x the reference's own error vs ``truth``, plus the dtype floor."""
    ref_err = (same_dtype_reference.double() - truth.double()).abs().max().item()
    scale = magnitude.double().abs().max().item()
    return 2.0 * ref_err + FLOOR[same_dtype_reference.dtype] * max(scale, 1e-30)


def max_error(actual: torch.Tensor, truth: torch.Tensor) -> float:
    return (actual.double() - truth.double()).abs().max().item()


def check_close(
    name: str,
    actual: torch.Tensor,
    truth: torch.Tensor,
    same_dtype_reference: torch.Tensor,
    magnitude: torch.Tensor,
) -> str | None:
    """``None`` if ``actual`` is within :func:`tolerance`, else a one-line description."""
    if actual.shape != truth.shape:
        return f"{name}: shape {tuple(actual.shape)} != expected {tuple(truth.shape)}"
    if actual.dtype != same_dtype_reference.dtype:
        return f"{name}: dtype {actual.dtype} != expected {same_dtype_reference.dtype}"
    err, tol = max_error(actual, truth), tolerance(truth, same_dtype_reference, magnitude)
    if not err <= tol:
        return f"{name}: max abs error {err:.3e} > tolerance {tol:.3e}"
    return None


def assert_no_failures(per_rank: list[list[str]]) -> None:
    """Fail with every rank's mismatches (the first 30) when any rank reported one."""
    lines = [f"rank {r}: {f}" for r, fails in enumerate(per_rank) for f in fails]
    assert not lines, f"{len(lines)} mismatches:\n" + "\n".join(lines[:30])
