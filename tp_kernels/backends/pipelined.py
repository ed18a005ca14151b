"""The ``pipelined`` backend: per-peer (or finer) point-to-point chunks overlapped with matmuls.

It needs nothing but the ProcessGroup (NCCL, gloo, across nodes). On rank ``r`` of ``W``:

* all-gather -> matmul: every transfer is posted up front (at step ``k = 1..W-1`` rank ``r`` sends
  its shard to ``r-k`` and receives ``r+k``'s, each split into ``chunks`` row blocks); the matmul of
  the local shard runs first, while the first blocks are in flight, then each block's matmul runs as
  soon as that block has landed, in the order ``r, r+1, ..., r-1``.
* matmul -> reduce-scatter: the partial product owed to rank ``r+k`` is computed block by block
  and each block is sent as soon as it is computed (``k = 1..W-1``), while ``r-k``'s blocks for this
  rank arrive; the own block is computed last, and the ``W`` partial sums are added in fp32 in rank
  order ``0..W-1``, so the result does not depend on arrival order.

On CUDA the transfers run on the communicator's stream and ``Work.wait()`` only makes the compute
stream wait for them, so the host never blocks; on gloo the transfers run on gloo's threads.

Every row block travels in its own ``batch_isend_irecv``: the block this rank receives and the
matching block it sends (see :func:`_exchange`). One block per batch because backends differ in
what a batch returns: gloo gives one Work per op, NCCL coalesces the whole batch into one Work
that alone says when any of its ops is done. Waiting every Work of a block's batch before using
that block is right under both, and still lets each block's matmul start as soon as that block
(not the whole peer's shard) has landed. The send and the receive share a batch so that NCCL runs
them as one group: a ring of receives each posted before its rank's send would deadlock.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from tp_kernels.backends.base import Backend

# A block smaller than this is dominated by per-message latency on gloo and NCCL alike.
_MIN_BLOCK_BYTES = 1 << 20
_MAX_CHUNKS = 4

_chunks_override: int | None = None


def set_chunks(chunks: int | None) -> None:
    """Fix the number of row blocks per peer transfer (``None``: choose from the shape).

    The environment variable ``TP_KERNELS_PIPELINE_CHUNKS`` sets the same default.
    """
    global _chunks_override
    if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"chunks: expected a positive int or None, got {chunks!r}")
    _chunks_override = chunks


def chunks_for(rows: int, row_bytes: int) -> int:
    """Row blocks per peer transfer of ``rows`` rows of ``row_bytes`` bytes each."""
    chosen = _chunks_override
    if chosen is None and os.environ.get("TP_KERNELS_PIPELINE_CHUNKS"):
        chosen = int(os.environ["TP_KERNELS_PIPELINE_CHUNKS"])
    if chosen is None:
        chosen = min(_MAX_CHUNKS, max(1, rows * row_bytes // _MIN_BLOCK_BYTES))
    return max(1, min(chosen, rows))


def _row_blocks(start: int, rows: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous ``(begin, end)`` row ranges covering ``[start, start + rows)``."""
    bounds = [start + rows * i // chunks for i in range(chunks + 1)]
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
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        world, rank = group.size(), group.rank()
        m = a_shard.shape[0]
        a = a_shard.new_empty((world * m, a_shard.shape[1]))
        outs = [a_shard.new_empty((world * m, b.shape[1])) for b in bs]
        chunks = chunks_for(m, a_shard.shape[1] * a_shard.element_size())

        pending = []  # (begin, end, works of the block's batch) in the order they are consumed
        for step in range(1, world):
            src, dst = (rank + step) % world, (rank - step) % world
            # Sent in the same blocks as received: a message is matched whole on the other side.
            for (begin, end), (s_begin, s_end) in zip(
                _row_blocks(src * m, m, chunks), _row_blocks(0, m, chunks)
            ):
                works = _exchange(a_shard[s_begin:s_end], dst, a[begin:end], src, group)
                pending.append((begin, end, works))

        own = slice(rank * m, (rank + 1) * m)
        a[own].copy_(a_shard)
        for out, b in zip(outs, bs):
            torch.mm(a_shard, b, out=out[own])
        for begin, end, works in pending:
            # On NCCL one Work stands for the block's send and receive together; the send's
            # source is the caller's a_shard, alive until we return.
            for work in works:
                work.wait()
            for out, b in zip(outs, bs):
                torch.mm(a[begin:end], b, out=out[begin:end])
        return (a if return_a else None), outs

    def matmul_reduce_scatter(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        addend: torch.Tensor | None = None,
    ) -> torch.Tensor:
        world, rank = group.size(), group.rank()
        m, n = a.shape[0] // world, b.shape[1]

        def partial(begin: int, end: int, out: torch.Tensor) -> torch.Tensor:
            if addend is None:
                return torch.mm(a[begin:end], b, out=out)
            return torch.addmm(addend[begin:end], a[begin:end], b, out=out)

        received = a.new_empty((world, m, n))  # received[s]: rank s's partial sum of our rows
        chunks = chunks_for(m, n * a.element_size())
        sent = a.new_empty((world - 1, m, n))  # kept alive until the sends complete
        works = []
        for step in range(1, world):
            dst, src = (rank + step) % world, (rank - step) % world
            blocks = _row_blocks(0, m, chunks)
            for begin, end in blocks:
                block = partial(dst * m + begin, dst * m + end, sent[step - 1, begin:end])
                works += _exchange(block, dst, received[src, begin:end], src, group)
        partial(rank * m, (rank + 1) * m, received[rank])
        # Every Work of every batch (one per batch on NCCL, one per op on gloo) before the sum.
        for work in works:
            work.wait()
        return _sum_in_rank_order(received)


def _sum_in_rank_order(parts: torch.Tensor) -> torch.Tensor:
    """``sum(parts[s] for s in 0..W-1)`` accumulated in fp32 (or wider), in that order."""
    acc_dtype = torch.promote_types(parts.dtype, torch.float32)
    acc = parts[0].to(acc_dtype, copy=True)
    for s in range(1, parts.shape[0]):
        acc += parts[s]
    return acc.to(parts.dtype)


BACKEND = PipelinedBackend()
