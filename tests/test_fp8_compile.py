"""torchao's Float8Linear on the fused path under torch.compile (tp_kernels/ops/scaled_compiled.py).

The SwiGLU block of tests/test_fp8.py (its PrepareModuleInput gathers, w1/w3 colwise, w2 rowwise
to ``Shard(1)``), converted with a recipe and compiled whole with ``torch.compile(model)``, runs
one training step at W=2: zero fallbacks, no graph break, each fused fp8 call counted once each
way per Linear boundary (the custom ops count themselves when the graph runs, as the eager calls
do) with fp8 bytes on the wire, and the values of the eager fused path and of torchao under
PyTorch's styles.

Compilers: the whole step under ``aot_eager`` (dynamo and AOTAutograd, the graphs run by eager
kernels), where every result can be held to the eager fused path's bit for bit; the forward
under inductor (the default), against the eager forward computed as inductor computes the
block's pointwise product (see that test). A whole inductor step takes about 60 s on two shared
cores, and its backward's fused pointwise kernels round bf16 where eager cannot mirror them.

Tolerances: under ``aot_eager`` the same aten ops run in the same order on the same values as
on the eager fused path (torchao's casts are aten ops on a tensor subclass that AOTAutograd
unwraps; behind the custom ops run the same fused calls and collectives), so every result
equals the eager fused path's, and torchao's under PyTorch's styles within what
tests/test_fp8.py's ``_check_fused`` allows at W=2 (output and input grad exact on
``reference``; weight grads within one bf16 rounding of the row order).
"""

from __future__ import annotations

import pytest
import torch

import tp_kernels as tpk
from tests.test_fp8 import B, H, _block_pair, _check_fused, _norm_error, _step

pytest.importorskip("torchao.float8")


def _compiled_step(recipe: str, backend: str) -> dict:
    """One training step of the block compiled, against the eager fused step (``"vs eager"``:
    equal?) and torchao under PyTorch's styles (``exact``, ``error``: see ``_check_fused``);
    the counters and bytes of both steps, and the compiled one's graph breaks."""
    import torch._dynamo.utils as dynamo_utils

    ours, theirs, x, names = _block_pair(recipe, torch.bfloat16)
    eager_model = _block_pair(recipe, torch.bfloat16)[0]  # the same seed: the same block
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    compiled = torch.compile(ours, backend="aot_eager")
    tpk.reset_comm_stats()
    with tpk.use_backend(backend):
        got = _step(compiled, x)
    counts = tpk.comm_stats()
    breaks = sum(dynamo_utils.counters["graph_break"].values())
    tpk.reset_comm_stats()
    with tpk.use_backend(backend):
        eager = _step(eager_model, x)
    eager_counts = tpk.comm_stats()
    want = _step(theirs, x)
    return {
        "vs eager": {n: torch.equal(a, b) for n, a, b in zip(names, got, eager)},
        "exact": {n: torch.equal(a, b) for n, a, b in zip(names, got, want)},
        "error": {n: _norm_error(a, b) for n, a, b in zip(names, got, want)},
        "counts": dict(counts),
        "sent": dict(counts.sent_bytes),
        "breaks": breaks,
        "eager counts": (dict(eager_counts), dict(eager_counts.sent_bytes)),
    }


# The amax all-reduces a compiled backward does not repeat: AOTAutograd merges identical calls
# of a functional op in one graph (CSE), and a tensor-wise recipe casts each Linear's output
# gradient twice with the same amax (torchao's grad_output and grad_output_for_grad_weight
# casts, both tensor-wise e5m2: for the input grad and for the weight grad), so the block's
# three Linears all-reduce three amaxes fewer. The row-wise recipe's two gradient casts reduce
# different dims (per row, per column): nothing to merge.
_MERGED_AMAXES = {"rowwise": 0, "tensorwise": 3}


