"""``python -m tp_kernels.bench.overlap`` on a CPU: its ``--device cpu`` run in this process (local
peers, the interpreter, tiny shapes), the efficiency arithmetic on fabricated medians, a wrong
GEMM, copies that never land and a spinner that did not run reported as FAIL, the spinner's
check and its sm_90 compile, MPS mode start to stop (a stand-in control program, 2 gloo ranks
on CPU tensors over the CPU symmetric heap: the two-rank path a GPU runs under MPS), and its
arguments.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _processes import run_without_interpreter

from tp_kernels.backends import symm_gather
from tp_kernels.bench import overlap as ov
from tp_kernels.bench.driver import MpsDaemon
from tp_kernels.bench.overlap_rows import OPS, ROWS, Setup

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--device", "cpu", "--copy-repeat", "1", "2"]
NUMBER = re.compile(r"^-?\d+\.\d+$")


def _tables(out: str) -> dict[tuple[str, int], dict[str, list[str]]]:
    """``{(op, copy repeat): {row: cells}}`` of every case table, and its efficiency lines under
    the key ``"<fused>:"``."""
    tables: dict[tuple[str, int], dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in out.splitlines():
        head = re.match(r"^== (\w+) .* copy-repeat=(\d+) ", line)
        if head:
            current = tables.setdefault((head.group(1), int(head.group(2))), {})
            continue
        cells = line.split()
        if current is not None and cells and (cells[0] in ROWS or cells[0].endswith(":")):
            current[cells[0]] = cells
    return tables


def _efficiency_terms(line: str) -> dict[str, float]:
    """The printed medians of an efficiency line: ``{"efficiency", "unfused", "bound", ...}``."""
    terms = {name: float(v) for name, v in re.findall(r"(\w+) (-?\d+\.\d+)", line)}
    eff = re.search(r"overlap efficiency (-?\d+\.\d+)", line)
    if eff:
        terms["efficiency"] = float(eff.group(1))
    terms["exposed"] = float(re.search(r"exposed comm (-?\d+\.\d+) ms", line).group(1))
    return terms


def test_cpu_mode_computes_and_checks_every_row(capsys):
    assert ov.main(FAST) == 0
    out = capsys.readouterr().out
    assert "spinner: ok (checked)" in out and "copy engine: n/a on cpu" in out
    assert f"({ov.LOCAL})" in out
    tables = _tables(out)
    assert set(tables) == {(op, k) for op in OPS for k in (1, 2)}
    for (op, repeat), rows in tables.items():
        for row in ("gemm", "copies", "bound", "unfused", "symm"):
            cells = rows[row]
            assert all(NUMBER.match(c) for c in cells[1:5]), (op, repeat, cells)
            assert cells[5] == "ok,", (op, repeat, cells)
        assert rows["symm_op"][1] == "n/a" and rows["torch"][1] == "n/a"
        # The efficiency line is the formula on the medians printed above it.
        terms = _efficiency_terms(" ".join(rows["symm:"]))
        for row in ("gemm", "bound", "unfused", "symm"):
            assert terms[row] == float(rows[row][1])
        assert terms["exposed"] == pytest.approx(terms["symm"] - terms["gemm"], abs=2e-3)
        if "efficiency" in terms:
            span = terms["unfused"] - terms["bound"]
            want = (terms["unfused"] - terms["symm"]) / span
            assert terms["efficiency"] == pytest.approx(want, abs=6e-3)
        assert "torch: overlap efficiency n/a (cpu:" in " ".join(rows["torch:"])


def test_it_runs_as_a_module():
    """``python -m``, as it is meant to be started (the interpreter chosen in its environment)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "tp_kernels.bench.overlap", *FAST[:2], "--ops", "ag_matmul"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(_tables(proc.stdout)) == {("ag_matmul", 1), ("ag_matmul", 2)}


