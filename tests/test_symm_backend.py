"""The ``symm`` backend on CPU: its torch path and its Triton path (in Triton's interpreter) across
2 and 3 processes, buffer reuse and growth, a late peer, mismatched calls and a killed peer.

The fused-op numerics (every shape, dim, dtype, forward and backward) run with backend="symm" in
``test_ops.py``; here the backend is called directly, so what is tested is its protocol.
"""

from __future__ import annotations

import os

# The Triton path runs the kernels in the interpreter, which must be chosen before triton is first
# imported; tests/test_kernels.py sets the same for the whole session.
os.environ["TRITON_INTERPRET"] = "1"

import ast  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tp_kernels  # noqa: E402
from tp_kernels import PeerTimeoutError, config, deadline, signals, symmetric_memory, tiling  # noqa: E402
from tp_kernels.backends import pipelined  # noqa: E402
from tp_kernels.backends import symm as symm_backend  # noqa: E402
from tp_kernels.testing import LocalWorld, RankError  # noqa: E402
from tp_kernels.testing.numerics import check_close  # noqa: E402

BACKEND = symm_backend.BACKEND
NAN = float("nan")


# ---------------------------------------------------------------- problems every rank can rebuild


def _inputs(seed: int, rank: int, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return {
        k: torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for k, s in shapes.items()
    }


def _ag_problem(seed, world, m, k, ns, dtype):
    """Per rank: its shard and its bs. Returns (shards, bs of this rank)."""
    rank = dist.get_rank()
    shards = [_inputs(seed, s, {"a": (m, k)}, dtype)["a"] for s in range(world)]
    bs = list(_inputs(seed + 1, rank, {f"b{j}": (k, n) for j, n in enumerate(ns)}, dtype).values())
    return shards, bs


def _ag_check(where, a, outs, shards, bs) -> list[str]:
    full = torch.cat(shards)
    problems = [] if a is None or torch.equal(a, full) else [f"{where}: gathered A differs"]
    for j, (out, b) in enumerate(zip(outs, bs, strict=True)):
        truth, same, mag = (
            full.double() @ b.double(),
            full @ b,
            full.double().abs() @ b.double().abs(),
        )
        if problem := check_close(f"{where} outs[{j}]", out, truth, same, mag):
            problems.append(problem)
    return problems


def _rs_problem(seed, world, m, k, n, dtype, addend):
    shapes = {"a": (world * m, k), "b": (k, n)} | ({"c": (world * m, n)} if addend else {})
    return [_inputs(seed, s, shapes, dtype) for s in range(world)]


def _rs_check(where, out, parts, m) -> str | None:
    """Rows of this rank of sum_s (a_s @ b_s + c_s): float64 truth, the same in the dtype added
    rank by rank (a collective's rounding), and the magnitude of the terms."""
    rows = slice(dist.get_rank() * m, (dist.get_rank() + 1) * m)

    def partial(p, cast):
        return cast(p["a"][rows]) @ cast(p["b"]) + (cast(p["c"][rows]) if "c" in p else 0)

    truth = sum(partial(p, lambda t: t.double()) for p in parts)
    mag = sum(partial(p, lambda t: t.double().abs()) for p in parts)
    same = partial(parts[0], lambda t: t)
    for p in parts[1:]:
        same = same + partial(p, lambda t: t)
    return check_close(where, out, truth, same, mag)


def _fill_own_buffers_with_nan() -> None:
    """NaN into both halves of this rank's data buffer, after every rank is done with them."""
    ws = symmetric_memory.get_workspace(dist.group.WORLD, 1, "cpu", tag=symm_backend._DATA_TAG)
    dist.barrier()
    ws.buffer(dist.get_rank(), ws.nbytes // 4, torch.float32).fill_(NAN)
    dist.barrier()


# Calls of one rank function, in order: (op, m, k, n or ns, dtype, extra). The shapes grow (the
# data workspace is reallocated), shrink (reused) and alternate ops, so both halves and both
# layouts are reused; "late" calls run with NaN-filled buffers and one rank arriving 0.5 s late.
TORCH_CALLS = [
    ("ag", 3, 5, (7,), torch.float32, "return_a"),
    ("rs", 3, 5, 7, torch.float32, "addend"),
    ("ag", 40, 24, (9, 4), torch.float64, ""),
    ("rs", 40, 24, 30, torch.bfloat16, ""),
    ("ag", 2, 3, (1,), torch.bfloat16, "return_a"),
    ("rs", 64, 16, 96, torch.float32, "late"),
    ("ag", 96, 48, (5,), torch.float32, "late return_a"),
    ("rs", 2, 3, 4, torch.float64, "addend late"),
]


def _run_calls(calls, late_rank: int) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    problems = []
    for i, (op, m, k, n, dtype, extra) in enumerate(calls):
        where = f"call {i} ({op} m={m} k={k} n={n} {dtype} {extra})"
        if "late" in extra:
            _fill_own_buffers_with_nan()
            if rank == late_rank % world:
                time.sleep(0.5)
        if op == "ag":
            shards, bs = _ag_problem(i, world, m, k, n, dtype)
            a, outs = BACKEND.all_gather_matmul(
                shards[rank], bs, group, return_a="return_a" in extra
            )
            problems += _ag_check(where, a, outs, shards, bs)
            # Same row blocks and kernels as the pipelined backend: the same bits.
            _, expected = pipelined.BACKEND.all_gather_matmul(
                shards[rank], bs, group, return_a=False
            )
            if not all(torch.equal(x, y) for x, y in zip(outs, expected, strict=True)):
                problems.append(f"{where}: differs from the pipelined backend")
        else:
            parts = _rs_problem(i, world, m, k, n, dtype, "addend" in extra)
            mine = parts[rank]
            out = BACKEND.matmul_reduce_scatter(mine["a"], mine["b"], group, addend=mine.get("c"))
            if problem := _rs_check(where, out, parts, m):
                problems.append(problem)
            # Same partial products, summed in fp32 in the same rank order: the same bits.
            expected = pipelined.BACKEND.matmul_reduce_scatter(
                mine["a"], mine["b"], group, addend=mine.get("c")
            )
            if not torch.equal(out, expected):
                problems.append(f"{where}: differs from the pipelined backend")
    return problems


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_path_reuse_growth_and_late_peer(worlds, world_size):
    results = worlds(world_size).run(_run_calls, TORCH_CALLS, world_size - 1)
    assert results == [[]] * world_size, results


# ---------------------------------------------------------------- the Triton path (interpreter)


@contextlib.contextmanager
def _triton_path():
    """Ask for the Triton path and count the launches that serve it."""
    from tp_kernels import kernels

    assert kernels.INTERPRET, "triton was imported before TRITON_INTERPRET=1 was set"
    launchers = {
        "ag_matmul_consumer": kernels.AgMatmulConsumer,
        "matmul_rs_producer": kernels.RsProducer,
        "reduce_slots": kernels.SlotReduction,
    }
    counts = dict.fromkeys(launchers, 0)
    originals = {name: launcher.launch for name, launcher in launchers.items()}

    def counting(name):
        def launch(self, *args, **kwargs):
            counts[name] += 1
            return originals[name](self, *args, **kwargs)

        return launch

    config.SYMM_TRITON.set(True)
    # Several chunks per shard (the interpreter's 16-row tiles), as a GPU takes where the model
    # finds them faster; the CPU's default is 1 (test_bytes_once and test_gpu_path run that).
    config.SYMM_CHUNKS.set(config.SYMM_MAX_CHUNKS)
    for name, launcher in launchers.items():
        launcher.launch = counting(name)
    try:
        yield counts
    finally:
        config.SYMM_TRITON.reset()
        config.SYMM_CHUNKS.reset()
        for name, launcher in launchers.items():
            launcher.launch = originals[name]


# Tiny shapes, not multiples of the interpreter's 16x16x16 tiles. The addend call takes the torch
# path (the producer kernel has no addend input) between two kernel calls on the same halves.
TRITON_CALLS = [
    ("ag", 5, 12, (9, 17), torch.float32, "return_a"),
    ("rs", 5, 12, 9, torch.float16, ""),
    ("rs", 3, 6, 5, torch.float32, "addend"),
    ("ag", 7, 20, (6,), torch.bfloat16, "late"),
    ("rs", 9, 10, 18, torch.bfloat16, "late"),
]


def _run_triton_calls(calls, late_rank: int) -> dict:
    assert BACKEND.unavailable_reason(dist.group.WORLD, torch.device("cpu")) is None
    with _triton_path() as counts:
        problems = []
        for call in calls:
            problems += _run_calls([call], late_rank)
    # The kernels' summation order differs from torch's: "differs from pipelined" is expected.
    return {
        "problems": [p for p in problems if "pipelined" not in p],
        "launches": counts,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_triton_path_across_processes(worlds, world_size):
    results = worlds(world_size).run(_run_triton_calls, TRITON_CALLS, 0)
    for rank, result in enumerate(results):
        assert result["problems"] == [], (rank, result["problems"])
        # 2 all-gathers and 2 kernel reduce-scatters; the addend call took the torch path.
        assert result["launches"] == {
            "ag_matmul_consumer": 2,
            "matmul_rs_producer": 2,
            "reduce_slots": 2,
        }, (rank, result["launches"])


def _fused_ops_on_the_triton_path(cases) -> dict:
    """The public fused ops with backend="symm" on the Triton path, forward and backward (so the
    backward's reduce-scatter of the input grad and gather of the saved shard run too), against
    the reference backend: float64 truth, the same in the dtype, and the terms' magnitude."""
    import tp_kernels as tpk

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    problems = []

    def ag(backend, shard, ws, grads, grad_a, return_a, cast):
        a_shard = cast(shard).requires_grad_()
        bs = [cast(w).t().requires_grad_() for w in ws]
        a, outs = tpk.all_gather_matmul(a_shard, bs, 0, group, backend=backend, return_a=return_a)
        loss = sum((o * cast(g)).sum() for o, g in zip(outs, grads, strict=True))
        (loss + (0 if a is None else (a * cast(grad_a)).sum())).backward()
        return [*([] if a is None else [a]), *outs, a_shard.grad, *(b.grad for b in bs)]

    def rs(backend, x_full, w, grad, x_grad, cast):
        # Without an input grad the weight grad gathers dy by all_gather_async alone.
        x, wt = cast(x_full).requires_grad_(x_grad), cast(w).t().requires_grad_()
        y = tpk.matmul_reduce_scatter(x, wt, 0, group, backend=backend)
        (y * cast(grad)).sum().backward()
        return [y, *([x.grad] if x_grad else []), wt.grad]

    state = symm_backend._state(group, torch.device("cpu"))
    regathers_before = state.regather_seq
    with _triton_path() as counts:
        for i, (m, k, ns, dtype) in enumerate(cases):
            where = f"case {i} (m={m} k={k} ns={ns} {dtype})"
            g = _inputs(i, rank, {"shard": (m, k), "grad_a": (world * m, k)}, torch.float64)
            ws = [_inputs(i + 50, rank, {"w": (n, k)}, torch.float64)["w"] for n in ns]
            grads = [_inputs(i + 90, rank, {"g": (world * m, n)}, torch.float64)["g"] for n in ns]
            runs = {
                "all_gather_matmul": (ag, (g["shard"], ws, grads, g["grad_a"], True)),
                "all_gather_matmul re-gathering": (ag, (g["shard"], ws, grads, None, False)),
                "matmul_reduce_scatter": (rs, (g["grad_a"], ws[0], grads[0][:m], True)),
                "matmul_reduce_scatter weight only": (
                    rs,
                    (g["grad_a"], ws[0], grads[0][:m], False),
                ),
            }
            for op, (run, args) in runs.items():
                got = run("symm", *args, functools.partial(torch.Tensor.to, dtype=dtype))
                truth = run("reference", *args, torch.Tensor.clone)
                same = run("reference", *args, functools.partial(torch.Tensor.to, dtype=dtype))
                mag = run("reference", *args, torch.Tensor.abs)
                for j, (x, *refs) in enumerate(zip(got, truth, same, mag, strict=True)):
                    if problem := check_close(f"{where} {op} result {j}", x, *refs):
                        problems.append(problem)
    return {
        "problems": problems,
        "launches": counts,
        "regathers": state.regather_seq - regathers_before,
    }


# Tiny, uneven (no multiple of the interpreter's 16-row tiles) and several chunks per shard.
FUSED_CASES = [
    (1, 1, (1,), torch.float32),
    (3, 5, (7, 2), torch.float32),
    (17, 24, (9, 4), torch.bfloat16),
    (40, 16, (5,), torch.float16),
]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fused_ops_on_the_triton_path(worlds, world_size):
    results = worlds(world_size).run(_fused_ops_on_the_triton_path, FUSED_CASES)
    for rank, result in enumerate(results):
        assert result["problems"] == [], (rank, result["problems"])
        # World 1 multiplies locally; otherwise every case gathers through the kernels three
        # times: the all-gather's forward, twice, and the reduce-scatter's backward with an input
        # grad (all_gather(dy) @ w^T); the re-gathers are copies (test_regather_...).
        want = 0 if world_size == 1 else 3 * len(FUSED_CASES)
        assert result["launches"]["ag_matmul_consumer"] == want, (rank, result["launches"])
        # The weight grads' gathers of a saved shard (backward keeps the shard, not A, unless
        # asked): both all-gather runs and the weight-only reduce-scatter.
        assert result["regathers"] == (0 if world_size == 1 else 3 * len(FUSED_CASES)), result


# ---------------------------------------------------------------- run-ahead (one protocol)

# How long the lagging rank sleeps between the two launches of each kernel: long enough for its
# peers to finish the call and start the next one (a few interpreted launches of tiny shapes); the
# control, which must see the race on its first call, leaves them more room on a loaded machine.
LAG_S = 0.4
CONTROL_LAG_S = 1.5


@contextlib.contextmanager
def _launched_twice(lag_rank: int, lag_s: float):
    """Every GEMM and reduction launched twice per call (as ``triton.autotune`` did on a shape's
    first call, before the kernels were tuned on a rank-local problem), and rank ``lag_rank``
    sleeping between the two launches: its peers run ahead into the next call while its second
    launch still waits on this call's signals."""
    from tp_kernels import kernels

    # The barrier is not relaunched: it consumes its words.
    launchers = (kernels.AgMatmulConsumer, kernels.RsProducer, kernels.SlotReduction)
    originals = [launcher.launch for launcher in launchers]

    def twice(launch):
        def run(self, *args, **kwargs):
            launch(self, *args, **kwargs)
            if dist.get_rank() == lag_rank:
                time.sleep(lag_s)
            launch(self, *args, **kwargs)

        return run

    for launcher, launch in zip(launchers, originals, strict=True):
        launcher.launch = twice(launch)
    try:
        yield
    finally:
        for launcher, launch in zip(launchers, originals, strict=True):
            launcher.launch = launch


# Which of two groups each call uses: runs of calls on one group (where a fast peer can reach the
# next call of the same group) and switches between them.
GROUP_PATTERN = (0, 0, 1, 0, 1, 1, 0, 0, 0, 1, 0, 1, 1, 1, 0, 1, 0, 0, 1, 1, 0, 1)


def _run_ahead(lag_rank: int, lag_s: float, timeout_s: float, calls: int) -> dict:
    """``calls`` consecutive calls through the symm backend's Triton path (AG, AG, RS, ...) on two
    process groups used in :data:`GROUP_PATTERN`, shapes growing and shrinking, with
    :func:`_launched_twice`. Returns the problems, the first error, and each call's start and
    end time on this rank (to show that peers really ran ahead)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group(list(range(world))) for _ in range(2)]
    saved_timeout = symmetric_memory.get_timeout()
    symmetric_memory.set_timeout(timeout_s)
    report: dict = {"problems": [], "error": None, "times": []}
    try:
        with _triton_path(), _launched_twice(lag_rank, lag_s):
            for i in range(calls):
                group = groups[GROUP_PATTERN[i % len(GROUP_PATTERN)]]
                m, k, n = 2 + (i * 7) % 9, 6 + (i * 5) % 13, 3 + (i * 3) % 11
                dtype = (torch.float32, torch.float16, torch.bfloat16)[i % 3]
                where = f"call {i} (group {GROUP_PATTERN[i % len(GROUP_PATTERN)]}, m={m})"
                start = time.time()
                if i % 3 != 2:
                    shards, bs = _ag_problem(i, world, m, k, (n, n + 2), dtype)
                    a, outs = BACKEND.all_gather_matmul(shards[rank], bs, group, return_a=True)
                    report["problems"] += _ag_check(where, a, outs, shards, bs)
                else:
                    parts = _rs_problem(i, world, m, k, n, dtype, False)
                    out = BACKEND.matmul_reduce_scatter(parts[rank]["a"], parts[rank]["b"], group)
                    if problem := _rs_check(where, out, parts, m):
                        report["problems"].append(problem)
                report["times"].append((start, time.time()))
    except PeerTimeoutError as exc:
        report["error"] = str(exc)
    finally:
        symmetric_memory.set_timeout(saved_timeout)
        for group in groups:
            dist.destroy_process_group(group)
    return report


def _ran_ahead(reports: list[dict], lag_rank: int) -> bool:
    """Whether some peer started a call before the lagging rank had finished the previous one."""
    lagging = reports[lag_rank]["times"]
    return any(
        r["times"][i + 1][0] < lagging[i][1]
        for s, r in enumerate(reports)
        if s != lag_rank
        for i in range(min(len(lagging), len(r["times"]) - 1))
    )


@pytest.mark.parametrize("world_size", [2, 3])
def test_triton_path_survives_a_lagging_rank(worlds, world_size):
    """Peers run ahead by a call while the lagging rank launches each kernel a second time (as
    triton.autotune did): its second reduction still reads its slots and its second consumer its
    progress words. The next call's start barrier holds the peers until the lagging rank has
    finished, so 22 calls on two groups all give the right values; the peers did run ahead."""
    reports = worlds(world_size).run(_run_ahead, 0, LAG_S, 60.0, 22)
    for rank, report in enumerate(reports):
        assert report["error"] is None and report["problems"] == [], (rank, report)
        assert len(report["times"]) == 22
    assert _ran_ahead(reports, 0), [r["times"] for r in reports]


def _run_ahead_without_start_barrier(lag_rank: int, lag_s: float, calls: int) -> dict:
    """:func:`_run_ahead` with every start barrier skipped (the progress and slot words then
    keep the previous call's raised values, and nothing holds a fast peer back)."""
    original = symm_backend._barrier

    def no_start(state, pads, rank, world, channel, *, clear):
        if channel != symm_backend._START:
            original(state, pads, rank, world, channel, clear=clear)

    symm_backend._barrier = no_start
    try:
        return _run_ahead(lag_rank, lag_s, 3.0, calls)
    finally:
        symm_backend._barrier = original


def test_without_the_start_barrier_the_lagging_rank_is_lost(worlds):
    """The control of the test above: without the start barrier, the peers' next calls push
    into the lagging rank's slots while its second reduction reads them, and its consumers find
    the previous call's progress words raised: some call gives wrong values (or a wait ends at
    its deadline)."""
    reports = worlds(2).run(_run_ahead_without_start_barrier, 0, CONTROL_LAG_S, 6)
    assert any(r["problems"] or r["error"] for r in reports), reports


# ---------------------------------------------------------------- the backward's re-gather

# The copier of the lagging rank sleeps this long before each chunk it copies: long enough for its
# peers to finish the re-gather and start the next one (and, with one half, overwrite its source).
COPY_LAG_S = 0.3


class _SlowShard:
    """A peer's shard whose chunks are handed to the copier only after :data:`COPY_LAG_S`."""

    def __init__(self, shard: torch.Tensor) -> None:
        self.shard, self.shape = shard, shard.shape

    def __getitem__(self, rows: slice) -> torch.Tensor:
        time.sleep(COPY_LAG_S)
        return self.shard[rows]


def _regathers_with_a_late_copier(path: str, halves: int, calls: int) -> list[str]:
    """``calls`` backward re-gathers (``all_gather_async``) of shards that change every call,
    each overlapped with a matmul-reduce-scatter as in backward (started, the fused call, then
    waited), the last rank's copier late on every chunk. Returns what came back wrong."""
    from tp_kernels.backends import symm_gather

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    start = symm_gather.Copier.start
    lagging = rank == world - 1

    def late_start(self, sources, *args):
        return start(self, [(s, _SlowShard(t)) for s, t in sources], *args)

    saved_halves = symm_backend._REGATHER_HALVES
    symm_backend._REGATHER_HALVES = halves
    if lagging:
        symm_gather.Copier.start = late_start
    problems = []
    try:
        with _triton_path() if path == "triton" else contextlib.nullcontext():
            for i in range(calls):
                m, k = 3 + i % 2, 5  # uneven growth: the workspace is sized on the first call
                shards = [_inputs(i, s, {"a": (m, k)}, torch.float32)["a"] for s in range(world)]
                pending = BACKEND.all_gather_async(shards[rank], group)
                parts = _rs_problem(i, world, 2, 4, 3, torch.float32, False)
                BACKEND.matmul_reduce_scatter(parts[rank]["a"], parts[rank]["b"], group)
                if not torch.equal(pending.wait(), torch.cat(shards)):
                    problems.append(f"re-gather {i}: the gathered A differs")
    finally:
        symm_gather.Copier.start = start
        symm_backend._REGATHER_HALVES = saved_halves
        dist.destroy_process_group(group)
    return problems


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_regather_is_double_buffered_against_a_late_copier(worlds, world_size, path):
    """Backward's re-gather pulls the peers' shards with the all-gather's copier and is joined
    only after the fused call it overlaps, so a peer may still be copying a shard when this rank
    starts the next re-gather: with its two halves every result is right."""
    results = worlds(world_size).run(_regathers_with_a_late_copier, path, 2, 4)
    assert results == [[]] * world_size, results


def test_one_regather_half_loses_the_late_copier(worlds):
    """The control: with one half, the fast rank's next re-gather overwrites the shard the late
    copier has not read yet, and the late rank gathers the next call's rows."""
    results = worlds(2).run(_regathers_with_a_late_copier, "torch", 1, 2)
    assert results[0] == [], results
    assert results[1] and "re-gather 0: the gathered A differs" in results[1][0], results


# ---------------------------------------------------------------- mismatched calls


def _mismatched_calls() -> dict:
    """Each case: a correct call that sizes the buffers, then one where the last rank calls with
    a larger shape (one that fits the buffers, then one that would need them to grow, which only
    that rank would ask for). Every rank must raise; a correct call afterwards must work."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    odd = rank == world - 1
    messages = []
    # Rows of 4 fp32 (16 bytes): 6 rows fit the buffers the correct call sizes; m_grow rows need
    # more than the whole data workspace holds now, whatever earlier tests left it at.
    state = symm_backend._state(group, torch.device("cpu"))
    m_grow = (state.data.nbytes if state.data is not None else 4096) // 16 + 1
    for m_bad in (6, m_grow):
        for op in ("ag", "rs"):
            shards, bs = _ag_problem(0, world, 8, 4, (3,), torch.float32)
            BACKEND.all_gather_matmul(shards[rank], bs, group, return_a=False)
            parts = _rs_problem(0, world, 8, 4, 3, torch.float32, False)
            BACKEND.matmul_reduce_scatter(parts[rank]["a"], parts[rank]["b"], group)
            m = m_bad if odd else 4
            try:
                if op == "ag":
                    BACKEND.all_gather_matmul(torch.ones(m, 4), bs, group, return_a=True)
                else:
                    BACKEND.matmul_reduce_scatter(torch.ones(world * m, 4), parts[rank]["b"], group)
            except ValueError as exc:
                messages.append(str(exc))
            else:
                messages.append("no error")
    # The group is still usable: the failed calls left no signal behind.
    return {"messages": messages, "m_bad": (6, m_grow), "after": _run_calls(TORCH_CALLS[:2], 0)}


def test_mismatched_shapes_raise_on_every_rank(worlds):
    world = 3
    results = worlds(world).run(_mismatched_calls)
    for rank, result in enumerate(results):
        messages = result["messages"]
        assert len(messages) == 4 and result["after"] == [], (rank, result)
        for case, message in enumerate(messages):
            m_bad, op = result["m_bad"][case // 2], ("ag", "rs")[case % 2]
            if op == "ag":
                mine, odd = (
                    "all_gather_matmul(a_shard [4, 4]",
                    f"all_gather_matmul(a_shard [{m_bad}, 4]",
                )
            else:
                mine = f"matmul_reduce_scatter(a [{world * 4}, 4] @ b [4, 3]"
                odd = f"matmul_reduce_scatter(a [{world * m_bad}, 4] @ b [4, 3]"
            assert "the ranks made different calls" in message, (rank, case, message)
            assert f"rank 0: {mine}" in message and f"rank 1: {mine}" in message, (rank, message)
            assert f"rank 2: {odd}" in message, (rank, case, message)


# ---------------------------------------------------------------- a peer killed mid-call


def _killed_peer(out_dir: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    parts = _rs_problem(0, world, 8, 4, 3, torch.float32, False)
    BACKEND.matmul_reduce_scatter(parts[rank]["a"], parts[rank]["b"], group)  # buffers set up
    symmetric_memory.set_timeout(2.0)
    victim = world - 1
    if rank == victim:
        # Dies at its first product, after the call began and before its slots are sent.
        torch.mm = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    report: dict = {
        "prefixes": [
            symmetric_memory.get_workspace(group, 1, "cpu", tag=tag).shm_name_prefix
            for tag in (symm_backend._CTL_TAG, symm_backend._DATA_TAG)
        ]
    }
    start = time.monotonic()
    try:
        BACKEND.matmul_reduce_scatter(parts[rank]["a"], parts[rank]["b"], group)
    except PeerTimeoutError as exc:
        report |= {"error": str(exc), "peers": exc.peers}
    report["waited"] = time.monotonic() - start
    try:
        BACKEND.matmul_reduce_scatter(parts[rank]["a"], parts[rank]["b"], group)
    except PeerTimeoutError as exc:
        report["next_call"] = str(exc)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


def test_killed_peer_fails_survivors_at_the_deadline(tmp_path):
    with LocalWorld(3, timeout_s=60.0) as world:
        with pytest.raises(RankError, match=r"ranks \[2\] exited without answering"):
            world.run(_killed_peer, str(tmp_path))
    for rank in (0, 1):
        report = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        assert report["peers"] == [2], report
        assert "wait_signal on channel 1 ran past its deadline; rank(s) [2]" in report["error"]
        assert "gave up after" in report["error"], report["error"]
        assert 2.0 <= report["waited"] < 30.0, report
        assert "is broken by an earlier failed wait" in report["next_call"], report
        leftovers = [
            name for name in os.listdir("/dev/shm") if name.startswith(tuple(report["prefixes"]))
        ]
        assert leftovers == [], leftovers


def _killed_mid_copy(out_dir: str) -> None:
    """The last rank dies while its copier is between two chunks of a peer's shard (after the
    barrier: every rank has its shard). The survivors finish that call with the right values
    (they need nothing more from it); their next call's barrier waits for it to its deadline and
    raises, naming it; the call after that is refused."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    m, k, ns = 40, 8, (6,)  # 16-row chunks: 3 per shard
    config.SYMM_TRITON.set(True)
    config.SYMM_CHUNKS.set(3)
    shards, bs = _ag_problem(0, world, m, k, ns, torch.float32)
    BACKEND.all_gather_matmul(shards[rank], bs, group, return_a=False)  # buffers set up
    symmetric_memory.set_timeout(2.0)
    victim = world - 1
    copier = symm_backend._state(group, torch.device("cpu")).copier
    if rank == victim:
        # Its first progress word: the first chunk is copied, the next ones never are.
        copier._write = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
    report: dict = {}
    shards, bs = _ag_problem(1, world, m, k, ns, torch.float32)
    a, outs = BACKEND.all_gather_matmul(shards[rank], bs, group, return_a=True)
    report["problems"] = _ag_check("the call the victim died in", a, outs, shards, bs)
    start = time.monotonic()
    try:
        BACKEND.all_gather_matmul(shards[rank], bs, group, return_a=False)
    except PeerTimeoutError as exc:
        report |= {"error": str(exc), "peers": exc.peers}
    report["waited"] = time.monotonic() - start
    try:
        BACKEND.all_gather_matmul(shards[rank], bs, group, return_a=False)
    except PeerTimeoutError as exc:
        report["next_call"] = str(exc)
    config.SYMM_TRITON.reset()
    config.SYMM_CHUNKS.reset()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


def test_peer_killed_mid_copy_is_named_at_the_deadline(tmp_path):
    with LocalWorld(3, timeout_s=60.0) as world:
        with pytest.raises(RankError, match=r"ranks \[2\] exited without answering"):
            world.run(_killed_mid_copy, str(tmp_path))
    for rank in (0, 1):
        report = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        assert report["problems"] == [], report
        assert report["peers"] == [2], report
        # The first wait that timed out is named: the next call's start barrier.
        assert (
            "waited 2 s for rank(s) [2] (rank 2: its arrival at the call's start barrier"
            in report["error"]
        ), report["error"]
        assert 2.0 <= report["waited"] < 30.0, report
        assert "is broken by an earlier failed wait" in report["next_call"], report


# ---------------------------------------------------------------- one timeout error


def _timeouts_of_the_heap_and_a_kernel() -> list[dict]:
    """Rank 0 meets a wait of the symmetric heap past its deadline (the torch path, rank 1 does
    not call) and a wait a kernel recorded (the Triton path), each in a fused call on a group of
    its own; what each raised, and whether the group is then broken in deadline's record."""
    rank = dist.get_rank()
    heap_group, kernel_group = dist.new_group([0, 1]), dist.new_group([0, 1])
    a, bs = torch.ones(4, 8), [torch.ones(8, 3)]
    saved_timeout = symmetric_memory.get_timeout()
    found = []
    try:
        BACKEND.all_gather_matmul(a, bs, heap_group, return_a=False)  # sets up
        config.SYMM_TRITON.set(True)
        BACKEND.all_gather_matmul(a, bs, kernel_group, return_a=False)  # sets up
        dist.barrier()
        if rank == 0:
            symmetric_memory.set_timeout(0.5)
            status, _, _ = symm_backend._state(kernel_group, torch.device("cpu")).kernel_state()
            status[1] = signals.WAIT_CHUNK  # what a wait for rank 1's chunk stores at its deadline
            for group, triton in ((heap_group, False), (kernel_group, True)):
                config.SYMM_TRITON.set(triton)
                try:
                    with deadline.fused_call(group, "all_gather_matmul", "forward"):
                        BACKEND.all_gather_matmul(a, bs, group, return_a=False)
                except Exception as exc:  # the test is which type it is
                    found.append(
                        {
                            "type": type(exc),
                            "op": getattr(exc, "op", None),
                            "group": (getattr(exc, "group", None), group.group_name),
                            "peers": getattr(exc, "peers", None),
                            "message": str(exc),
                            "broken": deadline.is_broken(group),
                        }
                    )
        dist.barrier()
    finally:
        symmetric_memory.set_timeout(saved_timeout)
        config.SYMM_TRITON.reset()
        dist.destroy_process_group(heap_group)
        dist.destroy_process_group(kernel_group)
    return found


def test_the_heap_and_the_kernels_time_out_with_one_error(worlds):
    """One failure model: a wait of the symmetric heap and a wait a kernel recorded both raise
    tp_kernels.PeerTimeoutError itself (no subclass), naming the op, pass, group, peer and wait,
    and both break the group in deadline's one record."""
    heap, kernel = worlds(2).run(_timeouts_of_the_heap_and_a_kernel)[0]
    which_wait = {
        "heap": "wait_signal on channel 1 ran past its deadline; rank(s) [1]",
        "kernel": "for rank(s) [1] (rank 1: a chunk of its shard copied",
    }
    for name, report in (("heap", heap), ("kernel", kernel)):
        assert report["type"] is tp_kernels.PeerTimeoutError, (name, report)
        assert report["op"] == "all_gather_matmul" and report["peers"] == [1], (name, report)
        assert report["group"][0] == report["group"][1], (name, report)
        message = report["message"]
        assert message.startswith("all_gather_matmul (forward signal wait): "), (name, message)
        assert which_wait[name] in message, (name, message)
        assert report["broken"], (name, report)


def test_only_deadline_defines_a_timeout_error():
    """No module of tp_kernels but deadline.py defines an exception class of the timeout kind."""
    root = Path(tp_kernels.__file__).parent
    defined = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(base) for base in node.bases]
                if any("Timeout" in base for base in bases):
                    defined.append((str(path.relative_to(root)), node.name))
    assert defined == [("deadline.py", "PeerTimeoutError")], defined


# ---------------------------------------------------------------- availability


def _group_reason() -> str | None:
    return BACKEND.unavailable_reason(dist.group.WORLD, torch.device("cpu"))


def test_unavailable_reason(worlds, monkeypatch):
    assert BACKEND.unavailable_reason(None, torch.device("cpu")) is None
    assert worlds(2).run(_group_reason) == [None, None]
    assert "not 'meta'" in BACKEND.unavailable_reason(None, torch.device("meta"))
    if not torch.cuda.is_available():
        assert "torch.cuda.is_available() is False" in BACKEND.unavailable_reason(
            None, torch.device("cuda")
        )
    from tp_kernels import kernels

    monkeypatch.setattr(config.SYMM_TRITON, "get", lambda: True)
    assert BACKEND.unavailable_reason(None, torch.device("cpu")) is None
    monkeypatch.setattr(kernels, "INTERPRET", False)
    assert "set TRITON_INTERPRET=1" in BACKEND.unavailable_reason(None, torch.device("cpu"))


# ---------------------------------------------------------------- the copier's rules


def test_chunks_are_the_models_fastest_or_the_setting(monkeypatch):
    """Chunks per shard: on a GPU the model knows, the count it predicts fastest for the shape
    (its simulation runs the backend's own row rule); 1 where it knows no device (a CPU, an
    unknown GPU); TP_KERNELS_SYMM_CHUNKS over both. Boundaries on whole 256-row tiles (16 in
    the interpreter), so a shard may take fewer chunks than asked."""
    from tp_kernels import cost
    from tp_kernels.backends import symm_gather

    cuda = torch.device("cuda", 0)
    shape = (1024, 8192, (3584, 3584), torch.bfloat16, 8)
    h100 = cost.Problem(1024, 8192, (3584, 3584), 8, "bf16", cost.DEVICES["h100"])
    symm_gather._modelled_chunks.cache_clear()
    monkeypatch.setattr(cost, "device_spec", lambda device: cost.DEVICES["h100"])
    assert symm_gather.chunks_per_shard(*shape, cuda) == cost.copy_engine_chunks(h100, 4)
    # Where the copies are costly (no latency hidden by a chunk), the model says 1; where they
    # are free and the link slow, more (the model's own tests work both out by hand).
    free = dataclasses.replace(cost.DEVICES["h100"], copy_latency_s=0.0, link_gb_s=50.0)
    monkeypatch.setattr(cost, "device_spec", lambda device: free)
    symm_gather._modelled_chunks.cache_clear()
    assert symm_gather.chunks_per_shard(1024, 8192, (256,), torch.bfloat16, 8, cuda) > 1
    monkeypatch.setattr(cost, "device_spec", lambda device: None)
    symm_gather._modelled_chunks.cache_clear()
    assert symm_gather.chunks_per_shard(*shape, cuda) == 1
    assert symm_gather.chunks_per_shard(*shape, torch.device("cpu")) == 1
    config.SYMM_CHUNKS.set(3)
    try:
        assert symm_gather.chunks_per_shard(*shape, cuda) == 3
    finally:
        config.SYMM_CHUNKS.reset()
    symm_gather._modelled_chunks.cache_clear()
    for bad in (0, 5, True, 2.0):
        with pytest.raises(ValueError, match="chunks: expected an int from 1 to 4 or None"):
            config.SYMM_CHUNKS.set(bad, argument="chunks")
    assert tiling.chunk_rows(1024, 1, interpret=False) == 1024
    assert tiling.chunk_rows(1024, 3, interpret=False) == 512  # 2 chunks
    assert tiling.chunk_rows(40, 4, interpret=True) == 16  # 3 chunks
    assert tiling.chunk_rows(0, 1, interpret=False) == 1  # never a zero divisor
    for m in (1, 5, 255, 256, 257, 1000, 4096, 5000):
        for chunks in range(1, symm_gather.MAX_CHUNKS + 1):
            rows = tiling.chunk_rows(m, chunks, interpret=False)
            assert rows % 256 == 0 and -(-m // rows) <= chunks, (m, chunks, rows)


def test_progress_falls_back_to_a_copy_without_stream_memory_operations(monkeypatch):
    """A driver without stream memory operations refuses cuStreamWriteValue32 ("operation not
    supported"): from then on each word is copied from (pinned) host memory, after the chunk.
    Any other error is raised."""
    from tp_kernels.backends import symm_gather

    calls = []

    def refused(words, word, value):
        calls.append(("stream_write", word, value))
        raise RuntimeError("CUDA driver error: operation not supported")

    monkeypatch.setattr(torch.ops.symm_mem, "stream_write_value32_", refused)
    # The raised value in (pinned, on a CUDA build) host memory is made once, with the writer,
    # outside any capture: no host allocation per word.
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    write = symm_gather._StreamWriter()
    progress = torch.zeros(4, dtype=torch.int32)
    real_copy = torch.Tensor.copy_

    def copy(dst, src, non_blocking=False):
        calls.append(("copy", src.data_ptr() == write._raised.data_ptr(), non_blocking))
        return real_copy(dst, src)

    monkeypatch.setattr(torch.Tensor, "copy_", copy)
    write(progress, 1)
    write(progress, 2)
    assert calls == [("stream_write", 1, 1), ("copy", True, True), ("copy", True, True)]
    assert progress.tolist() == [0, 1, 1, 0]

    def broken(words, word, value):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.ops.symm_mem, "stream_write_value32_", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        symm_gather._StreamWriter()(progress, 0)


class _Rows:
    """A fake CUDA tensor of ``rows`` rows whose row slices log their copies."""

    def __init__(self, log: list, name: str, rows: int = 0) -> None:
        self.log, self.name, self.shape = log, name, (rows,)

    def __getitem__(self, rows: slice) -> _Rows:
        return _Rows(self.log, f"{self.name}[{rows.start}:{rows.stop}]")

    def copy_(self, other: _Rows) -> None:
        self.log.append(("copy", other.name, self.name))

    def record_stream(self, stream) -> None:
        self.log.append(("record_stream", self.name, stream.name))


def test_cuda_copier_enqueues_chunks_then_words_after_the_barrier(monkeypatch):
    """On CUDA the copier's side stream first waits for the current stream (the barrier and
    the own rows), marks A as used by the side stream (so that an A dropped before the join,
    after an error, is not reused while the copies write it), then copies each peer's chunks in
    order, each followed by its progress word, and records the event the join waits for."""
    from tp_kernels.backends import symm_gather

    log = []

    class Stream:
        def __init__(self, device=None, priority=0, name="side"):
            self.device, self.name = device, name

        def wait_stream(self, other):
            log.append(("wait", self.name, other.name))

        def record_event(self):
            log.append(("record event", self.name))
            return "event"

    current = Stream(name="current")
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(
        symm_gather, "_StreamWriter", lambda: lambda words, w: log.append(("word", words, w))
    )
    copier = symm_gather.Copier(torch.device("cuda", 0))
    sources = [(s, _Rows(log, f"shard{s}", rows=5)) for s in (2, 0)]
    copies = copier.start(sources, _Rows(log, "A"), 3, "progress")
    assert log == [
        ("wait", "side", "current"),
        ("record_stream", "A", "side"),
        ("copy", "shard2[0:3]", "A[10:13]"),
        ("word", "progress", 4),
        ("copy", "shard2[3:5]", "A[13:15]"),
        ("word", "progress", 5),
        ("copy", "shard0[0:3]", "A[0:3]"),
        ("word", "progress", 0),
        ("copy", "shard0[3:5]", "A[3:5]"),
        ("word", "progress", 1),
        ("record event", "side"),
    ]
    assert copies._event == "event" and copies._thread is None


class _NamedGroup:
    """Stands for a process group where only its name and identity are read (the broken-group
    record is keyed by the group)."""

    group_name = "tp"


def test_a_call_on_another_stream_waits_for_the_previous_calls_stream(monkeypatch):
    """Every reuse rule rests on the current stream having joined the last call's side streams;
    a call on another CUDA stream first waits for the stream the group's last call ran on
    (and a call on the same stream waits for nothing)."""
    import types

    waits = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            waits.append((self.name, other.name))

    state = types.SimpleNamespace(broken=None, status=None, last_stream=None)
    current = [Stream("s1")]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(symm_backend, "_state", lambda group, device: state)
    group, cuda = _NamedGroup(), torch.device("cuda", 0)
    for name in ("s1", "s1", "s2", "s2", "s1"):
        current[0] = current[0] if current[0].name == name else Stream(name)
        assert symm_backend._usable_state(group, cuda, "a test call", need_half=64) is state
    assert waits == [("s2", "s1"), ("s1", "s2")]


def test_cuda_copies_are_joined_on_their_devices_current_stream(monkeypatch):
    """The current stream of the copies' own device (not the current device's) waits for their
    event, once, without synchronizing the host. (A CUDA event does not know its device: the
    copier passes it.)"""
    from tp_kernels.backends import symm_gather

    waited = []

    class Stream:
        def __init__(self, device):
            self.device = device

        def wait_event(self, event):
            waited.append((self.device, event))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
    event = object()  # a torch.cuda.Event has no device attribute either
    copies = symm_gather.Copies(event=event, device=torch.device("cuda", 1))
    copies.join()
    copies.join()
    assert waited == [(torch.device("cuda", 1), event)]


# ---------------------------------------------------------------- inference mode


def _first_call_under_inference_mode(triton: bool) -> dict:
    """A new group's first calls (which make its state) under ``torch.inference_mode()``, then
    calls outside it; the values of each, and whether any state tensor is an inference tensor
    (one that a later call writes in place would raise)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    report: dict = {"problems": [], "errors": []}
    saved_timeout = symmetric_memory.get_timeout()
    symmetric_memory.set_timeout(20.0)  # a failed copy leaves its consumer waiting
    if triton:
        config.SYMM_TRITON.set(True)
    try:
        for call, mode in enumerate((True, False, True, False)):
            shards, bs = _ag_problem(call, world, 5, 12, (9,), torch.float32)
            parts = _rs_problem(call, world, 5, 12, 9, torch.float32, False)
            try:
                with torch.inference_mode(mode):
                    a, outs = BACKEND.all_gather_matmul(shards[rank], bs, group, return_a=True)
                    out = BACKEND.matmul_reduce_scatter(parts[rank]["a"], parts[rank]["b"], group)
            except Exception as exc:  # noqa: BLE001 - reported, and the test fails on it
                report["errors"].append(f"call {call}: {exc!r}"[:300])
                break
            report["problems"] += _ag_check(f"call {call}", a, outs, shards, bs)
            if problem := _rs_check(f"call {call}", out, parts, 5):
                report["problems"].append(problem)
        state = symm_backend._state(group, torch.device("cpu"))
        made = {"pad": state.ctl.signal_pad(0), "data": state.data.buffer(0, (4,), torch.int32)}
        if triton:
            made |= {"status": state.status, "counters": state.counters, "words": state.words}
            made |= {"staging": state.staging, "pusher pad": state.pusher._pads[0]}
        report["inference"] = sorted(name for name, t in made.items() if t.is_inference())
    finally:
        config.SYMM_TRITON.reset()
        symmetric_memory.set_timeout(saved_timeout)
        dist.destroy_process_group(group)
    return report


@pytest.mark.parametrize("triton", [False, True])
def test_a_first_call_under_inference_mode_leaves_no_inference_state(worlds, triton):
    """The state a group's first call makes (workspaces, progress words, status, counters,
    staging, the pusher's pad views) is never made of inference tensors, and the CPU copier's and
    pusher's threads run in the caller's inference mode (a call under it gathers into an
    inference tensor). Before: the Triton path's first call under inference mode failed in the
    copier's thread ("Inplace update to inference tensor outside InferenceMode")."""
    for rank, report in enumerate(worlds(2).run(_first_call_under_inference_mode, triton)):
        assert report["errors"] == [] and report["problems"] == [], (rank, report)
        assert report["inference"] == [], (rank, report)


def test_grown_staging_is_freed_after_the_current_streams_work(monkeypatch):
    """Staging grows with the data workspace. The old block goes back to the pool of the stream
    it was made on, which need not follow the pusher's reads of it (the current stream may have
    changed since); it is first recorded on the current stream, which follows them (it joined
    the last call's side streams or waited for the stream that did). Before: not recorded."""
    import types

    log = []

    class OldStaging:
        def numel(self):
            return 64

        def record_stream(self, stream):
            log.append(("record_stream", stream))

    real_empty = torch.empty
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "current")
    monkeypatch.setattr(
        torch, "empty", lambda *size, dtype=None, device=None: real_empty(*size, dtype=dtype)
    )
    state = symm_backend._GroupState.__new__(symm_backend._GroupState)
    state.ctl = types.SimpleNamespace(world_size=2, device=torch.device("cuda", 0))
    state.data = types.SimpleNamespace(nbytes=2 * 256)
    state.pusher, state.staging = "pusher", OldStaging()
    pusher, staging = state.scatter_state()
    assert log == [("record_stream", "current")] and staging.numel() == 256
    log.clear()
    state.scatter_state()  # large enough: kept, nothing recorded
    assert log == [] and state.staging is staging


def _capture_readiness_before_and_after_reserve() -> dict:
    from tp_kernels.backends.base import CaptureNeed

    group = dist.new_group(list(range(dist.get_world_size())))
    cpu = torch.device("cpu")
    ag = CaptureNeed("all_gather_matmul", 4096, torch.float32)
    report = {"torch path": BACKEND.capture_unready_reason(group, cpu, ag)}
    config.SYMM_TRITON.set(True)
    try:
        report["before"] = BACKEND.capture_unready_reason(group, cpu, ag)
        BACKEND.reserve(group, cpu, 4096)
        report |= {
            "after": [
                BACKEND.capture_unready_reason(group, cpu, CaptureNeed(op, 4096, torch.float32))
                for op in ("all_gather_matmul", "matmul_reduce_scatter", "all_gather")
            ],
            "larger": BACKEND.capture_unready_reason(
                group, cpu, CaptureNeed("matmul_reduce_scatter", 1 << 20, torch.float32)
            ),
        }
    finally:
        config.SYMM_TRITON.reset()
        dist.destroy_process_group(group)
    return report


def test_reserve_makes_what_a_captured_call_needs(worlds):
    """The torch path is never capturable; on the Triton path, before any call a captured symm
    call would have to make the group's state (refused);
    after ``reserve`` calls up to its bytes need nothing made (the all-gather, the
    reduce-scatter, the backward's re-gather), and a larger one names both sizes."""
    for report in worlds(2).run(_capture_readiness_before_and_after_reserve):
        # The torch path's waits are the host's: never capturable (auto takes another backend).
        assert "takes its torch path" in report["torch path"], report
        assert "no call on this group has run yet" in report["before"], report
        assert report["after"] == [None, None, None], report
        assert "holds 4096 bytes per call and this call needs 1048576" in report["larger"], report
