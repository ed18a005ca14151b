"""One call of a public scaled (fp8) fused op against ``torch._scaled_mm`` of the gathered or
summed operands, computed on the rank: ``gpu_check``'s fp8 rows.

A case's whole problem is drawn from a seed on the CPU, so every rank rebuilds every rank's
operands: e4m3 data from standard normals, dequant scales in ``[0.25, 2)`` (not powers of two, so
that applying them rounds), ``b`` column-major (a Linear's weight transposed, the layout
``_scaled_mm`` takes), bf16 output, ``use_fast_accum=False``. Row-wise: ``a_scale`` one per row of
``a`` (``[..., 1]``), ``b_scale`` ``[1, N]``; tensor-wise: one ``[]`` scale each (the
all-gather's the same on every rank, the reduce-scatter's each rank's own).

The reference (what torch's fused scaled ops return, computed unfused on this rank):

* ``all_gather_scaled_matmul``: ``A = cat(shards, gather_dim)``, flattened to rows in its own
  layout (not the op's gathered-dim-first order), one ``torch._scaled_mm(A, b_j, A_scale,
  b_scale_j)`` per ``b_j``, reshaped back;
* ``scaled_matmul_reduce_scatter``: each rank's ``torch._scaled_mm`` partial (bf16), summed in
  fp32 in rank order, this rank's block along ``scatter_dim``; ``K`` may differ by rank.

The tolerance, per element (:data:`UNIT` ``u`` = 2^-8, half a bf16 ulp; ``T`` the float64 product
of the dequantized operands, ``M`` the same product of their absolute values, ``K`` the
reduction length). The fp8 products are exact in fp32; each GEMM sums them in fp32 (in any order
within ``γ = K 2^-24 M``, the classic bound), multiplies by the two scales in fp32 and rounds
once to bf16: ``|P - T| <= u |T| + acc`` with ``acc = 2 γ`` (the 2 also covers the scales' two
fp32 products and an fp32 sum of W <= 4 partials, each ``2^-24`` of at most ``M``). That holds for
symm's Triton kernels (scales in the epilogue, one rounding) and for ``_scaled_mm`` with a bf16
output (cuBLASLt's and CUTLASS's epilogues scale the fp32 accumulator, then round once), so:

* all-gather: ``|got - ref| <= 2 u |T| + 2 acc`` (one rounding each side);
* reduce-scatter: the op rounds each partial once and its fp32 sum once more, the reference
  rounds each partial and keeps the fp32 sum: ``|got - ref| <= 3 u S + 2 acc`` with ``S`` the sum
  over ranks of ``|T_s|`` and ``M``, ``K`` the sum and the largest over ranks.

Not covered, on purpose: an accumulator that keeps fewer bits than fp32 across ``K`` (Hopper's
fp8 tensor cores without periodic promotion to fp32, what ``use_fast_accum=True`` allows and
what Triton's ``tl.dot`` does on sm_90 by default, ``max_num_imprecise_acc``, which the
kernels set to ``BLOCK_K``): these rows ask for ``use_fast_accum=False``, so a row failing by
that is a finding, not noise. A wrong scale
(another row's, a missing one, one applied twice) is off by a factor, far past ``2 u``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

E4M3 = torch.float8_e4m3fn
OUT_DTYPE = torch.bfloat16
UNIT = 2.0**-8  # half an ulp of bf16, relative: one rounding to the output dtype
FP32_UNIT = 2.0**-24
ACCUMULATION = 2.0  # acc = ACCUMULATION * K * FP32_UNIT * M (see the module docstring)
TINY = 1e-30  # so that an element whose every product is 0 compares 0 with 0, not 0 / 0
SCALINGS = {"fp8-rowwise": True, "fp8-tensorwise": False}
"""The fp8 rows' dtype labels -> row-wise scales (else tensor-wise)."""


@dataclass(frozen=True)
class ScaledAGCase:
    """``all_gather_scaled_matmul`` of an ``a_shard`` of shape ``shard`` (``K`` last, a multiple
    of 16) gathered along ``dim``, with one ``b`` ``[K, n]`` per ``ns``."""

    shard: tuple[int, ...]
    dim: int
    ns: tuple[int, ...]


