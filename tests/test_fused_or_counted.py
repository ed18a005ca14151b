"""Every call of a style either takes its fused path or counts a fallback, whatever form its input
takes (positional or keyword, local tensor or DTensor, even or uneven), and fused outputs have
the memory layout PyTorch's give them (callers ``.view()`` results).

Each form is one call on world size 2, counted with :func:`tp_kernels.comm_stats` (fused ops by
kind, ``fallback`` for PyTorch's path), and its output compared with PyTorch's styles on the same
model: values, strides and a ``.view(-1, features)``. A norm under ``SequenceParallel`` keeps an
uneven sequence's global shape (5 rows on 2 ranks used to come out as 6 and 4).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel as torch_tp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import tp_kernels as tpk

B, S, H = 2, 8, 12  # batch > 1; the sequence (dim 1) is what the ranks shard


class Attention(nn.Module):
    """``wo(wq(x) * wk(x))``; ``x`` by keyword, as Hugging Face calls ``self_attn``."""

    def __init__(self, linear: type[nn.Linear] = nn.Linear) -> None:
        super().__init__()
        self.wq, self.wk, self.wo = linear(H, H), linear(H, H), nn.Linear(H, H)

    def forward(self, hidden_states: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.wo(self.wq(hidden_states) * self.wk(hidden_states) * scale)


class TwoInputs(Attention):
    """Two sequence-sharded inputs gathered by one PrepareModuleInput."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.wo(self.wq(x) * self.wk(y))


class OwnForward(nn.Linear):
    """A Linear subclass with its own forward: never fused."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def _gather(**kw) -> dict:
    return dict(desired_input_layouts=(Replicate(),), input_layouts=(Shard(1),), **kw)


def _block_plan(styles, prepare: dict) -> dict:
    return {
        "": styles.PrepareModuleInput(**prepare),
        "wq": styles.ColwiseParallel(),
        "wk": styles.ColwiseParallel(),
        "wo": styles.RowwiseParallel(output_layouts=Shard(1)),
    }


KEYWORD = dict(
    input_kwarg_layouts={"hidden_states": Shard(1)},
    desired_input_kwarg_layouts={"hidden_states": Replicate()},
)

# name -> (model, plan(styles), inputs(x_local, mesh) -> (args, kwargs), expected counts)
# Counts per forward: "ag" all_gather_matmul, "rs" matmul_reduce_scatter, "fallback".
FORMS = {
    "colwise, local input": (
        lambda: nn.Linear(H, H),
        lambda st: st.ColwiseParallel(input_layouts=Shard(1)),
        lambda x, mesh, s: ((x,), {}),
        {"ag": 1},
    ),
    "colwise, DTensor input": (
        lambda: nn.Linear(H, H),
        lambda st: st.ColwiseParallel(input_layouts=Shard(1)),
        lambda x, mesh, s: ((DTensor.from_local(x, mesh, (Shard(1),)),), {}),
        {"ag": 1},
    ),
    "colwise, uneven DTensor input": (
        lambda: nn.Linear(H, H),
        lambda st: st.ColwiseParallel(input_layouts=Shard(1)),
        lambda x, mesh, s: ((_uneven(x, mesh),), {}),
        {"fallback": 1},
    ),
    "colwise, Linear subclass": (
        lambda: OwnForward(H, H),
        lambda st: st.ColwiseParallel(input_layouts=Shard(1)),
        lambda x, mesh, s: ((x,), {}),
        {"fallback": 1},
    ),
    "rowwise to Shard(1)": (
        lambda: nn.Linear(H, H),
        lambda st: st.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        lambda x, mesh, s: ((s,), {}),
        {"rs": 1},
    ),
    "rowwise to Shard(1), uneven": (
        lambda: nn.Linear(H, H),
        lambda st: st.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        lambda x, mesh, s: ((s[:, :-1],), {}),
        {"fallback": 1},
    ),
    "block, positional input": (
        Attention,
        lambda st: _block_plan(st, _gather()),
        lambda x, mesh, s: ((x,), {}),
        {"ag": 1, "rs": 1},
    ),
    "block, keyword input": (
        Attention,
        lambda st: _block_plan(st, KEYWORD),
        lambda x, mesh, s: ((), {"hidden_states": x, "scale": 0.5}),
        {"ag": 1, "rs": 1},
    ),
    "block, keyword layout but positional call": (
        Attention,
        lambda st: _block_plan(st, KEYWORD),
        # Neither library converts a positional input declared by keyword: x stays local and
        # full-length (every rank passes the whole sequence), nothing is gathered.
        lambda x, mesh, s: ((s,), {}),
        {"rs": 1},
    ),
    # As torchao's Float8Linear with a config the fused fp8 path does not take (tests/test_fp8.py):
    # the gather then takes PyTorch's path, which used to go uncounted.
    "block, children it does not recognise": (
        lambda: Attention(linear=OwnForward),
        lambda st: _block_plan(st, _gather()),
        lambda x, mesh, s: ((x,), {}),
        {"fallback": 1, "rs": 1},
    ),
    "block, two gathered inputs": (
        TwoInputs,
        lambda st: _block_plan(
            st,
            dict(input_layouts=(Shard(1), Shard(1)), desired_input_layouts=(Replicate(),) * 2),
        ),
        lambda x, mesh, s: ((x, x * 2), {}),
        {"fallback": 1, "rs": 1},
    ),
}


def _uneven(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """Rank 0 keeps one row fewer: a global sequence of S-1 over 2 ranks."""
    local = x[:, :-1] if mesh.get_local_rank() == 0 else x
    sizes = [S // 2 - 1, S // 2]
    shape = (B, sum(sizes), H)
    stride = (shape[1] * H, H, 1)
    return DTensor.from_local(local, mesh, (Shard(1),), shape=shape, stride=stride)


def _counts() -> dict:
    stats = tpk.comm_stats()
    counts = {
        "ag": stats.total("forward", "all_gather_matmul"),
        "rs": stats.total("forward", "matmul_reduce_scatter"),
        "fallback": stats.total(kind="fallback"),
    }
    return {k: n for k, n in counts.items() if n}


def _run_form(name: str) -> list[str]:
    build, plan, inputs, expected = FORMS[name]
    rank = dist.get_rank()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    torch.manual_seed(0)
    base = build()
    ours = tpk.parallelize_module(_copy(base), mesh, plan(tpk))
    theirs = torch_tp.parallelize_module(_copy(base), mesh, plan(torch_tp))
    g = torch.Generator().manual_seed(1)
    full = torch.randn(B, S, H, generator=g)
    x = full.chunk(2, dim=1)[rank]
    failures = []
    tpk.reset_comm_stats()
    args, kwargs = inputs(x, mesh, full)
    got = ours(*args, **kwargs)
    counts = _counts()
    if counts != expected:
        failures.append(f"{name}: counts {counts}, expected {expected}")
    want = theirs(*inputs(x, mesh, full)[0], **inputs(x, mesh, full)[1])
    got_l, want_l = (t.to_local() if isinstance(t, DTensor) else t for t in (got, want))
    if got_l.stride() != want_l.stride():
        failures.append(f"{name}: strides {got_l.stride()} != PyTorch's {want_l.stride()}")
    if not torch.allclose(got_l, want_l, rtol=1e-5, atol=1e-5):
        failures.append(f"{name}: values differ by {(got_l - want_l).abs().max():.3g}")
    # HF's logits.view(-1, vocab): wherever PyTorch's output allows it, ours must too (PyTorch's
    # own uneven reduce-scatter returns a layout that cannot be viewed so).
    if _viewable(want_l) and not _viewable(got_l):
        failures.append(f"{name}: .view(-1, features) fails on ours, works on PyTorch's")
    return failures


def _viewable(t: torch.Tensor) -> bool:
    try:
        t.view(-1, t.shape[-1])
    except RuntimeError:
        return False
    return True


def _copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


@pytest.mark.parametrize("form", list(FORMS))
def test_each_call_is_fused_or_counted_with_pytorch_s_layout(worlds, form: str) -> None:
    for failures in worlds(2).run(_run_form, form):
        assert failures == []


def _row_major_ops(backend: str) -> list[str]:
    """The fused ops on a dim other than 0, batch > 1: outputs row-major, as PyTorch's are."""
    world = dist.get_world_size()
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(dist.get_rank())
    a = torch.randn(3, 2, 5, generator=g, requires_grad=True)  # [B, s, K], gathered on dim 1
    b = torch.randn(5, 4, generator=g, requires_grad=True)
    gathered, (out,) = tpk.all_gather_matmul(a, [b], 1, group, backend=backend, return_a=True)
    rs = tpk.matmul_reduce_scatter(
        torch.randn(3, 2 * world, 5, generator=g), b, 1, group, backend=backend
    )
    failures = [
        f"{what}: stride {t.stride()} != {torch.empty(t.shape).stride()}"
        for what, t in (("all_gather_matmul out", out), ("gathered a", gathered), ("rs", rs))
        if not t.is_contiguous()
    ]
    (out.view(-1, 4).sum() + rs.view(-1, 4).sum()).backward()
    return failures


