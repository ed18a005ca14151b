"""The ``pipelined`` backend: per-peer (or finer) point-to-point chunks overlapped with matmuls.

It needs nothing but the ProcessGroup (NCCL, gloo, across nodes). The order of work is
:mod:`tp_kernels.backends.schedule`'s; this module is its transport. On rank ``r`` of ``W``:

* all-gather -> matmul: every transfer is posted up front (at step ``k = 1..W-1`` rank ``r`` sends
  its shard to ``r-k`` and receives ``r+k``'s, each split into ``chunks`` row blocks); the matmul of
  the local shard runs first, while the first blocks are in flight, then each block's matmul runs as
  soon as that block has landed, in the order ``r, r+1, ..., r-1``.
* matmul -> reduce-scatter: the partial product owed to rank ``r+k`` is computed block by block
  and each block is sent as soon as it is computed (``k = 1..W-1``), while ``r-k``'s blocks for this
  rank arrive; the own block is computed last, and the ``W`` partial sums are added in fp32 in rank
  order ``0..W-1``, so the result does not depend on arrival order.

On CUDA the transfers run on the communicator's stream and ``Work.wait()`` only makes the compute
stream wait for them, so the host never blocks (NCCL's watchdog bounds them); on gloo the transfers
run on gloo's threads and the host waits for them within the deadline of :mod:`tp_kernels.deadline`.
A call that fails after posting transfers (a matmul that raises on every rank) waits for the
transfers it posted before it raises, so the next call on the group pairs its own.

Every row block travels in its own ``batch_isend_irecv``: the block this rank receives and the
matching block it sends (see :func:`_exchange`). One block per batch because backends differ in
what a batch returns: gloo gives one Work per op, NCCL coalesces the whole batch into one Work
that alone says when any of its ops is done. Waiting every Work of a block's batch before using
that block is right under both, and still lets each block's matmul start as soon as that block
(not the whole peer's shard) has landed. The send and the receive share a batch so that NCCL runs
them as one group: a ring of receives each posted before its rank's send would deadlock.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from tp_kernels import config, deadline, tiling
from tp_kernels.backends import schedule
from tp_kernels.backends.base import Backend
from tp_kernels.backends.scaled import Scaled


def set_chunks(chunks: int | None) -> None:
    """Fix the number of row blocks per peer transfer (``None``: choose from the shape), over
    ``TP_KERNELS_PIPELINE_CHUNKS`` (:data:`tp_kernels.config.PIPELINE_CHUNKS`)."""
    config.PIPELINE_CHUNKS.set(chunks, argument="chunks")


def chunks_setting() -> int | None:
    """The row blocks per peer transfer fixed by :func:`set_chunks` or, else, by
    ``TP_KERNELS_PIPELINE_CHUNKS``; ``None``: chosen from the shape. Part of what the ranks agree
    on before a fused call (a different count on one rank would pair blocks wrongly), so a bad
    value is an error every rank raises together."""
    return config.PIPELINE_CHUNKS.get()


def _row_blocks(rows: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous ``(begin, end)`` row ranges covering ``[0, rows)``."""
    bounds = [rows * i // chunks for i in range(chunks + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _exchange(
    send: torch.Tensor,
    dst: int,
    recv: torch.Tensor,
    src: int,
    group: dist.ProcessGroup,
) -> list[dist.Work]:
    """Post ``send -> dst`` and ``recv <- src`` (group ranks) as one batch; return its Works.

    Neither tensor may be touched (``recv`` read, ``send`` overwritten or freed) until *every*
    returned Work has been waited: NCCL returns one Work for the whole batch, gloo one per op.
    """
    with deadline.posting(group, "transfer"):
        return dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, send, group=group, group_peer=dst),
                dist.P2POp(dist.irecv, recv, group=group, group_peer=src),
            ]
        )


