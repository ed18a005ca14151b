"""The fused ops on CUDA, on one NCCL rank per GPU: every backend that runs, fp32 and bf16.

One test per (op, backend, dtype) runs a table of shapes, from 1x1 to medium, with dims that are not
multiples of any tile and sizes that differ across ranks where a real model has them differ (a
colwise weight's N, a rowwise weight's K). Each case checks the forward result and the gradient of
every input with the rule of tp_kernels/testing/numerics.py against an unsharded float64 truth,
twice: once with the plain single-GPU computation in the dtype as the reference whose own error sets
the tolerance, once with the reference backend's result in that role. One more test per fused
backend repeats calls and wants the same bits every time (a fixed reduction order, and for symm both
halves of its double buffer).

Tolerances: tp_kernels/testing/numerics.py argues its floors for W <= 4 partial sums; they hold for
the 8 GPUs of a node as well. A partial sum ``p_s`` rounded to bf16 errs by at most ``2^-8 |p_s|``
(half an ulp of bf16's 8 significant bits; fp32: ``2^-24 |p_s|``), and ``sum_s |p_s|`` is at most
the magnitude ``|a| @ |b|`` that the floor scales, so the W roundings together stay within ``2^-8``
(fp32: ``2^-24``) of it whatever W is. The reference backend's NCCL reduction, which adds in the
dtype, rounds W - 1 running sums more: at most ``(W - 1) * 2^-8`` of the magnitude, 0.027 at W = 8,
which is past bf16's 0.02 floor in the worst case, where every rounding goes the same way. The
allowance also holds twice the one-GPU result's own error, and independent roundings add up like a
random walk (about ``sqrt(W - 1) * 2^-9``, 0.005, at W = 8), so only systematically aligned
roundings could fail the reference backend on 8 GPUs; were it to happen, the bound is the
reference's, not a fused backend's. ``torch_symm_mem`` is held to the wider floors of
``numerics.TORCH_SYMM_MEM_FLOOR`` (argued there): the backward's addend is reduce-scattered by NCCL
in the dtype and then added, outside torch's op.

Each case is ``tp_kernels.testing.fused_cases.run_case`` (the cases and the math gpu_check runs
too): inputs drawn on the CPU from a per-case seed, so every rank builds the same whole problem;
truths computed on the GPU. Shapes are sized for up to 8 GPUs; the ``M`` of a case grows with the
world size (every rank contributes its rows), the ``K`` of a reduce-scatter too.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence

import pytest
import torch

from tp_kernels.testing.fused_cases import AGCase, RSCase, run_case
from tp_kernels.testing.numerics import check_close, floors_for

pytestmark = pytest.mark.gpu

BACKENDS = ("reference", "pipelined", "symm", "torch_symm_mem")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


def _case(nccl, case: AGCase | RSCase, dtype: torch.dtype, backend: str, seed: int) -> list[str]:
    """One call of ``case`` through ``backend``, every result within tolerance of the truth twice:
    with the one-GPU computation's error, and with the reference backend's, setting it."""
    run = dict(dtype=dtype, device=nccl.device, group=nccl.group, seed=seed)
    found = run_case(case, backend=backend, **run)
    failures = []
    if "a" in found.names:
        index = found.names.index("a")
        if not torch.equal(found.got[index], found.reference[index]):
            failures.append("the returned a is not the gathered a_shards")
    refs = {"single-GPU computation": found.reference}
    if backend != "reference":
        refs["reference backend"] = run_case(case, backend="reference", **run).got
    for ref_name, ref in refs.items():
        for name, g, t, r, m in zip(
            found.names, found.got, found.truth, ref, found.magnitude, strict=True
        ):
            problem = check_close(name, g, t, r, m, floors_for(backend))
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
    failures = _run_cases(AG_CASES, lambda case, seed: _case(nccl, case, dtype, backend, seed))
    nccl.check(failures)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_matmul_reduce_scatter(nccl, backend, dtype):
    nccl.require(backend)
    failures = _run_cases(RS_CASES, lambda case, seed: _case(nccl, case, dtype, backend, seed))
    nccl.check(failures)


def _same_bits_each_call(nccl, case, backend: str, repeats: int = 3) -> list[str]:
    """``repeats`` identical calls of ``case`` (forward and backward, bf16) must give the same
    bits: nothing in a backend may depend on timing, and symm alternates its buffer halves."""

    def call():
        return run_case(
            case,
            dtype=torch.bfloat16,
            device=nccl.device,
            group=nccl.group,
            seed=7,
            backend=backend,
        )

    first = call()
    failures = []
    for i in range(2, repeats + 1):
        for name, want, got in zip(first.names, first.got, call().got, strict=True):
            if not torch.equal(got, want):
                failures.append(f"call {i}: {name} differs from call 1's")
    return failures


@pytest.mark.parametrize("backend", ["pipelined", "symm"])
def test_repeated_calls_give_the_same_bits(nccl, backend):
    nccl.require(backend)
    cases = [AG_CASES[-2], RS_CASES[-2]]
    nccl.check(_run_cases(cases, lambda case, seed: _same_bits_each_call(nccl, case, backend)))