@pytest.mark.parametrize("backend", ["reference", "pipelined", "symm"])
def test_fused_ops_return_row_major_outputs(worlds, backend: str) -> None:
    if backend == "symm" and tpk.available_backends()["symm"] != "ok":
        pytest.skip(f"symm: {tpk.available_backends()['symm']}")
    for failures in worlds(2).run(_row_major_ops, backend):
        assert failures == []


def _sequence_parallel_uneven() -> list[str]:
    """A norm under SequenceParallel with a global sequence of 5 on 2 ranks (3 + 2 rows)."""
    import copy

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    torch.manual_seed(0)
    norm = nn.LayerNorm(H)
    ours = tpk.parallelize_module(copy.deepcopy(norm), mesh, tpk.SequenceParallel())
    theirs = torch_tp.parallelize_module(copy.deepcopy(norm), mesh, torch_tp.SequenceParallel())
    full = torch.randn(B, 5, H, generator=torch.Generator().manual_seed(3))
    local = full.tensor_split(2, dim=1)[dist.get_rank()]
    x = DTensor.from_local(local, mesh, (Shard(1),), shape=full.shape, stride=full.stride())
    got, want = ours(x), theirs(x)
    failures = [] if got.shape == want.shape else [f"global shape {got.shape} != {want.shape}"]
    # full_tensor() is a collective: only where every rank's shape is right (the old code gave
    # 6 rows on rank 0 and 4 on rank 1, and the gather would not have matched up).
    ok = torch.tensor([float(not failures)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item() and not torch.allclose(got.full_tensor(), want.full_tensor(), atol=1e-6):
        failures.append("full_tensor() differs from PyTorch's")
    return failures


def test_sequence_parallel_keeps_an_uneven_global_shape(worlds) -> None:
    for failures in worlds(2).run(_sequence_parallel_uneven):
        assert failures == []
