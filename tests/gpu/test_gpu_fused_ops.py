"""The fused ops on CUDA, on one NCCL rank per GPU: every backend that runs, fp32 and bf16.

One test per (op, backend, dtype) runs a table of shapes, from 1x1 to medium, with dims that are
not multiples of any tile and sizes that differ across ranks where a real model has them differ
(a colwise weight's N, a rowwise weight's K). Each case checks the forward result and the
gradient of every input with the rule of tests/_numerics.py against an unsharded float64 truth,
twice: once with the plain single-GPU computation in the dtype as the reference whose own error
sets the tolerance, once with the reference backend's result in that role. One more test per
fused backend repeats calls and wants the same bits every time (a fixed reduction order, and for
symm both halves of its double buffer).

Tolerances: tests/_numerics.py argues its floors for W <= 4 partial sums; they hold for the 8
GPUs of a node as well. A partial sum ``p_s`` rounded to bf16 errs by at most ``2^-8 |p_s|``
(half an ulp of bf16's 8 significant bits; fp32: ``2^-24 |p_s|``), and ``sum_s |p_s|`` is at most
the magnitude ``|a| @ |b|`` that the floor scales, so the W roundings together stay within
``2^-8`` (fp32: ``2^-24``) of it whatever W is. The reference backend's NCCL reduction, which adds
in the dtype, rounds W - 1 running sums more: at most ``(W - 1) * 2^-8`` of the magnitude, 0.027
at W = 8, which is past bf16's 0.02 floor in the worst case, where every rounding goes the same
way. The allowance also holds twice the one-GPU result's own error, and independent roundings
add up like a random walk (about ``sqrt(W - 1) * 2^-9``, 0.005, at W = 8), so only systematically
aligned roundings could fail the reference backend on 8 GPUs; were it to happen, the bound is
the reference's, not a fused backend's.
``torch_symm_mem`` is held to the wider floors of ``_numerics.TORCH_SYMM_MEM_FLOOR`` (argued
there): the backward's addend is reduce-scattered by NCCL in the dtype and then added, outside
torch's op.

Inputs are drawn on the CPU from a per-case seed, so every rank builds the same whole problem;
truths are computed on the GPU. Shapes are sized for up to 8 GPUs; the ``M`` of a case grows with
the world size (every rank contributes its rows), the ``K`` of a reduce-scatter too.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable, Sequence

import pytest
import torch

import tp_kernels as tpk
from tp_kernels.testing.numerics import check_close, floors_for

pytestmark = pytest.mark.gpu

BACKENDS = ("reference", "pipelined", "symm", "torch_symm_mem")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
AG_NAMES = ("outs", "grad a_shard", "grad bs")
RS_NAMES = ("out", "grad a", "grad b", "grad bias")


@dataclasses.dataclass(frozen=True)
class AGCase:
    """``all_gather_matmul`` of ``a_shard`` (this shape on every rank, gathered along ``dim``)
    with ``bs[j] [K, N_j + rank * n_step]`` on each rank."""

    shard: tuple[int, ...]
    dim: int
    ns: tuple[int, ...]
    n_step: int = 0
    return_a: bool = False
    save_gathered_a: bool = False
    b_transposed: bool = False  # bs stored column-major (a transposed weight)


@dataclasses.dataclass(frozen=True)
class RSCase:
    """``matmul_reduce_scatter`` of ``a [*rows with W * rows[dim], K_r]`` and ``b [K_r, n]`` on
    rank ``r``, ``K_r = k + r * k_step``, scattered along ``dim``."""

    rows: tuple[int, ...]
    dim: int
    k: int
    n: int
    k_step: int = 0
    reduce_op: str = "sum"
    bias: bool = False
    b_transposed: bool = False


AG_CASES = [
    AGCase((1, 1), 0, (1,)),
    AGCase((3, 5), 0, (7,), n_step=1),
    AGCase((17, 33), 0, (9, 65, 1), return_a=True),
    AGCase((2, 5, 24), 1, (40,), n_step=3, save_gathered_a=True),
    AGCase((127, 129), 0, (255,), n_step=2, b_transposed=True),
    AGCase((333, 96), 0, (130, 64), return_a=True, save_gathered_a=True),
    AGCase((256, 1024), 0, (768, 256)),
    AGCase((128, 4096), 0, (512,), n_step=16),
]
RS_CASES = [
    RSCase((1,), 0, 1, 1),
    RSCase((3,), 0, 5, 7, k_step=1),
    RSCase((17,), 0, 64, 33, reduce_op="avg", bias=True),
    RSCase((2, 5), 1, 24, 40, k_step=3),
    RSCase((127,), 0, 129, 255, k_step=2, bias=True, b_transposed=True),
    RSCase((256,), 0, 512, 768),
    RSCase((64,), 0, 2048, 1024, k_step=16, reduce_op="avg"),
]


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32)


def _on(
    device: torch.device, dtype: torch.dtype, t: torch.Tensor, transposed: bool = False
) -> torch.Tensor:
    """``t`` rounded to ``dtype`` on ``device``; ``transposed``: the same values, column-major."""
    t = t.to(device=device, dtype=dtype)
    return t.t().contiguous().t() if transposed else t


def _abs_or_not(magnitude: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    return torch.abs if magnitude else (lambda t: t)


# ---------------------------------------------------------------- all_gather_matmul


@dataclasses.dataclass
class AGProblem:
    """The whole problem, the same on every rank: ``a`` (gathered), every rank's ``bs`` and the
    upstream gradients of its outputs (and of ``a`` where it is returned)."""

    a: torch.Tensor
    bs: list[list[torch.Tensor]]
    grad_out: list[list[torch.Tensor]]
    grad_a: list[torch.Tensor] | None


def _ag_problem(case: AGCase, world: int, dtype: torch.dtype, device, seed: int) -> AGProblem:
    gen = torch.Generator().manual_seed(seed)
    full = list(case.shard)
    full[case.dim] *= world
    k = full[-1]
    a = _on(device, dtype, _randn(gen, *full))
    widths = [[n + r * case.n_step for n in case.ns] for r in range(world)]
    bs = [[_on(device, dtype, _randn(gen, k, n), case.b_transposed) for n in row] for row in widths]
    grad_out = [[_on(device, dtype, _randn(gen, *full[:-1], n)) for n in row] for row in widths]
    grad_a = (
        [_on(device, dtype, _randn(gen, *full)) for _ in range(world)] if case.return_a else None
    )
    return AGProblem(a, bs, grad_out, grad_a)


def _ag_unsharded(p: AGProblem, case: AGCase, rank: int, dtype: torch.dtype, magnitude: bool):
    """This rank's ``(outs, grad a_shard, grad bs)`` computed unsharded in ``dtype`` from the
    whole problem; ``magnitude``: on absolute values (the size of the terms every result sums)."""
    val = _abs_or_not(magnitude)
    a = val(p.a).to(dtype, copy=True).requires_grad_()
    bs = [[val(b).to(dtype, copy=True).requires_grad_() for b in row] for row in p.bs]
    loss = 0
    for r, row in enumerate(bs):
        for b, g in zip(row, p.grad_out[r]):
            loss = loss + ((a @ b) * val(g).to(dtype)).sum()
        if p.grad_a is not None:
            loss = loss + (a * val(p.grad_a[r]).to(dtype)).sum()
    loss.backward()
    world = len(p.bs)
    outs = [(a @ b).detach() for b in bs[rank]]
    return outs, a.grad.chunk(world, case.dim)[rank], [b.grad for b in bs[rank]]


def _ag_fused(p: AGProblem, case: AGCase, nccl, backend: str):
    """This rank's ``(outs, grad a_shard, grad bs)`` and the returned ``a`` from the fused op."""
    rank, world = nccl.rank, nccl.world_size
    a_shard = p.a.chunk(world, case.dim)[rank].clone().requires_grad_()
    bs = [b.clone().requires_grad_() for b in p.bs[rank]]  # clone keeps column-major strides
    a, outs = tpk.all_gather_matmul(
        a_shard,
        bs,
        case.dim,
        nccl.group,
        backend=backend,
        return_a=case.return_a,
        save_gathered_a=case.save_gathered_a,
    )
    loss = sum((o * g).sum() for o, g in zip(outs, p.grad_out[rank]))
    if p.grad_a is not None:
        loss = loss + (a * p.grad_a[rank]).sum()
    loss.backward()
    return ([o.detach() for o in outs], a_shard.grad, [b.grad for b in bs]), a


