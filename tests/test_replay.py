"""The symm backend's protocol under CUDA graph replay, on the CPU.

A TP MLP step (forward and backward: the all-gather-matmul, the matmul-reduce-scatter, the
backward's all-gather-matmul, matmul-reduce-scatter and re-gather, and the ops between them) runs
once eagerly (the warmup: it makes the workspaces and state), is recorded once through the Triton
path (:mod:`_replay`: every launch with its arguments, every copy and word, every op, in order),
then replayed several times with new inputs copied into the recorded input tensors, as a CUDA
graph replays a captured step. Every replay must match an unsharded float64 computation. The
copies start late in every replay, so that a wait that ends early reads the previous replay's
data: the control, which replays with the words left as the previous replay raised them (what
the host-side epochs of the previous protocol amounted to under a replay), must give wrong values.
"""

from __future__ import annotations

import os

# Must precede the first import of triton (in this process and in the ranks).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _replay import Recorder  # noqa: E402

from tp_kernels import config  # noqa: E402
from tp_kernels.backends import symm as symm_backend  # noqa: E402
from tp_kernels.ops import ag_matmul, matmul_rs  # noqa: E402
from tp_kernels.testing.numerics import check_close  # noqa: E402

# Tokens per rank, model width, hidden width per rank: tiny and uneven.
M, D, F = 5, 12, 7
REPLAYS = 3
# How late each copy of a replay starts: longer than a tile needs to run ahead in the
# interpreter, so that reading before the copy landed is seen.
COPY_DELAY_S = 0.15


def _problem(seed: int, world: int) -> dict[str, torch.Tensor]:
    """The unsharded step's inputs: x [W*M, D], w1 [W*F, D], w2 [D, W*F], dy [W*M, D]."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(world * M, D, generator=gen),
        "w1": torch.randn(world * F, D, generator=gen) / D**0.5,
        "w2": torch.randn(D, world * F, generator=gen) / (world * F) ** 0.5,
        "dy": torch.randn(world * M, D, generator=gen),
    }


def _shards(full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """This rank's inputs: x and dy by rows (sequence), w1 colwise, w2 rowwise."""
    rows, cols = slice(rank * M, (rank + 1) * M), slice(rank * F, (rank + 1) * F)
    return {
        "x": full["x"][rows].clone(),
        "w1": full["w1"][cols].clone(),
        "w2": full["w2"][:, cols].clone(),
        "dy": full["dy"][rows].clone(),
    }


def _step(group: dist.ProcessGroup, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The TP MLP ``y = rs(relu(ag(x) @ w1^T) @ w2^T)`` and its backward from ``dy``, through the
    fused ops' math (each op module's ``_forward``/``_backward``) on the symm backend."""
    impl = symm_backend.BACKEND
    _, (h,) = ag_matmul._forward(impl, group, t["x"], [t["w1"].t()], keep_a=False)
    act = torch.relu(h)
    y = matmul_rs._forward(impl, group, act, t["w2"].t(), None, avg=False)
    dact, dw2, _ = matmul_rs._backward(
        impl, group, act, t["w2"].t(), t["dy"], avg=False, need_a=True, need_b=True,
        need_bias=False, linear_weight=True,
    )  # fmt: skip
    dh = dact * (h > 0)
    dx, (dw1,) = ag_matmul._backward(
        impl, group, t["x"], False, [t["w1"].t()], [dh], None, need_a=True, need_b=[True],
        linear_weights=True,
    )  # fmt: skip
    return {"y": y, "dx": dx, "dw1": dw1, "dw2": dw2}


def _truth(full: dict[str, torch.Tensor], rank: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """Each output of this rank: (float64 truth, fp32 single-process result, magnitude)."""

    def run(t: dict[str, torch.Tensor], absolute: bool) -> dict[str, torch.Tensor]:
        x, w1, w2, dy = (t[k].abs() if absolute else t[k] for k in ("x", "w1", "w2", "dy"))
        h = x @ w1.t()
        mask = (t["x"].double() @ t["w1"].double().t() > 0).to(h.dtype)
        act = h * mask
        dact = dy @ w2
        dh = dact * mask
        rows, cols = slice(rank * M, (rank + 1) * M), slice(rank * F, (rank + 1) * F)
        return {
            "y": (act @ w2.t())[rows],
            "dx": (dh @ w1)[rows],
            "dw1": (dh.t() @ x)[cols],
            "dw2": (dy.t() @ act)[:, cols],
        }

    double = {k: v.double() for k, v in full.items()}
    truth, same, magnitude = run(double, False), run(full, False), run(double, True)
    return {k: (truth[k], same[k], magnitude[k]) for k in truth}


def _replayed_step(clear_words: bool, replays: int) -> dict:
    """Warm up, record one step, replay it ``replays`` times with new inputs; the problems seen
    in each replay, and what the recording held."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    config.SYMM_TRITON.set(True)
    config.SYMM_CHUNKS.set(2)  # several chunks per shard (16-row interpreter tiles: M*W rows)
    report: dict = {"problems": []}
    try:
        inputs = _shards(_problem(0, world), rank)
        _step(group, inputs)  # the warmup: workspaces, state and tuning
        recorder = Recorder()
        with recorder.recording():
            outputs = _step(group, inputs)
        report["recorded"] = recorder.counts()
        for replay in range(replays):
            full = _problem(1 + replay, world)
            for name, shard in _shards(full, rank).items():
                inputs[name].copy_(shard)
            dist.barrier()  # every rank's inputs are in before any rank's replay reads them
            recorder.replay(clear_words=clear_words, copy_delay_s=COPY_DELAY_S)
            for name, reference in _truth(full, rank).items():
                if problem := check_close(f"replay {replay} {name}", outputs[name], *reference):
                    report["problems"].append(problem)
            dist.barrier()  # every rank has checked before the inputs change
    finally:
        config.SYMM_TRITON.reset()
        config.SYMM_CHUNKS.reset()
        dist.destroy_process_group(group)
    return report


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_replays_of_a_recorded_tp_mlp_step_match_the_reference(worlds, world_size):
    reports = worlds(world_size).run(_replayed_step, True, REPLAYS)
    for rank, report in enumerate(reports):
        assert report["problems"] == [], (rank, report["problems"])
        recorded = report["recorded"]
        if world_size == 1:  # one rank multiplies locally: nothing but ops
            assert set(recorded) == {"op"}, recorded
            continue
        # Forward and backward: two all-gather-matmuls and two matmul-reduce-scatters, each
        # opened by its start barrier (the re-gather by its own), the gathers and the re-gather
        # also by a publish barrier; their copies and pushes joined.
        assert recorded["ag_matmul_consumer"] == 2, recorded
        assert "matmul_rs_producer" not in recorded, recorded  # launched inside the push
        assert recorded["push"] == 2 and recorded["reduce_slots"] == 2, recorded
        assert recorded["copies"] == 3 and recorded["join"] == 5, recorded
        assert recorded["barrier"] == 2 * 2 + 2 + 2, recorded


@pytest.mark.parametrize("world_size", [2, 3])
def test_replays_without_clearing_the_words_read_stale_data(worlds, world_size):
    """The control: the same replays with the words not cleared, i.e. every wait satisfied by
    what the previous replay raised (the previous protocol's host-side epochs under a replay),
    read chunks and slots before their copies of this replay land: wrong values."""
    reports = worlds(world_size).run(_replayed_step, False, 2)
    assert any(report["problems"] for report in reports), reports
