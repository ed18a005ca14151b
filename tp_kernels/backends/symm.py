"""The ``symm`` backend: symmetric memory (``tp_kernels.symmetric_memory``) and one-sided signals.

On rank ``r`` of ``W`` ranks (shapes as in ``backends/base.py``), every call uses one half of a
data workspace that every rank of the group maps (see "Buffer reuse" below):

* all-gather -> matmul: ``r`` copies ``a_shard [m, K]`` into its own buffer and signals every
  peer; it multiplies its own shard first, then, for ``s = r+1, r+2, ...`` (mod W), once ``s``'s
  rows have arrived, ``outs[j][s*m:(s+1)*m] = A_s @ bs[j]``. On the Triton path a barrier waits
  for every peer's signal, a copier (:mod:`tp_kernels.backends.symm_gather`: the copy engine on
  CUDA, a host thread on CPU) copies each peer's rows once, in chunks, into the local gathered
  ``A`` [W*m, K] with a progress word per chunk, and the consumer GEMM waits on those words and
  reads ``A`` only. Every remote byte crosses the link once, however many ``bs`` and column
  tiles there are; ``A`` is what ``return_a`` returns.
* matmul -> reduce-scatter: each rank's buffer is viewed as ``slots [W, m, N]``. ``r`` computes
  ``(a @ b + addend)[d*m:(d+1)*m]`` for ``d = r+1, ..., r`` (own last) into slot ``r`` of rank
  ``d``'s buffer, signalling ``d`` after each, then waits for its ``W-1`` incoming slots and
  returns ``slots[0] + ... + slots[W-1]`` summed in fp32 in that order (as ``pipelined`` does,
  so both give the same bits for the same partials). The torch path computes each block
  straight into the peer's slot; on the Triton path the producer GEMM stores the peers' blocks
  into a local staging buffer with a progress word each, and a pusher
  (:mod:`tp_kernels.backends.symm_scatter`: the copy engine on CUDA, a host thread on CPU)
  copies each block once it is complete and signals its peer, so no SM waits for the link.

Two paths run this protocol:

* the torch path (default on CPU): torch matmuls on views of the shared buffers, with the 0/1
  ``put_signal``/``wait_signal`` of :class:`~tp_kernels.symmetric_memory.SymmWorkspace` on channel
  :data:`_READY`; on CPU a wait runs on the host with the deadline of
  :func:`tp_kernels.deadline.get_timeout` and raises
  :class:`~tp_kernels.deadline.PeerTimeoutError`.
* the Triton path (default on CUDA; on CPU only with ``TP_KERNELS_SYMM_TRITON=1`` and
  ``TRITON_INTERPRET=1``, since the interpreter is slow and serves to test the kernels'
  signalling across processes): the launchers of :mod:`tp_kernels.kernels`, whose words go
  0 -> 1 -> 0 on fixed channels (:data:`_START`, :data:`_PUBLISHED`, :data:`_SLOTS`; see the
  protocol in :mod:`tp_kernels.kernels`; never shared with the torch path's 0/1 signals), and
  the copier of :mod:`tp_kernels.backends.symm_gather` (all-gather) or the pusher of
  :mod:`tp_kernels.backends.symm_scatter` (reduce-scatter), whose progress words the call's
  start barrier clears. Every call opens with that barrier: a rank arrives only after its
  previous call ended, so past it no peer reads anything of the previous call. Nothing any of
  them launches, copies, writes or waits for depends on the call (no epoch, no parity), so a
  CUDA graph that captured calls replays them correctly, and an eager call runs the very
  protocol a replay does. The host does exactly the same on CPU and CUDA (but that
  the CPU's copier and pusher are threads, the GPU's side streams): no handshake of its own,
  nothing that synchronizes with the device, tables, progress words, staging and the side
  streams made once, the weight read through its strides. It covers fp32, fp16 and bf16, and
  scaled (fp8) calls whose ``out_dtype`` is one of them (:mod:`tp_kernels.backends.scaled`: the
  all-gather moves the shard's bytes, packed rows with their scales or fp8 bytes, unchanged
  under the same progress words; both GEMMs apply the scales in their epilogue, so a scaled
  result agrees with ``scaled_mm`` within a rounding, not bit for bit); other dtypes, and a
  reduce-scatter with an ``addend`` (the producer kernel has no addend input), take the torch
  path.

A call is opened by ``_begin``, which refuses what cannot run before anything is signalled and
returns its two parts: a ``_Round`` (the call's number, its header and its signals to and from each
peer: numbering and agreement) and a ``_Half`` (its half of the data workspace, grown when too
small). The torch path's order
of work is :mod:`tp_kernels.backends.schedule`'s, with ``_Arrivals`` and ``_Slots`` as transport.

Timeouts of the Triton path are recorded by the kernels in a per-group status in host memory
(pinned on CUDA), which this module turns into :class:`~tp_kernels.deadline.PeerTimeoutError`
(naming each peer's wait) at the start of the next call on the group, without waiting for the
device (on CPU the kernels have finished when the launcher returns, so also right after them).

CUDA graph capture: a captured call must not allocate, grow a workspace (a collective) or make
its state, so one that would have to is refused before anything is launched, naming the bytes
that :meth:`SymmBackend.reserve` (``tp_kernels.reserve``) or an eager warmup call provides;
:meth:`SymmBackend.capture_unready_reason` tells the ops layer (and ``auto``) beforehand.

Agreement (torch path on CPU): next to its data every rank writes a header (call number, op,
dtype, the shape that lays out the buffers, bytes needed) into a small control workspace that
never grows; a reader
checks the peer's header after the peer's signal and before touching its data, so ranks that call
with different shapes (or ops, or out of step) get a ValueError naming every rank's arguments
instead of an out-of-bounds read. On a mismatch a rank still collects every peer's signal before
raising, so each signal is consumed in the call that raised it and the next call starts clean.
Growing the data workspace is collective (:func:`tp_kernels.symmetric_memory.get_workspace`), so a
rank that needs more room first exchanges headers with every peer and grows only if all ask the
same; otherwise all raise. The Triton path and CUDA do not check headers (on CUDA reading them would
synchronize the host on every call): the ops layer's consistency check (on by default for CPU
tensors, ``TP_KERNELS_CHECK_CONSISTENCY=1`` on CUDA) is what catches mismatched calls there.

Buffer reuse. The Triton path needs none of its own: its start barrier orders every write of a
call after every peer's reads of the previous one, whatever region it uses. The torch path
(host signals, CPU only, never captured) double-buffers: call ``c`` uses half ``c % 2`` of the
data and header workspaces. A rank signals in call ``c`` only after returning from call
``c-1``, so once rank ``r`` has received every peer's signal of call ``c-1`` (it always has,
mismatch or not), no peer still reads anything of call ``c-2``: ``r`` may overwrite that half
(its own shard, or its slots in the peers' buffers) in call ``c``, and the next call's own-shard
work absorbs the skew instead of a barrier at the end of each call (measured in
benchmarks/README.md). The Triton path takes its half by the same parity, so that the two
paths interleave on one group (on CPU a dtype the kernels lack takes the torch path), but its
correctness does not rest on it: a captured call keeps the half of its capture.

After a deadline error the group's state is unknown (a peer may be dead or a signal outstanding),
so the group is marked broken (:func:`tp_kernels.deadline.mark_broken`, the one record of broken
groups) and every later call on it raises at once.

``all_gather_async`` (the backward's re-gather of a saved shard, overlapped with the input
grad's reduce-scatter) runs the all-gather's protocol too: barrier, then the copier pulls each
peer's shard once (the copy engine on CUDA: no SM and no NCCL kernel). Its result is consumed
after the fused call it overlaps, so it cannot use the data workspace (a half would stay busy
across calls and break the reuse rule above): it has a double-buffered workspace of its own,
numbered by its own count (:func:`_regather`).
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from tp_kernels import config, deadline, signals, symmetric_memory
from tp_kernels.backends import base, schedule, symm_gather, symm_scatter
from tp_kernels.backends.base import Backend, CaptureNeed, PendingGather
from tp_kernels.backends.scaled import BlockScaling, Scaled

T = TypeVar("T")

_CTL_TAG = "tp_kernels.backends.symm.ctl"
_DATA_TAG = "tp_kernels.backends.symm.data"
_REGATHER_TAG = "tp_kernels.backends.symm.regather"
# The re-gather workspace's halves: re-gather g uses half g % 2 (see _regather).
_REGATHER_HALVES = 2
# Channel 0 is left to SymmWorkspace.barrier (used when a workspace is set up); 1 is the torch
# path's 0/1 host signals.
_READY = 1
# The Triton path's channels (see tp_kernels.kernels): the start barrier, the publish barrier
# and the reduce-scatter's slot words. Fixed, so a replayed call signals on the same words.
_START, _PUBLISHED, _SLOTS = 2, 3, 4
# Header words: call number, op, dtype code, three dims, bytes of one half needed.
_HEADER_WORDS = 7
_CTL_BYTES = 4096
# Halves start on cache-line multiples (and at any dtype's alignment).
_ALIGN = 256

_AG, _RS = 1, 2
_OP_NAMES = {_AG: "all_gather_matmul", _RS: "matmul_reduce_scatter"}
_MAX_VIEWS = 256  # per group state; a model whose shapes never repeat would grow it without end
_DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.uint8,  # a scaled all-gather's fp8 bytes (see tp_kernels.backends.scaled)
)
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A scaled call's operands (its gathered bytes, fp8): it takes the Triton path by its out_dtype,
# one of _KERNEL_DTYPES.
_SCALED_OPERAND_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)


def _describe(header: Sequence[int]) -> str:
    seq, op, code, d0, d1, d2, _ = header
    dtype = _DTYPES[code] if 0 <= code < len(_DTYPES) else f"dtype code {code}"
    if op == _AG:
        what = f"all_gather_matmul(a_shard [{d0}, {d1}] {dtype})"
    elif op == _RS:
        what = f"matmul_reduce_scatter(a [{d0}, {d2}] @ b [{d2}, {d1}] {dtype})"
    else:
        what = f"an unknown op {op}"
    return f"{what} as call {seq}"


def _same_layout(mine: Sequence[int], theirs: Sequence[int]) -> bool:
    # The first five words fix the buffers' layout; the third dim (RS's K) is each rank's own.
    return list(mine[:5]) == list(theirs[:5])


def _half_bytes(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _grown_size(need_half: int) -> int:
    """Bytes of a workspace whose halves hold ``need_half``: the next power of two, so a slowly
    growing shape reallocates O(log) times (the same on every rank: ``need_half`` is agreed)."""
    return 2 * (1 << max(need_half - 1, 1).bit_length())


class _GroupState:
    """Per (group, device): the control workspace, the data workspace, the call counter and,
    for the kernels, the address tables of the data halves, the timeout status, the
    reduce-scatter producer's tile counters, the progress words, the all-gather's copier, and
    the reduce-scatter's pusher and staging (each made once, not per call, and never under
    ``torch.inference_mode``: later calls write them in place).

    The progress words are one int32 vector, ``[W * MAX_CHUNKS]`` for the all-gather's chunks
    then ``[W]`` for the reduce-scatter's blocks, so that the start barrier clears them all."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.ctl = symmetric_memory.get_workspace(group, _CTL_BYTES, device, tag=_CTL_TAG)
        self.pad_ptrs = self.ctl.signal_pad_ptrs()  # every rank's signal pad, for the kernels
        self.data: symmetric_memory.SymmWorkspace | None = None
        self.half_ptrs: tuple[torch.Tensor, torch.Tensor] | None = None
        # (rank, shape, dtype, parity) -> that rank's half viewed so: a shape class's calls
        # repeat their views, which are made once (the host's cost per call on a GPU).
        self.views: dict[tuple, torch.Tensor] = {}
        self.status: torch.Tensor | None = None
        self.counters: torch.Tensor | None = None
        self.words: torch.Tensor | None = None
        # Views of ``words``: the all-gather's chunk words, the reduce-scatter's block words.
        self.gather_words: torch.Tensor | None = None
        self.scatter_words: torch.Tensor | None = None
        self.copier: symm_gather.Copier | None = None
        self.pusher: symm_scatter.Pusher | None = None
        self.staging: torch.Tensor | None = None
        self.seq = 0
        # The call shapes whose kernels this group has compiled and tuned (see _made_ready).
        self.ready_shapes: set[tuple] = set()
        # The re-gathers (see _regather): their own count, and the copies of the one in flight.
        self.regather_seq = 0
        self.regather_copies: symm_gather.Copies | None = None
        # CUDA: the stream of the last call (see _follow_last_stream).
        self.last_stream: torch.cuda.Stream | None = None

    def grow(self, group: dist.ProcessGroup, nbytes: int) -> None:
        """Replace the data workspace by one of ``nbytes`` (collective) and its half tables."""
        self.data = data = symmetric_memory.get_workspace(
            group, nbytes, self.ctl.device, tag=_DATA_TAG
        )
        ptrs = data.buffer_ptrs()
        self.half_ptrs = (ptrs.clone(), ptrs + data.nbytes // 2)
        self.views = {}

    def kernel_state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(status, counters, words)`` of the kernels, made on first use."""
        if self.status is None or self.counters is None or self.words is None:
            from tp_kernels import kernels

            world, device = self.ctl.world_size, self.ctl.device
            with torch.inference_mode(False):
                self.status = kernels.new_status(world, device)
                self.counters = kernels.new_counters(world, device)
                self.words = torch.zeros(
                    world * (symm_gather.MAX_CHUNKS + 1), dtype=torch.int32, device=device
                )
                split = world * symm_gather.MAX_CHUNKS
                self.gather_words, self.scatter_words = self.words[:split], self.words[split:]
        return self.status, self.counters, self.words

    def progress_words(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The all-gather's chunk words and the reduce-scatter's block words (views of
        :attr:`words`, made once: no per-call slicing on the host)."""
        self.kernel_state()
        return self.gather_words, self.scatter_words

    def copier_state(self) -> symm_gather.Copier:
        """The all-gather's copier, made on first use."""
        if self.copier is None:
            with torch.inference_mode(False):
                self.copier = symm_gather.Copier(self.ctl.device)
        return self.copier

    def scatter_state(self) -> tuple[symm_scatter.Pusher, torch.Tensor]:
        """``(pusher, staging)`` of the reduce-scatter, made on first use; ``staging`` (uint8, the
        producer's local blocks) is as large as one half of the data workspace and grows with
        it."""
        world, device = self.ctl.world_size, self.ctl.device
        with torch.inference_mode(False):
            if self.pusher is None:
                pads = [self.ctl.signal_pad(s) for s in range(world)]
                where = f"symm matmul_reduce_scatter on group {self.ctl.group.group_name!r}"
                self.pusher = symm_scatter.Pusher(device, pads, where)
            half = self.data.nbytes // 2
            if self.staging is None or self.staging.numel() < half:
                if self.staging is not None and device.type == "cuda":
                    # The old block goes back to the pool of the stream it was made on, which
                    # need not follow the pusher's reads of it; the current stream does (it
                    # joined the last call's side streams, or followed the stream that did).
                    self.staging.record_stream(torch.cuda.current_stream(device))
                self.staging = torch.empty(half, dtype=torch.uint8, device=device)
        return self.pusher, self.staging

    def capture_unready_reason(self, need_half: int, *, regather: bool) -> str | None:
        """Why a captured call needing ``need_half`` bytes of a data half would have to make or
        grow something first (what the warmup or :meth:`SymmBackend.reserve` does), or None."""
        if self.data is None or self.data.nbytes // 2 < need_half:
            have = 0 if self.data is None else self.data.nbytes // 2
            return f"the data workspace holds {have} bytes per call and this call needs {need_half}"
        if self.words is None or self.copier is None or self.pusher is None:
            return "its kernels' state (progress words, copier, pusher) is not made yet"
        if self.staging is None or self.staging.numel() < need_half:
            return "its reduce-scatter staging is smaller than this call needs"
        if regather:
            ws = symmetric_memory.cached_workspace(self.ctl.group, self.ctl.device, _REGATHER_TAG)
            need = _REGATHER_HALVES * need_half
            if ws is None or ws.nbytes < need:
                have = 0 if ws is None else ws.nbytes
                return f"the re-gather workspace holds {have} bytes and this call needs {need}"
        return None

    def headers(self, rank: int) -> torch.Tensor:
        """``rank``'s two headers, int64 [2, _HEADER_WORDS]."""
        return self.ctl.buffer(rank, (2, _HEADER_WORDS), torch.int64)


_states: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[str, _GroupState]]
_states = weakref.WeakKeyDictionary()


