"""The ``symm`` backend's reduce-scatter pusher: each block of partials the producer GEMM stored
locally is copied into its destination's symmetric buffer, then the destination is signalled.

Rank ``r`` of ``W``, slot channel ``ch``: the producer
(:func:`tp_kernels.kernels.matmul_rs_producer`) stores the rows owed to rank ``d != r`` into
block ``d`` of a local ``staging [W, m, N]`` and then raises the local progress word ``d``.
For ``d = r+1, r+2, ...`` (mod W, not ``r``), the pusher waits until word ``d`` is raised,
copies ``staging[d]`` into slot ``r`` of ``d``'s buffer, then raises word ``ch * W + r`` of
``d``'s signal pad, the word :func:`tp_kernels.kernels.reduce_slots` waits on. Every word holds
:data:`tp_kernels.signals.RAISED` when raised, in every call (the call's start barrier clears
them), so what the side stream enqueues is the same in every call: a CUDA graph replays it.
Each partial crosses the link once, by a copy, while the GEMM computes the next blocks.

* CUDA: on a cached high-priority side stream that first waits for the current stream as it was
  before the producer (so the copies come after the start barrier, which every peer passes only
  after its previous call's reads of its slots, and after the previous call's reads of staging),
  enqueued after the producer (a stream wait stalls its hardware queue, which the producer's stream
  may share), each wait is the driver's ``cuStreamWaitValue32`` (through ctypes: torch has no stream
  wait-value op), each copy a ``copy_`` of the staging block (``cudaMemcpyAsync`` device to device:
  the copy engine), each signal the fenced stream write of :mod:`tp_kernels.backends.symm_gather`.
  None needs an SM, and the persistent producer may hold every SM. The waits have no deadline of
  their own: they wait for this device's producer, which waits for nothing; a dead peer shows up in
  :func:`reduce_slots`' bounded waits instead. The producer raises every word it owes whatever
  happens (it runs after the start barrier, whose waits end at the deadline, and waits for nothing
  itself), and a producer that fails to launch leaves no wait behind (they are enqueued after its
  launch), so these waits end when the producer does. A driver without stream memory operations
  (``NVreg_EnableStreamMemOPs`` off) cannot wait on a word without an SM: there the side stream
  waits for the whole producer instead (no overlap of the copies with the GEMM, still no SM), and
  the signals are pinned-memory copies as in the all-gather.
* CPU: a host thread does the same while the producer runs in Triton's interpreter on the
  calling thread: it polls each word until the deadline (:func:`tp_kernels.symmetric_memory.
  get_timeout`; past it, a :class:`~tp_kernels.deadline.PeerTimeoutError` naming the
  group and the peer), copies from staging into the peer's mapping, and signals with a release
  store (``tp_kernels._C.store_release``). It is joined before the call returns, and an error it
  raised is raised there. The interpreter's stores and the thread's loads are ordered by the
  GIL, which both hold while they touch the words or the data.

The current stream waits for the side stream before the call returns: staging is reused by the
next call's producer, and the next call's signals must come after this call's copies.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence

import torch

from tp_kernels import deadline, signals, symmetric_memory
from tp_kernels.backends import symm_gather

# cuStreamWaitValue32's flag for "wait until *addr == value".
_CU_STREAM_WAIT_VALUE_EQ = 1
_CUDA_SUCCESS = 0
_CUDA_ERROR_NOT_SUPPORTED = 801
# How long the CPU pusher sleeps between polls of a word: the producer runs in the interpreter
# on the other thread, so a busy poll would only take the core (and the GIL) from it.
_POLL_S = 20e-6

# One block to push: (destination rank, its block in staging, slot r of its buffer).
Push = tuple[int, torch.Tensor, torch.Tensor]


class _StreamWaiter:
    """``cuStreamWaitValue32(stream, &word, RAISED, EQ)``, or ``None`` from :meth:`load` where
    the driver has no stream memory operations."""

    def __init__(self, wait: Callable[..., int]) -> None:
        self._wait = wait

    @classmethod
    def load(cls, stream: torch.cuda.Stream) -> _StreamWaiter | None:
        try:
            libcuda = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return None
        names = ("cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        wait = next((getattr(libcuda, n) for n in names if hasattr(libcuda, n)), None)
        if wait is None:
            return None
        wait.restype = ctypes.c_int
        wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        waiter = cls(wait)
        # A word that already holds the value: returns at once, or says "not supported". (The
        # stream's context makes its device current, as the driver call needs.) No host sync:
        # the probe word, allocated on the stream, is reused only by work queued after the wait,
        # and the stream, one of torch's pooled streams, may carry others' work.
        with torch.cuda.stream(stream):
            probe = torch.zeros(1, dtype=torch.int32, device=stream.device)
            code = waiter._enqueue(stream, probe.data_ptr(), 0)
            if code == _CUDA_ERROR_NOT_SUPPORTED:
                return None
            waiter._check(code)
        return waiter

    def _enqueue(self, stream: torch.cuda.Stream, address: int, value: int) -> int:
        return self._wait(stream.cuda_stream, address, value, _CU_STREAM_WAIT_VALUE_EQ)

    @staticmethod
    def _check(code: int) -> None:
        if code != _CUDA_SUCCESS:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {code}")

    def __call__(self, stream: torch.cuda.Stream, progress: torch.Tensor, word: int) -> None:
        address = progress.data_ptr() + word * progress.element_size()
        self._check(self._enqueue(stream, address, signals.RAISED))


class Pusher:
    """The reduce-scatter's pusher of one ``(group, device)``: its side stream and stream
    operations (CUDA), or its thread per call (CPU); the peers' signal pads it writes into."""

    def __init__(self, device: torch.device, pads: Sequence[torch.Tensor], where: str) -> None:
        """``pads[d]``: int32 view of rank ``d``'s signal pad; ``where`` names the group in
        errors."""
        self.device, self._pads, self._where = device, list(pads), where
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device, priority=-1)
            self._wait = _StreamWaiter.load(self._stream)
            self._write = symm_gather._StreamWriter()
        else:
            self._stream, self._wait = None, None
            self._write = symm_gather._store_release

    def run(
        self,
        produce: Callable[[], None],
        pushes: Sequence[Push],
        progress: torch.Tensor,
        word: int,
    ) -> symm_gather.Copies:
        """Launch ``produce`` (the producer GEMM, on the calling thread and current stream) and,
        beside it, for each ``(d, block, slot)`` of ``pushes`` in order: wait until
        ``progress[d]`` is raised, ``slot.copy_(block)``, raise word ``word`` of ``d``'s pad.
        Returns the copies, to be joined before the call returns."""

        def push(d: int, block: torch.Tensor, slot: torch.Tensor) -> None:
            slot.copy_(block)
            self._write(self._pads[d], word)

        if self._stream is not None:
            stream, current = self._stream, torch.cuda.current_stream(self.device)
            if self._wait is None:  # no stream waits: the copies follow the whole producer
                produce()
                stream.wait_stream(current)
            else:
                # The side stream starts after the previous call's reads of staging and of this
                # half (the event before the producer), but its waits are enqueued after the
                # producer: a stream wait stalls its hardware queue, which the current stream
                # may share (streams outnumber the queues; CUDA_DEVICE_MAX_CONNECTIONS=1 leaves
                # one), and a producer queued behind a wait for its own words would never run;
                # and a producer that fails to launch leaves no wait behind.
                before = current.record_event()
                produce()
                stream.wait_event(before)
            with torch.cuda.stream(stream):
                for d, block, slot in pushes:
                    if self._wait is not None:
                        self._wait(stream, progress, d)
                    push(d, block, slot)
            return symm_gather.Copies(event=stream.record_event(), device=self.device)

        stop = threading.Event()
        timeout_s = symmetric_memory.get_timeout()

        def push_all() -> None:
            for d, block, slot in pushes:
                if not self._poll(progress, d, timeout_s, stop):
                    return  # the producer failed: its error is the call's
                push(d, block, slot)

        inference = torch.is_inference_mode_enabled()

        def run() -> None:
            try:
                with torch.inference_mode(inference):  # the caller's, as the copier's thread
                    push_all()
            except BaseException as exc:  # raised again by join, on the calling thread
                copies.error = exc

        thread = threading.Thread(target=run, name="tp_kernels symm pusher", daemon=True)
        copies = symm_gather.Copies(thread=thread)
        thread.start()
        try:
            produce()
        except BaseException:
            stop.set()
            copies.join()
            raise
        return copies

    def _poll(
        self, progress: torch.Tensor, d: int, timeout_s: float, stop: threading.Event
    ) -> bool:
        """CPU: wait until ``progress[d]`` is raised (True) or ``stop`` is set (False); raise
        past the deadline."""
        start = time.monotonic()
        while int(progress[d]) != signals.RAISED:
            if stop.is_set():
                return False
            waited = time.monotonic() - start
            if waited > timeout_s:
                raise deadline.PeerTimeoutError(
                    f"{self._where}: the pusher gave up after {waited:.3g} s (timeout "
                    f"{timeout_s:g} s) waiting for this rank's producer to finish the block owed "
                    f"to peer rank {d} (progress word {d} holds {int(progress[d])}, needed "
                    f"{signals.RAISED}); rank {d} did not get it",
                    phase="signal wait",
                    peers=[d],
                    waited_s=waited,
                )
            time.sleep(_POLL_S)
        return True
