"""The fp8 path's communication as torch custom ops: what :mod:`tp_kernels.float8` runs while
torch.compile traces it.

The eager fp8 path (``float8.py``) calls the backend object it chose and ``dist`` directly; a
traced graph can hold neither. So under torch.compile each of its communicating steps is one
opaque custom op with a fake kernel, taking plain fp8/fp32 tensors, the group by its registered
name and the backend by the name asked for (``""``: the default in force when the graph runs):

=====================================  ======================================================
``scaled_all_gather_matmul``           :func:`~tp_kernels.ops.scaled.gather_scaled`: the fused
                                       gather of fp8 rows (scales packed beside them) and GEMMs
``scaled_matmul_reduce_scatter``       :func:`~tp_kernels.ops.scaled.reduce_scatter_scaled`
``amax_all_reduce``                    the MAX all-reduce of a cast's amax whose scale spans
                                       the group's shards
``scaled_all_gather``                  the wgrad operand's re-gather (fp8 bytes as ``uint8``,
                                       or high precision where the recipe disables that cast)
=====================================  ======================================================

Each op resolves its backend when it runs, as the eager call does
(:func:`~tp_kernels.ops.scaled.scaled_backend`, keyed by the Linear call it belongs to:
``call_op``, ``call_shape = [m, K, *N_j]``, ``call_dtype``), so every part of one Linear's
forward and backward runs on, and is counted under, the backend an eager call of that shape
would use. The ops count themselves when they run (``comm_stats``, with the bytes they send),
so a compiled graph counts every step it runs, as the eager path does. None is differentiable:
the autograd Functions of ``quantized_linears.py`` call them, through ``float8.py``'s call, from
their forward and backward, which dynamo traces.

The re-gather is not overlapped with the dgrad's fused call here (the eager path starts it
first and waits after): a custom op returns a finished tensor, and the two run back to back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from tp_kernels import deadline
from tp_kernels.backends.base import Backend
from tp_kernels.ops._checks import group_size
from tp_kernels.ops.comm_stats import count_as_collective, gather_bytes, record
from tp_kernels.ops.scaled import gather_scaled, reduce_scatter_scaled, scaled_backend

__all__ = [
    "amax_all_reduce",
    "scaled_all_gather",
    "scaled_all_gather_matmul",
    "scaled_matmul_reduce_scatter",
]


def _resolve(
    group_name: str,
    backend: str,
    call_op: str,
    call_shape: Sequence[int],
    call_dtype: torch.dtype,
    device: torch.device,
) -> tuple[dist.ProcessGroup, Backend]:
    """The group of an op's ``group_name`` and the backend its Linear call runs on: the eager
    call's choice for that call's key (every op takes these same trailing arguments: a custom
    op's schema is read from its own signature, so each spells them out)."""
    group = _resolve_process_group(group_name)
    m, k, *ns = call_shape
    return group, scaled_backend(backend or None, group, call_op, m, k, ns, call_dtype, device)


@torch.library.custom_op("tp_kernels::scaled_all_gather_matmul", mutates_args=())
def scaled_all_gather_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    bs: list[torch.Tensor],
    b_scales: list[torch.Tensor],
    out_dtype: torch.dtype,
    fast_accum: bool,
    post_scale: bool,
    group_name: str,
    backend: str,
    call_op: str,
    call_shape: list[int],
    call_dtype: torch.dtype,
    phase: str,
) -> list[torch.Tensor]:
    group, impl = _resolve(group_name, backend, call_op, call_shape, call_dtype, a.device)
    return gather_scaled(impl, group, a, a_scale, bs, b_scales, out_dtype=out_dtype,
                         fast_accum=fast_accum, phase=phase, post_scale=post_scale)  # fmt: skip


@scaled_all_gather_matmul.register_fake
def _(a, a_scale, bs, b_scales, out_dtype, fast_accum, post_scale, group_name, *_):
    rows = group_size(group_name) * a.shape[0]
    return [a.new_empty((rows, b.shape[1]), dtype=out_dtype) for b in bs]


@torch.library.custom_op("tp_kernels::scaled_matmul_reduce_scatter", mutates_args=())
def scaled_matmul_reduce_scatter(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    addend: torch.Tensor | None,
    out_dtype: torch.dtype,
    fast_accum: bool,
    post_scale: bool,
    group_name: str,
    backend: str,
    call_op: str,
    call_shape: list[int],
    call_dtype: torch.dtype,
    phase: str,
) -> torch.Tensor:
    group, impl = _resolve(group_name, backend, call_op, call_shape, call_dtype, a.device)
    return reduce_scatter_scaled(impl, group, a, a_scale, b, b_scale, out_dtype=out_dtype,
                                 fast_accum=fast_accum, phase=phase, addend=addend,
                                 post_scale=post_scale)  # fmt: skip


@scaled_matmul_reduce_scatter.register_fake
def _(a, a_scale, b, b_scale, addend, out_dtype, fast_accum, post_scale, group_name, *_):
    rows = a.shape[0] // group_size(group_name)
    return a.new_empty((rows, b.shape[1]), dtype=out_dtype)


@torch.library.custom_op("tp_kernels::amax_all_reduce", mutates_args=())
def amax_all_reduce(
    amax: torch.Tensor,
    group_name: str,
    backend: str,
    call_op: str,
    call_shape: list[int],
    call_dtype: torch.dtype,
    phase: str,
) -> torch.Tensor:
    """The MAX over the group of each rank's ``amax`` (a new tensor: custom ops may not return
    their input)."""
    group, impl = _resolve(group_name, backend, call_op, call_shape, call_dtype, amax.device)
    out = amax.clone()
    record(phase, "amax_all_reduce", impl.name, sent_bytes=out.nbytes)
    deadline.complete(
        lambda: dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group, async_op=True),
        group,
        "amax all-reduce",
        out.device,
    )
    return out


@amax_all_reduce.register_fake
def _(amax, *_):
    return torch.empty_like(amax)


@torch.library.custom_op("tp_kernels::scaled_all_gather", mutates_args=())
def scaled_all_gather(
    shard: torch.Tensor,
    group_name: str,
    backend: str,
    call_op: str,
    call_shape: list[int],
    call_dtype: torch.dtype,
    phase: str,
) -> torch.Tensor:
    """``[W*m, ...]``: the group's ``shard`` rows, rank by rank (the wgrad operand's re-gather)."""
    group, impl = _resolve(group_name, backend, call_op, call_shape, call_dtype, shard.device)
    record(phase, "all_gather", impl.name, sent_bytes=gather_bytes(shard, group))
    return impl.all_gather_async(shard.contiguous(), group).wait()


@scaled_all_gather.register_fake
def _(shard, group_name, *_):
    return shard.new_empty((group_size(group_name) * shard.shape[0], *shard.shape[1:]))


# What CommDebugMode counts each as (a compiled graph's ops under a dispatch mode).
count_as_collective("scaled_all_gather_matmul", "all_gather_into_tensor")
count_as_collective("scaled_matmul_reduce_scatter", "reduce_scatter_tensor")
count_as_collective("amax_all_reduce", "all_reduce")
count_as_collective("scaled_all_gather", "all_gather_into_tensor")
