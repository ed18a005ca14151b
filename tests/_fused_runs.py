"""One forward and backward of a fused op through the public API, for tests that compare a
backend with ``reference`` and a float64 truth on cases of their own.

A case is any object with the fields used here: an all-gather case has ``shard`` (a_shard's shape
on every rank), ``dim``, ``ns`` (the N of each b) and ``return_a``; a reduce-scatter case has
``rows`` (a's shape without K, with the per-rank count in place of M), ``dim``, ``k``, ``n``,
``reduce_op`` and ``bias``. The data are drawn in float64 from a seed and cast per run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import tp_kernels as tpk


def draw(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


def ag_data(case, seed: int) -> dict[str, torch.Tensor]:
    """a_shard, every b_j, and the upstream gradients of every output (and of A)."""
    full = list(case.shard)
    full[case.dim % len(full)] *= dist.get_world_size()
    shapes = {"a": case.shard, "ga": tuple(full)}
    for j, n in enumerate(case.ns):
        shapes |= {f"b{j}": (case.shard[-1], n), f"g{j}": (*full[:-1], n)}
    return draw(seed, shapes)


def rs_data(case, seed: int) -> dict[str, torch.Tensor]:
    """a, b, the upstream gradient of the output, and a replicated bias (the same on every rank)."""
    rows = list(case.rows)
    out_rows = tuple(rows)
    rows[case.dim % len(rows)] *= dist.get_world_size()
    data = draw(seed, {"a": (*rows, case.k), "b": (case.k, case.n), "g": (*out_rows, case.n)})
    if case.bias:
        data["bias"] = draw(7, {"bias": (case.n,)})["bias"]
    return data


def _cast(data, dtype, magnitude):
    return {k: (v.abs() if magnitude else v).to(dtype) for k, v in data.items()}


def ag_run(case, data, backend: str, dtype, magnitude=False) -> list[torch.Tensor]:
    """[outs..., (A), d a_shard, d bs...] of one all_gather_matmul, forward and backward;
    ``magnitude``: on the absolute values (the size of the terms, for tolerances)."""
    t = _cast(data, dtype, magnitude)
    a_shard = t["a"].clone().requires_grad_()
    bs = [t[f"b{j}"].clone().requires_grad_() for j in range(len(case.ns))]
    a, outs = tpk.all_gather_matmul(
        a_shard, bs, case.dim, dist.group.WORLD, backend=backend, return_a=case.return_a
    )
    loss = sum((o * t[f"g{j}"]).sum() for j, o in enumerate(outs))
    results = [o.detach() for o in outs]
    if case.return_a:
        loss = loss + (a * t["ga"]).sum()  # d A: the addend of the backward's reduce-scatter
        results.append(a.detach())
    else:
        assert a is None
    loss.backward()
    return [*results, a_shard.grad, *(b.grad for b in bs)]


def rs_run(case, data, backend: str, dtype, magnitude=False) -> list[torch.Tensor]:
    """[out, d a, d b, (d bias)] of one matmul_reduce_scatter, forward and backward."""
    t = _cast(data, dtype, magnitude)
    a, b = t["a"].clone().requires_grad_(), t["b"].clone().requires_grad_()
    bias = t["bias"].clone().requires_grad_() if case.bias else None
    out = tpk.matmul_reduce_scatter(
        a, b, case.dim, dist.group.WORLD, reduce_op=case.reduce_op, backend=backend, bias=bias
    )
    (out * t["g"]).sum().backward()
    return [out.detach(), a.grad, b.grad] + ([bias.grad] if case.bias else [])
