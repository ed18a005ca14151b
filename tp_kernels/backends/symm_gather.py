"""The ``symm`` backend's all-gather producer: peers' shards copied into the local gathered A in
chunks, each chunk followed by a progress word that the consumer GEMM waits on.

Rank ``r`` of ``W``, once the publish barrier (:func:`tp_kernels.kernels.barrier`) has seen
every peer's shard published in its symmetric buffer: for ``s = r+1, r+2, ...`` (mod W) and chunk
``j = 0, 1, ...`` of ``s``'s ``m`` rows, copy rows ``[j*c, min((j+1)*c, m))`` of ``s``'s buffer
into rows ``s*m + ...`` of ``A`` [W*m, K], then raise progress word ``s * chunks + j`` (to
:data:`tp_kernels.signals.RAISED`, the same value in every call: the call's start barrier clears
the words) (:func:`tp_kernels.kernels.ag_matmul_consumer` documents the consumer's
side). Each remote byte is read once, by a copy; the copies of a call run one after another.

* CUDA: the copies are ``copy_`` of the peer's view (``cudaMemcpyAsync`` device to device: the copy
  engine, no SM) on a side stream that first waits for the current stream (so it starts after the
  barrier), and each progress word is written by a stream memory operation,
  ``torch.ops.symm_mem.stream_write_value32_`` (``cuStreamWriteValue32``, which fences at system
  scope before the write; in every torch this package supports, >= 2.7). A driver without stream
  memory operations (``NVreg_EnableStreamMemOPs`` off: "operation not supported") gets a 4-byte copy
  of the raised value from pinned host memory instead (made once, with the writer), which stream
  order puts after the chunk's copy. Neither needs an SM; a kernel (or a memset, which the driver
  may run as one) could not be trusted to, since the persistent consumer may hold every SM while it
  waits for the word. The current stream waits for the side stream before the call returns, so the
  call's results (and its A) include the copies.
* CPU: the same copies (``copy_`` from the peer's mapping) on a host thread while the consumer
  runs in Triton's interpreter on the calling thread, each word a release store
  (``tp_kernels._C.store_release``); the thread is joined before the call returns.

Rows per chunk: :func:`chunk_rows` (whole consumer tiles). Chunks per shard
(:func:`chunks_per_shard`): a chunk lets the consumer's tiles start on part of a shard (the
first peer's behind the own shard's tiles, the last peer's before the rest of it lands), but
each costs the copy engine a per-copy latency and the host a copy and a word, so
the count is the one the cost model predicts fastest for the device and shape
(:func:`tp_kernels.cost.copy_engine_chunks`, 1 to :data:`MAX_CHUNKS`), or
``TP_KERNELS_SYMM_CHUNKS``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import torch

from tp_kernels import config, cost, signals, tiling

# Most chunks per shard (the progress words per shard).
MAX_CHUNKS = config.SYMM_MAX_CHUNKS


def chunks_per_shard(
    m: int, k: int, ns: tuple[int, ...], dtype: torch.dtype, world_size: int, device: torch.device
) -> int:
    """Chunks per peer shard of ``m x k`` rows feeding GEMMs of widths ``ns``: the setting
    (:data:`tp_kernels.config.SYMM_CHUNKS`) where given, else the count the cost model predicts
    fastest (:func:`tp_kernels.cost.copy_engine_chunks`) on a GPU it knows, else 1."""
    chunks = config.SYMM_CHUNKS.get()
    return _modelled_chunks(m, k, ns, dtype, world_size, device) if chunks is None else chunks


def chunk_rows(
    m: int,
    k: int,
    ns: tuple[int, ...],
    dtype: torch.dtype,
    world_size: int,
    device: torch.device,
    *,
    interpret: bool,
) -> int:
    """Rows per copy of a shard: :func:`chunks_per_shard`'s count, in whole consumer tiles
    (:func:`tp_kernels.tiling.chunk_rows`; ``interpret``: the kernels run in Triton's
    interpreter). Cached per shape class: the host's cost per call on a GPU."""
    return _whole_tiles(m, chunks_per_shard(m, k, ns, dtype, world_size, device), interpret)


@functools.lru_cache(maxsize=1024)
def _whole_tiles(m: int, chunks: int, interpret: bool) -> int:
    return tiling.chunk_rows(m, chunks, interpret=interpret)


