"""Triton kernels of the ``symm`` backend, with one thin host launcher each.

Importing this package imports Triton (the rest of ``tp_kernels`` never does at import time).
Set ``TRITON_INTERPRET=1`` *before* importing it to run the kernels in Triton's interpreter on
CPU tensors and CPU shared memory; block sizes are then fixed and small, and bf16 operands are
upcast to fp32 before ``tl.dot`` (the interpreter's bf16 dot is wrong; a bf16 x bf16 product is
exact in fp32, so the result equals a bf16 MMA with an fp32 accumulator up to summation order).

Supported Triton: :data:`MIN_TRITON` and newer (the versions torch's CUDA wheels pin from torch
2.10 on: 3.6.0, 3.7.x, and the newest release). ``python -m tp_kernels.kernels.compile_check``
compiles every variant for sm_90 / sm_80 without a GPU and checks the PTX.

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
  written by rank ``src`` to tell ``d`` something is ready. A writer stores the call's **epoch**
  (release, system scope); a waiter polls its own pad until the word *equals* the epoch it expects
  (acquire, system scope). Nobody resets a word: the caller numbers its calls 1, 2, 3, ...
  (wrapping from ``MAX_EPOCH`` back to 1; pads start zeroed). Waiting never consumes a word, so
  every tile that needs rank ``s`` may wait on the same word, and a kernel may run several times
  for one call (autotuning does).
* **Consecutive calls use different channels** (the caller alternates two, by call parity). With
  one channel a fast peer that has finished call ``c`` stores ``c + 1`` into the word while this
  rank's late tiles of call ``c`` still wait for ``c``: they would spin to the deadline. With two,
  the peer's next store into this word is call ``c + 2``'s, and no rank can start call ``c + 2``
  before every rank has finished call ``c``: every call waits for a signal of every peer, and a
  rank signals call ``c + 1`` only after its call ``c`` (stream order on a GPU).
* What the kernels do not order: a rank must not overwrite a buffer that peers may still be
  reading for the previous call (write-after-read). The caller guarantees it, e.g. by alternating
  two buffer halves by call parity (the argument above then covers the buffers too).
* Waits are bounded: a wait that runs past ``timeout_s`` stores the epoch it waited for into
  ``status[s]`` (int32 [W], zero until then, never reset) and the kernel finishes with rank
  ``s``'s part undefined; a later wait for ``s`` that would have to spin gives up at once. The
  launchers never read ``status``: on a GPU it lives in pinned host memory (see
  :func:`new_status`), so the host reads it without synchronizing, at the caller's next call;
  :func:`raise_on_timeout` turns it into :class:`PeerWaitTimeout`.
* Launches go to the operands' device (not the current one), and on its current stream.
* The launchers trust their operands (A, B, the outputs, the gathered A, the slots): shapes,
  dtypes and devices as each docstring states. The ops layer has checked the user's tensors
  (:mod:`tp_kernels.ops._checks`) and the ``symm`` backend allocates the rest from them, so a
  launcher does not check them again. It checks what only the backend makes, cheaply and before
  launching: rank, channel and epoch, the address tables, the scratch (progress words, counters)
  and the timeout record, whose mistakes would send a kernel to a wrong address or a wrong word.
"""

from tp_kernels.kernels._shared import (
    DEFAULT_TIMEOUT_S,
    INTERPRET,
    MAX_EPOCH,
    MIN_TRITON,
    VARYING_ARGS,
    PeerWaitTimeout,
    dot_precision,
    new_status,
    on_device,
    raise_on_timeout,
    tma_layout,
    triton_unsupported_reason,
)
from tp_kernels.kernels.ag_matmul import (
    ag_matmul_consumer,
    signal_ready,
    wait_ready,
)
from tp_kernels.kernels.matmul_rs import (
    matmul_rs_producer,
    new_counters,
    reduce_slots,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "INTERPRET",
    "MAX_EPOCH",
    "MIN_TRITON",
    "VARYING_ARGS",
    "PeerWaitTimeout",
    "ag_matmul_consumer",
    "dot_precision",
    "matmul_rs_producer",
    "new_counters",
    "new_status",
    "on_device",
    "raise_on_timeout",
    "reduce_slots",
    "signal_ready",
    "tma_layout",
    "triton_unsupported_reason",
    "wait_ready",
]
