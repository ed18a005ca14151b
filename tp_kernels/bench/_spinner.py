"""The overlap check's spinner: a Triton kernel that keeps every SM busy for a chosen time.

Imported only when the probe runs (it imports Triton, which must come after ``TRITON_INTERPRET``
is set). Each program steps a 32-bit linear congruential generator ``iters`` times on every lane
(``x <- x * LCG_A + LCG_C mod 2**32``) and stores the last value: a chain of dependent integer
multiply-adds that the compiler cannot fold into a closed form, so its time grows with ``iters``,
and whose result :func:`expected` recomputes on the host (a spinner that did not run fails).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LCG_A, LCG_C = 1664525, 1013904223
# The kernel's copies: a jitted function reads a global only when it is a constexpr.
_A, _C = tl.constexpr(LCG_A), tl.constexpr(LCG_C)
# 4 warps of 32 lanes, one element per lane: 16 programs per SM fill its 64 warp slots (sm_90).
BLOCK, NUM_WARPS, PROGRAMS_PER_SM = 128, 4, 16


@triton.jit(do_not_specialize=["iters"])
def _spin(out_ptr, iters, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    x = (pid * BLOCK + lanes).to(tl.uint32)
    for _ in range(iters):
        x = x * _A + _C
    tl.store(out_ptr + pid * BLOCK + lanes, x.to(tl.int32, bitcast=True))


def spin(out: torch.Tensor, iters: int) -> None:
    """Launch the spinner: one program per :data:`BLOCK` int32 of ``out`` (contiguous), each
    stepping its lanes ``iters`` times; returns once launched."""
    if out.dtype != torch.int32 or out.dim() != 1 or out.numel() % BLOCK:
        raise ValueError(
            f"out: got {out.dtype} of shape {tuple(out.shape)}, expected int32 [programs * {BLOCK}]"
        )
    _spin[(out.numel() // BLOCK,)](out, iters, BLOCK=BLOCK, num_warps=NUM_WARPS)


def expected(programs: int, iters: int) -> torch.Tensor:
    """What :func:`spin` stores with ``programs * BLOCK`` int32 and ``iters`` steps, computed on
    the host by jumping ahead: ``iters`` steps are one affine map ``x -> a*x + c mod 2**32``,
    whose ``(a, c)`` come from composing the one-step map with itself by squaring (log2(iters)
    compositions: a GPU run takes about a million steps)."""
    mask = 0xFFFFFFFF
    a, c = 1, 0  # the identity map, then the composition of the steps so far
    step_a, step_c = LCG_A, LCG_C  # the map of 2**i steps
    n = iters
    while n:
        if n & 1:
            a, c = (a * step_a) & mask, (c * step_a + step_c) & mask
        step_a, step_c = (step_a * step_a) & mask, (step_c * step_a + step_c) & mask
        n >>= 1
    x = (torch.arange(programs * BLOCK, dtype=torch.int64) * a + c) & mask
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)
