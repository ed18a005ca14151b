"""PyTorch's own debugging tools on tp_kernels' styles, as PyTorch's TP tests use them.

* ``CommDebugMode`` counts each fused op as the collective it replaces (an all-gather-matmul as
  one ``all_gather_into_tensor``, a matmul-reduce-scatter as one ``reduce_scatter_tensor``, the
  backward likewise), under the module that issued it: the counts, total and per module, forward
  and backward, equal those of PyTorch's styles on the same model.
* Under ``LocalTensorMode`` (one process simulating every rank) the styles take PyTorch's path:
  the same values and gradients as PyTorch's styles, no crash.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor import parallel as torch_tp
from torch.distributed.tensor.debug import CommDebugMode

import tp_kernels as tpk

funcol = torch.ops.c10d_functional


def _plans(kind: str, styles) -> tuple[nn.Module, dict, object]:
    """A model, its plan in ``styles`` (tp_kernels or torch.distributed.tensor.parallel) and
    the input layout, for the three cases of PyTorch's TP style tests."""
    torch.manual_seed(0)
    if kind == "colwise":
        return nn.Linear(16, 12), {"": styles.ColwiseParallel(input_layouts=Shard(0))}, Shard(0)
    if kind == "rowwise":
        plan = {"": styles.RowwiseParallel(output_layouts=Shard(0))}
        return nn.Linear(16, 12), plan, Shard(1)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    plan = {
        "0": styles.ColwiseParallel(input_layouts=Shard(0)),
        "2": styles.RowwiseParallel(output_layouts=Shard(0)),
    }
    return mlp, plan, Shard(0)


def _counts(kind: str, styles_name: str, backend: str = "auto") -> dict:
    """Forward and backward of one case under CommDebugMode: total, per collective and per
    module counts, as strings (picklable)."""
    styles = tpk if styles_name == "tp_kernels" else torch_tp
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, plan, layout = _plans(kind, styles)
    model = styles.parallelize_module(copy.deepcopy(model), mesh, plan)
    x = distribute_tensor(torch.randn(8, 16), mesh, [Replicate()]).redistribute(mesh, [layout])
    x = x.to_local().requires_grad_()
    comm_mode = CommDebugMode()
    with tpk.use_backend(backend), comm_mode:
        out = model(x)
        forward = {str(k): v for k, v in comm_mode.get_comm_counts().items()}
        forward_total = comm_mode.get_total_counts()
        out.sum().backward()
    per_module = {
        name: {p: {str(k): v for k, v in c.items()} for p, c in passes.items()}
        for name, passes in comm_mode.comm_module_counts.items()
    }
    return {
        "forward": forward,
        "forward_total": forward_total,
        "all": {str(k): v for k, v in comm_mode.get_comm_counts().items()},
        "total": comm_mode.get_total_counts(),
        "per_module": per_module,
    }


@pytest.mark.parametrize(
    ("kind", "backend"),
    [("colwise", "auto"), ("rowwise", "auto"), ("mlp", "auto"), ("mlp", "reference")],
)
def test_comm_debug_mode_counts_what_pytorch_counts(worlds, kind, backend):
    ours = worlds(2).run(_counts, kind, "tp_kernels", backend)[0]
    theirs = worlds(2).run(_counts, kind, "torch")[0]
    gather, scatter = str(funcol.all_gather_into_tensor), str(funcol.reduce_scatter_tensor)
    expected_forward = {
        "colwise": {gather: 1},
        "rowwise": {scatter: 1},
        "mlp": {gather: 1, scatter: 1},
    }[kind]
    assert ours["forward"] == expected_forward, ours
    assert ours["forward_total"] == sum(expected_forward.values())
    # Backward: the collectives of the forward, swapped (the re-gather of the saved shard
    # replaces nothing in DTensor's path and is not counted).
    assert ours["total"] == 2 * ours["forward_total"], ours
    assert (ours["forward"], ours["all"], ours["total"]) == (
        theirs["forward"],
        theirs["all"],
        theirs["total"],
    )
    assert ours["per_module"] == theirs["per_module"]


_LOCAL_TENSOR_SCRIPT = textwrap.dedent(
    """
    import copy, json
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.distributed._functional_collectives import wait_tensor
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor import parallel as torch_tp
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import tp_kernels as tpk

    W = 3
    dist.init_process_group("fake", rank=0, world_size=W, store=FakeStore())
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8))
    x = torch.randn(2 * W, 8)

    def run(styles):
        with LocalTensorMode(W):
            mesh = init_device_mesh("cpu", (W,))
            plan = {
                "0": styles.ColwiseParallel(input_layouts=Shard(0)),
                "2": styles.RowwiseParallel(output_layouts=Shard(0)),
            }
            model = styles.parallelize_module(copy.deepcopy(mlp), mesh, plan)
            y = wait_tensor(model(distribute_tensor(x, mesh, [Shard(0)])))
            y.sum().backward()
            grad = wait_tensor(model[0].weight.grad.to_local())
            return {
                "y": {r: t.tolist() for r, t in y._local_tensors.items()},
                "grad": {r: t.tolist() for r, t in grad._local_tensors.items()},
            }

    tpk.reset_comm_stats()
    ours, theirs = run(tpk), run(torch_tp)
    print(json.dumps({"ours": ours, "theirs": theirs, "stats": str(dict(tpk.comm_stats()))}))
    """
)


def test_local_tensor_mode_takes_pytorch_path():
    pytest.importorskip("torch.distributed._local_tensor")
    out = subprocess.run(
        [sys.executable, "-c", _LOCAL_TENSOR_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ours"] == result["theirs"]
    assert "fallback" in result["stats"] and "all_gather_matmul" not in result["stats"]


def test_importing_tp_kernels_leaves_triton_alone():
    """CommDebugMode's module imports Triton, which must wait until ``TRITON_INTERPRET`` is set
    (the CPU tests set it before their first Triton import): tp_kernels registers with it only
    once it is loaded, at the first fused call."""
    script = "import sys, tp_kernels; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
