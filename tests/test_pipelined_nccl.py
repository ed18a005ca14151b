"""The ``pipelined`` backend under NCCL's ``batch_isend_irecv`` contract, on gloo ranks.

gloo returns one Work per point-to-point op of a batch; NCCL coalesces a whole batch into one
Work. Code that pairs ``works[i]`` with ``ops[i]`` is right on gloo and silently wrong on NCCL.
These tests run every pipelined case through the public ops, forward and backward, with
``torch.distributed.batch_isend_irecv`` replaced inside the rank processes by a shim that returns
what NCCL returns, and compare with the ``reference`` backend and a float64 truth.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tp_kernels.backends import pipelined
from tp_kernels.testing.fused_cases import AGCase, RSCase, run_case
from tp_kernels.testing.numerics import assert_no_failures, check_close

# ---------------------------------------------------------------- NCCL's contract, on gloo


class _CoalescedWork:
    """One Work for a whole batch, as NCCL returns from ``batch_isend_irecv``.

    Why this is faithful to NCCL: there, the ops of a batch run as one ``ncclGroupStart/End``
    group and ``batch_isend_irecv`` returns ``[work]`` for the group (``_coalescing_manager``'s
    ``cm.works``); ``work.wait()`` is the only completion guarantee, and it covers every op of the
    batch, no finer. A received tensor's contents are undefined until then. Here the gloo ops of
    the batch are posted as usual, but every receive lands in a private buffer and the caller's
    tensor holds NaN until :meth:`wait` copies the data in: code that reads a block before waiting
    for its batch reads NaN every time, instead of racing gloo's threads (which usually win).
    What the shim cannot show is NCCL's deadlock when a receive is posted without its matching
    send in the same group; the backend keeps each send paired with a receive for that.
    """

    def __init__(self, works: list, landing: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._works = works
        self._landing = landing  # (caller's recv tensor, private buffer gloo receives into)
        self._done = False

    def wait(self, timeout=None) -> bool:
        if not self._done:
            for work in self._works:
                work.wait()
            for dst, buf in self._landing:
                dst.copy_(buf)
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


_batches: list[int] = []  # sizes of the batches the shim served, per rank process


def _coalescing(original):
    def batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list[_CoalescedWork]:
        ops, landing = [], []
        for op in p2p_op_list:
            if op.op is dist.irecv:
                buf = torch.empty_like(op.tensor, memory_format=torch.contiguous_format)
                op.tensor.fill_(math.nan)
                landing.append((op.tensor, buf))
                op = dist.P2POp(
                    dist.irecv, buf, group=op.group, tag=op.tag, group_peer=op.group_peer
                )
            ops.append(op)
        _batches.append(len(ops))
        return [_CoalescedWork(original(ops), landing)]

    return batch_isend_irecv


@contextlib.contextmanager
def _nccl_style_batches() -> Iterator[None]:
    """Within the block, ``dist.batch_isend_irecv`` returns one Work per batch (in this process).

    Restored on exit: the rank processes serve the whole test session.
    """
    original = c10d.batch_isend_irecv
    shim = _coalescing(original)
    dist.batch_isend_irecv = c10d.batch_isend_irecv = shim
    _batches.clear()
    try:
        yield
    finally:
        dist.batch_isend_irecv = c10d.batch_isend_irecv = original


def _shim_contract() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    peer_to, peer_from = (rank + 1) % world, (rank - 1) % world
    send = torch.full((4,), float(rank))
    recv = torch.zeros(4)
    with _nccl_style_batches():
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, send, group_peer=peer_to),
                dist.P2POp(dist.irecv, recv, group_peer=peer_from),
            ]
        )
        before = recv.clone()
        for work in works:
            work.wait()
    return {
        "works": len(works),
        "nan_before_wait": bool(before.isnan().all()),
        "after": recv.tolist(),
        "expected": [float(peer_from)] * 4,
        "restored": dist.batch_isend_irecv is c10d.batch_isend_irecv
        and dist.batch_isend_irecv.__module__ == "torch.distributed.distributed_c10d",
    }


def test_shim_keeps_nccl_contract(worlds):
    for rank, got in enumerate(worlds(2).run(_shim_contract)):
        assert got["works"] == 1, (rank, got)
        assert got["nan_before_wait"], (rank, got)
        assert got["after"] == got["expected"], (rank, got)
        assert got["restored"], (rank, got)


# ---------------------------------------------------------------- the cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One fused call, with the pipelined backend's chunks (``pipelined.set_chunks``; None: the
    backend picks from the shape) and the dtypes it runs in."""

    call: AGCase | RSCase
    chunks: int | None
    dtypes: tuple[torch.dtype, ...] = (torch.float64, torch.float32)


