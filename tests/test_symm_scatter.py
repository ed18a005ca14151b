"""The reduce-scatter's pusher (tp_kernels/backends/symm_scatter.py): its waits, its order on
CUDA (with fakes: no GPU here), and a peer that dies while pushing.

The public op through the pusher, forward and backward at W=1..4, bytes-once and a lagging rank
are the symm backend's Triton-path tests (tests/test_symm_backend.py, tests/test_bytes_once.py),
which run every kernel reduce-scatter through it; the kernels' own tests (tests/test_kernels.py)
run the producer beside the pusher across processes.
"""

from __future__ import annotations

import os

# The ranks' Triton path runs in the interpreter, chosen before triton is first imported.
os.environ["TRITON_INTERPRET"] = "1"

import contextlib  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from test_symm_backend import BACKEND, _rs_check, _rs_problem  # noqa: E402

from tp_kernels import PeerTimeoutError, config, signals, symmetric_memory  # noqa: E402
from tp_kernels.backends import symm as symm_backend  # noqa: E402
from tp_kernels.backends import symm_gather, symm_scatter  # noqa: E402
from tp_kernels.testing import LocalWorld, RankError  # noqa: E402

WORLD, RANK, CHANNEL = 3, 0, 2
RAISED = signals.RAISED
WORD = CHANNEL * WORLD + RANK  # this rank's word in a peer's pad


def _pusher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tp_kernels symm pusher"]


def _cpu_pusher() -> tuple[symm_scatter.Pusher, list[torch.Tensor], torch.Tensor]:
    pads = [torch.zeros(4 * WORLD, dtype=torch.int32) for _ in range(WORLD)]
    pusher = symm_scatter.Pusher(torch.device("cpu"), pads, "symm test on group 'g'")
    return pusher, pads, torch.zeros(WORLD, dtype=torch.int32)


def test_pusher_copies_each_block_after_its_word_then_signals():
    """The producer fills each block, then (later) its word: each peer's slot gets the block's
    final values, and its pad word is raised; the own word and block are not the pusher's."""
    pusher, pads, progress = _cpu_pusher()
    blocks = torch.zeros(WORLD, 2, 3)
    slots = [torch.full((2, 3), -1.0) for _ in range(WORLD)]
    peers = [1, 2]

    def produce():
        for d in reversed(peers):  # block 2 completes before block 1, which the pusher takes first
            time.sleep(0.2)
            blocks[d].fill_(10.0 + d)  # a pusher that did not wait would copy the zeros
            symm_gather._store_release(progress, d)

    pushes = [(d, blocks[d], slots[d]) for d in peers]
    pusher.run(produce, pushes, progress, WORD).join()
    assert [s.unique().tolist() for s in slots] == [[-1.0], [11.0], [12.0]]
    assert [p[WORD].item() for p in pads] == [0, RAISED, RAISED]
    assert sum(int(p.count_nonzero()) for p in pads) == 2


def test_pusher_stops_when_the_producer_fails():
    """The producer's error is the call's, at once (not after the deadline), and nothing is
    pushed."""
    pusher, pads, progress = _cpu_pusher()
    slot = torch.zeros(3)

    def produce():
        raise RuntimeError("the producer failed")

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the producer failed"):
        pusher.run(produce, [(1, torch.ones(3), slot)], progress, WORD)
    assert time.monotonic() - start < 5.0
    assert slot.eq(0).all() and all(p.eq(0).all() for p in pads)
    assert _pusher_threads() == []  # joined before the error was raised


def test_pusher_waits_for_a_word_at_most_the_deadline():
    """A block whose word never comes: join raises at the deadline, naming the group and the
    peer; the block is not pushed."""
    pusher, pads, progress = _cpu_pusher()
    slot = torch.zeros(3)
    # Never raised (the start barrier cleared it, and the producer never got to it).
    saved = symmetric_memory.get_timeout()
    symmetric_memory.set_timeout(0.3)
    try:
        copies = pusher.run(lambda: None, [(2, torch.ones(3), slot)], progress, WORD)
        start = time.monotonic()
        with pytest.raises(PeerTimeoutError) as caught:
            copies.join()
    finally:
        symmetric_memory.set_timeout(saved)
    assert time.monotonic() - start < 5.0
    message = str(caught.value)
    assert caught.value.peers == [2] and "group 'g'" in message, message
    assert "block owed to peer rank 2 (progress word 2 holds 0, needed 1)" in message, message
    assert slot.eq(0).all() and all(p.eq(0).all() for p in pads)
    assert _pusher_threads() == []


# ---------------------------------------------------------------- CUDA, with fakes