def _state(group: dist.ProcessGroup, device: torch.device) -> _GroupState:
    per_group = _states.setdefault(group, {})
    key = str(device)
    if key not in per_group:
        per_group[key] = _GroupState(group, device)
    return per_group[key]


def unraised_timeouts() -> list[str]:
    """The deadline errors that kernels recorded and no later call raised (a group's last call
    timed out): each group's status, read after its device has finished."""
    found = []
    for group, per_device in list(_states.items()):
        if deadline.is_broken(group):
            continue  # its error was raised (a recorded one breaks the group when raised)
        for device, state in per_device.items():
            if state.status is None:
                continue
            if device.startswith("cuda"):
                # Every wait ends at its deadline, so this cannot hang; at interpreter exit CUDA
                # may already be shut down, and then the record is read as it stands.
                with contextlib.suppress(RuntimeError):
                    torch.cuda.synchronize(device)
            note = "no later call on the group raised it, so that call's results are undefined"
            error = _recorded_timeout(state, group, note)
            if error is not None:
                found.append(f"tp_kernels symm ({device}): {error}")
    return found


@atexit.register
def _report_unraised_timeouts() -> None:
    # An error the next call would have raised must not vanish with the process.
    for message in unraised_timeouts():
        print(message, file=sys.stderr)


