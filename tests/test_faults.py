"""Fault injection: a rank that misbehaves never leaves its peers waiting past the deadline.

Every scenario runs on a fresh group in a world of its own whose deadline is ``DEADLINE_S``. The
last rank is the *victim*: it never calls, is stopped (SIGSTOP past the deadline) or killed in
forward, in backward or in symmetric-memory setup, passes a bad group or dtype, or runs with
different settings. Every rank reports what it raised and after how long, whether a further call
on the same group is refused at once, and whether a new group then computes the right values;
/dev/shm must hold no segment of ours afterwards.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

import tp_kernels as tpk
from tp_kernels import config, deadline, symmetric_memory
from tp_kernels.backends import schedule
from tp_kernels.testing import LocalWorld

DEADLINE_S = 1.5
# A survivor gives up at the deadline, then waits the roll call's grace for its peers; the rest
# is the time a loaded two-core machine may take to schedule three ranks.
GRACE_S = min(2.0, DEADLINE_S)
MARGIN_S = 3.0
BACKENDS = ["reference", "pipelined", "symm", "auto"]
WORLD_SIZES = [2, 3]


@pytest.fixture(scope="module")
def fault_worlds():
    made: dict[int, LocalWorld] = {}

    def get(world_size: int) -> LocalWorld:
        if world_size not in made:
            env = {"TP_KERNELS_TIMEOUT_S": str(DEADLINE_S)}
            made[world_size] = LocalWorld(world_size, timeout_s=120.0, env=env)
        return made[world_size]

    yield get
    for world in made.values():
        world.close()


# --- on the ranks ---------------------------------------------------------------------------------


def _inputs(world: int, rank: int, dtype: torch.dtype = torch.float32):
    """A two-layer sequence-parallel block's operands: x [2W, 4] (rank r holds rows 2r, 2r+1),
    w1 [4, 3], w2 [3, 5], the same on every rank."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2 * world, 4, generator=gen)
    w1, w2 = torch.randn(4, 3, generator=gen), torch.randn(3, 5, generator=gen)
    shard = x[2 * rank : 2 * rank + 2].to(dtype).requires_grad_(dtype.is_floating_point)
    return x, shard, w1.requires_grad_(), w2.requires_grad_()


def _block(group, backend: str, *, dtype=torch.float32, before_rs=None, in_backward=None):
    """y = reduce_scatter(all_gather(x) @ w1 @ w2) and its backward; returns y (this rank's rows
    of W * x @ w1 @ w2). ``before_rs`` runs between the two forward ops, ``in_backward`` between
    the two backward ops."""
    world, rank = dist.get_world_size(), dist.get_rank()
    _, shard, w1, w2 = _inputs(world, rank, dtype)
    _, (h,) = tpk.all_gather_matmul(shard, [w1], 0, group, backend=backend)
    if in_backward is not None:
        h.register_hook(lambda grad: in_backward())
    if before_rs is not None:
        before_rs()
    y = tpk.matmul_reduce_scatter(h, w2, 0, group, backend=backend)
    y.sum().backward()
    return y.detach()


def _expected(world: int, rank: int) -> torch.Tensor:
    x, _, w1, w2 = _inputs(world, rank)
    return (world * (x @ w1 @ w2))[2 * rank : 2 * rank + 2].detach()


