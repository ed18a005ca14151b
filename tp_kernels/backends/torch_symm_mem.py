"""The ``torch_symm_mem`` backend: PyTorch's own fused ops over CUDA symmetric memory.

It hands both patterns to ``torch.ops.symm_mem`` (defined by importing
``torch.distributed._symmetric_memory``), so a GPU user gets a fused path that PyTorch maintains.
On rank ``r`` of ``W`` ranks, shapes as in ``backends/base.py``::

    all_gather_matmul:      fused_all_gather_matmul(a_shard [m, K], bs, gather_dim=0, group_name,
                                                    return_A=return_a)
                            -> (A [W*m, K] or None, [A @ b_j  [W*m, N_j]])
    matmul_reduce_scatter:  fused_matmul_reduce_scatter(a [W*m, K], b [K, N], "sum",
                                                        scatter_dim=0, group_name)
                            -> (sum over s of (a @ b)(rank s))[r*m:(r+1)*m]   [m, N]

The ops layer has already moved the gather/scatter dim to the front and made the input
contiguous, which is the layout torch's ops take without a copy; ``"avg"`` and the bias are
applied by the ops layer after the sum, so torch's op always sums.

``addend`` (the backward's gradient of a returned ``A``) has no place in torch's op. Since
``rs(a @ b + addend) = rs(a @ b) + rs(addend)``, the addend's reduce-scatter is started as an
ordinary collective before the fused op and added afterwards: it runs on the communicator's
stream while the fused op computes. It cannot deadlock: every rank enqueues the collective, then
the fused op; the collective depends only on the peers' collectives, the fused op's
symmetric-memory barriers only on the peers' fused ops.

Requirements (checked by :meth:`TorchSymmMemBackend.unavailable_reason` without communication):
CUDA tensors; a torch build whose ``torch.distributed._symmetric_memory`` imports and defines both
ops; every rank of the group on this host (an NVLink domain; from ``LOCAL_WORLD_SIZE``). Any group
with a store will do for the rendezvous (NCCL on GPU nodes; gloo where ranks share one GPU).
Torch 2.7 .. 2.13 differ in two ways, both feature-detected: before ``return_A`` existed, the
gathered ``A`` is always returned (and dropped here when not asked for); before
``enable_symm_mem_for_group`` was deprecated, it is called once per group.

What was not run where this was written (a CPU machine, no GPU): torch's CUDA kernels behind the
two ops, the overlap of the addend's reduce-scatter with them, and the availability checks on a
CUDA machine. The CPU tests replace the two ops by gloo implementations of their documented
semantics, registered under the real schemas, and check the glue: argument order, return values,
the addend, autograd through the ops layer.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tp_kernels import symmetric_memory
from tp_kernels._compat import reduce_scatter_single
from tp_kernels.backends.base import Backend

_OPS = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")

_enabled_groups: set[str] = set()


def _symm_mem_module() -> tuple[Any, str | None]:
    """``(torch.distributed._symmetric_memory, None)``, or ``(None, why it does not import)``."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except (ImportError, RuntimeError) as exc:
        return None, f"torch.distributed._symmetric_memory does not import ({exc})"
    return symm_mem, None


def _missing_ops_reason() -> str | None:
    """Why this torch build cannot run the two fused ops (``None`` when it can)."""
    _, why = _symm_mem_module()  # importing it is what defines torch.ops.symm_mem.*
    if why is not None:
        return why
    missing = [name for name in _OPS if not hasattr(torch.ops.symm_mem, name)]
    if missing:
        names = ", ".join(f"torch.ops.symm_mem.{name}" for name in missing)
        return f"torch {torch.__version__} has no {names}"
    return None


def _hosts_reason(group: dist.ProcessGroup) -> str | None:
    """Why ``group`` may span more than one host (``None`` when all its ranks are on this one).

    Local facts only, as for our own symmetric memory
    (:func:`tp_kernels.symmetric_memory._spans_hosts_reason`);
    without ``LOCAL_WORLD_SIZE`` nothing is known, and unlike our workspaces torch's ops have no
    hostname check of ours behind them, so that counts as a reason too.
    """
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not local.isdigit() or int(local) < 1:
        return (
            f"LOCAL_WORLD_SIZE is {local!r}, so whether every rank of the group runs on this host "
            "cannot be told without communication (torchrun sets it)"
        )
    return symmetric_memory._spans_hosts_reason(group, "torch's fused symmetric-memory ops")


def _enable_for_group(group: dist.ProcessGroup) -> None:
    """Register ``group`` with torch's symmetric memory, on the torch versions that need it.

    Older releases need ``enable_symm_mem_for_group`` before the first fused op on a group (some
    call it themselves; calling it again is a no-op); newer ones mark it deprecated (a
    FutureWarning on every call) and need nothing.
    """
    name = group.group_name
    if name in _enabled_groups:
        return
    symm_mem, _ = _symm_mem_module()
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None and getattr(enable, "__deprecated__", None) is None:
        enable(name)
    _enabled_groups.add(name)


@functools.cache
def _takes_return_a() -> bool:
    """Whether this torch's ``fused_all_gather_matmul`` has the ``return_A`` keyword."""
    schema = torch.ops.symm_mem.fused_all_gather_matmul.default._schema
    return any(arg.name == "return_A" for arg in schema.arguments)


class TorchSymmMemBackend(Backend):
    name = "torch_symm_mem"

    def unavailable_reason(
        self, group: dist.ProcessGroup | None, device: torch.device
    ) -> str | None:
        if device.type != "cuda":
            return f"torch's fused symmetric-memory ops run on CUDA tensors, not {device.type}"
        if not torch.cuda.is_available():
            return f"torch.cuda.is_available() is False (torch {torch.__version__})"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"{device} does not exist: this process sees {torch.cuda.device_count()} GPUs"
        why = _missing_ops_reason()
        if why is not None or group is None:
            return why
        # Any group with a store: torch's rendezvous exchanges handles through it (NCCL for real
        # GPU nodes; gloo where several ranks share one GPU, which NCCL refuses).
        return _hosts_reason(group)

    def all_gather_matmul(
        self,
        a_shard: torch.Tensor,
        bs: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        *,
        return_a: bool,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        if group.size() == 1:
            return (a_shard.clone() if return_a else None), [a_shard @ b for b in bs]
        _enable_for_group(group)
        op = torch.ops.symm_mem.fused_all_gather_matmul
        kwargs = {"return_A": return_a} if _takes_return_a() else {}
        a, outs = op(a_shard, list(bs), 0, group.group_name, **kwargs)
        return (a if return_a else None), list(outs)

    def matmul_reduce_scatter(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        addend: torch.Tensor | None = None,
    ) -> torch.Tensor:
        world = group.size()
        if world == 1:
            return a @ b if addend is None else torch.addmm(addend, a, b)
        _enable_for_group(group)
        pending = None
        if addend is not None:
            # Started first, so that it overlaps the fused op (see the module docstring).
            rs_addend = addend.new_empty((addend.shape[0] // world, addend.shape[1]))
            pending = reduce_scatter_single(rs_addend, addend.contiguous(), group, async_op=True)
        out = torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group.group_name)
        if pending is not None:
            pending.wait()
            out = out.add_(rs_addend)
        return out


BACKEND = TorchSymmMemBackend()