def _use_triton(device: torch.device, dtype: torch.dtype, *, block_scaled: bool = False) -> bool:
    """Whether a call making ``dtype`` runs the Triton kernels on ``device`` (always on CUDA;
    on CPU with ``TP_KERNELS_SYMM_TRITON=1``); a ``block_scaled`` (MXFP8) one only where they
    take block scales (:func:`tp_kernels.kernels.block_scaled_mma`: sm_100), else torch's
    schedule runs torchao's GEMM per block."""
    if dtype not in _KERNEL_DTYPES or not (device.type == "cuda" or config.SYMM_TRITON.get()):
        return False
    if block_scaled:
        from tp_kernels import kernels

        return kernels.block_scaled_mma(device)
    return True


def _capture_unready_reason(
    group: dist.ProcessGroup, device: torch.device, need_half: int, *, regather: bool
) -> str | None:
    """Why a call needing ``need_half`` bytes per data half cannot be captured now (it would
    allocate, grow a workspace collectively or make its state), or None."""
    state = _states.get(group, {}).get(str(device))
    if state is None:
        return "no call on this group has run yet, so its workspaces and state are not made"
    return state.capture_unready_reason(need_half, regather=regather)


def _usable_state(
    group: dist.ProcessGroup,
    device: torch.device,
    what: str,
    *,
    need_half: int,
    regather: bool = False,
) -> _GroupState:
    """The group's state, or a refusal before anything is signalled: a CUDA graph capture that
    would have to make or grow something first, or a group broken by an earlier deadline
    (raising a timeout a kernel recorded first)."""
    if base.capturing(device):
        why = _capture_unready_reason(group, device, need_half, regather=regather)
        if why is not None:
            raise RuntimeError(
                f"symm {what} on group {group.group_name!r}: cannot be captured in a CUDA "
                f"graph now: {why}; nothing was launched. Run the step once eagerly before "
                f"capturing it (a warmup), or call tp_kernels.reserve(group, nbytes={need_half}) "
                "on every rank before the capture"
            )
    state = _state(group, device)
    deadline.raise_if_broken(group, f"symm {what}")
    _raise_recorded_timeout(state, group, what)
    if device.type == "cuda":
        _follow_last_stream(state, device)
    return state


