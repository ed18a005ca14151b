"""The cheap host path of the fused ops and styles stays right.

A shape class's plan (checks passed, backend chosen, signature agreed) is reused, so these check
what a reuse must still see: a changed setting or ``use_backend`` context, a changed shape (whose
checks run again), a peer that calls differently (the agreement still runs on a reused plan, when
consistency checks are on). Eager calls take the ``autograd.Function``\\ s (one node per fused op,
and per fused Linear of a style); under a dispatch mode the custom ops run, with the same values
and grads. Host time itself is measured by ``python -m tp_kernels.bench overhead``, not here.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode

import tp_kernels as tpk
from tp_kernels import config
from tp_kernels.bench import overhead

# The hot-path trace runs symm's Triton kernels in the interpreter (set before Triton's import).
os.environ["TRITON_INTERPRET"] = "1"


def _backends_used() -> list[str]:
    return [backend for (_, _, backend) in tpk.comm_stats()]


def _settings_are_seen() -> list[list[str]]:
    group = dist.group.WORLD
    a, b = torch.ones(8, 16), torch.ones(16, 4)
    seen = []
    try:
        for set_to in ("reference", "symm"):
            tpk.set_backend(set_to)
            tpk.reset_comm_stats()
            tpk.all_gather_matmul(a, [b], 0, group)
            tpk.matmul_reduce_scatter(a, b, 0, group)
            seen.append(_backends_used())
        with tpk.use_backend("pipelined"):
            tpk.reset_comm_stats()
            tpk.all_gather_matmul(a, [b], 0, group)
            seen.append(_backends_used())
    finally:
        config.BACKEND.reset()
    return seen


def test_a_reused_plan_sees_settings_and_contexts(worlds):
    for seen in worlds(2).run(_settings_are_seen):
        assert seen == [["reference", "reference"], ["symm", "symm"], ["pipelined"]]


def _new_shape_is_checked() -> str:
    group = dist.group.WORLD
    tpk.all_gather_matmul(torch.ones(8, 16), [torch.ones(16, 4)], 0, group)
    with pytest.raises(ValueError) as raised:
        tpk.all_gather_matmul(torch.ones(8, 16), [torch.ones(12, 4)], 0, group)
    return str(raised.value)


def test_a_new_shape_is_checked_again(worlds):
    for message in worlds(2).run(_new_shape_is_checked):
        assert "bs[0] has K=12" in message and "a_shard has K=16" in message


def _peer_calls_differently() -> str:
    group = dist.group.WORLD
    config.CHECK_CONSISTENCY.set(True)
    try:
        b = torch.ones(16, 4)
        tpk.all_gather_matmul(torch.ones(8, 16), [b], 0, group, backend="reference")
        rows = 8 if dist.get_rank() == 0 else 4  # rank 0 reuses its plan, rank 1 makes one
        with pytest.raises(ValueError) as raised:
            tpk.all_gather_matmul(torch.ones(rows, 16), [b], 0, group, backend="reference")
        return str(raised.value)
    finally:
        config.CHECK_CONSISTENCY.reset()


def test_a_reused_plan_still_agrees_with_the_peers(worlds):
    for message in worlds(2).run(_peer_calls_differently):
        assert "called with different arguments" in message
        assert "a=(8, 16)" in message and "a=(4, 16)" in message


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _both_paths(backend: str) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
    """Both ops (with a bias, avg and the gathered A) eagerly and under a dispatch mode: the
    autograd node each path creates, and every output and grad."""
    group = dist.group.WORLD
    nodes, results = [], []
    for mode in (contextlib.nullcontext, _PassThrough):
        torch.manual_seed(0)
        a = torch.randn(2, 6, 16, requires_grad=True)  # gathered along dim 1
        bs = [torch.randn(16, 4, requires_grad=True), torch.randn(16, 3, requires_grad=True)]
        c = torch.randn(2, 8, 16, requires_grad=True)  # scattered along dim 1
        w = torch.randn(16, 5, requires_grad=True)
        bias = torch.randn(5, requires_grad=True)
        with mode():
            gathered, outs = tpk.all_gather_matmul(a, bs, 1, group, backend=backend, return_a=True)
            y = tpk.matmul_reduce_scatter(
                c, w, 1, group, backend=backend, reduce_op="avg", bias=bias
            )
        nodes += [type(outs[0].grad_fn).__name__, type(y.grad_fn).__name__]
        loss = sum((o * (i + 1)).square().sum() for i, o in enumerate(outs))
        (loss + gathered.sum() + y.square().sum()).backward()
        tensors = [gathered, *outs, y, a.grad, *(b.grad for b in bs), c.grad, w.grad, bias.grad]
        results.append([t.detach() for t in tensors])
    return nodes, results[0], results[1]


@pytest.mark.parametrize("backend", ["reference", "pipelined", "symm"])
def test_eager_and_custom_op_paths_agree(worlds, backend):
    for nodes, eager, custom in worlds(2).run(_both_paths, backend):
        # Eager: the views of the Functions' outputs; under the mode: of the custom ops'.
        assert "Generated" not in "".join(nodes[:2]), nodes
        for got, want in zip(eager, custom):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def _sequence_parallel_mlp() -> nn.Module:
    """Colwise(Shard(0)) -> Rowwise(output Shard(0)), 16 -> 32 -> 16, on the world's ranks."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    plan = {
        "0": tpk.ColwiseParallel(input_layouts=Shard(0)),
        "1": tpk.RowwiseParallel(output_layouts=Shard(0)),
    }
    tpk.parallelize_module(model, mesh, plan)
    return model


