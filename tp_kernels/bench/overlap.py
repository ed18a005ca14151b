"""``python -m tp_kernels.bench.overlap``: does the symm backend overlap its copies with its GEMM?
Measured on one GPU, beside PyTorch's own fused ops.

Why: two ranks in two processes on one GPU are time-sliced, so a fused step measured that way
(27.7 ms per MLP step against 0.63 ms of matmuls) says nothing about overlap. Here the ranks
share the GPU's SMs at once, under CUDA MPS, or the copies come from local "peers".

**1. The probe** (one process, before MPS starts; :func:`probe`):

* MPS: whether ``nvidia-cuda-mps-control`` is on ``PATH``, whether a daemon already runs (its
  control pipe in the default pipe directory), ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` here, the
  SMs torch reports;
* the copy engine: a spinner (:mod:`tp_kernels.bench._spinner`, 16 programs per SM: every warp
  slot of every SM) runs for about ``--spin-ms`` on one stream; a ``--copy-mib`` device-to-device
  copy on another stream waits only for the event before the spinner. Events time both from the
  spinner's start: a copy that ends before the spinner ran beside it (the copy engine: no SM),
  one that ends after it waited for an SM;
* the copy-only bandwidth: bytes copied per second of the same copy alone (median of 5).

**2. The ranks**, started by :mod:`tp_kernels.bench.driver`. Where MPS can start, 2 ranks under
the script's own MPS daemon (:class:`~tp_kernels.bench.driver.MpsDaemon`, started within
``--mps-timeout-s`` and stopped whatever happened; no GPU setting changes), each limited to half
the SMs (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50``). Where MPS or its ranks cannot start, **local
peers**: one process whose "peer" buffers are local tensors holding what rank 1 would publish,
read by the same copier; its persistent GEMMs take half the SMs
(:data:`tp_kernels.config.SHARED_DEVICE_RANKS` 2). Under MPS a rank's GEMMs take one program per
SM of its share: all the SMs its device reports where MPS reports the share, else half of them.
The output names the mode.

**3. The rows**, per op (``ag_matmul``: ``[M/W, K]`` shards gathered into ``A [M, K]``, times ``B
[K, N]``; ``matmul_rs``: ``A [M, K] @ B [K, N]`` cut into ``W`` row blocks, each sent to its
rank), forward, per shape, per copy repeat, each on rank ``r`` of ``W = 2``. The first five are
the symm backend's own parts (the copier of :mod:`tp_kernels.backends.symm_gather`, the pusher of
:mod:`tp_kernels.backends.symm_scatter`, the GEMM launchers of :mod:`tp_kernels.kernels`) on
buffers published once, without the public op's per-call barriers; the last two are public ops:

* ``gemm``: the GEMM alone, every progress word it waits for already raised;
* ``copies``: the copies alone (the all-gather pulls the peer's shard; the reduce-scatter pushes
  its block to the peer's slot);
* ``bound``: both at once, on independent streams (disjoint buffers): what perfect overlap costs;
* ``unfused``: the copies, then the GEMM (all-gather), or the GEMM, then the copies;
* ``symm``: the fused data path: the GEMM's tiles wait on the copies' progress words
  (all-gather), or the pusher copies each block once the GEMM raised its word (reduce-scatter);
* ``symm_op``: the public op (:func:`tp_kernels.all_gather_matmul`,
  :func:`tp_kernels.matmul_reduce_scatter`) on the ``symm`` backend: the data path plus its
  per-call barriers, the reduction and the host's planning, as a user gets it;
* ``torch``: PyTorch's ``fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter`` through the
  ``torch_symm_mem`` backend, at the same SM share.

The two public ops' rows say "n/a: why" where they cannot run: on local peers (no group of
ranks), on the CPU (``torch``), at a copy repeat above 1 (it slows only the data path's copies).

``--copy-repeat k``, a test-only knob, copies each chunk (all-gather: into a scratch buffer, then
the last time into ``A`` and its word) or each block (reduce-scatter) ``k`` times, so that copies
inside one GPU take as long as over NVLink; ``auto`` is the probed bandwidth over
:data:`NVLINK_GBPS` (rounded, at least 1). Shapes: ``llama3-8b`` is Llama-3-8B's w1|w3 (all-gather)
and w2 (reduce-scatter) at 8192 tokens and TP 8; ``balanced`` cuts N (K) to 512 so that the GEMM
on half an H100 and the copies at NVLink speed should take about the same time (an estimate
from published peak rates; the ``gemm`` and ``copies`` rows show what they take).

Each row is timed by the protocol of ``python -m tp_kernels.bench``
(:func:`tp_kernels.bench.protocol.time_providers`: warmup, then rounds in a rotated order, each
call from a barrier to its device's synchronization, the slowest rank's time); the table shows
medians and 20th/80th percentiles, and ``host ms``: the median host time of one call started on
an idle device (synchronize, then time the call until it returns, without waiting on the
device; the slowest rank's). Per case, for each fused row (``symm``, ``symm_op``, ``torch``;
:func:`overlap_metrics`)::

    overlap efficiency = (unfused - fused) / (unfused - bound)   (1: perfect, 0: none)
    exposed comm (ms)  = fused - gemm

**Checks.** Before timing, every row runs once on outputs first filled with NaN and is checked:
GEMM outputs against ``torch.mm`` within :func:`tp_kernels.bench.tolerance.matmul_tolerance`, copied
rows bit for bit, the GEMM's wait record clean. A row that fails says FAIL and is not timed; the
exit status is then 1.

``--device cpu``: the same code with ``TRITON_INTERPRET=1`` (set before starting) and CPU tensors,
in this process, local peers, tiny shapes: the copier and pusher are host threads, the copies host
copies, the GEMMs interpreted, the spinner interpreted and checked. Its times mean nothing; what it
proves is that every row runs and computes the right result, so the first GPU runs code that ran.

Expected time on an H100 or H200 (not measured: no GPU has run this): the probe and each world's
start some 10-20 s each; compiling and tuning the two GEMMs at the 2 default shapes (the
first bf16 symm row took 48 s on an H200) 2-4 minutes; the timed rounds seconds. Every part has a
deadline: the probe 90 s, the MPS ranks' first allocation 60 s, the measurements ``--timeout-s``
(360 s), each MPS daemon start or stop ``--mps-timeout-s`` (30 s), each GEMM wait for a word
``--wait-timeout-s`` (60 s). ``--device cpu`` on 2 shared cores: 5-16 s.

Exit status: 0 when every check passes, 1 when one fails (or a rank fails), 2 for bad arguments.
Without CUDA and without ``--device cpu`` it says so and exits 0.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tp_kernels import config, signals
from tp_kernels.backends import symm_gather, symm_scatter
from tp_kernels.bench.driver import (
    MpsDaemon,
    Ranks,
    device_ready,
    exit_status,
    rank_device,
    run_row,
)
from tp_kernels.bench.protocol import (
    DTYPES,
    add_timeout_argument,
    cuda_seconds_back_to_back,
    host_seconds,
    non_negative_int,
    positive_int,
    positive_number,
    render_table,
    summarize,
    time_cells,
    time_providers,
    versions,
)
from tp_kernels.bench.tolerance import error_ratio, matmul_tolerance
from tp_kernels.testing import RankError

__all__ = [
    "LOCAL",
    "MPS",
    "NO_CUDA_MESSAGE",
    "OPS",
    "ROWS",
    "Case",
    "Peers",
    "Setup",
    "main",
    "measure",
    "merge",
    "mps_run",
    "overlap_metrics",
    "parse_args",
    "probe",
    "rank_hello",
    "render_case",
    "run_cases",
]

NO_CUDA_MESSAGE = "no CUDA device: nothing to measure"
OPS = ("ag_matmul", "matmul_rs")
ROWS = ("gemm", "copies", "bound", "unfused", "symm", "symm_op", "torch")
FUSED = ("symm", "symm_op", "torch")
# The rows of a public fused op, and the backend each asks for.
PUBLIC_OPS = {"symm_op": "symm", "torch": "torch_symm_mem"}
WORLD = 2
MPS, LOCAL = "2 ranks under MPS", "local peers: one process"
# NVLink 4 (H100, H200): 900 GB/s both ways, 450 GB/s each way.
NVLINK_GBPS = 450.0
# (name, M, K, N) per op; see the module docstring.
GPU_SHAPES = {
    "ag_matmul": (("llama3-8b", 8192, 4096, 3584), ("balanced", 8192, 4096, 512)),
    "matmul_rs": (("llama3-8b", 8192, 1792, 4096), ("balanced", 8192, 512, 4096)),
}
CPU_SHAPES = {op: (("tiny", 32, 32, 48),) for op in OPS}
SLOT_CHANNEL = 0  # the pad channel the reduce-scatter's signals use here
# Deadlines of the probe (compiling the spinner included) and of the MPS ranks' first allocation;
# a world's start has its own (LocalWorld's process group init).
PROBE_TIMEOUT_S, HELLO_TIMEOUT_S = 90.0, 60.0


@dataclass(frozen=True)
class Setup:
    """What one run measures (picklable: it goes to the ranks)."""

    device: str
    dtype: str
    shapes: dict[str, tuple[tuple[str, int, int, int], ...]]
    repeats: tuple[int, ...]
    rounds: int
    warmup: int
    host_reps: int
    seed: int
    wait_timeout_s: float
    # Ranks whose persistent GEMMs share the SMs this rank's device reports (the GEMMs launch
    # one program per SM of its share): 1 where MPS already reports the rank's share.
    shared_ranks: int = WORLD


@dataclass
class Case:
    """One (op, shape, copy repeat): per row its per-round times (empty when not timed), host
    time, check text, this rank's verdict and the verdict agreed over ranks, or why it cannot
    run."""

    op: str
    shape: tuple[str, int, int, int]
    repeat: int
    times_ms: dict[str, list[float]] = field(default_factory=dict)
    host_ms: dict[str, float] = field(default_factory=dict)
    checks: dict[str, str] = field(default_factory=dict)
    local_ok: dict[str, bool] = field(default_factory=dict)
    ok: dict[str, bool] = field(default_factory=dict)
    na: dict[str, str] = field(default_factory=dict)

    @property
    def failed(self) -> list[str]:
        return [row for row, good in self.ok.items() if not good]

    def medians(self) -> dict[str, float]:
        return {row: summarize(t)["median_ms"] for row, t in self.times_ms.items() if t}


def overlap_metrics(medians: Mapping[str, float], fused: str) -> tuple[float | None, float]:
    """``(efficiency, exposed_ms)`` of the fused row ``fused`` from the rows' medians (ms):
    ``(unfused - fused) / (unfused - bound)`` (None where ``unfused <= bound``: nothing to hide)
    and ``fused - gemm``."""
    unfused, bound, done = medians["unfused"], medians["bound"], medians[fused]
    efficiency = (unfused - done) / (unfused - bound) if unfused > bound else None
    return efficiency, done - medians["gemm"]


# ---------------------------------------------------------------------------------------------
# Where the peers' memory is


class Peers:
    """The memory a rank's copies read and write: each rank's region (a byte buffer) and signal
    pad. Local peers: every rank's region is a tensor of this process (rank ``rank`` is this
    one). Otherwise: the group's symmetric workspace, grown as a case needs."""

    def __init__(self, rank: int, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.rank, self.group, self.device = rank, group, device
        self._regions: list[torch.Tensor] = []
        self._pads = [torch.zeros(WORLD, dtype=torch.int32, device=device) for _ in range(WORLD)]
        self._workspace = None

    def reserve(self, nbytes: int) -> None:
        """Room for ``nbytes`` per rank (collective when ranks share a group)."""
        if self.group is not None:
            from tp_kernels import symmetric_memory

            self._workspace = symmetric_memory.get_workspace(
                self.group, nbytes, self.device, tag="overlap"
            )
        elif not self._regions or self._regions[0].numel() < nbytes:
            self._regions = [
                torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(WORLD)
            ]

    def region(self, s: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Rank ``s``'s region viewed as ``shape`` of ``dtype`` from its start."""
        if self._workspace is not None:
            return self._workspace.buffer(s, tuple(shape), dtype)
        return self._regions[s][: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def pads(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Every rank's int32 signal pad, and the table of their addresses."""
        if self._workspace is not None:
            pads = [self._workspace.signal_pad(d) for d in range(WORLD)]
            return pads, self._workspace.signal_pad_ptrs()
        table = torch.tensor([p.data_ptr() for p in self._pads], dtype=torch.int64)
        return self._pads, table.to(self.device)

    def barrier(self) -> None:
        """Every rank's writes so far are in place (local peers: nothing to wait for)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.group is not None:
            dist.barrier(group=self.group)


# ---------------------------------------------------------------------------------------------
# The two ops' rows


def _kernels():
    from tp_kernels import kernels  # imports Triton: after TRITON_INTERPRET is set

    return kernels


def _normal(shape: tuple[int, ...], seed: int, device: torch.device, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(device)


class _AllGatherRows:
    """All-gather-matmul on rank ``r``: the peer's shard pulled from its region into ``A``.
    ``run[row]`` calls a row; ``poison``, ``check``: its outputs, filled with NaN, then checked."""

    def __init__(self, peers: Peers, case: Case, setup: Setup) -> None:
        kernels, dtype, repeat = _kernels(), DTYPES[setup.dtype], case.repeat
        r, device = peers.rank, peers.device
        _, M, K, N = case.shape
        m = M // WORLD
        shards = [_normal((m, K), setup.seed + s, device).to(dtype) for s in range(WORLD)]
        self.b = _normal((K, N), setup.seed + WORLD, device, 1 / math.sqrt(K)).to(dtype)
        self.want_a = torch.cat(shards)
        self.want_c = torch.mm(self.want_a, self.b)
        self.tol = matmul_tolerance(dtype, K, roundings=1)
        peers.reserve(m * K * dtype.itemsize)
        local = peers.group is None
        for s in range(WORLD) if local else (r,):  # a rank publishes only its own shard
            peers.region(s, (m, K), dtype).copy_(shards[s])
        peers.barrier()
        sources = [(s, peers.region(s, (m, K), dtype)) for s in _peer_order(r)]
        self.own_rows = slice(r * m, (r + 1) * m)
        rows = symm_gather.chunk_rows(m, K, (N,), dtype, WORLD, device, interpret=kernels.INTERPRET)
        chunks = -(-m // rows)
        self.a = self.want_a.clone()  # own rows stay; the peer's rows are what a row copies
        self.a_side = self.want_a.clone()  # the bound's copies land here, apart from the GEMM's A
        self.c = torch.empty_like(self.want_c)
        scratch = torch.empty((m, K), dtype=dtype, device=device)
        words = torch.zeros(WORLD * chunks, dtype=torch.int32, device=device)
        raised = torch.full_like(words, signals.RAISED)
        self.status = kernels.new_status(WORLD, device)
        copier = symm_gather.Copier(device)

        def pull(dest: torch.Tensor, progress: torch.Tensor | None) -> list[symm_gather.Copies]:
            copies = []
            for s, shard in sources:
                # The repeats land in scratch with no word, so a chunk's word is raised only after
                # its k-th copy: a link k times slower, as the consumer sees it.
                for _ in range(repeat - 1):
                    copies.append(copier.start([(0, shard)], scratch, rows, None))
                copies.append(copier.start([(s, shard)], dest, rows, progress))
            return copies

        def gemm(a: torch.Tensor, progress: torch.Tensor) -> None:
            kernels.ag_matmul_consumer(
                a, [self.b], [self.c], progress=progress, chunk_rows=rows, status=self.status,
                rank=r, world_size=WORLD, timeout_s=setup.wait_timeout_s,
            )  # fmt: skip

        def bound() -> None:
            copies = pull(self.a_side, None)
            gemm(self.want_a, raised)
            _join(copies)

        def unfused() -> None:
            _join(pull(self.a, None))
            gemm(self.a, raised)

        def fused() -> None:
            words.zero_()  # the start barrier's clearing, in stream order before the copies
            copies = pull(self.a, words)
            try:
                gemm(self.a, words)
            finally:
                _join(copies)

        self.run = {
            "gemm": lambda: gemm(self.want_a, raised),
            "copies": lambda: _join(pull(self.a, None)),
            "bound": bound,
            "unfused": unfused,
            "symm": fused,
        }
        if peers.group is not None:
            import tp_kernels

            def gather(backend: str) -> torch.Tensor:
                _, (out,) = tp_kernels.all_gather_matmul(
                    shards[r], [self.b], 0, peers.group, backend=backend
                )
                return out

            self.run.update(_public_rows(gather, self.c))

    def timed_out(self) -> bool:
        """Whether a wait of the GEMM passed its deadline in any call so far (host memory)."""
        return bool(self.status.any())

    def _peer_rows(self, a: torch.Tensor) -> torch.Tensor:
        keep = torch.ones(a.shape[0], dtype=torch.bool)
        keep[self.own_rows] = False
        return a[keep.to(a.device)]

    def outputs(self, row: str) -> list[torch.Tensor]:
        return {
            "gemm": [self.c],
            "copies": [self.a],
            "bound": [self.c, self.a_side],
            **{public: [self.c] for public in PUBLIC_OPS},
        }.get(row, [self.c, self.a])

    def poison(self, row: str) -> None:
        for t in self.outputs(row):
            if t is self.c:
                t.fill_(math.nan)
            else:  # only the peer's rows: the own rows are in place before a call
                t.copy_(torch.where(_own_mask(t, self.own_rows), t, math.nan))

    def check(self, row: str) -> tuple[bool, str]:
        parts, ok = [], not self.timed_out()
        for t in self.outputs(row):
            if t is self.c:
                ratio = error_ratio(self.c, self.want_c, self.tol)
                ok = ok and ratio <= 1.0
                parts.append(f"C err {ratio:.2g} x tol")
            else:
                same = torch.equal(self._peer_rows(t), self._peer_rows(self.want_a))
                ok = ok and same
                parts.append("A rows exact" if same else "A rows DIFFER")
        if self.timed_out():
            parts.append("a wait timed out")
        return ok, ", ".join(parts)


def _own_mask(t: torch.Tensor, own: slice) -> torch.Tensor:
    mask = torch.zeros(t.shape[0], 1, dtype=torch.bool, device=t.device)
    mask[own] = True
    return mask


class _ReduceScatterRows:
    """Matmul-reduce-scatter on rank ``r``: block ``d`` of ``A @ B`` pushed into slot ``r`` of
    rank ``d``'s region (the reduction after it is left out: it is the same in every row but
    ``torch``, whose op includes it). The same interface as :class:`_AllGatherRows`."""

    def __init__(self, peers: Peers, case: Case, setup: Setup) -> None:
        kernels, dtype, repeat = _kernels(), DTYPES[setup.dtype], case.repeat
        r, device = peers.rank, peers.device
        _, M, K, N = case.shape
        m = M // WORLD
        a_of = [_normal((M, K), setup.seed + 100 + s, device).to(dtype) for s in range(WORLD)]
        b_of = [
            _normal((K, N), setup.seed + 200 + s, device, 1 / math.sqrt(K)).to(dtype)
            for s in range(WORLD)
        ]
        products = [torch.mm(a, b) for a, b in zip(a_of, b_of, strict=True)]
        self.want = products[r].view(WORLD, m, N)  # block d: the rows owed to rank d
        self.want_out = sum(p.float()[r * m : (r + 1) * m] for p in products).to(dtype)
        self.tol = matmul_tolerance(dtype, K, roundings=1)
        self.out_tol = matmul_tolerance(dtype, K, roundings=WORLD + 1)
        peers.reserve(WORLD * m * N * dtype.itemsize)
        pads, pad_ptrs = peers.pads()
        slots_of = [peers.region(d, (WORLD, m, N), dtype) for d in range(WORLD)]
        self.r, self.own = r, slots_of[r]
        self.sent = [slots_of[d][r] for d in _peer_order(r)]  # what this rank writes to peers
        self.staging = torch.empty_like(self.want)
        self.out = torch.empty_like(self.want_out)
        # The copies-only and bound rows push these (never poisoned), the others staging.
        self.source = self.want.clone()
        words = torch.zeros(WORLD, dtype=torch.int32, device=device)
        raised = torch.full_like(words, signals.RAISED)
        counters = kernels.new_counters(WORLD, device)
        pusher = symm_scatter.Pusher(device, pads, where="the overlap check")
        signal = SLOT_CHANNEL * WORLD + r
        # Consecutive repeats of a block: its peer's slot is complete only after the k-th.
        pushes = [(d, self.staging[d], slots_of[d][r]) for d in _peer_order(r)]
        pushes = [push for push in pushes for _ in range(repeat)]
        side = [(d, self.source[d], slot) for d, _, slot in pushes]
        a, b = a_of[r], b_of[r]

        def produce() -> None:
            kernels.matmul_rs_producer(
                a, b, self.staging, self.own, words, pad_ptrs, counters=counters, rank=r,
                world_size=WORLD, channel=SLOT_CHANNEL,
            )  # fmt: skip

        def gemm() -> None:
            words.zero_()
            produce()

        def copies() -> None:
            pusher.run(lambda: None, side, raised, signal).join()

        def bound() -> None:
            words.zero_()
            pusher.run(produce, side, raised, signal).join()

        def unfused() -> None:
            gemm()
            pusher.run(lambda: None, pushes, words, signal).join()

        def fused() -> None:
            words.zero_()  # before the pusher's waits are queued: they must see this call's words
            pusher.run(produce, pushes, words, signal).join()

        self.run = {"gemm": gemm, "copies": copies, "bound": bound, "unfused": unfused}
        self.run["symm"] = fused
        if peers.group is not None:
            import tp_kernels

            def scatter(backend: str) -> torch.Tensor:
                return tp_kernels.matmul_reduce_scatter(a, b, 0, peers.group, backend=backend)

            self.run.update(_public_rows(scatter, self.out))

    def timed_out(self) -> bool:
        """Always False: the producer waits for nothing, and the pusher's waits for its words
        end when the producer does (a CPU pusher's deadline raises instead)."""
        return False

    def outputs(self, row: str) -> list[torch.Tensor]:
        if row in PUBLIC_OPS:
            return [self.out]
        blocks = [self.staging, self.own[self.r]] if row in _RS_GEMM_ROWS else []
        return blocks + (self.sent if row in _RS_COPY_ROWS else [])

    def poison(self, row: str) -> None:
        for t in self.outputs(row):
            t.fill_(math.nan)

    def check(self, row: str) -> tuple[bool, str]:
        if row in PUBLIC_OPS:
            ratio = error_ratio(self.out, self.want_out, self.out_tol)
            return ratio <= 1.0, f"out err {ratio:.2g} x tol"
        parts, ok = [], True
        if row in _RS_GEMM_ROWS:
            got = self.staging.clone()
            got[self.r] = self.own[self.r]
            ratio = error_ratio(got, self.want, self.tol)
            ok = ratio <= 1.0
            parts.append(f"blocks err {ratio:.2g} x tol")
        if row in _RS_COPY_ROWS:
            pushed = self.source if row in ("copies", "bound") else self.staging
            want = [pushed[d] for d in _peer_order(self.r)]
            same = all(torch.equal(g, w) for g, w in zip(self.sent, want, strict=True))
            ok = ok and same
            parts.append("sent exact" if same else "sent DIFFER")
        return ok, ", ".join(parts)


# The reduce-scatter's rows that run its GEMM, and those that send its blocks.
_RS_GEMM_ROWS = ("gemm", "bound", "unfused", "symm")
_RS_COPY_ROWS = ("copies", "bound", "unfused", "symm")


def _public_rows(
    op: Callable[[str], torch.Tensor], out: torch.Tensor
) -> dict[str, Callable[[], None]]:
    """The rows of the public fused op ``op(backend)``: one per backend of :data:`PUBLIC_OPS`,
    each writing its result into ``out`` (the tensor its check reads)."""

    def row(backend: str) -> Callable[[], None]:
        return lambda: out.copy_(op(backend))

    return {name: row(backend) for name, backend in PUBLIC_OPS.items()}


def _peer_order(r: int) -> list[int]:
    return [(r + i) % WORLD for i in range(1, WORLD)]


def _join(copies: Sequence[symm_gather.Copies]) -> None:
    for c in copies:
        c.join()


# ---------------------------------------------------------------------------------------------
# One rank's measurements


def _public_reason(peers: Peers, repeat: int, backend: str) -> str | None:
    """Why the public op on ``backend`` cannot be a row of this case; None where it can."""
    if peers.device.type == "cpu" and backend == "torch_symm_mem":
        return "cpu: torch.ops.symm_mem's fused ops run on CUDA only"
    if peers.group is None:
        return "local peers: the public op needs a group of ranks"
    if repeat > 1:
        return f"--copy-repeat {repeat} slows only the data path's copies, not the op's"
    import tp_kernels
    from tp_kernels.backends.choice import get_backend

    why = tp_kernels.available_backends(peers.device).get(backend, "not registered")
    if why != "ok":
        return why
    return get_backend(backend).unavailable_reason(peers.group, peers.device)


def _host_ms(fn: Callable[[], None], reps: int, peers: Peers) -> float:
    """Median host time of ``fn`` started on an idle device (synchronized, the ranks together),
    until it returns; the device finishes it after the clock stops."""
    times = host_seconds(fn, reps, before=peers.barrier)
    peers.barrier()
    return statistics.median(times) * 1e3


def measure(
    op: str, shape: tuple[str, int, int, int], repeat: int, peers: Peers, setup: Setup
) -> Case:
    """Check, then time, every row of one case on this rank (every rank calls it together)."""
    case = Case(op, shape, repeat)
    build = _AllGatherRows if op == "ag_matmul" else _ReduceScatterRows
    rows = build(peers, case, setup)
    for row, backend in PUBLIC_OPS.items():
        why_not = _public_reason(peers, repeat, backend)
        if why_not is not None:
            rows.run.pop(row, None)
            case.na[row] = why_not
    for row in rows.run:
        rows.poison(row)
        peers.barrier()
        rows.run[row]()
        peers.barrier()
        case.local_ok[row], case.checks[row] = rows.check(row)
    case.ok = _agreed(case.local_ok, peers)
    timed = {row: fn for row, fn in rows.run.items() if case.ok[row]}
    case.times_ms = time_providers(
        timed, rounds=setup.rounds, warmup=setup.warmup, group=peers.group, device=peers.device
    )
    case.host_ms = {row: _host_ms(fn, setup.host_reps, peers) for row, fn in timed.items()}
    # A wait that timed out in a timed call (the checked call passed) makes its times a deadline's.
    if "symm" in timed:
        late = rows.timed_out()
        case.ok["symm"] = _agreed({"symm": not late}, peers)["symm"]
        if late:
            case.local_ok["symm"] = False
            case.checks["symm"] += "; a wait timed out in the timed calls"
    return case


def _agreed(ok: dict[str, bool], peers: Peers) -> dict[str, bool]:
    """Each row's verdict, failed where any rank failed it."""
    if peers.group is None:
        return dict(ok)
    bad = torch.tensor([0.0 if v else 1.0 for v in ok.values()])  # gloo: host tensors
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=peers.group)
    return {row: flag == 0.0 for row, flag in zip(ok, bad.tolist(), strict=True)}


def run_cases(setup: Setup, grouped: bool) -> list[Case]:
    """Every case on this rank: with ``grouped``, of the default group (two ranks), else local
    peers in this process."""
    device = rank_device(setup.device)
    group = dist.group.WORLD if grouped else None
    peers = Peers(dist.get_rank() if grouped else 0, group, device)
    with config.SHARED_DEVICE_RANKS.overriding(setup.shared_ranks, argument="shared_ranks"):
        return [
            measure(op, shape, repeat, peers, setup)
            for op in setup.shapes
            for shape in setup.shapes[op]
            for repeat in setup.repeats
        ]


def rank_hello(kind: str) -> dict[str, Any]:
    """A rank's first symmetric allocation (MPS mode's start), then its SM count (None on the
    CPU) and its ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``."""
    from tp_kernels import symmetric_memory

    device = rank_device(kind)
    symmetric_memory.get_workspace(dist.group.WORLD, 1 << 20, device, tag="overlap")
    cuda = device.type == "cuda"
    return {
        "sms": torch.cuda.get_device_properties(device).multi_processor_count if cuda else None,
        "percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
    }


# ---------------------------------------------------------------------------------------------
# The probe


def probe(kind: str, spin_ms: float, copy_mib: int) -> dict[str, Any]:
    """The facts of section 1 of the module docstring, as ``{name: text or number}``."""
    from tp_kernels.bench import _spinner

    device = rank_device(kind)
    facts: dict[str, Any] = {}
    control = shutil.which("nvidia-cuda-mps-control")
    facts["mps control"] = control or "not on PATH"
    default_pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    facts["mps daemon already running"] = (default_pipe / "control").exists()
    facts["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = os.environ.get(
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "unset"
    )
    cuda = device.type == "cuda"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 2
    facts["SMs"] = sms if cuda else "n/a (cpu)"
    src = torch.randn(copy_mib << 18, device=device)  # 4-byte floats: copy_mib MiB
    dst = torch.empty_like(src)
    spun = torch.empty(sms * _spinner.PROGRAMS_PER_SM * _spinner.BLOCK, dtype=torch.int32)
    spun = spun.to(device)
    if not cuda:
        # The interpreter runs the spinner on the host: a few steps, checked; no copy engine.
        _spinner.spin(spun, 3)
        good = torch.equal(spun, _spinner.expected(sms * _spinner.PROGRAMS_PER_SM, 3))
        facts["spinner"] = "ok (checked)" if good else "FAIL: wrong result"
        facts["copy engine"] = "n/a on cpu: the copier is a host thread"
        copy_s = statistics.median(host_seconds(lambda: dst.copy_(src), 5))
    else:
        facts["spinner"], facts["copy engine"] = _copy_engine_verdict(src, dst, spun, spin_ms)
        copy_s = _median_event_s(lambda: dst.copy_(src), 5)
    facts["copy GB/s"] = src.nbytes / copy_s / 1e9
    return facts


def _median_event_s(fn: Callable[[], object], reps: int) -> float:
    # One untimed call first: the first call compiles or touches pages.
    return statistics.median(cuda_seconds_back_to_back(fn, reps, warmup=1))


def _copy_engine_verdict(
    src: torch.Tensor, dst: torch.Tensor, spun: torch.Tensor, spin_ms: float
) -> tuple[str, str]:
    from tp_kernels.bench import _spinner

    programs = spun.numel() // _spinner.BLOCK
    iters = 1 << 12  # a first guess, timed (after compiling), then scaled to spin_ms
    alone_ms = _median_event_s(lambda: _spinner.spin(spun, iters), 3) * 1e3
    iters = max(1, round(iters * spin_ms / max(alone_ms, 1e-3)))
    side = torch.cuda.Stream(src.device)
    start, spin_end, copy_end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    torch.cuda.synchronize(src.device)
    start.record()
    _spinner.spin(spun, iters)
    spin_end.record()
    side.wait_event(start)
    with torch.cuda.stream(side):
        dst.copy_(src)
        copy_end.record()
    torch.cuda.synchronize(src.device)
    spin, copy = start.elapsed_time(spin_end), start.elapsed_time(copy_end)
    good = torch.equal(spun.cpu(), _spinner.expected(programs, iters))
    spinner = f"{programs} programs x {iters} steps: {spin:.2f} ms, " + (
        "ok (checked)" if good else "FAIL: wrong result"
    )
    size = f"{src.nbytes / 2**20:.0f} MiB D2D copy"
    if copy < spin:
        verdict = f"yes: the {size} ended at {copy:.3f} ms, the spinner at {spin:.3f} ms"
    else:
        verdict = f"NO: the {size} ended at {copy:.3f} ms, after the spinner ({spin:.3f} ms)"
    return spinner, verdict


# ---------------------------------------------------------------------------------------------
# The command


def _shape(text: str) -> tuple[str, int, int, int]:
    parts = text.split(",")
    try:
        dims = [positive_int(p) for p in parts]
    except (ValueError, argparse.ArgumentTypeError):
        dims = []
    if len(dims) != 3 or dims[0] % WORLD:
        raise argparse.ArgumentTypeError(
            f"got {text!r}, expected M,K,N: three positive ints, M a multiple of {WORLD}"
        )
    return (f"{dims[0]}x{dims[1]}x{dims[2]}", *dims)


def _repeat(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except ValueError:  # not a number: argparse would only say "invalid _repeat value"
        raise argparse.ArgumentTypeError(
            f"got {text!r}, expected a positive integer or auto"
        ) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tp_kernels.bench.overlap",
        description="Measure how much of the symm backend's communication its fused GEMMs hide, "
        "on one GPU (two ranks under MPS, or local peers), beside PyTorch's fused ops.",
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (default), or cpu: the same code in Triton's interpreter on CPU tensors, "
        "local peers, tiny shapes (needs TRITON_INTERPRET=1; times mean nothing)",
    )
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="ops to measure")
    p.add_argument(
        "--shape",
        type=_shape,
        action="append",
        default=None,
        metavar="M,K,N",
        help="a shape for every op, repeatable (default: llama3-8b and balanced on cuda, "
        "32,32,48 on cpu)",
    )
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default bf16 (cuda), fp32 (cpu)")
    p.add_argument(
        "--copy-repeat",
        type=_repeat,
        nargs="+",
        default=None,
        metavar="K",
        help="test-only: copy each chunk K times, so copies inside one GPU are as slow as over a "
        f"link; 'auto': probed GB/s / {NVLINK_GBPS:g} (NVLink). One case per value "
        "(default: 1 auto on cuda, 1 2 on cpu)",
    )
    p.add_argument("--rounds", type=positive_int, default=None, help="timed rounds (30; cpu 2)")
    p.add_argument("--warmup", type=non_negative_int, default=None, help="untimed (5; cpu 1)")
    p.add_argument(
        "--host-reps", type=positive_int, default=None, help="host-time calls per row (20; cpu 2)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    p.add_argument("--spin-ms", type=positive_number, default=20.0, help="the probe's spinner time")
    p.add_argument(
        "--copy-mib", type=positive_int, default=None, help="the probe's copy (256; cpu 1)"
    )
    p.add_argument("--no-mps", action="store_true", help="local peers even where MPS could run")
    p.add_argument(
        "--mps-timeout-s", type=positive_number, default=30.0, help="each MPS daemon start/stop"
    )
    add_timeout_argument(p, 360.0, "the measurements (the ranks' whole run)")
    p.add_argument(
        "--wait-timeout-s",
        type=positive_number,
        default=60.0,
        help="deadline of each GEMM wait for a progress word, seconds",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line with the device's defaults filled in; exits 2 on bad arguments."""
    args = _parser().parse_args(argv)
    gpu = args.device == "cuda"
    for name, cuda_default, cpu_default in (
        ("dtype", "bf16", "fp32"),
        ("copy_repeat", [1, "auto"], [1, 2]),
        ("rounds", 30, 2),
        ("warmup", 5, 1),
        ("host_reps", 20, 2),
        ("copy_mib", 256, 1),
    ):
        if getattr(args, name) is None:
            setattr(args, name, cuda_default if gpu else cpu_default)
    shapes = GPU_SHAPES if gpu else CPU_SHAPES
    args.shapes = {op: tuple(args.shape) if args.shape else shapes[op] for op in args.ops}
    return args


def _repeats(asked: Sequence[int | str], gbps: float) -> tuple[int, ...]:
    auto = max(1, round(gbps / NVLINK_GBPS))
    return tuple(dict.fromkeys(auto if k == "auto" else k for k in asked))


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_case(case: Case, mode: str, dtype: str) -> str:
    """One case's table and its efficiency lines."""
    name, M, K, N = case.shape
    lines = [f"== {case.op} {name} M={M} K={K} N={N} {dtype} copy-repeat={case.repeat} ({mode})"]
    header = ("row", "median ms", "p20 ms", "p80 ms", "host ms", "check")
    cells = []
    for row in ROWS:
        if row in case.na:
            cells.append((row, "n/a", "-", "-", "-", case.na[row]))
            continue
        times = case.times_ms.get(row)
        verdict = ("ok, " if case.ok[row] else "FAIL, ") + case.checks[row]
        if not times:
            cells.append((row, "-", "-", "-", "-", verdict))
            continue
        cells.append((row, *time_cells(times, 3), _fmt(case.host_ms[row]), verdict))
    lines.append(render_table(header, cells))
    # The arithmetic on the printed (rounded) medians, so a reader can redo it.
    medians = {row: round(ms, 3) for row, ms in case.medians().items()}
    for fused in FUSED:
        needed = ("gemm", "bound", "unfused", fused)
        if fused in case.na or not all(row in medians for row in needed):
            why = case.na.get(fused, "a row it needs was not timed")
            lines.append(f"  {fused}: overlap efficiency n/a ({why})")
            continue
        eff, exposed = overlap_metrics(medians, fused)
        shown = "n/a (unfused <= bound: nothing to hide)" if eff is None else f"{eff:.2f}"
        lines.append(
            f"  {fused}: overlap efficiency {shown} = (unfused {medians['unfused']:.3f} - "
            f"{fused} {medians[fused]:.3f}) / (unfused {medians['unfused']:.3f} - bound "
            f"{medians['bound']:.3f}); exposed comm {exposed:.3f} ms = {fused} "
            f"{medians[fused]:.3f} - gemm {medians['gemm']:.3f}"
        )
    return "\n".join(lines)


def merge(per_rank: Sequence[Sequence[Case]]) -> list[Case]:
    """The ranks' cases as one: a row's check text is that of each rank that failed it (rank 0's
    where none did), its host time the slowest rank's; times and verdicts are already agreed."""
    merged = []
    for cases in zip(*per_rank, strict=True):
        first = replace(cases[0], checks=dict(cases[0].checks))
        for row in first.checks:
            failed = [
                f"rank {r}: {c.checks[row]}" for r, c in enumerate(cases) if not c.local_ok[row]
            ]
            first.checks[row] = " | ".join(failed) or first.checks[row]
        first.host_ms = {row: max(c.host_ms[row] for c in cases) for row in first.host_ms}
        merged.append(first)
    return merged


def mps_run(
    args: argparse.Namespace, setup: Setup, control: str, full_sms: int | None
) -> tuple[str, list[Case]] | None:
    """The cases on 2 ranks under this script's MPS daemon (``control``: the control program;
    ``full_sms``: the GPU's SM count, None on the CPU), or None (printed why) where MPS or its
    ranks cannot start. On the CPU (tests, with a stand-in control program) the same steps run
    on CPU ranks."""
    daemon = MpsDaemon(control, args.mps_timeout_s)
    why = daemon.start()
    if why is not None:
        daemon.stop()
        print(f"MPS: cannot start ({why})")
        return None
    world = Ranks(args.device, args.timeout_s, mps=daemon).world(WORLD)
    try:
        hello = run_row(world, rank_hello, setup.device, timeout_s=HELLO_TIMEOUT_S)
        if hello.per_rank is None:
            print(f"MPS: started, but its ranks could not: {hello.error.splitlines()[0]}")
            return None
        for r, h in enumerate(hello.per_rank):
            print(
                f"MPS rank {r}: {h['sms']} SMs reported (the GPU has {full_sms}), "
                f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={h['percentage']}"
            )
        # Where MPS reports each rank its share, its persistent GEMMs take all it reports.
        shared = WORLD if all(h["sms"] == full_sms for h in hello.per_rank) else 1
        print(f"persistent GEMMs: one program per SM of 1/{shared} of the SMs reported")
        return MPS, merge(world.run(run_cases, replace(setup, shared_ranks=shared), True))
    finally:
        world.close()
        print(f"MPS daemon stopped ({daemon.stop()})")


def _alone(
    args: argparse.Namespace, timeout_s: float, fn: Callable[..., Any], *fn_args: Any
) -> Any:
    """``fn(*fn_args)`` within ``timeout_s``: on the CPU in this process (where the tests patch
    what it calls), on CUDA in a process of its own, as the ranks are, so that this one never
    holds a CUDA context."""
    if args.device == "cpu":
        return fn(*fn_args)
    with Ranks(args.device, timeout_s).world(1) as world:
        return world.run(fn, *fn_args)[0]


def _measure_all(args: argparse.Namespace) -> tuple[dict[str, Any], str, list[Case]]:
    """The probe (printed as it comes), then every case: under MPS where it runs, else on local
    peers. Returns the probe's facts, the mode and the cases."""
    facts = _alone(args, PROBE_TIMEOUT_S, probe, args.device, args.spin_ms, args.copy_mib)
    print("== probe")
    for key, value in facts.items():
        print(f"  {key}: {_fmt(value, 1) if isinstance(value, float) else value}", flush=True)
    setup = Setup(
        device=args.device, dtype=args.dtype, shapes=args.shapes,
        repeats=_repeats(args.copy_repeat, facts["copy GB/s"]), rounds=args.rounds,
        warmup=args.warmup, host_reps=args.host_reps, seed=args.seed,
        wait_timeout_s=args.wait_timeout_s,
    )  # fmt: skip
    control = facts["mps control"]
    outcome = None
    if args.device == "cuda" and not args.no_mps and control != "not on PATH":
        outcome = mps_run(args, setup, control, facts["SMs"])
    if outcome is None:
        outcome = LOCAL, _alone(args, args.timeout_s, run_cases, setup, False)
    return facts, *outcome


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (see the module docstring)."""
    args = parse_args(argv)
    if not device_ready(_parser(), args.device, interpreted_cpu=True):
        print(NO_CUDA_MESSAGE)
        return 0
    v = versions()
    print(
        f"tp_kernels.bench.overlap on {args.device}: torch {v['torch']}, triton {v['triton']}; "
        f"{args.dtype}, {args.warmup} warmup + {args.rounds} rounds, {args.host_reps} host reps"
    )
    started = time.perf_counter()
    try:
        facts, mode, cases = _measure_all(args)
    except RankError as exc:  # a rank raised, crashed or missed its deadline: no table to show
        print(f"ERROR: {exc}", file=sys.stderr)
        return 1
    for case in cases:
        print(render_case(case, mode, args.dtype))
    print(f"done in {time.perf_counter() - started:.1f} s")
    failed = [f"{c.op}/{c.shape[0]}/x{c.repeat}/{row}" for c in cases for row in c.failed]
    if "FAIL" in str(facts.get("spinner", "")):
        failed.append("probe/spinner")
    return exit_status(failed, "the tables above")


if __name__ == "__main__":
    # Run through the imported module, so that what the ranks unpickle (the probe, the rank
    # functions, Setup and Case) has the module's real name rather than __main__.
    from tp_kernels.bench.overlap import main as _main

    raise SystemExit(_main())