@dataclass(frozen=True)
class ScaledRSCase:
    """``scaled_matmul_reduce_scatter`` of an ``a`` whose shape is ``out`` with ``out[dim]``
    times the world size and ``K`` last, and ``b`` ``[K, n]``: rank ``r``'s ``K`` is ``k + r *
    k_step`` (multiples of 16)."""

    out: tuple[int, ...]
    dim: int
    k: int
    n: int
    k_step: int = 0


@dataclass
class ScaledResults:
    """This rank's results of one call (``got``) beside the reference and the tolerance of each
    element (the module docstring); ``names`` says which result each entry is."""

    names: list[str]
    got: list[torch.Tensor]
    reference: list[torch.Tensor]
    tolerance: list[torch.Tensor]

    def worst(self) -> tuple[float, str]:
        """The largest ``|got - reference| / tolerance`` over every element (at most 1 passes;
        ``inf`` for a shape that differs or a NaN) and the name of its result."""
        ratios = []
        for name, g, r, tol in zip(
            self.names, self.got, self.reference, self.tolerance, strict=True
        ):
            if g.shape != r.shape:
                ratios.append((math.inf, name))
                continue
            ratio = ((g.double() - r.double()).abs() / tol).nan_to_num(nan=math.inf)
            ratios.append((ratio.max().item() if ratio.numel() else 0.0, name))
        return max(ratios, key=lambda item: item[0], default=(0.0, "-"))


def _fp8(gen: torch.Generator, shape: Sequence[int], device: torch.device) -> torch.Tensor:
    # Drawn in fp32 on the CPU from one generator, so every rank draws the same whole problem.
    return torch.randn(tuple(shape), generator=gen).to(E4M3).to(device)


def _weight(gen: torch.Generator, k: int, n: int, device: torch.device) -> torch.Tensor:
    """``[k, n]`` column-major: the transpose of a row-major ``[n, k]``, as ``_scaled_mm``'s second
    operand must be on CUDA."""
    return _fp8(gen, (n, k), device).t()