class PipelinedBackend(Backend):
    name = "pipelined"

    def unavailable_reason(
        self, group: dist.ProcessGroup | None, device: torch.device
    ) -> str | None:
        """Why not: gloo's point-to-point send and receive hand the tensor's address to its TCP
        transport, which reads host memory, so CUDA tensors need a group that moves device
        memory (NCCL)."""
        if group is None or torch.device(device).type != "cuda":
            return None
        backend = str(dist.get_backend(group))
        if "gloo" in backend and "nccl" not in backend:
            return (
                f"the group's backend is {backend!r}, whose send/recv carry host memory only; "
                "CUDA tensors need an NCCL group"
            )
        return None

    def all_gather_matmul(
        self,
        a_shard: torch.Tensor,
        bs: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        *,
        return_a: bool,
        scaling: Scaled | None = None,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        world, rank = group.size(), group.rank()
        m = a_shard.shape[0]
        a = a_shard.new_empty((world * m, a_shard.shape[1]))
        out_dtype = a_shard.dtype if scaling is None else scaling.out_dtype
        outs = [a_shard.new_empty((world * m, b.shape[1]), dtype=out_dtype) for b in bs]
        transport = _GatherBlocks(a_shard, a, group)
        try:
            schedule.all_gather_matmul(a_shard, bs, outs, a, rank, world, transport, scaling)
        except BaseException:
            transport.drain()
            raise
        return (a if return_a else None), outs

    def matmul_reduce_scatter(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        addend: torch.Tensor | None = None,
        scaling: Scaled | None = None,
    ) -> torch.Tensor:
        world, rank = group.size(), group.rank()
        out_dtype = a.dtype if scaling is None else scaling.out_dtype
        transport = _ScatterBlocks(a.shape[0] // world, b.shape[1], out_dtype, a.device, group)
        try:
            return schedule.matmul_reduce_scatter(a, b, addend, rank, world, transport, scaling)
        except BaseException:
            transport.received()  # drain: wait for what was posted
            raise


class _GatherBlocks:
    """The all-gather's transport: every block posted up front (at step ``k`` this rank sends its
    shard to ``r-k`` and receives ``r+k``'s straight into the gathered ``a``, each split into
    ``chunks`` row blocks); a block is readable once its batch's Works are done."""

    def __init__(self, a_shard: torch.Tensor, a: torch.Tensor, group: dist.ProcessGroup) -> None:
        world, rank = group.size(), group.rank()
        m = a_shard.shape[0]
        chunks = tiling.transfer_blocks(m, a_shard.shape[1] * a_shard.element_size())
        self._a, self._m, self._group = a, m, group
        self._pending: dict[int, list[tuple[int, int, list[dist.Work]]]] = {}
        for step in range(1, world):
            src, dst = (rank + step) % world, (rank - step) % world
            into = a[src * m : (src + 1) * m]
            # Sent in the same blocks as received: a message is matched whole on the other side.
            self._pending[src] = [
                (begin, end, _exchange(a_shard[begin:end], dst, into[begin:end], src, group))
                for begin, end in _row_blocks(m, chunks)
            ]

    def arrivals(self, src: int) -> Iterator[schedule.Block]:
        base = src * self._m
        for begin, end, works in self._pending.pop(src):
            # On NCCL one Work stands for the block's send and receive together; the send's
            # source is the caller's a_shard, alive until the call returns.
            for work in works:
                deadline.wait(work, self._group, "transfer", self._a.device)
            yield begin, end, self._a[base + begin : base + end]

    def drain(self) -> None:
        """Wait for every transfer still posted (a call that failed midway)."""
        for src in list(self._pending):
            for _ in self.arrivals(src):
                pass


class _ScatterBlocks:
    """The reduce-scatter's transport: the block owed to ``r+k`` is computed into a send buffer
    and posted at once, with the matching receive of ``r-k``'s block for this rank; every Work
    (one per batch on NCCL, one per op on gloo) is waited before the sum."""

    def __init__(
        self, m: int, n: int, dtype: torch.dtype, device: torch.device, group: dist.ProcessGroup
    ) -> None:
        self._group = group
        self._rank, self._world = group.rank(), group.size()
        self._blocks = _row_blocks(m, tiling.transfer_blocks(m, n * dtype.itemsize))
        # [s]: rank s's partial of our rows
        self._received = torch.empty((self._world, m, n), dtype=dtype, device=device)
        # [k-1]: the block for rank r+k, kept alive until the sends complete.
        self._sent = torch.empty((self._world - 1, m, n), dtype=dtype, device=device)
        self._works: list[dist.Work] = []

    def slots(self, dst: int) -> list[schedule.Block]:
        if dst == self._rank:
            return [(0, self._received.shape[1], self._received[dst])]
        sent = self._sent[self._step(dst) - 1]
        return [(begin, end, sent[begin:end]) for begin, end in self._blocks]

    def send(self, dst: int, begin: int, end: int) -> None:
        step = self._step(dst)
        src = (self._rank - step) % self._world
        sent = self._sent[step - 1, begin:end]
        self._works += _exchange(sent, dst, self._received[src, begin:end], src, self._group)

    def _step(self, dst: int) -> int:
        return (dst - self._rank) % self._world

    def received(self) -> torch.Tensor:
        works, self._works = self._works, []
        for work in works:
            deadline.wait(work, self._group, "transfer", self._received.device)
        return self._received


BACKEND = PipelinedBackend()
