"""The ``reference`` backend: one collective, then the matmul(s) — what DTensor does.

It is the ground truth that the other backends are tested against, and the fallback that runs
everywhere a ProcessGroup runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from tp_kernels import deadline
from tp_kernels._compat import reduce_scatter_single
from tp_kernels.backends import schedule
from tp_kernels.backends.base import Backend
from tp_kernels.backends.scaled import Scaled


class ReferenceBackend(Backend):
    name = "reference"

    def all_gather_matmul(
        self,
        a_shard: torch.Tensor,
        bs: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        *,
        return_a: bool,
        scaling: Scaled | None = None,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        a = self.all_gather_async(a_shard, group).wait()
        if scaling is not None:
            return (a if return_a else None), [scaling.block(a, j, b) for j, b in enumerate(bs)]
        return (a if return_a else None), [a @ b for b in bs]

    def matmul_reduce_scatter(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        addend: torch.Tensor | None = None,
        scaling: Scaled | None = None,
    ) -> torch.Tensor:
        if scaling is not None:
            partial = scaling.block(a, 0, b)
            if addend is not None:
                partial += addend
        else:
            partial = a @ b if addend is None else torch.addmm(addend, a, b)
        world = group.size()
        if world == 1:
            return partial
        out = partial.new_empty((partial.shape[0] // world, partial.shape[1]))
        if "gloo" in str(dist.get_backend(group)) and partial.device.type == "cpu":
            # gloo's reduce-scatter, while one call of it waits for a peer that never comes,
            # holds back every later reduce-scatter of the process on any group (a new group
            # included) until the group's timeout; its all-to-all does not. The same bytes move.
            parts = partial.new_empty((world, *out.shape))
            deadline.complete(
                lambda: dist.all_to_all_single(parts, partial, group=group, async_op=True),
                group,
                "reduce-scatter",
            )
            return schedule.sum_in_rank_order(parts)
        deadline.complete(
            lambda: reduce_scatter_single(out, partial, group, async_op=True),
            group,
            "reduce-scatter",
            out.device,
        )
        return out


BACKEND = ReferenceBackend()
