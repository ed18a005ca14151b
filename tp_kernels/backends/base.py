"""What every backend provides: the two fused patterns on 2-D, row-major, rank-major tensors.

The ops layer (``tp_kernels.ops``) checks arguments, moves the gather/scatter dim to the front and
flattens, so a backend only ever sees (on rank ``r`` of a group of ``W`` ranks)::

    all_gather_matmul:      a_shard [m, K], bs[j] [K, N_j]
                            A = cat over s of a_shard(rank s)           [W*m, K]
                            outs[j] = A @ bs[j]                          [W*m, N_j]
    matmul_reduce_scatter:  a [W*m, K], b [K, N], addend None or [W*m, N]
                            out = (sum over s of (a @ b + addend)(rank s))[r*m:(r+1)*m]   [m, N]

Backends are stateless singletons; anything they cache (buffers) is keyed by group.

Under CUDA graph capture a call may not allocate outside the stream's order, grow a workspace or
exchange anything on the host: the ops layer asks :meth:`Backend.capture_unready_reason` before it
launches a captured call, and :meth:`Backend.reserve` (``tp_kernels.reserve``) makes, outside
capture, whatever a backend would otherwise make on a call's first use.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tp_kernels import deadline
from tp_kernels._compat import all_gather_single
from tp_kernels.backends.scaled import Scaled


class CaptureUnreadyError(RuntimeError):
    """A fused call that cannot be captured in a CUDA graph as things stand (a new shape class, or
    a backend that would have to allocate, grow or agree); raised before anything is launched."""


@dataclass(frozen=True)
class CaptureNeed:
    """What one fused call (or one part of it) needs from a backend to be captured: ``op``
    (``"all_gather_matmul"``, ``"matmul_reduce_scatter"`` or ``"all_gather"``, the backward's
    re-gather), ``nbytes``, the bytes of the call's largest symmetric buffer (the shard for an
    all-gather, ``a_shard.nbytes``; the ``[W*m, N]`` product for a reduce-scatter,
    ``a.shape[0] * N * itemsize``) and the ``dtype``; ``block_scaled``: an MXFP8 GEMM, which
    a backend may run by another path than its fp8 GEMMs."""

    op: str
    nbytes: int
    dtype: torch.dtype
    block_scaled: bool = False


def capturing(device: torch.device) -> bool:
    """Whether work for ``device`` is being captured in a CUDA graph on the current stream. CPU
    tensors never are (asking a CPU build of torch about capture is not free: it is skipped)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class PendingGather:
    """An all-gather in flight on ``group``; :meth:`wait` (within the deadline, see
    :func:`tp_kernels.deadline.wait`) returns the gathered ``[W*m, K]`` tensor."""

    def __init__(
        self, out: torch.Tensor, work: dist.Work | None, group: dist.ProcessGroup | None = None
    ) -> None:
        self._out, self._work, self._group = out, work, group

    def wait(self) -> torch.Tensor:
        if self._work is not None and self._group is not None:
            deadline.wait(self._work, self._group, "all-gather", self._out.device)
            self._work = None
        return self._out


class Backend(ABC):
    """Base class: the interface, and the plain asynchronous gather that the backward pass uses."""

    name: str = ""
    # Why this backend cannot run a block-scaled (MXFP8) call, or None: it can.
    block_scales_reason: str | None = None

    def unavailable_reason(
        self, group: dist.ProcessGroup | None, device: torch.device
    ) -> str | None:
        """``None`` when this backend can run for ``group`` and tensors on ``device``; else why not.

        ``group=None`` asks whether the backend can run in this process at all.
        """
        return None

    def capture_unready_reason(
        self, group: dist.ProcessGroup, device: torch.device, need: CaptureNeed
    ) -> str | None:
        """``None`` when a call needing ``need`` on ``group`` can be captured in a CUDA graph now,
        without allocating outside the stream's order, growing a workspace or agreeing with its
        peers; else why not, naming the bytes needed and how to reserve them. A backend with no
        state of its own needs nothing more than collectives a graph can hold: NCCL's are
        stream work and capture; gloo's run on the host (a CUDA tensor goes through a host copy
        and a synchronization), so no call on a gloo group of CUDA tensors is capturable."""
        if device.type != "cuda" or group.size() == 1:
            return None
        collectives = group._get_backend(device).name()
        if collectives == "nccl":
            return None
        return (
            f"its collectives on {device.type} run on the group's {collectives!r} backend, "
            "which works on the host: only NCCL's collectives can be captured"
        )

    def reserve(self, group: dist.ProcessGroup, device: torch.device, nbytes: int) -> None:
        """Make, outside capture, every workspace and state this backend would need for calls on
        ``group`` and ``device`` whose largest symmetric buffer (see :class:`CaptureNeed`) has up to
        ``nbytes``. Collective: every rank of ``group`` calls it with the same ``nbytes``. A
        backend with no state of its own has nothing to make."""
        return None

    def all_gather_async(self, a_shard: torch.Tensor, group: dist.ProcessGroup) -> PendingGather:
        """Start ``A = all_gather(a_shard)``; overlapped with whatever the caller computes next."""
        world = group.size()
        out = a_shard.new_empty((world * a_shard.shape[0], *a_shard.shape[1:]))
        if world == 1:
            out.copy_(a_shard)
            return PendingGather(out, None)
        with deadline.posting(group, "all-gather"):
            work = all_gather_single(out, a_shard, group, async_op=True)
        return PendingGather(out, work, group)

    @abstractmethod
    def all_gather_matmul(
        self,
        a_shard: torch.Tensor,
        bs: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        *,
        return_a: bool,
        scaling: Scaled | None = None,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """``(A if return_a else None, [A @ b for b in bs])`` with ``A`` gathered along dim 0.
        With ``scaling`` (:mod:`tp_kernels.backends.scaled`): ``a_shard`` is fp8 bytes
        (``uint8``, packed rows when row-wise), ``bs`` fp8, the products ``scaling``'s, and
        ``return_a`` is False (no scaled call wants the gathered bytes back)."""

    @abstractmethod
    def matmul_reduce_scatter(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        addend: torch.Tensor | None = None,
        scaling: Scaled | None = None,
    ) -> torch.Tensor:
        """This rank's rows of ``sum over ranks of (a @ b + addend)``, summed over the group.
        With ``scaling``: ``a`` and ``b`` fp8, ``a @ b`` is ``scaling``'s product."""
