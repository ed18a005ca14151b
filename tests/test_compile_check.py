"""``python -m tp_kernels.kernels.compile_check``: the offline sm_90 compile of the kernels and the
PTX checks. The whole variant set runs in ``.ci/run`` (minutes); here, the checker itself and a
few variants, in fresh interpreters without TRITON_INTERPRET."""

from __future__ import annotations

import os

# The session's kernels run in the interpreter, chosen before triton is first imported (importing
# compile_check imports tp_kernels.kernels); the compilations below run in fresh interpreters.
os.environ["TRITON_INTERPRET"] = "1"

import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from _processes import run_without_interpreter  # noqa: E402

from tp_kernels.kernels import compile_check  # noqa: E402


def test_check_ptx_names_what_is_missing():
    ptx = "ld.acquire.sys.global.b32 %v, [%rd1];\nmov.u64 %t0, %globaltimer;"
    assert compile_check.check_ptx(ptx, compile_check.WAIT_PATTERNS) == []
    missing = compile_check.check_ptx("ld.global.b32 %v, [%rd1];", compile_check.WAIT_PATTERNS)
    assert missing == [what for _, what in compile_check.WAIT_PATTERNS]
    relaxed = "atom.global.gpu.relaxed.exch.b32 %r5, [ %rd5 + 0 ], %r3;"
    assert compile_check.check_ptx(relaxed, compile_check.SIGNAL_PATTERNS) != []


def test_waiting_and_signalling_kernels_compile_for_sm_90(tmp_path):
    """The barrier (signals and waits; with and without clearing the words), the reduction
    (waits), and a 16-bit all-gather consumer whose B goes through pointers (its first launch
    waits on progress words; both read A with TMA) compile for sm_90 and pass their checks;
    every PTX file is written."""
    only = ("barrier", "reduce_slots[bf16,1024,w4]", "ag_matmul[bf16,B=ptr")
    args = ["--out", str(tmp_path), "--jobs", "1"] + [x for o in only for x in ("--only", o)]
    done = run_without_interpreter(
        f"""
        from tp_kernels.kernels import compile_check
        raise SystemExit(compile_check.main({args!r}))
        """
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "all 5 variants ok for sm_90" in done.stdout, done.stdout
    # Resources from Triton's own ptxas, per variant: registers per thread and spilled bytes.
    usage = re.findall(r"regs +(\d+) +spills +(\d+) B", done.stdout)
    assert len(usage) == 5 and all(int(regs) > 0 for regs, _ in usage), done.stdout
    written = sorted(p.name for p in Path(tmp_path, "sm_90").iterdir())
    assert "barrier_clear_.ptx" in written and len(written) == 5, written
    ptx = Path(tmp_path, "sm_90", "barrier_clear_.ptx").read_text()
    # The peer's word raised at system scope, after the own slot words are cleared.
    assert "atom.global.sys.release.exch" in ptx and "atom.global.sys.relaxed.exch" in ptx
    # B is read through pointers, so the TMA copies are A's; the waiting launch fences the
    # async proxy after its acquire, the other launch neither waits nor fences.
    consumers = {p.name: p.read_text() for p in Path(tmp_path, "sm_90").glob("ag_matmul*")}
    (waiting,) = [ptx for name, ptx in consumers.items() if ",wait" in name]
    (reading,) = [ptx for name, ptx in consumers.items() if ",wait" not in name]
    assert "cp.async.bulk.tensor" in waiting and "cp.async.bulk.tensor" in reading
    assert "ld.acquire.sys" in waiting and "fence.proxy.async.global" in waiting
    assert "ld.acquire.sys" not in reading and "fence.proxy.async.global" not in reading


def test_a_variant_that_lacks_a_pattern_fails_by_name(tmp_path):
    done = run_without_interpreter(
        f"""
        from tp_kernels.kernels import compile_check
        compile_check.SIGNAL_PATTERNS = (("wgmma", "a pattern no signal has"),)
        raise SystemExit(compile_check.main(
            ["--out", {str(tmp_path)!r}, "--jobs", "1", "--only", "barrier"]
        ))
        """
    )
    assert done.returncode == 1, done.stdout
    assert "barrier" in done.stderr and "FAILED" in done.stderr, done.stderr
    assert "PTX lacks a pattern no signal has" in done.stdout, done.stdout


def test_interpreter_mode_is_refused():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-m", "tp_kernels.kernels.compile_check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "TRITON_INTERPRET=1 is set" in done.stderr, done.stderr