def _ag_case(nccl, case: AGCase, dtype: torch.dtype, backend: str, seed: int) -> list[str]:
    p = _ag_problem(case, nccl.world_size, dtype, nccl.device, seed)
    truth, same, mag = (
        _ag_unsharded(p, case, nccl.rank, d, m)
        for d, m in ((torch.float64, False), (dtype, False), (torch.float64, True))
    )
    got, a = _ag_fused(p, case, nccl, backend)
    refs = {"single-GPU computation": same}
    if backend != "reference":
        refs["reference backend"] = _ag_fused(p, case, nccl, "reference")[0]
    failures = []
    if case.return_a and not torch.equal(a, p.a):
        failures.append("the returned a is not the gathered a_shards")
    failures += _compare(AG_NAMES, got, truth, refs, mag, floors_for(backend))
    return failures


# ---------------------------------------------------------------- matmul_reduce_scatter


@dataclasses.dataclass
class RSProblem:
    """The whole problem: ``a [.., M, .., sum K_r]``, ``b [sum K_r, n]``, the bias, the upstream
    gradient of the whole (unscattered) output, and where each rank's K slice starts."""

    a: torch.Tensor
    b: torch.Tensor
    bias: torch.Tensor | None
    grad: torch.Tensor
    k_offsets: list[int]


