"""Triton kernels of the ``symm`` backend, with one thin host launcher each.

Importing this package imports Triton (the rest of ``tp_kernels`` never does at import time).
Set ``TRITON_INTERPRET=1`` *before* importing it to run the kernels in Triton's interpreter on
CPU tensors and CPU shared memory; block sizes are then fixed and small, and bf16 operands are
upcast to fp32 before ``tl.dot`` (the interpreter's bf16 dot is wrong; a bf16 x bf16 product is
exact in fp32, so the result equals a bf16 MMA with an fp32 accumulator up to summation order).

Layout and signal protocol, shared by every kernel (W ranks, this rank ``r``):

* All matrices are 2-D, row-major and contiguous; a gathered or scattered dimension is rank-major
  (rows ``[s*m, (s+1)*m)`` belong to rank ``s``).
* Peers are reached through int64 address tables of length W (``buffer_ptrs``, ``signal_ptrs``):
  entry ``s`` is the address, *in this process*, of rank ``s``'s symmetric buffer or signal pad.
* A signal pad is an array of int32 words; word ``channel * W + src`` of rank ``d``'s pad is
  written by rank ``src`` to tell ``d`` something is ready. A writer stores the call's **epoch**
  (release, system scope); a waiter polls its own pad until the word *equals* the epoch it expects
  (acquire, system scope). Nobody resets a word: the caller keeps one counter per channel and
  passes 1, 2, 3, ... (wrapping from ``MAX_EPOCH`` back to 1; pads start zeroed). Waiting never
  consumes a word, so every tile that needs rank ``s`` may wait on the same word; and a signal of
  call ``k`` cannot satisfy call ``k + 1``'s wait, with no host reset to race against a fast peer
  that already signals the next call. Exact equality also turns a protocol slip (a peer one call
  ahead) into a timeout instead of a silent stale read. A channel used with these kernels carries
  epochs, so it must not also carry ``SymmWorkspace.put_signal`` / ``wait_signal`` (their 0/1
  protocol) or ``barrier``.
* What the kernels do not order: a rank must not overwrite a buffer that peers may still be
  reading for the previous call (write-after-read). The caller guarantees it, e.g. with a barrier
  before reusing a buffer, or by alternating two buffers.
* Waits are bounded: a wait that runs past ``timeout_s`` marks the peer in an int32 ``status``
  tensor (shape ``[W]``, 1 = timed out) and the kernel finishes with that peer's rows undefined;
  the launcher raises :class:`PeerWaitTimeout` unless called with ``check=False``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"
MAX_EPOCH: int = 2**31 - 1
DEFAULT_TIMEOUT_S: float = 300.0

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


class PeerWaitTimeout(TimeoutError):
    """A kernel waited for a peer's signal past its deadline.

    Attributes: ``peers`` (the ranks that never signalled), ``channel``, ``epoch``, ``timeout_s``.
    """

    def __init__(
        self, message: str, *, peers: list[int], channel: int, epoch: int, timeout_s: float
    ) -> None:
        super().__init__(message)
        self.peers = peers
        self.channel = channel
        self.epoch = epoch
        self.timeout_s = timeout_s


def tl_dtype(dtype: torch.dtype, *, argument: str) -> tl.dtype:
    """The Triton element type of a supported torch floating dtype (fp32, fp16, bf16)."""
    if dtype not in _TL_DTYPES:
        raise TypeError(
            f"{argument}: dtype {dtype} is not supported; expected one of "
            f"{sorted(str(d) for d in _TL_DTYPES)}"
        )
    return _TL_DTYPES[dtype]


def dot_precision(dtype: torch.dtype) -> str | None:
    """``input_precision`` for ``tl.dot``: fp32 follows ``torch.backends.cuda.matmul.allow_tf32``
    like ``torch.matmul`` does; 16-bit operands keep Triton's default."""
    if dtype != torch.float32:
        return None
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 and not INTERPRET else "ieee"


def gemm_configs() -> list[triton.Config]:
    """Tile shapes the GEMM kernels pick from: one small fixed tile under the interpreter."""
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, num_warps=1)]
    shapes = [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 32, 4, 4)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bm, bn, bk, w, st in shapes
    ]


def check_world(rank: int, world_size: int, channel: int, epoch: int) -> None:
    """Validate the rank/channel/epoch arguments every launcher takes."""
    if world_size < 1:
        raise ValueError(f"world_size: got {world_size}, expected >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: got {rank}, expected 0 <= rank < world_size={world_size}")
    if channel < 0:
        raise ValueError(f"channel: got {channel}, expected >= 0")
    if not 1 <= epoch <= MAX_EPOCH:
        raise ValueError(
            f"epoch: got {epoch}, expected 1 <= epoch <= {MAX_EPOCH} "
            "(0 is the value of a fresh pad, so it would never be waited for)"
        )


