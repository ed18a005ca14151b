"""tp_kernels.symmetric_memory on the CPU: the shared-memory heap of tp_kernels._C across local
gloo ranks.

Every workspace test uses its own tag: the worlds live for the whole session, and so does each
rank's workspace cache. Values are small integers (exact in every dtype used), so all comparisons
are exact.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tp_kernels
from tp_kernels import PeerTimeoutError, symmetric_memory
from tp_kernels.testing import free_port

WORLD_SIZES = (2, 3)


def _segments(prefix: str) -> list[str]:
    """Entries of /dev/shm that belong to the allocation with this name prefix."""
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefix))


# The channel of a barrier that follows a look at a pad: peers that pass the look first may
# already be signalling on it, so the look skips its words.
SPARE_CHANNEL = 9
# Written and cleared by the pad-view check (a data word there, never a 0/1 signal).
PAD_VIEW_CHANNEL = 10


def _own_pad(ws: symmetric_memory.SymmWorkspace) -> list[int]:
    """This rank's signal pad, read through the address that kernels would use, except the words
    of SPARE_CHANNEL."""
    n = ws.world_size
    words = ws.num_signals * n
    pad = list((ctypes.c_int32 * words).from_address(int(ws.signal_pad_ptrs()[ws.rank])))
    return pad[: SPARE_CHANNEL * n] + pad[(SPARE_CHANNEL + 1) * n :]


def _views_and_pointers(tag: str) -> str:
    group = dist.group.WORLD
    assert symmetric_memory.symm_unavailable_reason("cpu", group=group) is None
    ws = symmetric_memory.get_workspace(group, 4096, "cpu", tag=tag)
    r, n = ws.rank, ws.world_size
    assert (r, n) == (dist.get_rank(), dist.get_world_size())
    assert ws.group is group and ws.nbytes >= 4096 and ws.device == torch.device("cpu")
    assert ws.num_signals == 9216 // (4 * n)  # CUDA symmetric memory's default pad, 4-byte words
    assert _segments(ws.shm_name_prefix) == []  # unlinked once every rank had mapped them

    def expected(rank: int) -> torch.Tensor:
        return torch.arange(128, dtype=torch.float32).view(16, 8) + 1000 * rank

    mine = ws.buffer(r, (16, 8), torch.float32)
    mine.copy_(expected(r))
    ws.barrier()
    views = [ws.buffer(p, (16, 8), torch.float32) for p in range(n)]
    for p, view in enumerate(views):
        assert torch.equal(view, expected(p)), f"rank {p}'s buffer as seen by rank {r}"
    ws.barrier()  # every rank has read before any rank overwrites
    mine.neg_()
    ws.barrier()
    for p, view in enumerate(views):  # the views taken before the write see it: zero copy
        assert torch.equal(view, -expected(p))

    # Views at a byte offset alias the same bytes, in any dtype.
    ws.buffer(r, (4, 4), torch.float16, offset=512).fill_(r + 0.5)
    ws.barrier()
    for p in range(n):
        half = ws.buffer(p, (16,), torch.float16, offset=512)
        assert torch.equal(half, torch.full((16,), p + 0.5, dtype=torch.float16))
        raw = ws.buffer(p, (32,), torch.uint8, offset=512)
        assert torch.equal(raw, half.view(torch.uint8))

    ptrs, pads = ws.buffer_ptrs(), ws.signal_pad_ptrs()
    assert ptrs.dtype == pads.dtype == torch.int64 and ptrs.shape == pads.shape == (n,)
    assert ptrs.tolist() == [v.data_ptr() for v in views]
    assert ws.buffer(n - 1, (2,), torch.int32, offset=100).data_ptr() == int(ptrs[n - 1]) + 100
    assert len(set(ptrs.tolist()) | set(pads.tolist())) == 2 * n
    peer = (r + 1) % n
    assert ctypes.c_float.from_address(int(ptrs[peer])).value == views[peer][0, 0].item()

    # Pad views (the reduce-scatter's pusher writes through them): every word of each rank's
    # pad at the address the kernels use; a word stored into the peer's view is the peer's.
    pad_views = [ws.signal_pad(p) for p in range(n)]
    assert [v.data_ptr() for v in pad_views] == pads.tolist()
    assert all(v.shape == (ws.num_signals * n,) and v.dtype == torch.int32 for v in pad_views)
    word = PAD_VIEW_CHANNEL * n + r
    pad_views[peer][word] = 100 + r
    ws.barrier()
    before = (r - 1) % n
    assert ws.signal_pad(r)[PAD_VIEW_CHANNEL * n + before].item() == 100 + before
    ws.barrier()  # read before the word goes back to zero
    pad_views[peer][word] = 0
    with pytest.raises(ValueError, match=rf"rank: expected a rank in \[0, {n}\), got -1"):
        ws.signal_pad(-1)

    with pytest.raises(ValueError, match=rf"rank: expected a rank in \[0, {n}\), got {n}"):
        ws.buffer(n, (1,), torch.float32)
    with pytest.raises(ValueError, match="offset: 2 bytes is not a multiple of the 4-byte"):
        ws.buffer(r, (1,), torch.float32, offset=2)
    with pytest.raises(ValueError, match=f"needs {ws.nbytes + 4} bytes, but the workspace holds"):
        ws.buffer(r, (ws.nbytes // 4 + 1,), torch.float32)
    with pytest.raises(ValueError, match="shape: expected non-negative ints"):
        ws.buffer(r, (2, -1), torch.float32)
    with pytest.raises(
        ValueError, match=rf"channel: expected a channel in \[0, {ws.num_signals}\)"
    ):
        ws.put_signal(peer, channel=ws.num_signals)
    with pytest.raises(ValueError, match="src_rank: expected a rank"):
        ws.wait_signal(-1)
    with pytest.raises(ValueError, match="nbytes: expected a positive number of bytes, got 0"):
        symmetric_memory.get_workspace(group, 0, "cpu", tag=tag)
    with pytest.raises(ValueError, match="timeout_s: expected a positive, finite number"):
        ws.barrier(timeout_s=0)
    ws.barrier()
    return ws.shm_name_prefix


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_peer_views_are_zero_copy(worlds, world_size):
    prefixes = worlds(world_size).run(_views_and_pointers, f"views{world_size}")
    assert len(set(prefixes)) == 1 and prefixes[0].startswith(symmetric_memory.SHM_NAME_PREFIX)
    assert _segments(prefixes[0]) == []


def _ping_pong(tag: str, rounds: int) -> list[int]:
    """A token goes around the ring 0 -> 1 -> ... -> 0 on channel 1, `rounds` times; each hop
    carries a value in the sender's buffer that the signal's release/acquire makes visible."""
    ws = symmetric_memory.get_workspace(dist.group.WORLD, 4096, "cpu", tag=tag)
    r, n = ws.rank, ws.world_size
    nxt, prv = (r + 1) % n, (r - 1) % n
    box = ws.buffer(r, (1,), torch.int64)
    seen = []
    for k in range(rounds):
        if r == 0:
            box.fill_(k * n)
            ws.put_signal(nxt, channel=1)
            ws.wait_signal(prv, channel=1)
        else:
            ws.wait_signal(prv, channel=1)
        got = ws.buffer(prv, (1,), torch.int64).item()
        seen.append(got)
        if r != 0:
            box.fill_(got + 1)
            ws.put_signal(nxt, channel=1)
    ws.barrier()
    assert not any(_own_pad(ws)), "a signal was left over after the rounds"
    ws.barrier(SPARE_CHANNEL)

    # The word that carries prv's signal on channel 2 is word 2 * n + prv of this rank's pad.
    ws.put_signal(nxt, channel=2)
    ws.barrier()
    pad = _own_pad(ws)
    assert pad[2 * n + prv] == 1 and sum(pad) == 1
    ws.wait_signal(prv, channel=2)
    assert not any(_own_pad(ws))
    with pytest.raises(PeerTimeoutError):  # consumed: it does not satisfy a second wait
        ws.wait_signal(prv, channel=2, timeout_s=0.2)
    ws.barrier(SPARE_CHANNEL)
    return seen


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_signal_ping_pong(worlds, world_size):
    rounds = 40
    seen = worlds(world_size).run(_ping_pong, f"pingpong{world_size}", rounds)
    n = world_size
    assert seen[0] == [k * n + n - 1 for k in range(rounds)]
    for r in range(1, n):
        assert seen[r] == [k * n + r - 1 for k in range(rounds)]


def _timeouts(tag: str) -> None:
    group = dist.group.WORLD
    ws = symmetric_memory.get_workspace(group, 4096, "cpu", tag=tag)
    r, n = ws.rank, ws.world_size
    label = f"group '{group.group_name}'"
    if r == 0:
        start = time.monotonic()
        with pytest.raises(PeerTimeoutError) as info:
            ws.wait_signal(1, channel=3, timeout_s=0.5)
        assert time.monotonic() - start >= 0.5  # it does not give up early
        msg = str(info.value)
        for part in (f"rank 0 of {label}", "peer rank 1", "channel 3", "timeout 0.500 s"):
            assert part in msg, (part, msg)
        error = info.value
        assert (error.peers, error.group, error.waited_s) == ([1], group.group_name, 0.5)

        # Without timeout_s, the process-wide default applies.
        previous = symmetric_memory.get_timeout()
        symmetric_memory.set_timeout(0.3)
        try:
            with pytest.raises(PeerTimeoutError, match=r"timeout 0\.300 s"):
                ws.wait_signal(n - 1, channel=5)
        finally:
            symmetric_memory.set_timeout(previous)

        # A barrier that no peer joins: its puts land, its first wait gives up.
        with pytest.raises(PeerTimeoutError, match=r"peer rank 1: barrier on channel 6"):
            ws.barrier(channel=6, timeout_s=0.3)
    if r == 1:
        # A second put waits for the first to be consumed, which rank 0 does only later.
        ws.put_signal(0, channel=4)
        with pytest.raises(PeerTimeoutError, match=r"peer rank 0: put_signal on channel 4"):
            ws.put_signal(0, channel=4, timeout_s=0.3)
    ws.barrier()
    if r == 0:
        ws.wait_signal(1, channel=4, timeout_s=10)
    else:
        ws.wait_signal(0, channel=6, timeout_s=10)  # rank 0's abandoned barrier signalled us
    ws.barrier()
    assert not any(_own_pad(ws))
    ws.barrier(SPARE_CHANNEL)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_wait_deadline_names_peer_and_channel(worlds, world_size):
    worlds(world_size).run(_timeouts, f"timeouts{world_size}")


def _growth(tag: str) -> list[str]:
    group = dist.group.WORLD
    r = dist.get_rank()
    ws1 = symmetric_memory.get_workspace(group, 1000, "cpu", tag=tag)
    assert ws1.nbytes >= 1000
    assert symmetric_memory.get_workspace(group, 10, "cpu", tag=tag) is ws1
    assert symmetric_memory.get_workspace(group, ws1.nbytes, torch.device("cpu"), tag=tag) is ws1
    old = ws1.buffer(r, (4,), torch.float32)
    old.fill_(r)
    big = 3 * ws1.nbytes + 1
    ws2 = symmetric_memory.get_workspace(group, big, "cpu", tag=tag)
    assert ws2 is not ws1 and ws2.nbytes >= big
    assert symmetric_memory.get_workspace(group, 1000, "cpu", tag=tag) is ws2
    assert symmetric_memory.get_workspace(group, big, "cpu", tag=tag) is ws2
    other = symmetric_memory.get_workspace(group, 1000, "cpu", tag=tag + "-other")
    assert other is not ws2

    words = ws2.nbytes // 4
    ws2.buffer(r, (words,), torch.int32).fill_(r + 1)
    ws2.barrier()
    for p in range(ws2.world_size):
        assert torch.all(ws2.buffer(p, (words,), torch.int32) == p + 1)
    assert torch.equal(old, torch.full((4,), float(r)))  # an old view keeps its mapping alive
    ws2.barrier()

    # A size mismatch at an allocation raises on every rank, and leaves the group usable.
    with pytest.raises(ValueError, match=r"nbytes differs across ranks \(by rank: \[4096, 8192"):
        symmetric_memory.get_workspace(group, 4096 * (r + 1), "cpu", tag=tag + "-mismatch")
    ws3 = symmetric_memory.get_workspace(group, 4096, "cpu", tag=tag + "-mismatch")
    ws3.barrier()
    prefixes = [w.shm_name_prefix for w in (ws1, ws2, other, ws3)]
    assert len(set(prefixes)) == 4
    for prefix in prefixes:
        assert _segments(prefix) == []
    return prefixes


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_growth_reallocates_and_cache_serves_smaller(worlds, world_size):
    prefixes = worlds(world_size).run(_growth, f"growth{world_size}")
    assert all(p == prefixes[0] for p in prefixes)  # every rank names the same segments


def _killed_peer_child(rank: int, port: int, results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ws = symmetric_memory.get_workspace(dist.group.WORLD, 4096, "cpu", tag="killed-peer")
    ws.barrier(timeout_s=60)
    results.put(("ready", rank, ws.shm_name_prefix))
    if rank == 1:
        time.sleep(120)  # killed by the parent long before this ends
        return
    try:
        ws.wait_signal(1, channel=0, timeout_s=2.0)
        results.put(("returned", None, None))
    except PeerTimeoutError as exc:
        results.put(("timeout", str(exc), exc.peers))
    results.close()
    results.join_thread()
    os._exit(0)  # gloo's teardown with a dead peer would only add waiting


def test_killed_peer_times_out_and_leaves_no_segment():
    ctx = mp.get_context("spawn")
    # One queue per child: a child killed while its queue's writer lock is held would block the
    # other one's reports on a shared queue.
    queues = [ctx.Queue() for _ in range(2)]
    port = free_port()
    procs = [
        ctx.Process(target=_killed_peer_child, args=(r, port, queues[r]), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        ready = [q.get(timeout=120) for q in queues]
        assert [(kind, rank) for kind, rank, _ in ready] == [("ready", 0), ("ready", 1)]
        prefix = ready[0][2]
        assert ready[1][2] == prefix and _segments(prefix) == []
        procs[1].kill()  # rank 0 is waiting on its signal meanwhile
        procs[1].join(timeout=10)
        assert procs[1].exitcode == -signal.SIGKILL
        kind, msg, peers = queues[0].get(timeout=60)
        assert kind == "timeout", msg
        assert peers == [1]
        assert "peer rank 1" in msg and "channel 0" in msg and "timeout 2.000 s" in msg
        procs[0].join(timeout=30)
        assert procs[0].exitcode == 0
        assert _segments(prefix) == []
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


def test_timeout_setting():
    previous = symmetric_memory.get_timeout()
    try:
        symmetric_memory.set_timeout(12.5)
        assert symmetric_memory.get_timeout() == 12.5
        for bad in (0, -1.0, float("inf"), float("nan")):
            with pytest.raises(ValueError, match="seconds: expected a positive, finite number"):
                symmetric_memory.set_timeout(bad)
        with pytest.raises(TypeError, match="seconds: expected a number of seconds, got '3'"):
            symmetric_memory.set_timeout("3")
        assert symmetric_memory.get_timeout() == 12.5
    finally:
        symmetric_memory.set_timeout(previous)


def test_timeout_from_environment():
    script = (
        "from tp_kernels import symmetric_memory; print(symmetric_memory.get_timeout())\n"
        "try:\n    symmetric_memory.set_timeout(-2)\n"
        "except ValueError as e:\n    print('refused')\n"
    )
    env = dict(os.environ, TP_KERNELS_TIMEOUT_S="7.5")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["7.5", "refused"]
    env["TP_KERNELS_TIMEOUT_S"] = "soon"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "TP_KERNELS_TIMEOUT_S: expected a number of seconds, got 'soon'" in out.stderr


def test_unavailable_reasons():
    assert symmetric_memory.symm_unavailable_reason("cpu") is None
    assert "not 'meta'" in symmetric_memory.symm_unavailable_reason(torch.device("meta"))
    if not torch.cuda.is_available():
        assert "torch.cuda.is_available() is False" in symmetric_memory.symm_unavailable_reason(
            "cuda"
        )
    with pytest.raises(ValueError, match="device: not a device: 'gpu0'"):
        symmetric_memory.symm_unavailable_reason("gpu0")
    with pytest.raises(TypeError, match="group: expected a torch.distributed.ProcessGroup"):
        symmetric_memory.get_workspace(None, 4096, "cpu")


def test_package_imports_without_the_extension():
    script = (
        "import sys; sys.modules['tp_kernels._C'] = None\n"
        "import tp_kernels; from tp_kernels import symmetric_memory\n"
        "print(symmetric_memory.symm_unavailable_reason('cpu'))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "the native extension tp_kernels._C is not available" in out.stdout


def test_extension_is_importable_after_install():
    out = subprocess.run(
        [sys.executable, "-c", "import tp_kernels._C as C; print(C.__file__)"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    built = Path(out.stdout.strip())
    assert built.parent == Path(tp_kernels.__file__).parent and built.name.startswith("_C")


def _mapped(prefix: str) -> int:
    """How many of this process's mappings come from the allocation with this name prefix."""
    with open("/proc/self/maps") as maps:
        return sum(f"/dev/shm/{prefix}" in line for line in maps)


def _teardown_with_group() -> tuple[int, int, bool]:
    sub = dist.new_group(list(range(dist.get_world_size())))
    ws = symmetric_memory.get_workspace(sub, 4096, "cpu", tag="teardown")
    prefix = ws.shm_name_prefix
    before = _mapped(prefix)
    ws_ref = weakref.ref(ws)
    del ws
    dist.destroy_process_group(sub)
    del sub
    gc.collect()
    return before, _mapped(prefix), ws_ref() is None


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_destroying_the_group_unmaps_its_workspaces(worlds, world_size):
    for before, after, gone in worlds(world_size).run(_teardown_with_group):
        assert (before, after, gone) == (world_size, 0, True)
