"""The order of work of the two overlapped patterns, written once; backends supply the transport.

On rank ``r`` of ``W`` ranks (shapes as in ``backends/base.py``):

* all-gather -> matmul (:func:`all_gather_matmul`): the shards are consumed in
  :func:`gather_order` ``r, r+1, ..., r-1``: the own shard first (it needs no wait, so its
  matmuls cover the first transfer), then each peer's in the order the peers' data arrives (peer
  ``r+k`` is received at step ``k``). Each block of rows is multiplied by every ``b`` as soon as
  the transport says it is readable, and copied once into the gathered ``A`` when one is kept.
* matmul -> reduce-scatter (:func:`matmul_reduce_scatter`): the partial blocks are produced in
  :func:`scatter_order` ``r+1, ..., r-1, r``: the peers' blocks first, each handed to the
  transport as soon as it is computed so its transfer overlaps the next block's math; the own
  block last. Then the ``W`` partial sums of this rank's rows are added in fp32 in rank order
  ``0..W-1`` (:func:`sum_in_rank_order`), so the result does not depend on arrival order or on
  the backend.

A transport (``pipelined``: NCCL/gloo point-to-point blocks; ``symm``'s torch path: copies through
symmetric memory and signals) says where bytes go and when they have arrived; nothing else
differs. The symm Triton kernels run the same order on the device (their tile order starts at
``r``; the producer writes the peers' slots first), and ``reference`` is the unoverlapped baseline
(one collective, then one matmul: what DTensor does), so it has no order to follow.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from tp_kernels.backends.scaled import Scaled

Block = tuple[int, int, torch.Tensor]
"""``(begin, end, rows)``: rows ``[begin, end)`` of one rank's block, as a tensor."""


def gather_order(rank: int, world: int) -> list[int]:
    """The ranks whose shards rank ``rank`` consumes, in order: ``rank, rank+1, ...`` (mod W)."""
    return [(rank + k) % world for k in range(world)]


def scatter_order(rank: int, world: int) -> list[int]:
    """The ranks whose partial blocks rank ``rank`` produces, in order: ``rank+1, ..., rank``."""
    return [(rank + k) % world for k in range(1, world + 1)]


def sum_in_rank_order(parts: torch.Tensor) -> torch.Tensor:
    """``sum(parts[s] for s in 0..W-1)`` accumulated in fp32 (or wider), in that order."""
    acc_dtype = torch.promote_types(parts.dtype, torch.float32)
    acc = parts[0].to(acc_dtype, copy=True)
    for s in range(1, parts.shape[0]):
        acc += parts[s]
    return acc.to(parts.dtype)


class GatherTransport(Protocol):
    def arrivals(self, src: int) -> Iterable[Block]:
        """The blocks of peer ``src``'s shard, each yielded once it is readable here."""


class ScatterTransport(Protocol):
    def slots(self, dst: int) -> Iterable[Block]:
        """Where to compute the blocks of the partial sum owed to rank ``dst`` (this rank's
        own, last); after each block is written the schedule calls :meth:`send`."""

    def send(self, dst: int, begin: int, end: int) -> None:
        """Hand rows ``[begin, end)`` of the partial for ``dst`` over (nothing for the own)."""

    def received(self) -> torch.Tensor:
        """``[W, m, N]``: every rank's partial sum of this rank's rows, once all have arrived."""


def all_gather_matmul(
    a_shard: torch.Tensor,
    bs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    gathered: torch.Tensor | None,
    rank: int,
    world: int,
    transport: GatherTransport,
    scaling: Scaled | None = None,
) -> None:
    """``outs[j][s*m:(s+1)*m] = A_s @ bs[j]`` (or ``scaling``'s product) for every rank ``s`` in
    :func:`gather_order`, and ``gathered[s*m:(s+1)*m] = A_s`` when ``gathered`` is given (a
    transport that delivers straight into ``gathered`` costs no copy)."""
    m = a_shard.shape[0]
    for src in gather_order(rank, world):
        blocks = [(0, m, a_shard)] if src == rank else transport.arrivals(src)
        for begin, end, rows in blocks:
            dst = slice(src * m + begin, src * m + end)
            if gathered is not None and rows.data_ptr() != gathered[dst].data_ptr():
                rows = gathered[dst].copy_(rows)
            for j, (out, b) in enumerate(zip(outs, bs)):
                if scaling is None:
                    torch.mm(rows, b, out=out[dst])
                else:
                    out[dst] = scaling.block(rows, j, b)


def matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    addend: torch.Tensor | None,
    rank: int,
    world: int,
    transport: ScatterTransport,
    scaling: Scaled | None = None,
) -> torch.Tensor:
    """This rank's rows of ``sum over ranks of (a @ b + addend)`` (``a @ b``: ``scaling``'s
    product when given, to which ``addend`` is added in its dtype): partial blocks produced in
    :func:`scatter_order` into the transport's slots, then summed by :func:`sum_in_rank_order`."""
    m = a.shape[0] // world
    for dst in scatter_order(rank, world):
        for begin, end, slot in transport.slots(dst):
            rows = slice(dst * m + begin, dst * m + end)
            if scaling is not None:
                slot.copy_(scaling.block(a[rows], 0, b, rows))
                if addend is not None:
                    slot += addend[rows]
            elif addend is None:
                torch.mm(a[rows], b, out=slot)
            else:
                torch.addmm(addend[rows], a[rows], b, out=slot)
            if dst != rank:
                transport.send(dst, begin, end)
    return sum_in_rank_order(transport.received())
