"""The kernels' tile configs are chosen on each rank alone, kept on disk, and no peer's deadline
counts a rank's compiling and tuning.

:func:`tp_kernels.kernels.tuning.choose` is driven with stand-in launches (the interpreter has one
config, a GPU several): it compiles and times every candidate, keeps the fastest in memory and
in the tuning file, skips a config the device cannot run, and a new process starts from the
file. Across processes, one rank of the ``symm`` backend's Triton path tunes far longer than the
deadline on a shape's first call (an injected delay): its peers wait for it and no wait times
out; the control, the same delay with the backend's :func:`tp_kernels.deadline.local_work`
taken away (the kernels tuned where ``triton.autotune`` tuned them, inside the call), times out.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time

import pytest
import torch
import torch.distributed as dist
import triton
from triton.runtime.errors import OutOfResources

from tp_kernels import PeerTimeoutError, config, deadline
from tp_kernels.backends import symm as symm_backend
from tp_kernels.kernels import tuning

CPU = torch.device("cpu")
# Each stand-in config's launch takes this long: the tuner must find the fastest.
SECONDS = {16: 0.004, 32: 0.001, 64: 0.002}


def _configs(*blocks: int) -> list[triton.Config]:
    return [triton.Config({"BLOCK": b}, num_warps=4, num_stages=3) for b in blocks]


@pytest.fixture
def tuning_file(tmp_path):
    config.TUNING_CACHE.set(str(tmp_path))
    tuning.forget()
    yield tmp_path
    config.TUNING_CACHE.reset()
    tuning.forget()


def test_the_fastest_config_is_chosen_once_and_kept_on_disk(tuning_file, caplog):
    runs: list[int] = []

    def run(c: triton.Config) -> None:
        runs.append(c.kwargs["BLOCK"])
        time.sleep(SECONDS[c.kwargs["BLOCK"]])

    caplog.set_level(logging.INFO, logger="tp_kernels")
    chosen = tuning.choose("gemm", (7, "bf16"), _configs(16, 32, 64), run, CPU)
    assert chosen.kwargs == {"BLOCK": 32}
    # One compiling run each, then the timed ones.
    assert sorted(runs) == sorted([16, 32, 64] * (1 + tuning._TIMED_RUNS))
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "tuned, compiled 3 config(s)" in caplog.records[0].message
    assert "BLOCK=32" in caplog.records[0].message

    # Asked again in this process: no run, no log.
    runs.clear()
    assert tuning.choose("gemm", (7, "bf16"), _configs(16, 32, 64), run, CPU) is chosen
    assert runs == [] and len(caplog.records) == 1

    # A new process (the memory forgotten) starts from the file: it compiles the choice only.
    (stored,) = tuning_file.glob("*.json")
    assert list(json.loads(stored.read_text()).values()) == [tuning._describe(chosen)]
    tuning.forget()
    again = tuning.choose("gemm", (7, "bf16"), _configs(16, 32, 64), run, CPU)
    assert again.kwargs == {"BLOCK": 32} and runs == [32]
    assert "from the tuning cache" in caplog.records[-1].message

    # Another shape is tuned anew.
    runs.clear()
    tuning.choose("gemm", (8, "bf16"), _configs(16, 32, 64), run, CPU)
    assert len(runs) == 3 * (1 + tuning._TIMED_RUNS)


def test_a_config_the_device_cannot_run_is_skipped(tuning_file):
    def run(c: triton.Config) -> None:
        if c.kwargs["BLOCK"] == 32:
            raise OutOfResources(300_000, 232_448, "shared memory")
        time.sleep(SECONDS[c.kwargs["BLOCK"]])

    assert tuning.choose("gemm", (1,), _configs(16, 32, 64), run, CPU).kwargs == {"BLOCK": 64}

    def never(c: triton.Config) -> None:
        raise OutOfResources(300_000, 232_448, "shared memory")

    with pytest.raises(RuntimeError, match=r"gemm \(2,\): none of its 2 tile configs fits"):
        tuning.choose("gemm", (2,), _configs(16, 32), never, CPU)


def test_without_a_folder_nothing_is_written(tmp_path):
    config.TUNING_CACHE.set(None)
    tuning.forget()
    try:
        tuning.choose("gemm", (3,), _configs(16, 32), lambda c: None, CPU)
    finally:
        config.TUNING_CACHE.reset()
        tuning.forget()
    assert list(tmp_path.iterdir()) == []


def test_the_interpreter_has_one_config_and_runs_nothing_to_choose_it():
    tuning.forget()

    def run(c: triton.Config) -> None:
        raise AssertionError("the interpreter compiles nothing: no run to choose its one config")

    (only,) = _configs(16)
    assert tuning.choose("gemm", (4,), [only], run, CPU) is only


# ---------------------------------------------------------------- across processes

# The deadline of every wait in the runs below, and how long the slow rank tunes: longer.
DEADLINE_S = 2.0
SLOW_TUNING_S = 5.0


def _calls_with_a_slow_tuning_rank(slow_rank: int, *, local_work: bool) -> dict:
    """Two all-gather-matmuls and two matmul-reduce-scatters of one shape each on the symm
    backend's Triton path, rank ``slow_rank``'s tuning of each new shape taking
    :data:`SLOW_TUNING_S` (past the deadline). ``local_work=False`` is the control: the
    backend's ``deadline.local_work`` is bypassed, as if tuning ran inside the call. Returns
    the error (if any) and whether the results are right."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    choose, work = tuning.choose, deadline.local_work

    def slow_choose(*args, **kwargs):
        if rank == slow_rank and tuning._chosen.get(args[:2]) is None:
            time.sleep(SLOW_TUNING_S)
        return choose(*args, **kwargs)

    tuning.forget()
    tuning.choose = slow_choose
    if not local_work:
        deadline.local_work = lambda group, what, make: make()
    config.SYMM_TRITON.set(True)
    deadline.set_timeout(DEADLINE_S)
    report: dict = {"error": None, "right": []}
    try:
        gen = torch.Generator().manual_seed(7)
        shards = [torch.randn(5, 12, generator=gen) for _ in range(world)]
        b = torch.randn(12, 9, generator=gen)
        parts = [torch.randn(world * 5, 12, generator=gen) for _ in range(world)]
        for _ in range(2):
            _, (out,) = symm_backend.BACKEND.all_gather_matmul(
                shards[rank], [b], group, return_a=False
            )
            report["right"].append(torch.allclose(out, torch.cat(shards) @ b, atol=1e-5))
            got = symm_backend.BACKEND.matmul_reduce_scatter(parts[rank], b, group)
            want = sum(p @ b for p in parts)[rank * 5 : (rank + 1) * 5]
            report["right"].append(torch.allclose(got, want, atol=1e-4))
    except PeerTimeoutError as exc:
        report["error"] = str(exc)
    finally:
        tuning.choose, deadline.local_work = choose, work
        config.SYMM_TRITON.reset()
        config.TIMEOUT_S.reset()
        with contextlib.suppress(Exception):
            dist.destroy_process_group(group)
    return report


def test_a_rank_that_tunes_past_the_deadline_times_out_no_peer(worlds):
    """Rank 1 tunes each new shape for longer than the deadline; rank 0, whose tuning is quick,
    waits for it without counting it (it beats on the store), and every result is right."""
    for rank, report in enumerate(
        worlds(2).run(_calls_with_a_slow_tuning_rank, 1, local_work=True)
    ):
        assert report["error"] is None, (rank, report)
        assert report["right"] == [True] * 4, (rank, report)


def test_control_tuning_inside_the_call_times_out_the_peer(worlds):
    """The control: the same slow tuning inside the call (no local_work) runs rank 0's start
    barrier past its deadline while rank 1 tunes."""
    reports = worlds(2).run(_calls_with_a_slow_tuning_rank, 1, local_work=False)
    assert "waited" in (reports[0]["error"] or ""), reports