def _scale(gen: torch.Generator, shape: Sequence[int], device: torch.device) -> torch.Tensor:
    return (torch.rand(tuple(shape), generator=gen) * 1.75 + 0.25).to(device)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, last]``, rows in its own layout."""
    return t.reshape(-1, t.shape[-1])


def scaled_mm(a, a_scale, b, b_scale) -> torch.Tensor:
    """The reference product: ``torch._scaled_mm`` of ``a [..., K]`` (rows flattened in its own
    layout) and ``b [K, N]``, bf16, ``use_fast_accum=False``; ``[..., N]``."""
    scale = _rows(a_scale) if a_scale.dim() else a_scale
    out = torch._scaled_mm(
        _rows(a), b, scale_a=scale, scale_b=b_scale, out_dtype=OUT_DTYPE, use_fast_accum=False
    )
    return out.reshape(*a.shape[:-1], b.shape[1])


def _exact(a, a_scale, b, b_scale, absolute: bool) -> torch.Tensor:
    """The float64 product of the dequantized operands (of their absolute values when
    ``absolute``), ``[..., N]``."""
    left = a.double() * a_scale.double()
    right = b.double() * b_scale.double()
    if absolute:
        left, right = left.abs(), right.abs()
    return (_rows(left) @ right).reshape(*a.shape[:-1], b.shape[1])


def unavailable_reason(device: torch.device, rowwise: bool) -> str | None:
    """Why ``torch._scaled_mm`` cannot make the reference on ``device`` with these scales (a GPU
    without fp8 GEMMs, or without row-wise ones), else None: a 16 x 16 x 16 product is tried."""
    gen = torch.Generator().manual_seed(0)
    a, b = _fp8(gen, (16, 16), device), _weight(gen, 16, 16, device)
    shapes = ((16, 1), (1, 16)) if rowwise else ((), ())
    try:
        scaled_mm(a, _scale(gen, shapes[0], device), b, _scale(gen, shapes[1], device))
    except Exception as exc:  # whatever torch raises for an unsupported device or scaling
        what = "row-wise" if rowwise else "tensor-wise"
        return f"torch._scaled_mm cannot run {what} on {device}: {type(exc).__name__}: {exc}"
    return None


def _ag_case(case, rowwise, device, group, seed, backend) -> ScaledResults:
    import tp_kernels

    world, rank = group.size(), dist.get_rank(group)
    gen = torch.Generator().manual_seed(seed)
    k = case.shard[-1]
    shards = [_fp8(gen, case.shard, device) for _ in range(world)]
    if rowwise:
        scales = [_scale(gen, (*case.shard[:-1], 1), device) for _ in range(world)]
        own_scale, a_scale = scales[rank], torch.cat(scales, case.dim)
    else:  # one scale, the same on every rank
        own_scale = a_scale = _scale(gen, (), device)
    bs = [_weight(gen, k, n, device) for n in case.ns]
    b_scales = [_scale(gen, (1, n) if rowwise else (), device) for n in case.ns]
    got = tp_kernels.all_gather_scaled_matmul(
        shards[rank], bs, own_scale, b_scales, case.dim, group, out_dtype=OUT_DTYPE,
        backend=backend,
    )  # fmt: skip
    a = torch.cat(shards, case.dim)
    refs, tols = [], []
    for b, b_scale in zip(bs, b_scales, strict=True):
        refs.append(scaled_mm(a, a_scale, b, b_scale))
        exact = _exact(a, a_scale, b, b_scale, absolute=False)
        magnitude = _exact(a, a_scale, b, b_scale, absolute=True)
        acc = ACCUMULATION * k * FP32_UNIT * magnitude
        tols.append(2 * UNIT * exact.abs() + 2 * acc + TINY)
    names = [f"out[{j}]" for j in range(len(bs))]
    return ScaledResults(names, list(got), refs, tols)


def _rs_case(case, rowwise, device, group, seed, backend) -> ScaledResults:
    import tp_kernels

    world, rank = group.size(), dist.get_rank(group)
    gen = torch.Generator().manual_seed(seed)
    shape = list(case.out)
    shape[case.dim] *= world
    ks = [case.k + s * case.k_step for s in range(world)]
    a = [_fp8(gen, (*shape, k), device) for k in ks]
    a_scale = [_scale(gen, (*shape, 1) if rowwise else (), device) for _ in ks]
    b = [_weight(gen, k, case.n, device) for k in ks]
    b_scale = [_scale(gen, (1, case.n) if rowwise else (), device) for _ in ks]
    got = tp_kernels.scaled_matmul_reduce_scatter(
        a[rank], b[rank], a_scale[rank], b_scale[rank], case.dim, group, out_dtype=OUT_DTYPE,
        backend=backend,
    )  # fmt: skip
    total = sum_abs = magnitude = None
    for s in range(world):  # in rank order, in fp32, as the op sums
        operands = (a[s], a_scale[s], b[s], b_scale[s])
        partial = scaled_mm(*operands).float()
        exact = _exact(*operands, absolute=False).abs()
        size = _exact(*operands, absolute=True)
        if total is None:
            total, sum_abs, magnitude = partial, exact, size
        else:
            total, sum_abs, magnitude = total + partial, sum_abs + exact, magnitude + size
    rows = case.out[case.dim]

    def mine(t: torch.Tensor) -> torch.Tensor:
        return t.narrow(case.dim, rank * rows, rows)

    acc = ACCUMULATION * max(ks) * FP32_UNIT * mine(magnitude)
    return ScaledResults(["out"], [got], [mine(total)], [3 * UNIT * mine(sum_abs) + 2 * acc + TINY])


def run_scaled_case(
    case: ScaledAGCase | ScaledRSCase,
    *,
    rowwise: bool,
    device: torch.device,
    group: dist.ProcessGroup,
    seed: int,
    backend: str,
) -> ScaledResults:
    """One call of ``case`` on this rank of ``group`` (collective: every rank runs it with the
    same arguments) through ``backend``, beside its reference and tolerance."""
    run = _ag_case if isinstance(case, ScaledAGCase) else _rs_case
    return run(case, rowwise, device, group, seed, backend)