class _Log(list):
    def op(self, *what):
        self.append(what)


def _fake_cuda(monkeypatch, log: _Log, waits: bool) -> symm_scatter.Pusher:
    """A Pusher on a fake CUDA device whose streams, stream waits and word writes log what is
    enqueued, in order."""

    class Stream:
        cuda_stream = 1234

        def __init__(self, device=None, priority=0, name="side"):
            self.device, self.name = device, name

        def wait_stream(self, other):
            log.op(f"{self.name} waits for {other.name}")

        def wait_event(self, event):
            log.op(f"{self.name} waits for {event}")

        def record_event(self):
            log.op(f"record event on {self.name}")
            return f"event on {self.name}"

    current = Stream(name="current")

    def waiter(stream, progress, word):
        log.op("wait", word)

    def writer(pad, word):
        log.op("write", pad, word)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(symm_scatter._StreamWaiter, "load", lambda s: waiter if waits else None)
    monkeypatch.setattr(symm_gather, "_StreamWriter", lambda: writer)
    return symm_scatter.Pusher(torch.device("cuda", 0), ["pad0", "pad1", "pad2"], "g")


class _Block:
    def __init__(self, log: _Log, name: str) -> None:
        self.log, self.name = log, name

    def copy_(self, other):
        self.log.op("copy", other.name, self.name)


@pytest.mark.parametrize("waits", [True, False])
def test_cuda_pusher_enqueues_the_cpu_pushers_steps(monkeypatch, waits):
    """With stream waits: the side stream is ordered after what the current stream held before
    the producer (the previous call), then per peer a wait on its word, the copy and the signal,
    all enqueued after the producer's launch: a stream wait ahead of the producer would stall a
    hardware queue the two streams may share, and the producer behind it would never run (the
    order before this test's change). Without them (no stream memory operations): the producer
    first, the side stream after all of it, then the copies and signals."""
    log = _Log()
    pusher = _fake_cuda(monkeypatch, log, waits)
    pushes = [(d, _Block(log, f"staging[{d}]"), _Block(log, f"slot of {d}")) for d in (1, 2)]
    copies = pusher.run(lambda: log.op("produce"), pushes, "progress", WORD)
    steps = [
        [("wait", d)] * waits
        + [("copy", f"staging[{d}]", f"slot of {d}"), ("write", f"pad{d}", WORD)]
        for d in (1, 2)
    ]
    pushed = [step for per_peer in steps for step in per_peer]
    if waits:
        before = [("record event on current",), ("produce",), ("side waits for event on current",)]
    else:
        before = [("produce",), ("side waits for current",)]
    assert log == [*before, *pushed, ("record event on side",)]
    assert copies._event == "event on side" and copies._thread is None


def test_cuda_pusher_leaves_no_wait_behind_a_producer_that_fails_to_launch(monkeypatch):
    """A producer whose launch raises on the host (out of resources, a bad argument) never
    writes its words: no stream wait may be enqueued before it, or the side stream would block
    for good, and with it every later push and the device's synchronization at exit."""
    log = _Log()
    pusher = _fake_cuda(monkeypatch, log, True)
    pushes = [(d, _Block(log, f"staging[{d}]"), _Block(log, f"slot of {d}")) for d in (1, 2)]

    def produce():
        raise RuntimeError("Triton Error [CUDA]: out of resources")

    with pytest.raises(RuntimeError, match="out of resources"):
        pusher.run(produce, pushes, "progress", WORD)
    assert not [step for step in log if step[0] in ("wait", "copy", "write")], log


def _fake_libcuda(monkeypatch, code: int) -> list:
    calls = []

    def wait(stream, address, value, flags):
        calls.append((stream, address, value, flags))
        return code

    class LibCuda:
        cuStreamWaitValue32_v2 = staticmethod(wait)

    monkeypatch.setattr(symm_scatter.ctypes, "CDLL", lambda name: LibCuda())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    return calls


class _ProbeStream:
    cuda_stream = 99
    device = torch.device("cpu")  # where the probe word is made, here

    def synchronize(self):
        # The pusher's stream is one of torch's pooled streams, which may carry others' work
        # (an unbounded wait): the probe never synchronizes the host.
        raise AssertionError("the probe synchronized the host with its stream")