def _style_nodes() -> list[str]:
    model = _sequence_parallel_mlp()
    x = torch.randn(4, 16, requires_grad=True)
    h = model[0](x)
    y = model[1](h)
    return [type(h).__name__, type(h.grad_fn).__name__, type(y).__name__, type(y.grad_fn).__name__]


def test_a_fused_linear_is_one_autograd_node(worlds):
    for nodes in worlds(2).run(_style_nodes):
        assert nodes == [
            "Tensor",
            "AllGatherMatmulBackward",
            "Tensor",
            "MatmulReduceScatterBackward",
        ]


def test_an_eager_colwise_call_runs_fourteen_modules(worlds):
    """One eager colwise Linear forward on symm's Triton path (the GPU's protocol) runs the code
    of these fourteen modules of tp_kernels and no others (17 before the ops were one module
    each; 10 before the kernels' tiles were chosen by ``kernels/tuning.py``, whose lookup each
    call makes; 11 before planning's helpers moved to the modules named for them: the layout,
    the DTensor helpers, the counters): the path a newcomer reads. The kernel's and the copier's
    modules must be among them, so a run that silently took the torch path fails; the backend's
    choice must not, as a reused plan never asks it."""
    pytest.importorskip("triton")
    for modules, _ in worlds(2).run(overhead.hot_path):
        assert "kernels/ag_matmul.py" in modules and "backends/symm_gather.py" in modules
        assert modules == [
            "styles.py",
            "ops/dtensors.py",
            "ops/ag_matmul.py",
            "ops/planning.py",
            "ops/comm_stats.py",
            "config.py",
            "backends/base.py",
            "deadline.py",
            "ops/layout.py",
            "backends/symm.py",
            "backends/symm_gather.py",
            "kernels/ag_matmul.py",
            "kernels/_shared.py",
            "kernels/tuning.py",
        ]


def _copied_after_a_call() -> list[str]:
    import copy

    model = _sequence_parallel_mlp()
    x = torch.randn(4, 16)
    want = model(x)
    copied = copy.deepcopy(model)  # after a call: the styles hold their resolved group
    got = copied(x)
    return [] if torch.equal(got, want) else [f"the copy differs by {(got - want).abs().max()}"]


def test_a_parallelized_model_copies_after_a_call(worlds):
    """The styles keep their mesh's group once resolved; a ProcessGroup cannot be copied, so a
    ``copy.deepcopy`` of a model that has run (an EMA copy, a checkpoint) must leave it out."""
    for failures in worlds(2).run(_copied_after_a_call):
        assert failures == []


def _grouped_copy_after_a_call() -> list[str]:
    """A block whose PrepareModuleInput groups its colwise children, run, copied, the copy's
    weights changed: the copy must compute with its own weights (PyTorch's styles on the same
    changed weights say what that is)."""
    import copy

    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import style as torch_styles

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))

    def plan(styles) -> dict:
        return {
            "": styles.PrepareModuleInput(
                input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)
            ),
            "0": styles.ColwiseParallel(),
            "1": styles.RowwiseParallel(output_layouts=Shard(0)),
        }

    model = tpk.parallelize_module(copy.deepcopy(base), mesh, plan(tpk))
    x = torch.randn(4, 16)
    model(x)
    copied = copy.deepcopy(model)  # after a call: the group knows the original's children
    with torch.no_grad():
        copied[0].weight.mul_(2)
        base[0].weight.mul_(2)
    want = tpk.parallelize_module(base, mesh, plan(torch_styles))(x)
    fused_weights = []  # the weights each fused gather of the copy's forward multiplies

    def spy(x, weights, *args, **kwargs):
        fused_weights.extend(weights)
        return colwise_linears(x, weights, *args, **kwargs)

    from tp_kernels import styles

    colwise_linears = styles.colwise_linears
    styles.colwise_linears = spy
    try:
        got = copied(x)
    finally:
        styles.colwise_linears = colwise_linears
    failures = []
    if len(fused_weights) != 1 or fused_weights[0] is not copied[0].weight:
        failures.append("the copy's fused gather did not multiply the copy's weight alone")
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        failures.append(f"the copy differs from its weights' result by {(got - want).abs().max()}")
    return failures


def test_a_copy_of_a_grouping_block_computes_with_its_own_weights(worlds):
    """Before, the grouping PrepareModuleInput's hooks closed over its group, which a deepcopy
    shares: the copy's hook ran the original's fused gather with the original's children
    (their weights; outputs no child of the copy claimed), and each child of the copy then ran
    PyTorch's path on the gathered input: right values, the fused work wasted on the original's
    weights."""
    for failures in worlds(2).run(_grouped_copy_after_a_call):
        assert failures == []
