"""One fused call, forward and backward, checked against float64: the cases and the math that
``gpu_check``, the GPU tests and the suite share.

A case draws its whole problem from a seed (fp32 on the CPU, rounded once to the dtype), so every
rank rebuilds every rank's shards; it runs this rank's part through the public op, then computes
the same results from the whole problem three ways: in float64 (the truth), in the dtype on one
device (the reference, whose own error sets the tolerance: :mod:`tp_kernels.testing.numerics`)
and in float64 on absolute values (the magnitude of the terms summed).

* ``a, outs = all_gather_matmul(a_shard, bs, d)``; with ``A = cat_s a_shard(s)`` along ``d``, the
  upstream gradients ``G[s][j]`` of rank ``s``'s ``outs[j]`` and ``GA[s]`` of its ``a``:
  ``outs[j] = A @ bs_r[j]``, ``a = A``, ``grad a_shard = chunk_r(sum_s sum_j G[s][j] @ bs_s[j]^T +
  sum_s GA[s])``, ``grad bs_r[j] = A^T G[r][j]`` (leading dims flattened).
* ``out = matmul_reduce_scatter(a_r, b_r, d, bias=bias)``; with the whole ``a = [.., W*m, ..,
  K]`` (rank ``r`` holds its columns ``K_r``, and the rows ``K_r`` of the whole ``b``), ``c = a @
  b`` (``/ W`` for avg) and the upstream gradient ``G`` of the whole output: ``out = chunk_r(c) +
  bias``, ``grad a_r = (G @ b^T)[.., K_r]``, ``grad b_r = (a^T G)[K_r]`` (both ``/ W`` for avg),
  ``grad bias = G`` summed over all its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tp_kernels.testing.numerics import FLOOR, error_ratio

__all__ = ["AGCase", "CaseResults", "RSCase", "run_case"]


@dataclass(frozen=True)
class AGCase:
    """One ``all_gather_matmul`` call: ``a_shard`` of shape ``shard`` on every rank, gathered
    along ``dim``; rank ``r``'s ``bs[j]`` is ``[K, ns[j] + r * n_step]`` (column-major with
    ``b_transposed``, as a Linear's transposed weight is); ``return_a`` returns the gathered ``a``
    and feeds a gradient into it; ``save_gathered_a`` is the op's argument."""

    shard: tuple[int, ...]
    dim: int
    ns: tuple[int, ...]
    n_step: int = 0
    return_a: bool = False
    save_gathered_a: bool = False
    b_transposed: bool = False


@dataclass(frozen=True)
class RSCase:
    """One ``matmul_reduce_scatter`` call whose output on every rank is ``rows + (n,)``,
    scattered along ``dim``; rank ``r`` holds ``K_r = k + r * k_step`` columns of ``a`` (and
    ``b``'s rows, column-major with ``b_transposed``)."""

    rows: tuple[int, ...]
    dim: int
    k: int
    n: int
    k_step: int = 0
    reduce_op: str = "sum"
    bias: bool = False
    b_transposed: bool = False


@dataclass
class CaseResults:
    """This rank's results of one call (``got``) beside the same results from the whole problem:
    ``truth`` (float64), ``reference`` (the dtype, one device) and ``magnitude``; ``names`` says
    which result each entry is."""

    names: list[str]
    got: list[torch.Tensor]
    truth: list[torch.Tensor]
    reference: list[torch.Tensor]
    magnitude: list[torch.Tensor]

    def worst(self, floors: dict[torch.dtype, float] = FLOOR) -> tuple[float, str]:
        """The largest error ratio (:func:`~tp_kernels.testing.numerics.error_ratio`; at most 1
        is within tolerance) and the name of its result."""
        ratios = [
            (error_ratio(g, t, r, m, floors), name)
            for name, g, t, r, m in zip(
                self.names, self.got, self.truth, self.reference, self.magnitude, strict=True
            )
        ]
        return max(ratios, key=lambda item: item[0], default=(0.0, "-"))