def test_stream_waiter_waits_for_equality_or_reports_no_stream_memory_operations(monkeypatch):
    """The probe (a word that already holds 0) finds out once whether the driver has stream
    memory operations; a wait is cuStreamWaitValue32(stream, &progress[word], RAISED, EQ);
    another error is raised."""
    calls = _fake_libcuda(monkeypatch, symm_scatter._CUDA_ERROR_NOT_SUPPORTED)
    assert symm_scatter._StreamWaiter.load(_ProbeStream()) is None
    assert len(calls) == 1 and calls[0][2:] == (0, symm_scatter._CU_STREAM_WAIT_VALUE_EQ)

    calls = _fake_libcuda(monkeypatch, symm_scatter._CUDA_SUCCESS)
    waiter = symm_scatter._StreamWaiter.load(_ProbeStream())
    progress = torch.zeros(4, dtype=torch.int32)
    waiter(_ProbeStream(), progress, 2)
    assert calls[1] == (99, progress.data_ptr() + 8, RAISED, symm_scatter._CU_STREAM_WAIT_VALUE_EQ)

    _fake_libcuda(monkeypatch, 1)  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(RuntimeError, match="cuStreamWaitValue32 failed with CUresult 1"):
        symm_scatter._StreamWaiter.load(_ProbeStream())


def test_a_driver_without_the_wait_symbol_gets_the_no_wait_path(monkeypatch):
    """A libcuda that has neither cuStreamWaitValue32 symbol is a driver without stream waits
    (the side stream then waits for the whole producer), not an AttributeError."""

    class OldLibCuda:
        pass

    monkeypatch.setattr(symm_scatter.ctypes, "CDLL", lambda name: OldLibCuda())
    assert symm_scatter._StreamWaiter.load(_ProbeStream()) is None


# ---------------------------------------------------------------- a peer killed mid-push


def _killed_mid_push(out_dir: str) -> None:
    """The last rank dies in its pusher, between its two peers: rank 0 (its first) has its
    block and word, rank 1 only the block. Each survivor raises within two calls, naming rank 2
    (rank 1 at the end of the call, when its reduction's wait has run to its deadline; rank 0,
    whose call was complete, at the next one); a call that returns has the right values; the
    call after the error is refused."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    m, k, n = 8, 6, 5
    config.SYMM_TRITON.set(True)
    parts = _rs_problem(0, world, m, k, n, torch.float32, False)
    BACKEND.matmul_reduce_scatter(parts[rank]["a"], parts[rank]["b"], group)  # buffers set up
    symmetric_memory.set_timeout(2.0)
    victim = world - 1
    pusher = symm_backend._state(group, torch.device("cpu")).pusher
    if rank == victim:
        write, writes = pusher._write, []

        def dies_at_the_second(*args):
            writes.append(args)
            if len(writes) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            write(*args)

        pusher._write = dies_at_the_second
    report: dict = {"problems": [], "calls": 0}
    start = time.monotonic()
    for call in range(1, 3):
        parts = _rs_problem(call, world, m, k, n, torch.float32, False)
        try:
            out = BACKEND.matmul_reduce_scatter(parts[rank]["a"], parts[rank]["b"], group)
        except PeerTimeoutError as exc:
            report |= {"error": str(exc), "peers": exc.peers, "failed_call": call}
            break
        report["calls"] = call
        if problem := _rs_check(f"call {call}", out, parts, m):
            report["problems"].append(problem)
    report["waited"] = time.monotonic() - start
    try:
        BACKEND.matmul_reduce_scatter(parts[rank]["a"], parts[rank]["b"], group)
    except PeerTimeoutError as exc:
        report["next_call"] = str(exc)
    config.SYMM_TRITON.reset()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


def test_peer_killed_mid_push_is_named_at_the_deadline(tmp_path):
    with LocalWorld(3, timeout_s=60.0) as world:
        with pytest.raises(RankError, match=r"ranks \[2\] exited without answering"):
            world.run(_killed_mid_push, str(tmp_path))
    reports = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, report in enumerate(reports):
        assert report["problems"] == [], (rank, report)
        assert 2.0 <= report["waited"] < 30.0, (rank, report)
        assert "is broken by an earlier failed wait" in report["next_call"], (rank, report)
    # Rank 1 never got the dead rank's word: its first call fails, naming it.
    assert reports[1]["failed_call"] == 1 and reports[1]["calls"] == 0, reports[1]
    assert reports[1]["peers"] == [2], reports[1]
    assert "for rank(s) [2] (rank 2: its partial pushed" in reports[1]["error"], reports[1]
    # Rank 0 got the block before the rank died: that call is complete and right; its next one
    # waits at its start barrier for rank 2, and for rank 1, which stopped at its own error.
    assert reports[0]["failed_call"] == 2 and reports[0]["calls"] == 1, reports[0]
    assert "for rank(s) [1, 2] (rank 1: its arrival at the call's start" in reports[0]["error"]
