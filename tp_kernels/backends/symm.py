"""The ``symm`` backend: symmetric memory (``tp_kernels.symm``) and one-sided signals.

On rank ``r`` of ``W`` ranks (shapes as in ``backends/base.py``), every call uses one half of a
data workspace that every rank of the group maps (see "Buffer reuse" below):

* all-gather -> matmul: ``r`` copies ``a_shard [m, K]`` into its own buffer and signals every
  peer; it multiplies its own shard first, then, for ``s = r+1, r+2, ...`` (mod W), waits for
  ``s``'s signal and multiplies ``s``'s rows straight out of ``s``'s buffer (zero copy):
  ``outs[j][s*m:(s+1)*m] = A_s @ bs[j]``. ``A`` is copied out only when ``return_a``.
* matmul -> reduce-scatter: each rank's buffer is viewed as ``slots [W, m, N]``. ``r`` computes
  ``(a @ b + addend)[d*m:(d+1)*m]`` straight into slot ``r`` of rank ``d``'s buffer for
  ``d = r+1, ..., r`` (own last), signalling ``d`` after each, then waits for its ``W-1`` incoming
  slots and returns ``slots[0] + ... + slots[W-1]`` summed in fp32 in that order (as
  ``pipelined`` does, so both give the same bits for the same partials).

Two paths run this protocol:

* the torch path (default on CPU): torch matmuls on views of the shared buffers, with the 0/1
  ``put_signal``/``wait_signal`` of :class:`~tp_kernels.symm.SymmWorkspace` on channel
  :data:`_READY`; on CPU a wait runs on the host with the deadline of
  :func:`tp_kernels.symm.get_timeout` and raises :class:`~tp_kernels.symm.SymmTimeoutError`.
* the Triton path (default on CUDA; on CPU only with ``TP_KERNELS_SYMM_TRITON=1`` and
  ``TRITON_INTERPRET=1``, since the interpreter is slow and serves to test the kernels'
  signalling across processes): the launchers of :mod:`tp_kernels.kernels`, whose epoch signals
  use channel :data:`_KERNEL_CHANNEL` (never shared with the 0/1 signals). It covers fp32, fp16
  and bf16; other dtypes, and a reduce-scatter with an ``addend`` (the producer kernel has no
  addend input), take the torch path.

Agreement: next to its data every rank writes a header (call number, op, dtype, the shape that
lays out the buffers, bytes needed) into a small control workspace that never grows; a reader
checks the peer's header after the peer's signal and before touching its data, so ranks that call
with different shapes (or ops, or out of step) get a ValueError naming every rank's arguments
instead of an out-of-bounds read. On a mismatch a rank still collects every peer's signal before
raising, so each signal is consumed in the call that raised it and the next call starts clean.
Growing the data workspace is collective (:func:`tp_kernels.symm.get_workspace`), so a rank that
needs more room first exchanges headers with every peer and grows only if all ask the same;
otherwise all raise. On CUDA the headers live in device memory and reading them would
synchronize the host on every call, so they are not checked there: the ops layer's consistency
check (``TP_KERNELS_CHECK_CONSISTENCY=1``) is what catches mismatched calls on CUDA.

Buffer reuse: double buffering. Call ``c`` uses half ``c % 2`` of the data and header
workspaces. A rank signals in call ``c`` only after returning from call ``c-1``, so once rank
``r`` has received every peer's signal of call ``c-1`` (it always has, mismatch or not), no peer
still reads anything of call ``c-2``: ``r`` may overwrite that half (its own shard, or its slots
in the peers' buffers) in call ``c``. The alternative, one buffer and a barrier at the end of
every call, makes every rank wait for the slowest at the end of each call instead of letting the
next call's own-shard work absorb the skew. Measured at M=4096, K=2048, N=2048 fp32 on two
ranks (8 interleaved rounds, medians on ranks 0/1, on a 2-core machine loaded by other jobs):
all-gather-matmul 1.91/2.01 s double-buffered vs 2.00/2.00 s with the barrier, matmul-reduce-
scatter 1.58/1.64 s vs 1.85/1.87 s. Double buffering costs only a second half of memory.

After a deadline error the group's state is unknown (a peer may be dead or a signal outstanding),
so every later call on that group raises at once.

``all_gather_async`` (the backward's re-gather of a saved shard) is the base class's collective:
its result is consumed after the fused call it overlaps with, so serving it from these buffers
would hold a half busy across calls and break the reuse rule above, while the collective runs on
the group's own threads (gloo) or stream (NCCL) and overlaps as well.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from tp_kernels import symm
from tp_kernels.backends.base import Backend
from tp_kernels.backends.pipelined import _sum_in_rank_order

_CTL_TAG = "tp_kernels.backends.symm.ctl"
_DATA_TAG = "tp_kernels.backends.symm.data"
# Channel 0 is left to SymmWorkspace.barrier (used when a workspace is set up).
_READY = 1
_KERNEL_CHANNEL = 2
# Header words: call number, op, dtype code, three dims, bytes of one half needed.
_HEADER_WORDS = 7
_CTL_BYTES = 4096
# Halves start on cache-line multiples (and at any dtype's alignment).
_ALIGN = 256

_AG, _RS = 1, 2
_OP_NAMES = {_AG: "all_gather_matmul", _RS: "matmul_reduce_scatter"}
_DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
)
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
    """Per (group, device): the control workspace, the data workspace and the call counter."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.ctl = symm.get_workspace(group, _CTL_BYTES, device, tag=_CTL_TAG)
        self.data: symm.SymmWorkspace | None = None
        self.seq = 0
        self.broken: str | None = None

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