def _randn(gen: torch.Generator, shape: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    # Drawn in fp32 on the CPU from one generator, so every rank draws the same whole problem;
    # rounded once to the dtype: those are the values every computation, the truth included, sees.
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def _column_major(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``t``'s values in a new tensor, column-major when ``transposed``."""
    return t.t().contiguous().t() if transposed else t.clone()


def _as(t: torch.Tensor, f64: bool, absolute: bool) -> torch.Tensor:
    """``t`` for one of the three computations: the truth (float64), the one-device reference (its
    own dtype) or the magnitude (float64 of ``|t|``)."""
    t = t.abs() if absolute else t
    return t.double() if f64 else t


def _ag_math(a, bs, gs, gas, rank: int, dim: int) -> list[torch.Tensor]:
    """Rank ``rank``'s ``[outs..., a, grad a_shard, grad bs...]`` (``a`` only when ``gas``) of the
    whole problem, in the dtype of the tensors given. ``bs[s][j]``, ``gs[s][j]``: rank ``s``'s
    weights and its outputs' upstream gradients; ``gas[s]``: the gradient of rank ``s``'s ``a``."""
    world, k = len(bs), a.shape[-1]
    outs = [a @ b for b in bs[rank]]
    # One product over every rank's outputs, as the fused backward makes one per rank.
    grad_a = (
        torch.cat([g for row in gs for g in row], dim=-1)
        @ torch.cat([b for row in bs for b in row], dim=1).t()
    )
    if gas is not None:
        for ga in gas:
            grad_a = grad_a + ga
    flat = a.reshape(-1, k).t()
    grad_bs = [flat @ g.reshape(-1, g.shape[-1]) for g in gs[rank]]
    returned = [a] if gas is not None else []
    return [*outs, *returned, grad_a.chunk(world, dim)[rank], *grad_bs]


def _ag_case(
    case: AGCase, dtype, device, group: dist.ProcessGroup, seed: int, backend: str
) -> CaseResults:
    import tp_kernels

    rank, world = dist.get_rank(group), group.size()
    gen = torch.Generator().manual_seed(seed)
    full = list(case.shard)
    full[case.dim] *= world
    k = full[-1]
    widths = [[n + r * case.n_step for n in case.ns] for r in range(world)]
    a = _randn(gen, full, dtype, device)
    bs = [[_randn(gen, (k, n), dtype, device) for n in row] for row in widths]
    gs = [[_randn(gen, (*full[:-1], n), dtype, device) for n in row] for row in widths]
    gas = [_randn(gen, full, dtype, device) for _ in range(world)] if case.return_a else None

    a_shard = a.chunk(world, case.dim)[rank].contiguous().requires_grad_()
    mine = [_column_major(b, case.b_transposed).requires_grad_() for b in bs[rank]]
    a_out, outs = tp_kernels.all_gather_matmul(
        a_shard,
        mine,
        case.dim,
        group,
        backend=backend,
        return_a=case.return_a,
        save_gathered_a=case.save_gathered_a,
    )
    tensors, grads = list(outs), list(gs[rank])
    if case.return_a:
        tensors.append(a_out)
        grads.append(gas[rank])
    torch.autograd.backward(tensors, grads)
    got = [o.detach() for o in outs] + ([a_out.detach()] if case.return_a else [])
    got += [a_shard.grad, *(b.grad for b in mine)]

    def on(f64: bool, absolute: bool) -> list[torch.Tensor]:
        c = lambda t: _as(t, f64, absolute)
        return _ag_math(
            c(a),
            [[c(b) for b in row] for row in bs],
            [[c(g) for g in row] for row in gs],
            None if gas is None else [c(t) for t in gas],
            rank,
            case.dim,
        )

    names = [f"out[{j}]" for j in range(len(outs))] + (["a"] if case.return_a else [])
    names += ["grad a_shard"] + [f"grad b[{j}]" for j in range(len(mine))]
    return CaseResults(names, got, on(True, False), on(False, False), on(True, True))


def _rs_math(a, b, bias, g, rank: int, world: int, case: RSCase, ks: slice) -> list[torch.Tensor]:
    """Rank ``rank``'s ``[out, grad a, grad b(, grad bias)]`` of the whole problem, in the dtype
    of the tensors given."""
    n = b.shape[1]
    c = a @ b
    grad_a = g @ b.t()
    grad_b = a.reshape(-1, a.shape[-1]).t() @ g.reshape(-1, n)
    if case.reduce_op == "avg":
        c, grad_a, grad_b = c / world, grad_a / world, grad_b / world
    if bias is None:
        return [c.chunk(world, case.dim)[rank], grad_a[..., ks], grad_b[ks]]
    out = (c + bias).chunk(world, case.dim)[rank]
    # The bias is replicated: its gradient is the whole output's, summed over every row.
    return [out, grad_a[..., ks], grad_b[ks], g.reshape(-1, n).sum(0)]


def _rs_case(
    case: RSCase, dtype, device, group: dist.ProcessGroup, seed: int, backend: str
) -> CaseResults:
    import tp_kernels

    rank, world = dist.get_rank(group), group.size()
    gen = torch.Generator().manual_seed(seed)
    rows = list(case.rows)
    rows[case.dim] *= world
    widths = [case.k + r * case.k_step for r in range(world)]
    start = sum(widths[:rank])
    ks = slice(start, start + widths[rank])
    a = _randn(gen, (*rows, sum(widths)), dtype, device)
    b = _randn(gen, (sum(widths), case.n), dtype, device)
    bias = _randn(gen, (case.n,), dtype, device) if case.bias else None
    g = _randn(gen, (*rows, case.n), dtype, device)

    a_r = a[..., ks].contiguous().requires_grad_()
    b_r = _column_major(b[ks], case.b_transposed).requires_grad_()
    bias_r = bias.clone().requires_grad_() if bias is not None else None
    out = tp_kernels.matmul_reduce_scatter(
        a_r, b_r, case.dim, group, reduce_op=case.reduce_op, backend=backend, bias=bias_r
    )
    out.backward(g.chunk(world, case.dim)[rank])
    got = [out.detach(), a_r.grad, b_r.grad] + ([bias_r.grad] if bias is not None else [])

    def on(f64: bool, absolute: bool) -> list[torch.Tensor]:
        c = lambda t: None if t is None else _as(t, f64, absolute)
        return _rs_math(c(a), c(b), c(bias), c(g), rank, world, case, ks)

    names = ["out", "grad a", "grad b"] + (["grad bias"] if bias is not None else [])
    return CaseResults(names, got, on(True, False), on(False, False), on(True, True))


def run_case(
    case: AGCase | RSCase,
    *,
    dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup,
    seed: int,
    backend: str,
) -> CaseResults:
    """One call of ``case`` on this rank of ``group`` (collective: every rank runs it with the
    same arguments), forward and backward through ``backend``, beside its truth."""
    run = _ag_case if isinstance(case, AGCase) else _rs_case
    return run(case, dtype, device, group, seed, backend)