@functools.lru_cache(maxsize=1024)
def _modelled_chunks(
    m: int, k: int, ns: tuple[int, ...], dtype: torch.dtype, world_size: int, device: torch.device
) -> int:
    spec = cost.device_spec(device) if device.type == "cuda" else None
    if spec is None or dtype not in cost.DTYPE_NAMES:
        return 1
    problem = cost.Problem(m, k, ns, world_size, cost.DTYPE_NAMES[dtype], spec)
    return cost.copy_engine_chunks(problem, MAX_CHUNKS)


class _StreamWriter:
    """Progress and signal words on CUDA: raised by a fenced stream write, or, where the driver
    has none, by a copy of the raised value from pinned host memory (the copy engine again,
    ordered after the chunk's copy). Made outside any capture: the pinned word is its own."""

    def __init__(self) -> None:
        self._stream_ops = True
        self._raised = torch.tensor([signals.RAISED], dtype=torch.int32).pin_memory()

    def __call__(self, words: torch.Tensor, word: int) -> None:
        if self._stream_ops:
            try:
                torch.ops.symm_mem.stream_write_value32_(
                    words.view(torch.uint32), word, signals.RAISED
                )
                return
            except RuntimeError as exc:
                if "not supported" not in str(exc):
                    raise
                self._stream_ops = False  # NVreg_EnableStreamMemOPs=0: once, then copies
        words[word : word + 1].copy_(self._raised, non_blocking=True)


def _store_release(words: torch.Tensor, word: int) -> None:
    from tp_kernels import _C

    _C.store_release(words.data_ptr() + word * words.element_size(), signals.RAISED)


class Copies:
    """One call's copies in flight; :meth:`join` makes the caller's work follow them."""

    def __init__(
        self,
        event: torch.cuda.Event | None = None,
        device: torch.device | None = None,
        thread: threading.Thread | None = None,
    ) -> None:
        self._event, self._device, self._thread = event, device, thread
        self.error: BaseException | None = None

    def join(self) -> None:
        """CUDA: the current stream waits for the copies (no host sync). CPU: the thread ends;
        an error it raised is raised here."""
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
            self._event = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self.error is not None:
                raise self.error


class Copier:
    """The producer of one ``(group, device)``: its side stream (CUDA) and progress writer."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device, priority=-1)
            self._write = _StreamWriter()
        else:
            self._stream = None
            self._write = _store_release

    def start(
        self,
        sources: Sequence[tuple[int, torch.Tensor]],
        a: torch.Tensor,
        rows: int,
        progress: torch.Tensor | None,
    ) -> Copies:
        """Copy each ``(s, shard_s)`` of ``sources`` (in order; ``shard_s`` [m, K] a view of rank
        ``s``'s buffer) into rows ``[s*m, (s+1)*m)`` of ``a`` [W*m, K] in chunks of ``rows``
        rows, raising ``progress[s * chunks + j]`` after chunk ``j`` (no words when
        ``progress`` is None: nothing waits on them, only on :meth:`Copies.join`)."""

        def copy_all() -> None:
            for s, shard in sources:
                m = shard.shape[0]
                chunks = -(-m // rows)
                for j in range(chunks):
                    lo, hi = j * rows, min((j + 1) * rows, m)
                    a[s * m + lo : s * m + hi].copy_(shard[lo:hi])
                    if progress is not None:
                        self._write(progress, s * chunks + j)

        if self._stream is not None:
            current = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(current)  # after the barrier and the own rows
            # The caller reads ``a`` only after the join, but may drop it before (an error
            # between start and join): its block must not be handed out while the copies write.
            a.record_stream(self._stream)
            with torch.cuda.stream(self._stream):
                copy_all()
                return Copies(event=self._stream.record_event(), device=self.device)
        copies = Copies()
        inference = torch.is_inference_mode_enabled()

        def run() -> None:
            try:
                # The thread writes the caller's tensors as the caller would: inference mode
                # is per thread, and a call under it gets inference tensors (A among them).
                with torch.inference_mode(inference):
                    copy_all()
            except BaseException as exc:  # raised again by join, on the calling thread
                copies.error = exc

        copies._thread = threading.Thread(target=run, name="tp_kernels symm copier", daemon=True)
        copies._thread.start()
        return copies