def _follow_last_stream(state: _GroupState, device: torch.device) -> None:
    """Order a call after the group's previous one when it runs on another stream. Every reuse
    rule (the halves by parity, staging, the progress words and counters, the re-gather's
    halves) rests on the current stream having joined the previous call's side streams; a call
    on another stream (a user's stream switch, an overlapping schedule) would not follow that
    join without this wait."""
    current = torch.cuda.current_stream(device)
    # A capture may not wait for work outside it; torch.cuda.graph synchronizes the device
    # before capturing, so the last call has finished anyway.
    if (
        state.last_stream is not None
        and current != state.last_stream
        and not base.capturing(device)
    ):
        current.wait_stream(state.last_stream)
    state.last_stream = current


def _begin(
    group: dist.ProcessGroup,
    device: torch.device,
    op: int,
    dtype: torch.dtype,
    dims: tuple[int, int, int],
    nbytes: int,
    *,
    kernels: bool = False,
) -> tuple[_Round, _Half]:
    """Open one fused call on this rank, or refuse it before anything is signalled: a dtype the
    buffers cannot hold, CUDA graph capture, a group broken by an earlier deadline (raising a
    timeout a kernel recorded first). Returns its round and its half of the data workspace."""
    if dtype not in _DTYPES:
        raise TypeError(
            f"symm {_OP_NAMES[op]}: dtype {dtype} is not supported; expected one of "
            f"{[str(d) for d in _DTYPES]}"
        )
    state = _usable_state(group, device, _OP_NAMES[op], need_half=_half_bytes(nbytes))
    state.seq += 1
    header = [state.seq, op, _DTYPES.index(dtype), *dims, _half_bytes(nbytes)]
    # See the module docstring: headers are checked where the host can read them cheaply,
    # on the torch path (the Triton path runs the GPU's protocol unchanged on CPU).
    round_ = _Round(group, state, header, checks_headers=device.type == "cpu" and not kernels)
    return round_, _Half(state, round_)


class _Round:
    """Call numbering and agreement: one fused call's number and header, and its signals to and
    from every peer (with the peer's header checked where headers are checked)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        state: _GroupState,
        header: list[int],
        *,
        checks_headers: bool,
    ) -> None:
        self.group, self.state, self.header = group, state, header
        self.rank, self.world = group.rank(), group.size()
        self.seq, self.op = header[0], header[1]
        self.parity = self.seq % 2
        self.checks_headers = checks_headers
        self._unreceived = self.peers()
        if checks_headers:
            state.headers(self.rank)[self.parity] = torch.tensor(header)

    @property
    def where(self) -> str:
        return f"symm {_OP_NAMES[self.op]} on rank {self.rank} of group {self.group.group_name!r}"

    def peers(self) -> list[int]:
        """The other ranks, ``r+1, r+2, ...`` (mod W)."""
        return [(self.rank + k) % self.world for k in range(1, self.world)]

    def signal(self, peers: Sequence[int] | None = None) -> None:
        """Release: tell ``peers`` (default: all) that this rank's part of the call is in place."""
        for peer in self.peers() if peers is None else peers:
            self._timed(self.state.ctl.put_signal, peer, "put_signal")

    def receive(self, peer: int) -> None:
        """Acquire ``peer``'s signal of this round, then check its header. On a mismatch first
        collect the signals of the peers not yet received, then raise a ValueError naming every
        rank's call."""
        self._unreceived.remove(peer)
        self._timed(self.state.ctl.wait_signal, peer, "wait_signal")
        if self.checks_headers and not _same_layout(self.header, self._header_of(peer)):
            for rest in self._unreceived:
                self._timed(self.state.ctl.wait_signal, rest, "wait_signal")
            self._unreceived = self.peers()
            raise self._mismatch()
        if not self._unreceived:
            self._unreceived = self.peers()  # the next round

    def receive_all(self) -> None:
        """:meth:`receive` every peer still due in this round, ``r-1, r-2, ...`` (the order in
        which reduce-scatter slots arrive)."""
        due = set(self._unreceived)
        for peer in [(self.rank - k) % self.world for k in range(1, self.world)]:
            if peer in due:
                self.receive(peer)

    def _header_of(self, rank: int) -> list[int]:
        return self.state.headers(rank)[self.parity].tolist()

    def _mismatch(self) -> ValueError:
        calls = "; ".join(
            f"rank {s}: {_describe(self.header if s == self.rank else self._header_of(s))}"
            for s in range(self.world)
        )
        return ValueError(
            f"{self.where}: the ranks made different calls, so their symmetric buffers do not "
            f"line up ({calls}); every rank of the group must make the same sequence of calls "
            "with the same shapes and dtype"
        )

    def _timed(self, wait: Callable[[int, int], None], peer: int, what: str) -> None:
        _timed_signal(self.group, wait, peer, f"{self.where}, call {self.seq}", what)