def _use_triton(device: torch.device, dtype: torch.dtype) -> bool:
    if dtype not in _KERNEL_DTYPES:
        return False
    return device.type == "cuda" or os.environ.get("TP_KERNELS_SYMM_TRITON") == "1"


class _Call:
    """One fused call on this rank: its number, its header and the half of the buffers it uses."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        op: int,
        dtype: torch.dtype,
        dims: tuple[int, int, int],
        nbytes: int,
    ) -> None:
        if dtype not in _DTYPES:
            raise TypeError(
                f"symm {_OP_NAMES[op]}: dtype {dtype} is not supported; expected one of "
                f"{[str(d) for d in _DTYPES]}"
            )
        self.state = state = _state(group, device)
        if state.broken is not None:
            raise RuntimeError(
                f"symm {_OP_NAMES[op]} on group {group.group_name!r}: an earlier call on this "
                f"group failed at its deadline ({state.broken}); the peers' state is unknown, "
                "so this group cannot use the symm backend any more"
            )
        self.group = group
        self.rank, self.world = group.rank(), group.size()
        self.op = op
        state.seq += 1
        self.seq = state.seq
        self.parity = self.seq % 2
        self.half = _half_bytes(nbytes)
        self.header = [self.seq, op, _DTYPES.index(dtype), *dims, self.half]
        self._unreceived = self.peers()
        # See the module docstring: headers are checked where the host can read them cheaply.
        self.checks_headers = device.type == "cpu"
        if self.checks_headers:
            state.headers(self.rank)[self.parity] = torch.tensor(self.header)

    @property
    def where(self) -> str:
        return f"symm {_OP_NAMES[self.op]} on rank {self.rank} of group {self.group.group_name!r}"

    def peers(self) -> list[int]:
        """The other ranks, ``r+1, r+2, ...`` (mod W)."""
        return [(self.rank + k) % self.world for k in range(1, self.world)]

    def data(self, *, agreed: bool = False) -> symm.SymmWorkspace:
        """The data workspace, grown when too small for this call. Growing is collective, so
        unless the headers are ``agreed`` already (or cannot be checked), every rank first
        exchanges them and all grow only if all ask the same."""
        state = self.state
        if state.data is None or state.data.nbytes // 2 < self.half:
            if self.checks_headers and not agreed:
                self.signal()
                self.receive_all()
            nbytes = _grown_size(self.half)
            state.data = symm.get_workspace(self.group, nbytes, state.ctl.device, tag=_DATA_TAG)
        return state.data

    def view(self, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """This call's half of ``rank``'s data buffer, viewed as ``shape`` of ``dtype``."""
        ws = self.state.data
        return ws.buffer(rank, shape, dtype, offset=self.parity * (ws.nbytes // 2))

    def addresses(self) -> torch.Tensor:
        """int64 [W]: the address of this call's half of every rank's data buffer."""
        ws = self.state.data
        return ws.buffer_ptrs() + self.parity * (ws.nbytes // 2)

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
        try:
            wait(peer, _READY)
        except symm.SymmTimeoutError as exc:
            self.state.broken = str(exc)
            raise symm.SymmTimeoutError(
                f"{self.where}, call {self.seq}: {what} for peer rank {peer} on channel "
                f"{_READY} ran past its deadline: {exc}",
                peer=peer,
                channel=_READY,
                timeout_s=exc.timeout_s,
            ) from None

    def kernel_args(self) -> dict:
        """The arguments every launcher takes: this rank, the kernels' channel, this call's
        epoch (the call number, wrapped into the kernels' epoch range)."""
        from tp_kernels import kernels

        return {
            "rank": self.rank,
            "world_size": self.world,
            "channel": _KERNEL_CHANNEL,
            "epoch": (self.seq - 1) % kernels.MAX_EPOCH + 1,
        }

    def wait_args(self) -> dict:
        """The extra arguments of the launchers that wait."""
        return {"timeout_s": symm.get_timeout(), "group_name": self.group.group_name}

    @contextlib.contextmanager
    def kernel_deadline(self) -> Iterator[None]:
        """A kernel's deadline error, re-raised as the symm one (and the group marked broken)."""
        from tp_kernels import kernels

        try:
            yield
        except kernels.PeerWaitTimeout as exc:
            self.state.broken = str(exc)
            raise symm.SymmTimeoutError(
                f"{self.where}, call {self.seq}: {exc}",
                peer=exc.peers[0],
                channel=exc.channel,
                timeout_s=exc.timeout_s,
            ) from None


def _kernels_unavailable_reason(device: torch.device) -> str | None:
    try:
        from tp_kernels import kernels
    except ImportError as exc:
        return f"the Triton kernels cannot be imported ({exc})"
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
        why = symm.symm_unavailable_reason(device, group=group)
        if why is not None:
            return why
        if device.type != "cpu" or os.environ.get("TP_KERNELS_SYMM_TRITON") == "1":
            return _kernels_unavailable_reason(device)
        return None

    def all_gather_matmul(
        self,
        a_shard: torch.Tensor,
        bs: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        *,
        return_a: bool,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """``A = cat_s A_s`` [W*m, K] from every rank's ``a_shard`` [m, K]; ``outs[j] = A @ bs[j]``
        [W*m, N_j]; ``(A if return_a else None, outs)``."""
        rank, world = group.rank(), group.size()
        if world == 1:
            return (a_shard.clone() if return_a else None), [a_shard @ b for b in bs]
        m, k = a_shard.shape
        dtype = a_shard.dtype
        call = _Call(group, a_shard.device, _AG, dtype, (m, k, 0), a_shard.nbytes)
        a = a_shard.new_empty((world * m, k)) if return_a else None
        outs = [a_shard.new_empty((world * m, b.shape[1])) for b in bs]
        if _use_triton(a_shard.device, dtype):
            _ag_triton(call, a_shard, [b.contiguous() for b in bs], outs, a)
            return a, outs
        call.data()
        call.view(rank, (m, k), dtype).copy_(a_shard)
        call.signal()
        for s in [rank, *call.peers()]:
            if s == rank:
                shard = a_shard
            else:
                call.receive(s)
                shard = call.view(s, (m, k), dtype)
            rows = slice(s * m, (s + 1) * m)
            for out, b in zip(outs, bs):
                torch.mm(shard, b, out=out[rows])
            if a is not None:
                a[rows].copy_(shard)
        return a, outs

    def matmul_reduce_scatter(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        addend: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's rows ``[r*m, (r+1)*m)`` of ``sum over ranks s of (a @ b + addend)(s)``:
        ``a`` [W*m, K], ``b`` [K, N], ``addend`` None or [W*m, N]; returns [m, N]."""
        rank, world = group.rank(), group.size()
        if world == 1:
            return a @ b if addend is None else torch.addmm(addend, a, b)
        m, n = a.shape[0] // world, b.shape[1]
        dtype = a.dtype
        call = _Call(
            group,
            a.device,
            _RS,
            dtype,
            (a.shape[0], n, a.shape[1]),
            a.element_size() * a.shape[0] * n,
        )
        if addend is None and _use_triton(a.device, dtype):
            return _rs_triton(call, a.contiguous(), b.contiguous(), m, n)
        call.data()
        for dst in [*call.peers(), rank]:
            rows = slice(dst * m, (dst + 1) * m)
            slot = call.view(dst, (world, m, n), dtype)[rank]
            if addend is None:
                torch.mm(a[rows], b, out=slot)
            else:
                torch.addmm(addend[rows], a[rows], b, out=slot)
            if dst != rank:
                call.signal([dst])
        call.receive_all()
        return _sum_in_rank_order(call.view(rank, (world, m, n), dtype))


def _ag_triton(
    call: _Call,
    a_shard: torch.Tensor,
    bs: list[torch.Tensor],
    outs: list[torch.Tensor],
    a: torch.Tensor | None,
) -> None:
    """The all-gather-matmul of :class:`SymmBackend` by :func:`kernels.ag_matmul_consumer`."""
    from tp_kernels import kernels

    if call.checks_headers:  # the kernel reads peers' rows without asking: agree first
        call.signal()
        call.receive_all()
    call.data(agreed=True)
    m, k = a_shard.shape
    call.view(call.rank, (m, k), a_shard.dtype).copy_(a_shard)
    pads = call.state.ctl.signal_pad_ptrs()
    with call.kernel_deadline():
        kernels.signal_ready(pads, **call.kernel_args())
        kernels.ag_matmul_consumer(
            call.addresses(), pads, bs, outs, a_out=a, **call.kernel_args(), **call.wait_args()
        )


def _rs_triton(call: _Call, a: torch.Tensor, b: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """The matmul-reduce-scatter of :class:`SymmBackend` by :func:`kernels.matmul_rs_producer`
    and :func:`kernels.reduce_slots`."""
    from tp_kernels import kernels

    if call.checks_headers:  # the producer writes into peers' buffers: agree first
        call.signal()
        call.receive_all()
    call.data(agreed=True)
    pads = call.state.ctl.signal_pad_ptrs()
    out = a.new_empty((m, n))
    with call.kernel_deadline():
        kernels.matmul_rs_producer(a, b, call.addresses(), pads, **call.kernel_args())
        kernels.reduce_slots(
            call.view(call.rank, (call.world, m, n), a.dtype),
            out,
            pads,
            **call.kernel_args(),
            **call.wait_args(),
        )
    return out


BACKEND = SymmBackend()