def _rs_problem(case: RSCase, world: int, dtype: torch.dtype, device, seed: int) -> RSProblem:
    gen = torch.Generator().manual_seed(seed)
    rows = list(case.rows)
    rows[case.dim] *= world
    ks = [case.k + r * case.k_step for r in range(world)]
    offsets = [sum(ks[:r]) for r in range(world + 1)]
    a = _on(device, dtype, _randn(gen, *rows, offsets[-1]))
    b = _on(device, dtype, _randn(gen, offsets[-1], case.n))
    bias = _on(device, dtype, _randn(gen, case.n)) if case.bias else None
    grad = _on(device, dtype, _randn(gen, *rows, case.n))
    return RSProblem(a, b, bias, grad, offsets)


def _rs_unsharded(p: RSProblem, case: RSCase, rank: int, dtype: torch.dtype, magnitude: bool):
    """This rank's ``(out, grad a, grad b[, grad bias])`` computed unsharded in ``dtype``."""
    val = _abs_or_not(magnitude)
    world = len(p.k_offsets) - 1
    ks = slice(p.k_offsets[rank], p.k_offsets[rank + 1])
    a = val(p.a).to(dtype, copy=True).requires_grad_()
    b = val(p.b).to(dtype, copy=True).requires_grad_()
    c = a @ b
    if case.reduce_op == "avg":
        c = c / world
    bias = None
    if p.bias is not None:
        bias = val(p.bias).to(dtype, copy=True).requires_grad_()
        c = c + bias
    (c * val(p.grad).to(dtype)).sum().backward()
    grads = (c.detach().chunk(world, case.dim)[rank], a.grad[..., ks], b.grad[ks])
    return grads + ((bias.grad,) if bias is not None else ())


def _rs_fused(p: RSProblem, case: RSCase, nccl, backend: str):
    rank, world = nccl.rank, nccl.world_size
    ks = slice(p.k_offsets[rank], p.k_offsets[rank + 1])
    a = p.a[..., ks].clone().requires_grad_()
    b = p.b[ks]
    b = (b.t().contiguous().t() if case.b_transposed else b.clone()).requires_grad_()
    bias = p.bias.clone().requires_grad_() if p.bias is not None else None
    out = tpk.matmul_reduce_scatter(
        a, b, case.dim, nccl.group, reduce_op=case.reduce_op, backend=backend, bias=bias
    )
    (out * p.grad.chunk(world, case.dim)[rank]).sum().backward()
    return (out.detach(), a.grad, b.grad) + ((bias.grad,) if bias is not None else ())