class _Half:
    """Workspace and growth: one call's half (by call parity) of the group's data workspace."""

    def __init__(self, state: _GroupState, round_: _Round) -> None:
        self.state, self.round = state, round_
        self.need = round_.header[-1]

    def ensure(self) -> None:
        """Grow the data workspace when too small for this call. Growing is collective, so
        where headers are checked every rank first exchanges them and all grow only if all ask
        the same (elsewhere :func:`tp_kernels.symmetric_memory.get_workspace` compares the sizes
        asked)."""
        state, round_ = self.state, self.round
        if state.data is None or state.data.nbytes // 2 < self.need:
            if round_.checks_headers:
                round_.signal()
                round_.receive_all()
            state.grow(round_.group, _grown_size(self.need))

    def view(self, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """This call's half of ``rank``'s data buffer, viewed as ``shape`` of ``dtype``."""
        views, key = self.state.views, (rank, shape, dtype, self.round.parity)
        view = views.get(key)
        if view is None:
            if len(views) >= _MAX_VIEWS:
                views.clear()
            ws = self.state.data
            offset = self.round.parity * (ws.nbytes // 2)
            with torch.inference_mode(False):  # later calls write it in place
                view = views[key] = ws.buffer(rank, shape, dtype, offset=offset)
        return view

    def addresses(self) -> torch.Tensor:
        """int64 [W]: the address of this call's half of every rank's data buffer."""
        return self.state.half_ptrs[self.round.parity]


def _recorded_timeout(
    state: _GroupState, group: dist.ProcessGroup, note: str
) -> deadline.PeerTimeoutError | None:
    """The deadline error of the waits that a kernel of this group recorded in its status (host
    memory: no wait for the device), each peer's wait named by its ``signals.WAIT_*`` code, with
    ``note`` (who raises it) at the end; None when none is recorded."""
    status = state.status
    if status is None or not status.any():
        return None
    waits = {s: code for s, code in enumerate(status.tolist()) if code}
    peers = sorted(waits)
    waited = "; ".join(
        f"rank {s}: {signals.WAIT_NAMES.get(code, f'wait {code}')}" for s, code in waits.items()
    )
    timeout = deadline.get_timeout()
    return deadline.PeerTimeoutError(
        f"a symm kernel on rank {group.rank()} of group {group.group_name!r}: waited "
        f"{timeout:g} s for rank(s) {peers} ({waited}) and the signal never came; the peer did "
        f"not reach this call, or failed in it (recorded by a kernel; {note})",
        phase="signal wait",
        group=group.group_name,
        peers=peers,
        waited_s=timeout,
    )


def _raise_recorded_timeout(state: _GroupState, group: dist.ProcessGroup, op: str) -> None:
    """Raise the deadline error a kernel of this group recorded, and mark the group broken."""
    error = _recorded_timeout(state, group, f"raised by the next symm call on the group, {op}")
    if error is not None:
        deadline.mark_broken(group, error)
        raise error


def _kernels_unavailable_reason(device: torch.device) -> str | None:
    try:
        from tp_kernels import kernels
    except Exception as exc:  # an ImportError, or a Triton too old for the kernels' decorators
        return f"the Triton kernels cannot be imported ({type(exc).__name__}: {exc})"
    why = kernels.triton_unsupported_reason()
    if why is not None:
        return why
    if device.type == "cpu" and not kernels.INTERPRET:
        return (
            "TP_KERNELS_SYMM_TRITON=1 asks for the Triton kernels on CPU, which run only in "
            "Triton's interpreter: set TRITON_INTERPRET=1 before triton is first imported"
        )
    if device.type != "cpu" and kernels.INTERPRET:
        return f"TRITON_INTERPRET=1 is set, and Triton's interpreter cannot run {device} tensors"
    return None


class SymmBackend(Backend):
    name = "symm"

    def unavailable_reason(
        self, group: dist.ProcessGroup | None, device: torch.device
    ) -> str | None:
        """Why not: symmetric memory for ``group`` on ``device`` (CPU: the native heap and every
        rank on this host; CUDA: torch symmetric memory on an NCCL group), and the Triton kernels
        where this device runs them (always on CUDA; on CPU with ``TP_KERNELS_SYMM_TRITON=1``)."""
        device = torch.device(device)
        why = symmetric_memory.symm_unavailable_reason(device, group=group)
        if why is not None:
            return why
        if device.type != "cpu" or config.SYMM_TRITON.get():
            return _kernels_unavailable_reason(device)
        return None

    def capture_unready_reason(
        self, group: dist.ProcessGroup, device: torch.device, need: CaptureNeed
    ) -> str | None:
        """Why a call needing ``need`` cannot be captured in a CUDA graph now (its workspaces,
        staging or state would have to be made or grown: collective allocations), or None. The
        ops layer asks before launching anything; :meth:`reserve` or one eager call makes them."""
        device = torch.device(device)
        if group.size() == 1:
            return None
        # A scaled call's operands take the path of its out_dtype, which the kernels cover.
        scaled = need.dtype in _SCALED_OPERAND_DTYPES
        if not _use_triton(
            device, torch.bfloat16 if scaled else need.dtype, block_scaled=need.block_scaled
        ):
            # The torch path (CPU without the kernels, or a dtype they lack) waits for its
            # signals on the host, which no graph can capture.
            return f"{need.dtype} on {device.type} takes its torch path, whose waits are the host's"
        return _capture_unready_reason(
            group, device, _half_bytes(need.nbytes), regather=need.op == "all_gather"
        )

    def reserve(self, group: dist.ProcessGroup, device: torch.device, nbytes: int) -> None:
        """Make, on every rank of ``group`` (collective), what calls of up to ``nbytes`` per
        buffer need: the data workspace (both halves), the re-gather's workspace, the progress
        words, the copier, the pusher and its staging. Call it outside any capture. (The kernels
        tune themselves on a shape's first call, which the ops layer requires to be eager.)"""
        device = torch.device(device)
        if group.size() == 1:
            return
        need = _half_bytes(nbytes)
        state = _state(group, device)
        if state.data is None or state.data.nbytes // 2 < need:
            state.grow(group, _grown_size(need))
        symmetric_memory.get_workspace(group, _REGATHER_HALVES * need, device, tag=_REGATHER_TAG)
        if _use_triton(device, torch.float32):
            state.kernel_state()
            state.copier_state()
            state.scatter_state()

    def all_gather_matmul(
        self,
        a_shard: torch.Tensor,
        bs: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        *,
        return_a: bool,
        scaling: Scaled | None = None,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """``A = cat_s A_s`` [W*m, K] from every rank's ``a_shard`` [m, K]; ``outs[j] = A @ bs[j]``
        [W*m, N_j] (``scaling``'s product when given); ``(A if return_a else None, outs)``."""
        rank, world = group.rank(), group.size()
        if world == 1:
            a = a_shard.clone() if return_a else None
            if scaling is not None:
                return a, [scaling.block(a_shard, j, b) for j, b in enumerate(bs)]
            return a, [a_shard @ b for b in bs]
        m, k = a_shard.shape
        dtype = a_shard.dtype
        # A scaled call's kernels take its fp8 bytes as they come and make its out_dtype.
        use_kernels = _use_triton(
            a_shard.device,
            dtype if scaling is None else scaling.out_dtype,
            block_scaled=isinstance(scaling, BlockScaling),
        )
        round_, half = _begin(
            group, a_shard.device, _AG, dtype, (m, k, 0), a_shard.nbytes, kernels=use_kernels
        )
        # The gathered A: each peer's rows are read from its memory once, into here, and every
        # matmul reads them from here (it is also what return_a gives). The Triton path always
        # gathers: the copier fills it and the consumer reads local memory only.
        a = a_shard.new_empty((world * m, k))
        out_dtype = dtype if scaling is None else scaling.out_dtype
        outs = [a_shard.new_empty((world * m, b.shape[1]), dtype=out_dtype) for b in bs]
        half.ensure()
        if use_kernels:
            _ag_triton(round_, half, a_shard, bs, outs, a, scaling)
            return (a if return_a else None), outs
        half.view(rank, (m, k), dtype).copy_(a_shard)
        round_.signal()
        # One matmul and no gathered A wanted: it reads the peer's rows once by itself, and a copy
        # would only cost (on a CPU, peer memory is this machine's memory).
        gathered = a if return_a or len(bs) > 1 else None
        transport = _Arrivals(round_, half, (m, k), dtype)
        try:
            schedule.all_gather_matmul(a_shard, bs, outs, gathered, rank, world, transport, scaling)
        except Exception as exc:
            # A matmul raised after this rank signalled: take the peers' signals of this round
            # too, so that the next call starts clean (as it does after a mismatch). The
            # protocol's own errors (a mismatch, a deadline) have settled the round already.
            if not isinstance(exc, (ValueError, deadline.PeerTimeoutError)):
                round_.receive_all()
            raise
        return (a if return_a else None), outs

    def all_gather_async(self, a_shard: torch.Tensor, group: dist.ProcessGroup) -> PendingGather:
        """Start ``A = all_gather(a_shard)`` [W*m, ...] from ``a_shard`` [m, ...] (backward's
        re-gather of a saved shard) through the all-gather's copies, from a region of its own
        (:func:`_regather`); :meth:`PendingGather.wait` makes the caller's work follow them."""
        if group.size() == 1 or a_shard.dtype not in _DTYPES:
            return super().all_gather_async(a_shard, group)
        return _regather(group, a_shard)

    def matmul_reduce_scatter(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        addend: torch.Tensor | None = None,
        scaling: Scaled | None = None,
    ) -> torch.Tensor:
        """This rank's rows ``[r*m, (r+1)*m)`` of ``sum over ranks s of (a @ b + addend)(s)``:
        ``a`` [W*m, K], ``b`` [K, N], ``addend`` None or [W*m, N]; returns [m, N]. With
        ``scaling``, ``a @ b`` is its product, in its ``out_dtype``."""
        rank, world = group.rank(), group.size()
        if world == 1 and scaling is not None:
            out = scaling.block(a, 0, b)
            return out if addend is None else out.add_(addend)
        if world == 1:
            return a @ b if addend is None else torch.addmm(addend, a, b)
        m, n = a.shape[0] // world, b.shape[1]
        dtype = a.dtype if scaling is None else scaling.out_dtype
        use_kernels = addend is None and _use_triton(
            a.device, dtype, block_scaled=isinstance(scaling, BlockScaling)
        )
        round_, half = _begin(
            group,
            a.device,
            _RS,
            dtype,
            (a.shape[0], n, a.shape[1]),
            dtype.itemsize * a.shape[0] * n,
            kernels=use_kernels,
        )
        half.ensure()
        if use_kernels:
            return _rs_triton(round_, half, a, b, m, n, scaling)
        transport = _Slots(round_, half, (world, m, n), dtype)
        return schedule.matmul_reduce_scatter(a, b, addend, rank, world, transport, scaling)


class _Arrivals:
    """The all-gather's transport on the torch path: peer ``s``'s shard ``[m, K]`` is readable in
    ``s``'s buffer once its signal has arrived (and its header matched)."""

    def __init__(
        self, round_: _Round, half: _Half, shape: tuple[int, int], dtype: torch.dtype
    ) -> None:
        self._round, self._half, self._shape, self._dtype = round_, half, shape, dtype

    def arrivals(self, src: int) -> list[schedule.Block]:
        self._round.receive(src)
        return [(0, self._shape[0], self._half.view(src, self._shape, self._dtype))]


class _Slots:
    """The reduce-scatter's transport on the torch path: every buffer is ``slots [W, m, N]``; the
    partial for rank ``d`` is computed straight into slot ``r`` of ``d``'s, then ``d`` is
    signalled."""

    def __init__(
        self, round_: _Round, half: _Half, shape: tuple[int, int, int], dtype: torch.dtype
    ) -> None:
        self._round, self._half, self._shape, self._dtype = round_, half, shape, dtype

    def slots(self, dst: int) -> list[schedule.Block]:
        slot = self._half.view(dst, self._shape, self._dtype)[self._round.rank]
        return [(0, self._shape[1], slot)]

    def send(self, dst: int, begin: int, end: int) -> None:
        self._round.signal([dst])

    def received(self) -> torch.Tensor:
        self._round.receive_all()
        return self._half.view(self._round.rank, self._shape, self._dtype)


def _barrier(
    state: _GroupState, pads: torch.Tensor, rank: int, world: int, channel: int, *, clear: bool
) -> None:
    """The barrier on ``channel`` (:data:`_START` or :data:`_PUBLISHED`) of the ranks whose signal
    pads are ``pads`` (:func:`kernels.barrier`); ``clear``: clear the group's progress and slot
    words first (a fused call's start barrier)."""
    from tp_kernels import kernels

    status, _, words = state.kernel_state()
    kernels.barrier(
        pads,
        status=status,
        rank=rank,
        world_size=world,
        channel=channel,
        timeout_s=deadline.get_timeout(),
        clear=(words, _SLOTS) if clear else None,
        wait=signals.WAIT_START if channel == _START else signals.WAIT_PUBLISHED,
    )


def _shapes(*tensors: torch.Tensor) -> tuple:
    """What decides the kernels' variants and tiles of a call: its tensors' shapes, strides and
    dtypes."""
    return tuple((tuple(t.shape), t.stride(), t.dtype) for t in tensors)


def _made_ready(round_: _Round, shape: tuple, make: Callable[[], T]) -> T:
    """``make()``: a call's kernel launches, checked, their tiles chosen and compiled
    (:mod:`tp_kernels.kernels.tuning`). The first call of a ``shape`` on the group makes them
    inside :func:`deadline.local_work`, so that whichever rank compiles and tunes longest, no
    peer's wait counts it: every rank runs its start barrier only once every rank is ready.
    Every rank makes the same calls, so every rank takes the same branch."""
    state = round_.state
    if shape in state.ready_shapes:
        return make()
    made = deadline.local_work(round_.group, "compiling and tuning the symm kernels", make)
    state.ready_shapes.add(shape)
    return made


def _ag_triton(
    round_: _Round,
    half: _Half,
    a_shard: torch.Tensor,
    bs: list[torch.Tensor],
    outs: list[torch.Tensor],
    a: torch.Tensor,
    scaling: Scaled | None = None,
) -> None:
    """The all-gather-matmul of :class:`SymmBackend` on the copy-engine protocol
    (:mod:`tp_kernels.backends.symm_gather`): the start barrier, publish the shard, the publish
    barrier, then the copies into ``a`` beside :func:`kernels.ag_matmul_consumer`, which waits
    on their progress words. Every launch, copy and word is the same in every call of this
    shape: a CUDA graph replays it. A scaled call's shard is uint8 bytes (packed rows, or fp8
    bytes with a tensor-wise scale): they move unchanged under the same words, and the consumer
    reads the fp8 data and the scales from them (:func:`kernels.ag_matmul_consumer`)."""
    from tp_kernels import kernels

    state, rank, world = round_.state, round_.rank, round_.world
    m, k = a_shard.shape
    pads = state.pad_ptrs
    status, _, _ = state.kernel_state()
    words, _ = state.progress_words()
    copier = state.copier_state()
    ns = tuple(b.shape[1] for b in bs)
    rows = symm_gather.chunk_rows(m, k, ns, a.dtype, world, a.device, interpret=kernels.INTERPRET)
    scaled = {}
    if scaling is not None:
        scaled = {
            "a_dtype": scaling.a_dtype,
            "a_scale": scaling.a_scale,
            "b_scales": scaling.b_scales,
        }
    consumer = _made_ready(
        round_,
        (_AG, rows, *_shapes(a, *bs, *outs, *scaled.get("b_scales", ()))),
        lambda: kernels.AgMatmulConsumer(
            a, bs, outs, chunk_rows=rows, rank=rank, world_size=world, **scaled
        ),
    )
    _barrier(state, pads, rank, world, _START, clear=True)
    half.view(rank, (m, k), a_shard.dtype).copy_(a_shard)
    a[rank * m : (rank + 1) * m].copy_(a_shard)
    _barrier(state, pads, rank, world, _PUBLISHED, clear=False)
    sources = [(s, half.view(s, (m, k), a_shard.dtype)) for s in round_.peers()]
    copies = copier.start(sources, a, rows, words)
    try:
        consumer.launch(progress=words, status=status, timeout_s=deadline.get_timeout())
    finally:
        copies.join()
    if a_shard.device.type == "cpu":  # the kernels have finished: no reason to wait for later
        _raise_recorded_timeout(state, round_.group, _OP_NAMES[_AG])


def _rs_triton(
    round_: _Round,
    half: _Half,
    a: torch.Tensor,
    b: torch.Tensor,
    m: int,
    n: int,
    scaling: Scaled | None = None,
) -> torch.Tensor:
    """The matmul-reduce-scatter of :class:`SymmBackend` on the copy-engine protocol
    (:mod:`tp_kernels.backends.symm_scatter`): the start barrier (after which no peer reads its
    slots of the previous call), then :func:`kernels.matmul_rs_producer` stores the peers'
    blocks into local staging beside the pusher, which copies each into its peer's slot once
    complete and signals it; then :func:`kernels.reduce_slots`. Scaled: fp8 ``a`` and ``b``
    with ``scaling``'s scales applied in the producer's epilogue; the partials, the slots and
    the result are in ``scaling.out_dtype``."""
    from tp_kernels import kernels

    state, rank, world = round_.state, round_.rank, round_.world
    pads = state.pad_ptrs
    status, counters, _ = state.kernel_state()
    _, words = state.progress_words()
    pusher, staging_bytes = state.scatter_state()
    shape = (world, m, n)
    dtype = a.dtype if scaling is None else scaling.out_dtype
    staging = staging_bytes[: world * m * n * dtype.itemsize].view(dtype).view(shape)
    own = half.view(rank, shape, dtype)
    pushes = [(d, staging[d], half.view(d, shape, dtype)[rank]) for d in round_.peers()]
    scaled = {}
    if scaling is not None:
        scaled = {"a_scale": scaling.a_scale, "b_scale": scaling.b_scales[0]}
    out = a.new_empty((m, n), dtype=dtype)
    producer, reduction = _made_ready(
        round_,
        (_RS, *_shapes(a, b, own, out, *scaled.values())),
        lambda: (
            kernels.RsProducer(
                a, b, staging, own, rank=rank, world_size=world, channel=_SLOTS, **scaled
            ),
            kernels.SlotReduction(own, out, rank=rank, world_size=world, channel=_SLOTS),
        ),
    )
    _barrier(state, pads, rank, world, _START, clear=True)
    copies = pusher.run(
        lambda: producer.launch(words, pads, counters=counters), pushes, words,
        _SLOTS * world + rank,
    )  # fmt: skip
    try:
        reduction.launch(pads, status=status, timeout_s=deadline.get_timeout())
    finally:
        try:
            copies.join()
        except deadline.PeerTimeoutError as exc:
            deadline.mark_broken(round_.group, exc)
            raise
    if a.device.type == "cpu":  # the kernels have finished: no reason to wait for later
        _raise_recorded_timeout(state, round_.group, _OP_NAMES[_RS])
    return out


class _CopiesInFlight(PendingGather):
    """A re-gather whose copies are in flight: :meth:`wait` joins them (no host sync on CUDA)."""

    def __init__(self, out: torch.Tensor, copies: symm_gather.Copies) -> None:
        super().__init__(out, None)
        self._copies = copies

    def wait(self) -> torch.Tensor:
        self._copies.join()
        return self._out


def _regather(group: dist.ProcessGroup, a_shard: torch.Tensor) -> PendingGather:
    """Backward's re-gather of ``a_shard`` [m, ...] on the all-gather's protocol: on the Triton
    path the start barrier, publish it in the group's re-gather workspace, the publish barrier
    (both on that workspace's pad); on the torch path publish, then the host's signals. Then
    the copier pulls every peer's shard into ``A`` (no progress words: ``wait`` joins the copies
    instead).

    Its region is its own because its copies are joined only after the fused call it overlaps
    (the input grad's reduce-scatter), which uses the data workspace meanwhile. One re-gather is
    in flight per group: a new one first joins the last one's copies, so this rank arrives at
    the next start barrier only after them, and a peer overwrites its region only after that
    barrier (the Triton path: any region is safe, so a CUDA graph may replay it). The torch
    path relies on the regions alternating by the re-gathers' own count instead: re-gather
    ``g+2`` overwrites half ``g % 2`` only after this rank has every peer's signal of ``g+1``,
    which each peer raises after it joined its copies of ``g``. Headers are not checked: the
    re-gather belongs to a fused call's backward, whose forward the ranks agreed on."""
    device, dtype = a_shard.device, a_shard.dtype
    what = "all_gather (backward's re-gather)"
    need_half = _half_bytes(a_shard.nbytes)
    state = _usable_state(group, device, what, need_half=need_half, regather=True)
    if state.regather_copies is not None:
        state.regather_copies.join()
    state.regather_seq += 1
    rank, world, m = group.rank(), group.size(), a_shard.shape[0]
    shape = tuple(a_shard.shape)
    ws = symmetric_memory.get_workspace(
        group, _REGATHER_HALVES * need_half, device, tag=_REGATHER_TAG
    )
    offset = (state.regather_seq % _REGATHER_HALVES) * (ws.nbytes // _REGATHER_HALVES)
    out = a_shard.new_empty((world * m, *shape[1:]))
    mine = ws.buffer(rank, shape, dtype, offset=offset)
    out[rank * m : (rank + 1) * m].copy_(a_shard)
    peers = [(rank + k) % world for k in range(1, world)]
    where = f"symm {what} on rank {rank} of group {group.group_name!r}"
    if _use_triton(device, dtype):
        # The all-gather's order: the start barrier (every peer joined its copies of the last
        # re-gather, so none still reads this region), publish, the publish barrier.
        pads = ws.signal_pad_ptrs()
        _barrier(state, pads, rank, world, _START, clear=False)
        mine.copy_(a_shard)
        _barrier(state, pads, rank, world, _PUBLISHED, clear=False)
        if device.type == "cpu":  # the barriers have finished: no reason to wait for later
            _raise_recorded_timeout(state, group, what)
    else:
        mine.copy_(a_shard)
        for peer in peers:
            _timed_signal(group, ws.put_signal, peer, where, "put_signal")
        for peer in peers:
            _timed_signal(group, ws.wait_signal, peer, where, "wait_signal")
    sources = [(s, ws.buffer(s, shape, dtype, offset=offset)) for s in peers]
    state.regather_copies = state.copier_state().start(sources, out, m, None)
    return _CopiesInFlight(out, state.regather_copies)


def _timed_signal(
    group: dist.ProcessGroup,
    wait: Callable[[int, int], None],
    peer: int,
    where: str,
    what: str,
) -> None:
    """``wait(peer, _READY)``; past the deadline the group is broken and the error names it."""
    try:
        wait(peer, _READY)
    except deadline.PeerTimeoutError as exc:
        error = deadline.PeerTimeoutError(
            f"{where}: {what} on channel {_READY} ran past its deadline; rank(s) [{peer}] were "
            f"not heard from: {exc.detail}",
            phase="signal wait",
            group=group.group_name,
            peers=[peer],
            waited_s=exc.waited_s,
        )
        deadline.mark_broken(group, error)
        raise error from None


BACKEND = SymmBackend()