def test_overlap_metrics_arithmetic():
    medians = {"gemm": 1.0, "copies": 0.8, "bound": 1.1, "unfused": 1.8, "symm": 1.24}
    eff, exposed = ov.overlap_metrics(medians, "symm")
    assert eff == pytest.approx((1.8 - 1.24) / (1.8 - 1.1)) and eff == pytest.approx(0.8)
    assert exposed == pytest.approx(0.24)
    # Nothing to hide (unfused no slower than the bound): no efficiency, exposed still computed.
    eff, exposed = ov.overlap_metrics({**medians, "bound": 1.8}, "symm")
    assert eff is None and exposed == pytest.approx(0.24)


def test_wrong_gemm_fails(monkeypatch, capsys):
    from tp_kernels import kernels

    consumer, producer = kernels.ag_matmul_consumer, kernels.matmul_rs_producer

    def wrong_consumer(a, bs, outs, **kwargs):
        consumer(a, bs, outs, **kwargs)
        outs[0].add_(1.0)

    def wrong_producer(a, b, staging, own, *args, **kwargs):
        producer(a, b, staging, own, *args, **kwargs)
        staging.mul_(2.0)

    monkeypatch.setattr(kernels, "ag_matmul_consumer", wrong_consumer)
    monkeypatch.setattr(kernels, "matmul_rs_producer", wrong_producer)
    assert ov.main(["--device", "cpu", "--copy-repeat", "1"]) == 1
    tables = _tables(capsys.readouterr().out)
    for op in OPS:
        rows = tables[(op, 1)]
        for row in ("gemm", "bound", "unfused", "symm"):
            assert rows[row][1] == "-" and "FAIL," in rows[row], (op, rows[row])
        assert "ok," in rows["copies"]  # the copies do not go through the GEMM


def test_copies_that_never_land_fail(monkeypatch, capsys):
    """A copier that copies nothing and raises no word: the copies' checks fail, and the fused
    GEMM's waits time out (and say so) rather than pass on stale rows."""
    monkeypatch.setattr(symm_gather.Copier, "start", lambda self, *a, **k: symm_gather.Copies())
    argv = ["--device", "cpu", "--copy-repeat", "1", "--ops", "ag_matmul", "--wait-timeout-s", "1"]
    assert ov.main(argv) == 1
    out = capsys.readouterr().out
    rows = _tables(out)[("ag_matmul", 1)]
    assert "ok," in rows["gemm"]
    for row in ("copies", "bound", "unfused", "symm"):
        assert "FAIL," in rows[row] and "DIFFER" in " ".join(rows[row]), rows[row]
    assert "timed out" in " ".join(rows["symm"])