def _check_against_eager(result: dict, recipe: str, backend: str) -> list[str]:
    """The compiled step's values and counters against the eager fused step's."""
    failures = [f"{n} differs from the eager fused path" for n, same in
                result["vs eager"].items() if not same]  # fmt: skip
    if result["breaks"]:
        failures.append(f"{result['breaks']} graph breaks")
    counts, sent = result["counts"], result["sent"]
    eager_counts, eager_sent = result["eager counts"]
    amax = ("backward", "amax_all_reduce", backend)
    want = dict(eager_counts)
    want[amax] -= _MERGED_AMAXES[recipe]
    if counts != want:
        failures.append(f"counts {counts}, expected {want}")
    if {k: n for k, n in sent.items() if k != amax} != {
        k: n for k, n in eager_sent.items() if k != amax
    }:
        failures.append(f"sent {sent}, the eager path sent {eager_sent}")
    return failures


@pytest.mark.parametrize(
    "recipe, backend",
    [("rowwise", "reference"), ("tensorwise", "reference"), ("rowwise", "pipelined")],
)
def test_a_compiled_float8_block_fuses_with_the_eager_path_s_numerics(worlds, recipe, backend):
    for result in worlds(2).run(_compiled_step, recipe, backend):
        assert _check_against_eager(result, recipe, backend) == []
        assert _check_fused(result, recipe, "bfloat16", 2, backend) == []


def _inductor_forward(recipe: str) -> dict:
    """The block's forward compiled by inductor against the eager fused path's, whose SwiGLU
    product is computed as inductor's fused kernel computes it (see the test)."""
    import torch.nn.functional as F

    ours, _, x, _ = _block_pair(recipe, torch.bfloat16)
    eager = _block_pair(recipe, torch.bfloat16)[0]
    torch._dynamo.reset()
    compiled = torch.compile(ours)  # inductor
    tpk.reset_comm_stats()
    with tpk.use_backend("reference"), torch.no_grad():
        got = compiled(x)
        counts = tpk.comm_stats()
        as_written = eager(x)
        # The product in fp32, rounded once: an instance forward, so the module's hooks (the
        # grouped fp8 gather) still run around it.
        w1, w2, w3 = eager.w1, eager.w2, eager.w3
        eager.forward = lambda h: w2((F.silu(w1(h).float()) * w3(h).float()).to(torch.bfloat16))
        want = eager(x)
    return {
        "equal": torch.equal(got, want),
        "error as written": _norm_error(got, as_written),
        "counts": dict(counts),
        "sent": dict(counts.sent_bytes),
    }


def test_an_inductor_compiled_float8_forward_is_the_eager_fused_forward(worlds):
    """Inductor fuses ``silu(w1(x)) * w3(x)`` into one kernel that computes in fp32 and rounds
    once to bf16, where eager rounds ``silu`` to bf16 first; w2's fp8 cast then moves an element
    that one bf16 rounding put on the other side of an fp8 bucket edge by one fp8 step (e4m3:
    2^-3 of it), about 1 element in 2^5, so the output differs from the block as written by
    about 2^-6 norm-relative. With that product computed as inductor does, eagerly, the fused
    path's output is the same bit for bit: inductor's casts (amax, scale, fp8) around the custom
    ops are torchao's. Forward only: inductor's fused backward of silu reorders fp32 arithmetic
    that eager cannot mirror exactly; tests above check the whole step under ``aot_eager``."""
    rows = B * 8  # this rank's tokens
    want_counts = {
        ("forward", "scaled_all_gather_matmul", "reference"): 1,
        ("forward", "scaled_matmul_reduce_scatter", "reference"): 1,
        ("forward", "amax_all_reduce", "reference"): 2,  # w2's input and weight: K sharded
    }
    for result in worlds(2).run(_inductor_forward, "rowwise"):
        assert result["equal"]
        assert result["error as written"] <= 2**-4, result["error as written"]
        assert result["counts"] == want_counts
        # fp8 rows with their scales packed beside them, to the one peer
        gathered = result["sent"][("forward", "scaled_all_gather_matmul", "reference")]
        assert gathered == rows * (H + 16)
