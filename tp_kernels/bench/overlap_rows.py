"""The rows of ``python -m tp_kernels.bench.overlap`` (:mod:`tp_kernels.bench.overlap`), as a rank
runs them: the peers' memory (:class:`Peers`), each op's rows on it, and a case checked, then
timed (:func:`measure`); :func:`run_cases` is what the check's ranks (or its one local-peers
process) run.

Per op (``ag_matmul``: ``[M/W, K]`` shards gathered into ``A [M, K]``, times ``B [K, N]``;
``matmul_rs``: ``A [M, K] @ B [K, N]`` cut into ``W`` row blocks, each sent to its rank), forward,
per shape, per copy repeat, each on rank ``r`` of ``W = 2``. The first five rows are the symm
backend's own parts (the copier of :mod:`tp_kernels.backends.symm_gather`, the pusher of
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

The two public ops' rows say "n/a: why" where they cannot run: on local peers (no group of
ranks), on the CPU (``torch``), at a copy repeat above 1 (it slows only the data path's copies).
A copy repeat ``k`` copies each chunk (all-gather: into a scratch buffer, then the last time into
``A`` and its word) or each block (reduce-scatter) ``k`` times, so that copies inside one GPU
take as long as over NVLink.

**Checks.** Before timing, every row runs once on outputs first filled with NaN and is checked:
GEMM outputs against ``torch.mm`` within :func:`tp_kernels.bench.tolerance.matmul_tolerance`, copied
rows bit for bit, the GEMM's wait record clean. A row that fails says FAIL and is not timed; the
check's exit status is then 1.

Then every row that passed is timed by the protocol of ``python -m tp_kernels.bench``
(:func:`tp_kernels.bench.protocol.time_providers`), and its host time measured (:func:`measure`).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tp_kernels import config, signals
from tp_kernels.backends import symm_gather, symm_scatter
from tp_kernels.bench.driver import rank_device
from tp_kernels.bench.protocol import DTYPES, host_seconds, summarize, time_providers
from tp_kernels.bench.tolerance import error_ratio, matmul_tolerance

__all__ = [
    "OPS",
    "ROWS",
    "WORLD",
    "Case",
    "Peers",
    "Setup",
    "measure",
    "rank_hello",
    "run_cases",
]

OPS = ("ag_matmul", "matmul_rs")
ROWS = ("gemm", "copies", "bound", "unfused", "symm", "symm_op", "torch")
# The rows of a public fused op, and the backend each asks for.
PUBLIC_OPS = {"symm_op": "symm", "torch": "torch_symm_mem"}
WORLD = 2
SLOT_CHANNEL = 0  # the pad channel the reduce-scatter's signals use here


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