def check_ptr_table(
    table: torch.Tensor, world_size: int, device: torch.device, *, argument: str
) -> None:
    """An address table must be an int64 tensor of shape [world_size] on the kernel's device."""
    if table.dtype != torch.int64 or table.dim() != 1 or table.shape[0] != world_size:
        raise ValueError(
            f"{argument}: got a {table.dtype} tensor of shape {tuple(table.shape)}, "
            f"expected int64 of shape ({world_size},) (one address per rank)"
        )
    if table.device != device or not table.is_contiguous():
        raise ValueError(
            f"{argument}: got a tensor on {table.device} (contiguous="
            f"{table.is_contiguous()}), expected a contiguous tensor on {device}"
        )


def check_matrix(
    t: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    *,
    argument: str,
) -> None:
    """A kernel operand must have exactly this shape, dtype and device, and be contiguous."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ValueError(
            f"{argument}: got {t.dtype} of shape {tuple(t.shape)} on {t.device}, "
            f"expected {dtype} of shape {tuple(shape)} on {device}"
        )
    if not t.is_contiguous():
        raise ValueError(f"{argument}: must be contiguous (row-major), got strides {t.stride()}")


def timeout_ns(timeout_s: float) -> int:
    """A wait's deadline in nanoseconds, as ``tl.atomic_poll`` takes it."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: got {timeout_s}, expected a positive number of seconds")
    return int(timeout_s * 1e9)


def raise_on_timeout(
    status: torch.Tensor,
    *,
    what: str,
    rank: int,
    channel: int,
    epoch: int,
    timeout_s: float,
    group_name: str | None,
) -> None:
    """Raise :class:`PeerWaitTimeout` if a kernel's ``status`` marks any peer as timed out."""
    peers = [s for s, failed in enumerate(status.tolist()) if failed]
    if not peers:
        return
    world_size = status.shape[0]
    group = f" of group {group_name!r}" if group_name else ""
    words = [channel * world_size + s for s in peers]
    raise PeerWaitTimeout(
        f"{what} on rank {rank}{group}: waited {timeout_s:g} s for the signal of rank(s) {peers} "
        f"(channel {channel}, epoch {epoch}, signal words {words} of rank {rank}'s pad) and it "
        "never came; the peer did not reach this call, or signalled another epoch",
        peers=peers,
        channel=channel,
        epoch=epoch,
        timeout_s=timeout_s,
    )


@triton.jit
def _wait_signal(word_ptr, epoch, timeout_ns, failed_ptr):
    """Block until ``*word_ptr == epoch`` (acquire, system scope), at most ``timeout_ns``.

    On timeout set ``*failed_ptr = 1``. A wait whose ``*failed_ptr`` is already set returns at
    once, so the later tiles of a dead peer do not each spend a full timeout.
    """
    if tl.load(failed_ptr, volatile=True) == 0:
        ok = tl.atomic_poll(word_ptr, epoch, sem="acquire", scope="sys", timeout_ns=timeout_ns)
        if ok == 0:
            tl.store(failed_ptr, 1)


@triton.jit
def _round_to(x, DTYPE: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """``x`` (fp32) rounded to ``DTYPE``, to nearest with ties to even.

    ``BF16_BY_HAND`` is set for bf16 under the interpreter, which has two bf16 defects: its
    ``tl.dot`` of bf16 operands is wrong (the GEMMs upcast them to fp32 first) and its fp32 -> bf16
    cast truncates. The rounding is then done on the bits: add ``0x7FFF`` plus the lowest kept
    bit, keep the top half (a NaN whose payload lies only in the low 16 bits would come out as
    inf; torch's NaN does not).
    """
    if BF16_BY_HAND:
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _note_first_touch(trace_ptr, src, world_size):
    """Trace a tile start: ``ticket = trace[W]++``; ``trace[src] = min(trace[src], ticket)``.

    With ``trace = [INT32_MAX] * W + [0]`` beforehand, ``argsort(trace[:W])`` is the order in which
    the kernel first touched each source rank.
    """
    ticket = tl.atomic_add(trace_ptr + world_size, 1)
    tl.atomic_min(trace_ptr + src, ticket)


def new_trace(world_size: int, device: torch.device) -> torch.Tensor:
    """The initial trace buffer of :func:`_note_first_touch`: int32 [W + 1]."""
    trace = torch.full(
        (world_size + 1,), torch.iinfo(torch.int32).max, dtype=torch.int32, device=device
    )
    trace[world_size] = 0
    return trace


def store_order(trace: torch.Tensor, order_out: torch.Tensor, world_size: int) -> None:
    """Write the first-touch order recorded in ``trace`` into ``order_out`` (int [W])."""
    order_out.copy_(torch.argsort(trace[:world_size], stable=True))


from tp_kernels.kernels.ag_matmul import ag_matmul_consumer, signal_ready  # noqa: E402
from tp_kernels.kernels.matmul_rs import matmul_rs_producer, reduce_slots  # noqa: E402

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "INTERPRET",
    "MAX_EPOCH",
    "PeerWaitTimeout",
    "ag_matmul_consumer",
    "matmul_rs_producer",
    "reduce_slots",
    "signal_ready",
]
