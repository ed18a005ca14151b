"""Argument checks of the fused ops and the group they run on, all done before any rank
communicates: types, ranks, dims, dtypes, devices, group membership. What ranks could disagree on
(shapes, dtypes, options, the backend they resolved, a local check that failed on one rank only)
is compared across the group by the agreement of ``ops/planning.py``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group

GroupLike = dist.ProcessGroup | DeviceMesh | str | None


class NotAMemberError(ValueError):
    """This rank is not a member of the group a fused op was given (no peer waits for it)."""


def resolve_group(group: object, *, op: str) -> dist.ProcessGroup:
    """A ProcessGroup from a ProcessGroup, a 1-D DeviceMesh, a registered group name, or ``None``
    (the default group, as everywhere in torch.distributed)."""
    if group is None:
        if not dist.is_initialized():
            raise ValueError(
                f"{op}: group=None means the default process group, and none is initialized; "
                "call torch.distributed.init_process_group first or pass a group"
            )
        group = dist.group.WORLD
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"{op}: group must be a 1-D DeviceMesh, got a {group.ndim}-D mesh "
                f"of shape {tuple(group.shape)}; slice it, e.g. mesh['tp']"
            )
        group = group.get_group()
    elif isinstance(group, str):
        try:
            group = _resolve_process_group(group)
        except (ValueError, RuntimeError, KeyError) as exc:
            raise ValueError(
                f"{op}: group {group!r} is not a registered process group name: {exc}"
            ) from exc
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise NotAMemberError(
            f"{op}: this rank (global rank {dist.get_rank()}) is not a member of the given group"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{op}: group must be a ProcessGroup, a 1-D DeviceMesh, a group name or None (the "
            f"default group), got {type(group).__name__}"
        )
    if group.rank() < 0:
        raise NotAMemberError(
            f"{op}: this rank (global rank {dist.get_rank()}) is not a member of "
            f"group {group.group_name!r}"
        )
    return group


def group_size(group_name: str) -> int:
    """The size of the group registered as ``group_name`` (the custom ops' fake kernels, which
    get the group by name)."""
    return _resolve_process_group(group_name).size()


# The fused ops multiply and sum in floating point: an integer or bool input would be rounded
# (pipelined summed int64 in float32) or fail inside a backend after transfers were posted.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_operand(t: object, name: str, op: str) -> torch.Tensor:
    """A tensor operand of a fused op: :func:`_check_tensor`, in one of :data:`FLOAT_DTYPES`."""
    t = _check_tensor(t, name, op)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{op}: {name} has dtype {t.dtype}; the fused ops take floating tensors only, one of "
            f"{[str(d).removeprefix('torch.') for d in FLOAT_DTYPES]}"
        )
    return t


def _check_tensor(t: object, name: str, op: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(t, torch.distributed.tensor.DTensor):
        raise TypeError(
            f"{op}: {name} must be a local tensor, got a DTensor; pass {name}.to_local()"
        )
    if t.numel() == 0:
        raise ValueError(
            f"{op}: {name} has a zero-sized dim (shape {tuple(t.shape)}); every dim must be >= 1"
        )
    return t


def _normalize_dim(dim: object, ndim: int, name: str, op: str, a_name: str) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool) or not -ndim <= dim < ndim:
        raise ValueError(
            f"{op}: {name} must be an int in [{-ndim}, {ndim - 1}] for a {ndim}-D "
            f"{a_name}, got {dim!r}"
        )
    dim %= ndim
    if dim == ndim - 1:
        raise ValueError(
            f"{op}: {name}={dim} is the contracted (last) dim of {a_name}; "
            f"it must be one of the leading dims 0..{ndim - 2}"
        )
    return dim


def _check_rhs(b: object, name: str, a: torch.Tensor, a_name: str, op: str) -> torch.Tensor:
    b = _check_tensor(b, name, op)
    if b.ndim != 2:
        raise ValueError(f"{op}: {name} must be 2-D [K, N], got shape {tuple(b.shape)}")
    if b.shape[0] != a.shape[-1]:
        raise ValueError(
            f"{op}: {name} has K={b.shape[0]} rows (shape {tuple(b.shape)}) but "
            f"{a_name} has K={a.shape[-1]} (shape {tuple(a.shape)}); they must match"
        )
    if b.dtype != a.dtype:
        raise ValueError(
            f"{op}: {name} has dtype {b.dtype} but {a_name} has {a.dtype}; they must match"
        )
    if b.device != a.device:
        raise ValueError(
            f"{op}: {name} is on {b.device} but {a_name} is on {a.device}; they "
            f"must be on the same device"
        )
    return b


def check_all_gather_matmul(
    a_shard: object, bs: object, gather_dim: object
) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    op = "all_gather_matmul"
    a_shard = _check_operand(a_shard, "a_shard", op)
    if a_shard.ndim < 2:
        raise ValueError(
            f"{op}: a_shard must have >= 2 dims [..., K], got shape {tuple(a_shard.shape)}"
        )
    dim = _normalize_dim(gather_dim, a_shard.ndim, "gather_dim", op, "a_shard")
    if isinstance(bs, torch.Tensor) or not isinstance(bs, Sequence) or len(bs) == 0:
        raise TypeError(
            f"{op}: bs must be a non-empty list of 2-D tensors, got {type(bs).__name__}"
        )
    checked = [_check_rhs(b, f"bs[{i}]", a_shard, "a_shard", op) for i, b in enumerate(bs)]
    return a_shard, checked, dim


def check_matmul_reduce_scatter(
    a: object,
    b: object,
    scatter_dim: object,
    reduce_op: object,
    group: dist.ProcessGroup,
    bias: object = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    op = "matmul_reduce_scatter"
    a = _check_operand(a, "a", op)
    if a.ndim < 2:
        raise ValueError(f"{op}: a must have >= 2 dims [..., K], got shape {tuple(a.shape)}")
    dim = _normalize_dim(scatter_dim, a.ndim, "scatter_dim", op, "a")
    b = _check_rhs(b, "b", a, "a", op)
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"{op}: reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    if a.shape[dim] % group.size():
        raise ValueError(
            f"{op}: a.shape[{dim}]={a.shape[dim]} (a has shape {tuple(a.shape)}) "
            f"must be divisible by the group size {group.size()}"
        )
    if bias is not None:
        bias = _check_tensor(bias, "bias", op)
        if bias.shape != (b.shape[1],) or bias.dtype != a.dtype or bias.device != a.device:
            raise ValueError(
                f"{op}: bias must be [N]=[{b.shape[1]}] of {a.dtype} on {a.device}, "
                f"got shape {tuple(bias.shape)} of {bias.dtype} on {bias.device}"
            )
    return a, b, dim
