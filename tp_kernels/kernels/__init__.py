"""Triton kernels of the ``symm`` backend, with one thin host launcher each.

Importing this package imports Triton (the rest of ``tp_kernels`` never does at import time).
Set ``TRITON_INTERPRET=1`` *before* importing it to run the kernels in Triton's interpreter on
CPU tensors and CPU shared memory; block sizes are then fixed and small, and bf16 operands are
upcast to fp32 before ``tl.dot`` (the interpreter's bf16 dot is wrong; a bf16 x bf16 product is
exact in fp32, so the result equals a bf16 MMA with an fp32 accumulator up to summation order),
and block-scaled (MXFP8) blocks are dequantized to fp32 before it (Triton 3.6's and 3.7's
interpreters have no ``tl.dot_scaled``; the products are exact in fp32 there too).

Supported Triton: :data:`MIN_TRITON` and newer (the versions torch's CUDA wheels pin from torch
2.10 on: 3.6.0, 3.7.x, and the newest release). ``python -m tp_kernels.kernels.compile_check``
compiles every variant for sm_90 / sm_100 / sm_80 without a GPU and checks the PTX.

Layout and signal protocol, shared by every kernel (W ranks, this rank ``r``), the same on a GPU
and in the interpreter (only :func:`_poll_acquire` has two bodies: PTX on a GPU, the host clock
in the interpreter):

* Matrices are 2-D; a gathered or scattered dimension is rank-major (rows ``[s*m, (s+1)*m)``
  belong to rank ``s``). Symmetric buffers are row-major and contiguous, and every address in a
  table is a multiple of 16 bytes; other operands are passed with their strides (no copies).
* Peers are reached through int64 address tables of length W (``buffer_ptrs``, ``signal_ptrs``):
  entry ``s`` is the address, *in this process*, of rank ``s``'s symmetric buffer or signal pad.
  Callers build a table once per buffer and reuse it: building one is a host-to-device copy.
* A signal pad is an array of int32 words; word ``channel * W + src`` of rank ``d``'s pad is
  written by rank ``src`` to tell ``d`` something is ready. Every word the kernels wait on, in a
  pad or local (progress words), goes **0 -> 1 -> 0** (:mod:`tp_kernels.signals`): a writer
  raises it (release, system scope), a waiter polls until it is raised (acquire, system
  scope), and it is cleared by its only reader (a barrier's word) or by the next call's start
  barrier (progress and slot words, which many tiles wait on). No value depends on the call,
  so a CUDA graph that captured a call replays it correctly: there is no epoch or channel that
  the host fixes per call and a replay would repeat.
* **Every call starts with a barrier** (:func:`barrier` on the start channel, which also clears
  the call's progress and slot words). A rank arrives only after its previous call ended in
  stream order, so after the barrier no peer still reads anything of the previous call (the
  write-after-read rule for the symmetric buffers, whatever region a call uses), and a peer's
  signal of this call can only come after this rank's arrival, so the clear cannot erase it.
  Barrier words alternate with other channels (start, then publish, then start again), so a
  fast peer never raises a barrier word twice before its reader cleared it.
* Waits are bounded: a wait that runs past ``timeout_s`` stores what it waited for (a
  ``WAIT_*`` code) into ``status[s]`` (int32 [W], zero until then, never reset) and the kernel
  finishes with rank ``s``'s part undefined; a later wait for ``s`` that would have to spin gives
  up at once. The launchers never read ``status``: on a GPU it lives in pinned host memory (see
  :func:`new_status`), so the host reads it without synchronizing, at the caller's next call.
  Kernels raise nothing: the ``symm`` backend turns a recorded wait into
  :class:`tp_kernels.PeerTimeoutError`, naming each peer's wait by its code.
* Launches go to the operands' device (not the current one), and on its current stream.
* The launchers trust their operands (A, B, the outputs, the gathered A, the slots): shapes,
  dtypes and devices as each docstring states. The ops layer has checked the user's tensors
  (:mod:`tp_kernels.ops._checks`) and the ``symm`` backend allocates the rest from them, so a
  launcher does not check them again. It checks what only the backend makes, cheaply and before
  launching: rank and channel, the address tables, the scratch (progress words, counters)
  and the timeout record, whose mistakes would send a kernel to a wrong address or a wrong word.
"""

from tp_kernels.kernels._shared import (
    DEFAULT_TIMEOUT_S,
    INTERPRET,
    MIN_TRITON,
    VARYING_ARGS,
    block_scaled_mma,
    dot_precision,
    new_status,
    on_device,
    tma_layout,
    triton_unsupported_reason,
)
from tp_kernels.kernels.ag_matmul import (
    AgMatmulConsumer,
    ag_matmul_consumer,
    barrier,
)
from tp_kernels.kernels.matmul_rs import (
    RsProducer,
    SlotReduction,
    matmul_rs_producer,
    new_counters,
    reduce_slots,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "INTERPRET",
    "MIN_TRITON",
    "VARYING_ARGS",
    "AgMatmulConsumer",
    "RsProducer",
    "SlotReduction",
    "ag_matmul_consumer",
    "barrier",
    "block_scaled_mma",
    "dot_precision",
    "matmul_rs_producer",
    "new_counters",
    "new_status",
    "on_device",
    "reduce_slots",
    "tma_layout",
    "triton_unsupported_reason",
]