def _fake_control(tmp_path: Path, exit_code: int) -> Path:
    """A stand-in for nvidia-cuda-mps-control: logs its arguments, stdin and pipe directory."""
    script = tmp_path / "mps-control"
    log = tmp_path / "calls.log"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(cat)" >> {log}\n'
        f"exit {exit_code}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_mps_daemon_start_and_stop(tmp_path):
    daemon = MpsDaemon(str(_fake_control(tmp_path, 0)), timeout_s=10.0)
    pipe = Path(daemon.env["CUDA_MPS_PIPE_DIRECTORY"])
    assert pipe.is_dir() and Path(daemon.env["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
    assert daemon.start() is None
    assert daemon.stop() == "quit: exit 0"
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert calls[0].startswith(f"args=-d pipe={pipe} ")
    assert calls[1] == f"args= pipe={pipe} stdin=quit"
    assert not pipe.parent.exists()  # its own directory is gone


def test_mps_run_on_cpu_ranks(tmp_path, capsys):
    """What MPS mode runs, start to stop, with a stand-in control program and 2 CPU ranks (gloo,
    the CPU symmetric heap): the daemon started, the ranks' first allocation, every case on the
    peers' memory with verdicts agreed and merged, the daemon stopped."""
    args = ov.parse_args([*FAST, "--rounds", "1", "--warmup", "0", "--host-reps", "1"])
    setup = Setup(
        device="cpu", dtype="fp32", shapes=args.shapes, repeats=(1, 2), rounds=1, warmup=0,
        host_reps=1, seed=0, wait_timeout_s=30.0,
    )  # fmt: skip
    mode, cases = ov.mps_run(args, setup, str(_fake_control(tmp_path, 0)), None)
    out = capsys.readouterr().out
    assert mode == ov.MPS
    assert "MPS rank 1: None SMs reported" in out and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in out
    assert "MPS daemon stopped (quit: exit 0)" in out
    assert [line.split()[0] for line in (tmp_path / "calls.log").read_text().splitlines()] == [
        "args=-d",
        "args=",
    ]
    assert [(c.op, c.repeat) for c in cases] == [(op, k) for op in OPS for k in (1, 2)]
    for case in cases:
        assert not case.failed, (case.op, case.checks)
        rows = {"gemm", "copies", "bound", "unfused", "symm"}
        # The public symm op runs beside the data path where the copies are not repeated.
        assert set(case.medians()) == (rows | {"symm_op"} if case.repeat == 1 else rows)
        assert case.repeat == 1 or case.na["symm_op"].startswith("--copy-repeat 2 slows")
        assert case.na["torch"].startswith("cpu:")
        text = ov.render_case(case, ov.MPS, "fp32")
        assert "symm_op: overlap efficiency" in text and "FAIL" not in text


def test_mps_daemon_that_cannot_start_says_why(tmp_path):
    daemon = MpsDaemon(str(_fake_control(tmp_path, 3)), timeout_s=10.0)
    why = daemon.start()
    assert why is not None and "exited 3" in why
    daemon.stop()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shape", "33,8,8"], "--shape: got '33,8,8', expected M,K,N"),
        (["--shape", "8,8"], "expected M,K,N"),
        (["--copy-repeat", "0"], "--copy-repeat: must be a positive integer, got 0"),
        (["--copy-repeat", "x"], "--copy-repeat: got 'x', expected a positive integer or auto"),
        (["--spin-ms", "0"], "--spin-ms: must be a positive number, got 0"),
        (["--timeout-s", "-1"], "--timeout-s: must be a positive number, got -1"),
    ],
)
def test_bad_arguments_name_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        ov.parse_args(["--device", "cpu", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_no_cuda_says_so(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert ov.main([]) == 0
    assert capsys.readouterr().out.strip() == ov.NO_CUDA_MESSAGE


def test_a_spinner_that_did_not_run_fails(monkeypatch, capsys):
    from tp_kernels.bench import _spinner

    monkeypatch.setattr(_spinner, "expected", lambda programs, iters: torch.zeros(1))
    assert ov.main(["--device", "cpu", "--copy-repeat", "1", "--ops", "matmul_rs"]) == 1
    assert "spinner: FAIL: wrong result" in capsys.readouterr().out


def test_spinner_check_jumps_ahead_exactly():
    """The host's jump-ahead (a GPU run takes ~1e6 steps) equals stepping the generator."""
    from tp_kernels.bench import _spinner

    for iters in (0, 1, 2, 1000, 1027):
        x = torch.arange(2 * _spinner.BLOCK, dtype=torch.int64)
        for _ in range(iters):
            x = (x * _spinner.LCG_A + _spinner.LCG_C) % 2**32
        want = torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)
        assert torch.equal(_spinner.expected(2, iters), want), iters


def test_spinner_compiles_for_sm_90():
    """The probe's spinner, which no GPU has run, compiles for sm_90 (Triton's own ptxas) into a
    loop of the generator's multiply-adds (not folded into a closed form)."""
    done = run_without_interpreter(
        """
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from tp_kernels.bench import _spinner

        signature = {"out_ptr": "*i32", "iters": "i32", "BLOCK": "constexpr"}
        source = ASTSource(_spinner._spin, signature, {"BLOCK": _spinner.BLOCK})
        kernel = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": _spinner.NUM_WARPS}
        )
        print(kernel.asm["ptx"])
        """
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"mad\.lo\.s32\s+%r\d+, %r\d+, 1664525, 1013904223;", done.stdout), done.stdout
    assert "bra" in done.stdout  # the loop over iters
