"""Backward computes only what is needed: matmul FLOPs and collectives against PyTorch's styles.

A sequence-parallel feed-forward block (one gather for ``w1`` and ``w3``, ``w2`` reduce-
scattered) runs forward and backward with PyTorch's styles and with tp_kernels' on the same
weights, for each pattern of what needs a gradient: everything; frozen weights and biases (the
input still needs its grad, as LoRA-style fine-tuning does); frozen biases; an input that needs
none; one of ``w1``/``w3`` frozen. In backward, every backend must run the same matmul FLOPs as
PyTorch's (``aten::mm``/``addmm`` events of the profiler, which sees inside the fused ops), issue
the collectives PyTorch's issues (an all-gather-matmul for each of its all-gathers, a matmul-
reduce-scatter for each of its reduce-scatters, counted by ``comm_stats``), gather a saved input
again only for a weight that needs its grad, and give the same gradients. Both ways into the
fused ops are covered: the eager path, and the custom ops that dispatch modes and torch.compile
see. Under ``CommDebugMode``, PyTorch's own ``test_mlp_training`` count holds (2 all-gathers,
1 reduce-scatter, forward and backward of an MLP whose input needs no grad).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import parallel as torch_tp
from torch.utils._python_dispatch import TorchDispatchMode

import tp_kernels as tpk

funcol = torch.ops.c10d_functional
BACKENDS = ("reference", "pipelined", "symm")
# What needs a grad: (input, {parameter name prefixes that are frozen}).
CASES = {
    "all": (True, ()),
    "frozen_weights": (True, ("w1.", "w2.", "w3.")),
    "frozen_bias": (True, ("w1.bias", "w2.bias", "w3.bias")),
    "input_no_grad": (False, ()),
    "mixed_w1_frozen": (True, ("w1.",)),
}
DIM, HIDDEN, ROWS = 16, 24, 8


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN), nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _plan(styles) -> dict:
    return {
        "": styles.PrepareModuleInput(
            input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)
        ),
        "w1": styles.ColwiseParallel(),
        "w3": styles.ColwiseParallel(),
        "w2": styles.RowwiseParallel(output_layouts=Shard(0)),
    }


_MATMULS = ("aten::mm", "aten::addmm")


def _runs_a_matmul(event) -> bool:
    return any(c.name in _MATMULS or _runs_a_matmul(c) for c in event.cpu_children)


def _matmul_flops(prof) -> int:
    """2*M*K*N summed over the matmuls that ran: the innermost ``aten::mm``/``addmm`` events
    (a DTensor op is recorded with its global shapes around the local op it runs)."""
    total = 0
    for event in prof.events():
        if event.name not in _MATMULS or _runs_a_matmul(event):
            continue
        shapes = event.input_shapes if event.name == "aten::mm" else event.input_shapes[1:]
        (m, k), (_, n) = shapes[0], shapes[1]
        total += 2 * m * k * n
    return total


def _step(styles_name: str, case: str, backend: str, custom_ops: bool) -> dict:
    """Forward and backward of the block on this rank; what backward ran, and the grads."""
    # Imported here, in the ranks: the profiler imports Triton, which the test session's modules
    # must first set TRITON_INTERPRET for (this module is collected before them).
    from torch.profiler import ProfilerActivity, profile

    styles = tpk if styles_name == "tp_kernels" else torch_tp
    input_grad, frozen = CASES[case]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = styles.parallelize_module(FeedForward(), mesh, _plan(styles))
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(frozen))
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(ROWS, DIM, requires_grad=input_grad)
    # Under a dispatch mode the fused ops take their custom ops; forward decides for backward.
    mode = _PassThrough if custom_ops else contextlib.nullcontext
    with tpk.use_backend(backend):
        # The second step is profiled: DTensor propagates the shardings of an op's first call
        # on fake tensors, which the profiler records as matmuls too.
        for _ in range(2):
            model.zero_grad()
            x.grad = None
            with mode():
                y = model(x)
                loss = (y.to_local() if isinstance(y, DTensor) else y).square().sum()
            tpk.reset_comm_stats()
            with mode(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                loss.backward()
    stats = tpk.comm_stats()
    grads = {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    if x.grad is not None:
        grads["x"] = x.grad
    return {
        "flops": _matmul_flops(prof),
        "all_gathers": stats.total("backward", "all_gather_matmul"),
        "reduce_scatters": stats.total("backward", "matmul_reduce_scatter"),
        "regathers": stats.total("backward", "all_gather"),
        "grads": grads,
    }


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing: under it the fused ops take their custom ops, the
    path torch.compile traces."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _pytorch_counts(case: str) -> dict[str, int]:
    """The collectives PyTorch's styles issue in this block's backward: the all-gather of the
    output grad for w2's input grad (whenever anything upstream needs a grad, w2's input does),
    and the reduce-scatter of the input grad (only when the input needs one)."""
    input_grad, frozen = CASES[case]
    upstream = input_grad or not all(any(n.startswith(f) for f in frozen) for n in ("w1.", "w3."))
    return {"all_gather": int(upstream), "reduce_scatter": int(input_grad)}


@pytest.mark.parametrize("custom_ops", [False, True], ids=["eager", "custom_ops"])
@pytest.mark.parametrize("case", list(CASES))
def test_backward_does_only_the_work_pytorch_does(worlds, case, custom_ops):
    world = worlds(2)
    theirs = world.run(_step, "torch", case, "reference", custom_ops)
    input_grad, frozen = CASES[case]
    colwise_weights_train = not all(
        any(f"{w}.weight".startswith(f) for f in frozen) for w in ("w1", "w3")
    )
    expected = _pytorch_counts(case)
    for backend in BACKENDS:
        ours = world.run(_step, "tp_kernels", case, backend, custom_ops)
        for rank, (mine, ref) in enumerate(zip(ours, theirs)):
            where = f"{case} {backend} rank {rank}"
            assert mine["flops"] == ref["flops"], where
            assert mine["all_gathers"] == expected["all_gather"], where
            assert mine["reduce_scatters"] == expected["reduce_scatter"], where
            assert mine["regathers"] == int(colwise_weights_train), where
            assert mine["grads"].keys() == ref["grads"].keys(), where
            for name, grad in ref["grads"].items():
                torch.testing.assert_close(mine["grads"][name], grad, msg=f"{where} {name}")


def _mlp_training_counts(styles_name: str, backend: str) -> dict[str, int]:
    """PyTorch's ``test_mlp_training`` with sequence parallel: MLP(10, 16, 10), input [8, 10]
    needing no grad, forward and backward under CommDebugMode."""
    from torch.distributed.tensor.debug import CommDebugMode  # imports Triton: see _step

    styles = tpk if styles_name == "tp_kernels" else torch_tp
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 10))
    plan = {
        "0": styles.ColwiseParallel(input_layouts=Shard(0)),
        "2": styles.RowwiseParallel(output_layouts=Shard(0)),
    }
    model = styles.parallelize_module(copy.deepcopy(model), mesh, plan)
    torch.manual_seed(dist.get_rank())
    x = torch.rand(8, 10)
    with tpk.use_backend(backend), CommDebugMode() as comm_mode:
        y = model(x)
        (y.to_local() if isinstance(y, DTensor) else y).sum().backward()
    counts = comm_mode.get_comm_counts()
    return {
        "all_gather": counts.get(funcol.all_gather_into_tensor, 0),
        "reduce_scatter": counts.get(funcol.reduce_scatter_tensor, 0),
    }


def test_pytorch_mlp_training_count(worlds):
    world = worlds(2)
    assert (
        world.run(_mlp_training_counts, "torch", "reference")
        == [{"all_gather": 2, "reduce_scatter": 1}] * 2
    )
    for backend in BACKENDS:
        assert (
            world.run(_mlp_training_counts, "tp_kernels", backend)
            == [{"all_gather": 2, "reduce_scatter": 1}] * 2
        ), backend
