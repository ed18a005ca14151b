"""The Promela model of the symm backend's signal protocol (tp_kernels/backends/symm_protocol.pml)
verified by spin: safety (every read sees its own call's data, nothing is overwritten while
read, no unconsumed signal is stored to again) and no invalid end state (deadlock), for 2 and 3
ranks, eagerly and replayed as a CUDA graph; and the old protocol's host epochs (the
HOST_EPOCHS mutation) shown to read stale data under replay.

Needs ``spin`` and ``gcc``: skipped without them, except under CI (``CI`` set), which installs
spin and so fails instead."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

MODEL = Path(__file__).resolve().parent.parent / "tp_kernels" / "backends" / "symm_protocol.pml"

# Recorded call sequences: bit i set = call i is a matmul-reduce-scatter, else an
# all-gather-matmul (the model's SEQ).
AG_RS_AG = 0b010
RS_AG_RS = 0b101
AG_AG_RS_RS_AG = 0b01100  # every pair of consecutive kinds: AG-AG, AG-RS, RS-RS, RS-AG

# name: (ranks W, chunks per shard C, calls recorded K, SEQ, replays R)
CONFIGS = {
    "W2-eager": (2, 2, 5, AG_AG_RS_RS_AG, 1),
    "W2-replay": (2, 2, 3, AG_RS_AG, 2),
    "W3-eager": (3, 1, 5, AG_AG_RS_RS_AG, 1),
    "W3-replay": (3, 1, 3, AG_RS_AG, 2),
}


def _tools() -> None:
    missing = [tool for tool in ("spin", "gcc") if shutil.which(tool) is None]
    if missing:
        reason = f"{' and '.join(missing)} not on PATH (apt-get install spin gcc)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI installs spin, so this is a CI setup error")
        pytest.skip(reason)


def _verify(tmp_path: Path, w: int, c: int, k: int, seq: int, r: int, *extra: str) -> str:
    """spin -a, gcc -O2 -DSAFETY, ./pan on the model for one configuration; pan's report."""
    _tools()
    model = tmp_path / MODEL.name
    shutil.copyfile(MODEL, model)
    defines = [f"-DW={w}", f"-DC={c}", f"-DK={k}", f"-DSEQ={seq}", f"-DR={r}", *extra]
    run = lambda *cmd: subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    generated = run("spin", "-a", *defines, model.name)
    assert generated.returncode == 0 and (tmp_path / "pan.c").exists(), (
        generated.stdout + generated.stderr
    )
    # COLLAPSE: the W=3 state spaces (about 2 million states) in about 120 MB.
    compiled = run("gcc", "-O2", "-DSAFETY", "-DCOLLAPSE", "-w", "-o", "pan", "pan.c")
    assert compiled.returncode == 0, compiled.stderr
    checked = run("./pan", "-m200000", "-w22")
    report = checked.stdout + checked.stderr
    # A search cut short (depth, memory) would prove nothing.
    assert "max search depth too small" not in report, report
    assert "out of memory" not in report.lower(), report
    assert re.search(r"errors: \d+", report), report
    return report


def _errors(report: str) -> int:
    return int(re.search(r"errors: (\d+)", report).group(1))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_protocol_holds(tmp_path: Path, name: str) -> None:
    report = _verify(tmp_path, *CONFIGS[name])
    assert _errors(report) == 0, report
    assert "assertion violated" not in report, report
    assert "invalid end state (" not in report, report
    # the search covered both checks
    assert re.search(r"assertion violations\s+\+", report), report
    assert re.search(r"invalid end states\s+\+", report), report


@pytest.mark.parametrize(
    ("w", "c", "seq"),
    [(2, 2, AG_RS_AG), (2, 2, RS_AG_RS)],
    ids=["W2-AG-RS-AG", "W2-RS-AG-RS"],
)
def test_host_epochs_fail_under_replay(tmp_path: Path, w: int, c: int, seq: int) -> None:
    """Host epochs: the second replay's call waits for the epoch its word still holds from the
    first, and reads the first replay's data (AG-RS-AG: the pusher's staging block; RS-AG-RS: a
    peer's shard behind a stale barrier B)."""
    report = _verify(tmp_path, w, c, 3, seq, 2, "-DHOST_EPOCHS")
    assert _errors(report) >= 1, report
    assert "assertion violated" in report, report


def test_host_epochs_hold_eagerly(tmp_path: Path) -> None:
    """The same mutation without replay holds: the stale reads are replay's alone."""
    report = _verify(tmp_path, 2, 2, 5, AG_AG_RS_RS_AG, 1, "-DHOST_EPOCHS")
    assert _errors(report) == 0, report
