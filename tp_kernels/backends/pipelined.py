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
Each step's sends and receives go out in one ``batch_isend_irecv`` so NCCL pairs them without
deadlock.
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


class PipelinedBackend(Backend):
    name = "pipelined"

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

        pending = []  # (rows, works) in the order the blocks are consumed
        for step in range(1, world):
            src, dst = (rank + step) % world, (rank - step) % world
            blocks = _row_blocks(src * m, m, chunks)
            ops = [
                dist.P2POp(dist.irecv, a[begin:end], group=group, group_peer=src)
                for begin, end in blocks
            ]
            # Sent in the same blocks as received: a message is matched whole on the other side.
            ops += [
                dist.P2POp(dist.isend, a_shard[begin:end], group=group, group_peer=dst)
                for begin, end in _row_blocks(0, m, chunks)
            ]
            works = dist.batch_isend_irecv(ops)
            pending.append((blocks, works[: len(blocks)], works[len(blocks) :]))

        own = slice(rank * m, (rank + 1) * m)
        a[own].copy_(a_shard)
        for out, b in zip(outs, bs):
            torch.mm(a_shard, b, out=out[own])
        sends = []
        for blocks, recvs, send in pending:
            for (begin, end), work in zip(blocks, recvs):
                work.wait()
                for out, b in zip(outs, bs):
                    torch.mm(a[begin:end], b, out=out[begin:end])
            sends.extend(send)
        for work in sends:
            work.wait()
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
                works += dist.batch_isend_irecv(
                    [
                        dist.P2POp(dist.isend, block, group=group, group_peer=dst),
                        dist.P2POp(
                            dist.irecv, received[src, begin:end], group=group, group_peer=src
                        ),
                    ]
                )
        partial(rank * m, (rank + 1) * m, received[rank])
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