def _rs_case(nccl, case: RSCase, dtype: torch.dtype, backend: str, seed: int) -> list[str]:
    p = _rs_problem(case, nccl.world_size, dtype, nccl.device, seed)
    truth, same, mag = (
        _rs_unsharded(p, case, nccl.rank, d, m)
        for d, m in ((torch.float64, False), (dtype, False), (torch.float64, True))
    )
    got = _rs_fused(p, case, nccl, backend)
    refs = {"single-GPU computation": same}
    if backend != "reference":
        refs["reference backend"] = _rs_fused(p, case, nccl, "reference")
    return _compare(RS_NAMES, got, truth, refs, mag, floors_for(backend))


# ---------------------------------------------------------------- shared


def _flat(results: Sequence, names: Sequence[str]) -> list[tuple[str, torch.Tensor]]:
    """``[(name, tensor)]`` of a result tuple whose entries are tensors or lists of tensors."""
    out = []
    for name, item in zip(names, results):
        if isinstance(item, torch.Tensor):
            out.append((name, item))
        else:
            out += [(f"{name}[{j}]", t) for j, t in enumerate(item)]
    return out


def _compare(names, got, truth, refs: dict, mag, floors: dict) -> list[str]:
    """One line per result of ``got`` outside the tolerance of tests/_numerics.py (with the
    backend's ``floors``), for each same-dtype reference in ``refs`` (a description and a result
    tuple shaped like ``got``)."""
    failures = []
    flat_got, flat_truth, flat_mag = (_flat(r, names) for r in (got, truth, mag))
    for ref_name, ref in refs.items():
        for (name, g), (_, t), (_, r), (_, m) in zip(
            flat_got, flat_truth, _flat(ref, names), flat_mag, strict=True
        ):
            problem = check_close(name, g, t, r, m, floors)
            if problem is not None:
                failures.append(f"{problem} (tolerance from the {ref_name})")
    return failures


def _run_cases(cases: Sequence, run: Callable[..., list[str]]) -> list[str]:
    """``run(case, seed=i)`` for every case, each line prefixed with its case. An exception
    becomes a line too and ends the loop: the ranks may be out of step after it, so no further
    collective is started before :meth:`NcclWorld.check` shows what happened."""
    failures = []
    for i, case in enumerate(cases):
        try:
            failures += [f"case {i} {case}: {f}" for f in run(case, seed=i)]
        except Exception as exc:
            tb = "".join(traceback.format_exception(exc, limit=-4))
            failures.append(f"case {i} {case}: raised {type(exc).__name__}: {exc}\n{tb}")
            break
    return failures


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_all_gather_matmul(nccl, backend, dtype):
    nccl.require(backend)
    failures = _run_cases(
        AG_CASES, lambda case, seed: _ag_case(nccl, case, dtype, backend, seed=seed)
    )
    nccl.check(failures)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_matmul_reduce_scatter(nccl, backend, dtype):
    nccl.require(backend)
    failures = _run_cases(
        RS_CASES, lambda case, seed: _rs_case(nccl, case, dtype, backend, seed=seed)
    )
    nccl.check(failures)


def _same_bits_each_call(nccl, case, backend: str, repeats: int = 3) -> list[str]:
    """``repeats`` identical calls of ``case`` (forward and backward, bf16) must give the same
    bits: nothing in a backend may depend on timing, and symm alternates its buffer halves."""
    if isinstance(case, AGCase):
        p = _ag_problem(case, nccl.world_size, torch.bfloat16, nccl.device, seed=7)
        call = lambda: _flat(_ag_fused(p, case, nccl, backend)[0], AG_NAMES)
    else:
        p = _rs_problem(case, nccl.world_size, torch.bfloat16, nccl.device, seed=7)
        call = lambda: _flat(_rs_fused(p, case, nccl, backend), RS_NAMES)
    first = call()
    failures = []
    for i in range(2, repeats + 1):
        for (name, want), (_, got) in zip(first, call(), strict=True):
            if not torch.equal(got, want):
                failures.append(f"call {i}: {name} differs from call 1's")
    return failures


@pytest.mark.parametrize("backend", ["pipelined", "symm"])
def test_repeated_calls_give_the_same_bits(nccl, backend):
    nccl.require(backend)
    cases = [AG_CASES[-2], RS_CASES[-2]]
    nccl.check(_run_cases(cases, lambda case, seed: _same_bits_each_call(nccl, case, backend)))