AG_CASES = [
    # 7 rows in 3 blocks of 2, 2, 3 (uneven), two bs, A returned and used.
    Case(AGCase((7, 5), 0, (3, 2), return_a=True), chunks=3),
    Case(AGCase((7, 5), 0, (4,)), chunks=3),
    # batch 2 gathered on dim 1: 5*2 = 10 rows per shard, blocks of 3, 3, 4.
    Case(AGCase((2, 5, 6), 1, (4, 1)), chunks=3),
    Case(AGCase((2, 5, 6), 1, (3,), return_a=True), chunks=4),
    # 2 MiB per shard: the backend splits each peer transfer into 2 blocks by itself.
    Case(AGCase((512, 1024), 0, (8,)), chunks=None, dtypes=(torch.float32,)),
]
RS_CASES = [
    Case(RSCase((7,), 0, 6, 5), chunks=3),
    Case(RSCase((7,), 0, 4, 3, reduce_op="avg", bias=True), chunks=3),
    # batch 2 scattered on dim 1: 2*5 = 10 rows per destination, blocks of 3, 3, 4.
    Case(RSCase((2, 5), 1, 4, 6), chunks=3),
    Case(RSCase((2, 5), 1, 3, 2, reduce_op="avg", bias=True), chunks=4),
    # 2 MiB per destination (and per gathered grad shard in backward): 2 blocks by itself.
    Case(RSCase((512,), 0, 8, 1024), chunks=None, dtypes=(torch.float32,)),
]


def _compare(tag: str, case: Case, seed: int) -> list[str]:
    """``pipelined`` against the float64 truth, within twice the one-process result's own error."""
    failures = []
    for dtype in case.dtypes:
        with _nccl_style_batches():
            found = run_case(
                case.call,
                dtype=dtype,
                device=torch.device("cpu"),
                group=dist.group.WORLD,
                seed=seed,
                backend="pipelined",
            )
            served = len(_batches)
        if served == 0:
            failures.append(f"{tag} {dtype}: the shim served no batch; the test tests nothing")
        for name, g, t, r, m in zip(
            found.names, found.got, found.truth, found.reference, found.magnitude, strict=True
        ):
            msg = check_close(name, g, t, r, m)
            if msg:
                failures.append(f"{tag} {dtype}: {msg}")
    return failures


def _run_cases(kind: str) -> list[str]:
    failures = []
    try:
        for i, case in enumerate(AG_CASES if kind == "ag" else RS_CASES):
            pipelined.set_chunks(case.chunks)
            failures += _compare(f"case {i} {case}", case, seed=100 * i)
    finally:
        pipelined.set_chunks(None)
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_matmul_with_coalesced_batches(worlds, world_size):
    assert_no_failures(worlds(world_size).run(_run_cases, "ag"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_matmul_reduce_scatter_with_coalesced_batches(worlds, world_size):
    assert_no_failures(worlds(world_size).run(_run_cases, "rs"))


def _reasons() -> dict:
    from tp_kernels.backends import pipelined as backend

    group = dist.group.WORLD
    return {
        "cuda": backend.BACKEND.unavailable_reason(group, torch.device("cuda")),
        "cpu": backend.BACKEND.unavailable_reason(group, torch.device("cpu")),
    }


def test_gloo_group_refuses_cuda_tensors(worlds):
    """gloo's send/recv hand a tensor's address to a TCP transport that reads host memory: a CUDA
    tensor there would be a crash, so pipelined says why instead (one GPU shared by several
    ranks over gloo, as the one-GPU check runs)."""
    for got in worlds(2).run(_reasons):
        assert got["cpu"] is None
        assert "send/recv carry host memory only" in got["cuda"], got