def _stop() -> None:
    """SIGSTOP this process for longer than the deadline; a child sends the SIGCONT."""
    cont = f"sleep {DEADLINE_S + 1.0}; kill -CONT {os.getpid()}"
    subprocess.Popen(["sh", "-c", cont], start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def _kill() -> None:
    os._exit(17)


class _FailingMatmul:
    """Stands in for ``torch`` in the schedule: its ``mm`` raises, as an out-of-memory would,
    after the transfers of the call were posted."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def mm(*args, **kwargs):
        raise RuntimeError("injected matmul failure")


def _fail_in_setup(step_name: str, act, *, before: bool = False) -> None:
    """Make this rank ``act`` (stop or die) in symmetric-memory setup, right after doing the step
    whose description contains ``step_name`` ("create" or "map") and before telling its peers,
    or, ``before=True``, instead of doing it."""
    original = symmetric_memory._on_every_rank

    def patched(group, step, what):
        if step_name in what:
            if not before:
                step()
            act()
            return original(group, lambda: None, what)
        return original(group, step, what)

    symmetric_memory._on_every_rank = patched


def _victim_part(fault: str, backend: str, group, victim: bool) -> None:
    """The scenario up to its fault: what every rank calls, and what the victim does instead."""
    act = _stop if fault.startswith("stop") else _kill
    if fault == "never_calls":
        if not victim:
            _block(group, backend)
    elif fault == "never_calls_in_transfer":
        # The first call on a group always agrees; the second, with checks off, goes straight
        # to the transfers (or signals), where the survivors then wait.
        _block(group, backend)
        config.CHECK_CONSISTENCY.set(False)
        if not victim:
            _block(group, backend)
    elif fault in ("stop_forward", "kill_forward"):
        _block(group, backend, before_rs=act if victim else None)
    elif fault in ("stop_backward", "kill_backward"):
        _block(group, backend, in_backward=act if victim else None)
    elif fault in ("stop_setup_create", "kill_setup_create", "kill_setup_map"):
        if victim:
            _fail_in_setup(fault.rsplit("_", 1)[1], act)
        _block(group, "symm")
    elif fault == "kill_setup_before_map":
        if victim:
            _fail_in_setup("map", act, before=True)
        _block(group, "symm")
    elif fault == "kill_growth":
        _block(group, "symm")
        if victim:
            _fail_in_setup("create", act)
        _, shard, w1, _ = _inputs(dist.get_world_size(), dist.get_rank())
        tpk.all_gather_matmul(shard.detach().repeat(1024, 1), [w1], 0, group, backend="symm")
    elif fault == "bad_group":
        _block("no-such-group" if victim else group, backend)
    elif fault == "bad_group_then_next":
        if victim:
            with pytest.raises(ValueError, match="no-such-group"):
                _block("no-such-group", backend)
            # Its next call must not pair with the call its peers are still in.
        _block(group, backend)
    elif fault == "int_dtype":
        _block(group, backend, dtype=torch.int64 if victim else torch.float32)
    elif fault == "backend_differs":
        # (auto never takes pipelined for blocks this small)
        other = "reference" if backend == "pipelined" else "pipelined"
        _block(group, other if victim else backend)
    elif fault == "consistency_differs":
        config.CHECK_CONSISTENCY.set(not victim)
        _block(group, backend)
    elif fault == "chunks_differ":
        tpk.backends.pipelined.set_chunks(3 if victim else 2)
        _block(group, backend)
    elif fault == "late_failure":
        schedule.torch = _FailingMatmul()  # on every rank: every rank raises after posting
        _block(group, backend)
    else:
        raise ValueError(f"unknown fault {fault!r}")


def _fault(fault: str, backend: str) -> dict:
    """Run one scenario on this rank and report: ``error`` (type and message, or None),
    ``timeout`` (a PeerTimeoutError), ``elapsed`` seconds, ``again`` (a second call on the
    group: "ok", or what it raised and ``again_s``), ``fresh`` (a new group's result error)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    victim = rank == world - 1
    saved_on_every_rank = symmetric_memory._on_every_rank
    group = dist.new_group(list(range(world)))
    report: dict = {"rank": rank, "victim": victim, "error": None, "timeout": False}
    start = time.monotonic()
    try:
        _victim_part(fault, backend, group, victim)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["timeout"] = isinstance(exc, deadline.PeerTimeoutError)
    finally:
        report["elapsed"] = time.monotonic() - start
        schedule.torch = torch
        symmetric_memory._on_every_rank = saved_on_every_rank
        config.PIPELINE_CHUNKS.reset()
        config.CHECK_CONSISTENCY.reset()
    if report["timeout"] or fault == "late_failure":
        start = time.monotonic()
        try:
            torch.testing.assert_close(_block(group, backend), _expected(world, rank))
            report["again"] = "ok"
        except Exception as exc:
            report["again"] = f"{type(exc).__name__}: {exc}"
        report["again_s"] = time.monotonic() - start
    if not fault.startswith("kill"):
        fresh = dist.new_group(list(range(world)))
        got = _block(fresh, backend)
        report["fresh"] = float((got - _expected(world, rank)).abs().max())
    return report


# --- the checks -----------------------------------------------------------------------------------


def _shm_left() -> list[str]:
    return glob.glob(f"/dev/shm/{symmetric_memory.SHM_NAME_PREFIX}*")


def _run(world: LocalWorld, fault: str, backend: str) -> list[dict | None]:
    # Segments that were there before are another process's (a test session beside this one
    # keeps its worlds' groups, and their segments, alive): only this run's may not outlive it.
    before = set(_shm_left())
    reports = world.run(_fault, fault, backend, may_exit=fault.startswith("kill"))
    left = sorted(set(_shm_left()) - before)
    assert left == [], f"{fault}: segments left in /dev/shm: {left}"
    return reports


def _check_timed_out(report: dict, fault: str, phase: str, peer: int, *, waited: float) -> None:
    """A survivor of a deadline fault: PeerTimeoutError naming the phase and the peer, within
    the deadline plus the margin, and the group refused at once afterwards."""
    assert report["timeout"], report
    assert f"({phase}" in report["error"], report["error"]
    assert f"[{peer}]" in report["error"] or f", {peer}]" in report["error"], report["error"]
    assert report["elapsed"] < waited + GRACE_S + MARGIN_S, report
    assert report["again"].startswith("PeerTimeoutError") and "is broken" in report["again"]
    assert report["again_s"] < 0.5, report


def _check_fresh(reports: list[dict | None]) -> None:
    for report in reports:
        assert report is None or report["fresh"] < 1e-4, report


# Where the survivors wait when the victim never comes, by backend (checks off after the first
# call): the all-gather's first collective, the pipelined transfers, the symm signal waits.
_TRANSFER_PHASE = {
    "reference": "all-gather",
    "pipelined": "transfer",
    "symm": "signal wait",
    "auto": "",
}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_that_never_calls(fault_worlds, world_size, backend):
    reports = _run(fault_worlds(world_size), "never_calls", backend)
    victim = world_size - 1
    for report in reports[:victim]:
        _check_timed_out(report, "never_calls", "forward agreement", victim, waited=DEADLINE_S)
        assert "of group '" in report["error"], report["error"]
    assert reports[victim]["error"] is None
    _check_fresh(reports)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_that_never_calls_past_the_agreement(fault_worlds, world_size, backend):
    reports = _run(fault_worlds(world_size), "never_calls_in_transfer", backend)
    victim = world_size - 1
    for report in reports[:victim]:
        phase = f"forward {_TRANSFER_PHASE[backend]}".rstrip()
        _check_timed_out(report, "never_calls", phase, victim, waited=DEADLINE_S)
    _check_fresh(reports)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_rank_stopped_past_the_deadline(fault_worlds, world_size, backend, where):
    reports = _run(fault_worlds(world_size), f"stop_{where}", backend)
    victim = world_size - 1
    for report in reports[:victim]:
        _check_timed_out(report, f"stop_{where}", where, victim, waited=DEADLINE_S)
    # The victim, resumed, either finds what its peers posted before they gave up (and
    # finishes), or finds them gone and ends at its own deadline too, naming them.
    stopped = reports[victim]
    assert stopped["error"] is None or stopped["timeout"], stopped
    assert stopped["elapsed"] < (DEADLINE_S + 1.0) + DEADLINE_S + GRACE_S + MARGIN_S, stopped
    _check_fresh(reports)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(
    ("fault", "backend", "phase"),
    [
        ("kill_forward", "pipelined", "forward"),
        ("kill_backward", "reference", "backward"),
        ("kill_setup_create", "symm", "forward symmetric memory setup"),
        ("kill_setup_before_map", "symm", "forward symmetric memory setup"),
        ("kill_setup_map", "symm", "forward symmetric memory setup"),
        ("kill_growth", "symm", "forward symmetric memory setup"),
    ],
)
def test_rank_killed(fault_worlds, world_size, fault, backend, phase):
    """A dead peer's connection closes: the survivors raise at once (no need to wait for the
    deadline), name it, and leave no segment of the dead rank behind."""
    reports = _run(fault_worlds(world_size), fault, backend)
    victim = world_size - 1
    assert reports[victim] is None  # it exited
    for report in reports[:victim]:
        _check_timed_out(report, fault, phase, victim, waited=DEADLINE_S)


def test_rank_stopped_in_setup(fault_worlds):
    reports = _run(fault_worlds(2), "stop_setup_create", "symm")
    _check_timed_out(
        reports[0], "stop_setup", "forward symmetric memory setup", 1, waited=DEADLINE_S
    )
    assert reports[1]["timeout"], reports[1]
    _check_fresh(reports)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bad_group_on_one_rank(fault_worlds, world_size):
    reports = _run(fault_worlds(world_size), "bad_group", "pipelined")
    victim = world_size - 1
    for report in reports[:victim]:
        _check_timed_out(report, "bad_group", "forward agreement", victim, waited=DEADLINE_S)
    assert reports[victim]["error"].startswith("ValueError: all_gather_matmul: group 'no-such")
    _check_fresh(reports)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bad_group_then_next_call_does_not_pair(fault_worlds, world_size):
    """The victim's next call meets its peers' pending agreement: a mismatch on every rank that
    says why, not a silent pairing with the wrong call's data."""
    reports = _run(fault_worlds(world_size), "bad_group_then_next", "pipelined")
    for report in reports:
        assert report["error"].startswith("ValueError: all_gather_matmul: the ranks of group")
        assert "failed before it knew its group" in report["error"], report
        assert report["elapsed"] < DEADLINE_S, report
    _check_fresh(reports)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("fault", "victim_says", "peers_say"),
    [
        ("int_dtype", "ValueError", "a_shard has dtype torch.int64; the fused ops take floating"),
        ("backend_differs", "ValueError", "called with different arguments"),
        ("consistency_differs", "ValueError", "consistency_checks=False"),
        ("chunks_differ", "ValueError", "chunks=3"),
    ],
)
def test_refused_together_before_communicating(
    fault_worlds, world_size, backend, fault, victim_says, peers_say
):
    reports = _run(fault_worlds(world_size), fault, backend)
    for report in reports:
        assert report["error"] is not None and not report["timeout"], report
        assert peers_say in report["error"], report
        assert report["elapsed"] < DEADLINE_S, report
    assert reports[-1]["error"].startswith(victim_says), reports[-1]
    _check_fresh(reports)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend", ["pipelined", "symm"])
def test_failure_after_posting_leaves_the_group_usable(fault_worlds, world_size, backend):
    """Every rank's matmul raises after its transfers (or signals) were posted: the call drains
    them, so the next call on the same group pairs its own and computes the right values."""
    reports = _run(fault_worlds(world_size), "late_failure", backend)
    for report in reports:
        assert report["error"] == "RuntimeError: injected matmul failure", report
        assert report["again"] == "ok", report
        assert report["again_s"] < DEADLINE_S, report
    _check_fresh(reports)
