"""A process that used the fused ops exits cleanly after ``destroy_process_group()``.

On torch 2.15, 1 run in 15 of tests/_exit_rank.py's pattern aborted after its last print
(``terminate called without an active exception``): the default group outlived
``destroy_process_group()`` because a module torch imports on the first custom-op call had bound
it in its default arguments (see ``tp_kernels._compat.import_before_any_group``), and gloo's
threads met the interpreter's teardown. Each run here checks the cause on every rank, which
showed on every run before the fix (the group's threads still alive after the destroy), and the
symptom (an exit status other than 0).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tp_kernels.testing import free_port

RANK_SCRIPT = Path(__file__).with_name("_exit_rank.py")
WORLD_SIZE = 2
RUNS = 3


def _run_world() -> list[subprocess.CompletedProcess]:
    port = str(free_port())
    procs = []
    for rank in range(WORLD_SIZE):
        env = os.environ | {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD_SIZE),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(WORLD_SIZE),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(RANK_SCRIPT)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_group_is_gone_after_destroy_and_the_process_exits_cleanly():
    for run in range(RUNS):
        for rank, result in enumerate(_run_world()):
            where = f"run {run} rank {rank}"
            assert result.returncode == 0, f"{where}: exit {result.returncode}\n{result.stderr}"
            counts = result.stdout.split()
            assert counts[0] == "threads", f"{where}: {result.stdout!r}\n{result.stderr}"
            before, after = map(int, counts[1:3])
            # gloo's worker and transport threads and the store's (rank 0) go with the group.
            assert after == before, f"{where}: {before} threads before the group, {after} after"
