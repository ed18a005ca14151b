"""``python -m tp_kernels.bench.gpu_kernels`` on a machine without a GPU: its helpers, its checks
on fake launchers, its exits, and one whole run of its real launchers in Triton's interpreter.

Cheap and not marked ``gpu``: they run in the default CPU test run.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from tp_kernels.bench import gpu_kernels as gk
from tp_kernels.bench.protocol import render_table
from tp_kernels.bench.tolerance import error_ratio

CPU = torch.device("cpu")


def test_error_ratio_is_the_allclose_margin():
    want = torch.tensor([0.0, 1.0, -3.0], dtype=torch.float64)
    tol = 1e-2
    # |diff| = 0.5 * tol * (1 + |want|), except 0.9 times that bound for the last element.
    got = want + torch.tensor([0.5 * tol, 0.5 * tol * 2, -0.9 * tol * 4])
    assert error_ratio(got, want, tol) == pytest.approx(0.9)
    assert error_ratio(got[:2], want[:2], tol) == pytest.approx(0.5)
    assert error_ratio(want, want, tol) == 0.0
    assert bool(torch.isclose(got, want, rtol=tol, atol=tol).all())  # the same verdict


def test_error_ratio_nan_shape_and_bad_tolerance():
    want = torch.ones(3)
    assert error_ratio(torch.tensor([1.0, math.nan, 1.0]), want, 0.1) == math.inf
    assert error_ratio(torch.ones(4), want, 0.1) == math.inf
    with pytest.raises(ValueError, match=r"tol: got 0.0, expected a positive tolerance"):
        error_ratio(want, want, 0.0)


def test_per_second():
    # 8192 x 3584 x 8192 GEMM: 2*M*N*K = 4.81e11 flops in 1 ms -> 481 TFLOP/s.
    assert gk.per_second(2.0 * 8192 * 3584 * 8192, 1.0, "TFLOP/s") == pytest.approx(481.036, 1e-5)
    assert gk.per_second(3e9, 2.0, "GB/s") == pytest.approx(1500.0)
    with pytest.raises(ValueError, match=r"unit: got 'GFLOP/s', expected one of"):
        gk.per_second(1.0, 1.0, "GFLOP/s")
    with pytest.raises(ValueError, match=r"ms: got 0.0, expected a positive duration"):
        gk.per_second(1.0, 0.0, "GB/s")


def test_render_table_aligns_columns():
    # The table is the bench protocol's since issue 12 (this script's own copy went).
    table = render_table(("kernel", "ms"), [("a", "1.5"), ("longer", "10.25")])
    assert table.splitlines() == ["kernel     ms", "a         1.5", "longer  10.25"]
    left = render_table(("kernel", "ms", "n"), [("a", "1.5", "7"), ("longer", "10", "12")], left=2)
    assert left.splitlines() == ["kernel  ms    n", "a       1.5   7", "longer  10   12"]
    with pytest.raises(ValueError, match=r"rows\[1\]: got 1 cells, expected 2"):
        render_table(("kernel", "ms"), [("a", "1"), ("b",)])


def test_result_rows_rates_and_ratios():
    flops = 2e9  # 2 GFLOP per call
    results = [
        gk.Result(gk.BASELINE, "reference", True, flops, times_ms=[1.0, 2.0, 3.0]),
        gk.Result("ag_matmul_consumer", "ok", True, flops, times_ms=[4.0, 4.0, 4.0]),
        gk.Result("reduce_slots", "ok", True, 4e9, "GB/s", times_ms=[2.0]),
        gk.Result("barrier", "ok", True, times_ms=[0.01]),
        gk.Result("matmul_rs_producer", "MISMATCH", False, flops),
    ]
    rows = {row[0]: row for row in gk.result_rows(results)}
    assert rows[gk.BASELINE][1:6] == ("2.0000", "1.4000", "2.6000", "1.0 TFLOP/s", "1.00x")
    assert rows["ag_matmul_consumer"][4:6] == ("0.5 TFLOP/s", "0.50x")
    assert rows["reduce_slots"][4:6] == ("2000.0 GB/s", "-")
    assert rows["barrier"][4:] == ("-", "-", "ok")
    assert rows["matmul_rs_producer"][1:] == ("-",) * 5 + ("MISMATCH",)


def _fake_launchers(p: gk.Problem, *, producer_scale: float, producer_signals: bool) -> dict:
    """What each launcher should do, done with torch; the producer optionally wrong."""

    def producer() -> None:
        p.slots[0].copy_(p.want * producer_scale)
        if producer_signals:
            p.pad[gk.RS_CHANNEL] = 1

    return {
        "barrier": lambda: (p.pad.__setitem__(gk.AG_CHANNEL, 0), p.progress.zero_()),
        "ag_matmul_consumer": lambda: p.c.copy_(p.want),
        "matmul_rs_producer": producer,
        "reduce_slots": lambda: p.reduced.copy_(p.slots[0]),
        gk.BASELINE: lambda: torch.mm(p.a, p.b, out=p.c),
    }


def test_check_all_flags_wrong_results_and_missing_signals():
    p = gk.Problem(8, 5, 6, torch.bfloat16, seed=0, device=CPU)
    tol = 1e-2
    good = gk.check_all(p, _fake_launchers(p, producer_scale=1.0, producer_signals=True), tol)
    assert [r.name for r in good] == [
        gk.BASELINE,
        "barrier",
        "ag_matmul_consumer",
        "matmul_rs_producer",
        "matmul_rs_producer's signal",
        "reduce_slots",
    ]
    assert all(r.ok for r in good), [r.check for r in good]

    p = gk.Problem(8, 5, 6, torch.bfloat16, seed=0, device=CPU)
    bad = gk.check_all(p, _fake_launchers(p, producer_scale=1.5, producer_signals=False), tol)
    verdicts = {r.name: r for r in bad}
    assert not verdicts["matmul_rs_producer"].ok
    assert verdicts["matmul_rs_producer"].check.startswith("MISMATCH, max err")
    assert verdicts["matmul_rs_producer's signal"].check == "FAILED, pad word 0 != 1"
    assert verdicts["ag_matmul_consumer"].ok and verdicts["reduce_slots"].ok


def test_main_exits_1_on_a_failed_check_and_does_not_time_it(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what --device cpu asks for; no kernel runs
    monkeypatch.setattr(
        gk, "launchers", lambda p: _fake_launchers(p, producer_scale=1.5, producer_signals=True)
    )
    # Nothing may import Triton while TRITON_INTERPRET=1 is set in this process.
    monkeypatch.setattr(gk, "versions", lambda: {"torch": torch.__version__, "triton": "n/a"})
    status = gk.main(["--device", "cpu", "--M", "8", "--N", "4", "--K", "16", "--reps", "2"])
    out, err = capsys.readouterr()
    assert status == 1
    assert "ERROR: checks failed for ['matmul_rs_producer']" in err
    row = next(line for line in out.splitlines() if line.startswith("matmul_rs_producer "))
    assert row.split()[1:5] == ["-", "-", "-", "-"], row
    consumer = next(line for line in out.splitlines() if line.startswith("ag_matmul_consumer"))
    assert "TFLOP/s" in consumer and "ok, max err" in consumer


def test_no_cuda_exits_0_with_a_message(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gk.main([]) == 0
    assert capsys.readouterr().out == gk.NO_CUDA_MESSAGE + "\n"


def test_arguments(monkeypatch, capsys):
    args = gk.parse_args([])
    assert (args.M, args.N, args.K, args.dtype, args.device) == (8192, 3584, 8192, "bf16", "cuda")
    with pytest.raises(SystemExit) as exit_info:
        gk.parse_args(["--reps", "0"])
    assert exit_info.value.code == 2
    assert "must be a positive integer, got 0" in capsys.readouterr().err
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        gk.main(["--device", "cpu"])
    assert exit_info.value.code == 2
    assert "--device cpu runs the kernels in Triton's interpreter" in capsys.readouterr().err


def test_interpreted_run_checks_every_real_launcher():
    # A child process: TRITON_INTERPRET must be set before Triton is first imported, and this
    # process may have imported it for the GPU already.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "tp_kernels.bench.gpu_kernels", "--device", "cpu"]
    cmd += ["--M", "40", "--N", "24", "--K", "48", "--warmup", "1", "--reps", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    names = [
        gk.BASELINE,
        "barrier",
        "ag_matmul_consumer",
        "matmul_rs_producer",
        "matmul_rs_producer's signal",
        "reduce_slots",
    ]
    for name in names[1:]:
        row = next((line for line in lines if line.startswith(name + " ")), None)
        assert row is not None and " ok, " in row, (name, proc.stdout)
    assert "MISMATCH" not in proc.stdout and "FAILED" not in proc.stdout


def test_fp8_check_flags_a_wrong_scale():
    """``--dtype fp8-rowwise``'s checks can fail: launchers done with torch, the consumer with
    row 0's scale 5% off (the tolerance is about 2 bf16 roundings, 0.8%)."""
    p = gk.Fp8Problem(8, 16, 32, seed=0, device=CPU)
    tol = gk.matmul_tolerance(torch.bfloat16, 32, roundings=1)
    wrong_scale = p.a_scale.clone()
    wrong_scale[0] *= 1.05

    def consumer() -> None:
        torch._scaled_mm(
            p.a_data, p.b, scale_a=wrong_scale, scale_b=p.b_scale, out_dtype=torch.bfloat16,
            out=p.c,
        )  # fmt: skip

    run = {
        gk.FP8_BASELINE: lambda: p.scaled_mm(out=p.c),
        "ag_matmul_consumer": consumer,
        "matmul_rs_producer": lambda: p.scaled_mm(out=p.slots[0]),
    }
    verdicts = {r.name: r for r in gk.check_scaled(p, run, tol)}
    assert list(verdicts) == [gk.FP8_BASELINE, "ag_matmul_consumer", "matmul_rs_producer"]
    assert verdicts[gk.FP8_BASELINE].ok, verdicts[gk.FP8_BASELINE].check
    assert verdicts["matmul_rs_producer"].ok, verdicts["matmul_rs_producer"].check
    assert not verdicts["ag_matmul_consumer"].ok
    assert verdicts["ag_matmul_consumer"].check.startswith("MISMATCH, max err")


def test_interpreted_fp8_run_checks_both_gemms_against_scaled_mm():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "tp_kernels.bench.gpu_kernels", "--device", "cpu"]
    cmd += ["--M", "40", "--N", "48", "--K", "64", "--dtype", "fp8-rowwise"]
    cmd += ["--warmup", "0", "--reps", "1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("kernel ") and "vs torch._scaled_mm" in line for line in lines)
    for name, against in [
        (gk.FP8_BASELINE, "fp32"),
        ("ag_matmul_consumer", gk.FP8_BASELINE),
        ("matmul_rs_producer", gk.FP8_BASELINE),
    ]:
        row = next((line for line in lines if line.startswith(name + " ")), None)
        assert row is not None and " ok, " in row and row.endswith(f"vs {against}"), proc.stdout


def test_interpreted_mxfp8_run_checks_both_gemms_against_the_emulated_mm():
    """``--dtype mxfp8`` on a CPU: the block-scaled consumer and producer (each K step's scales
    applied in the kernel) against torchao's emulation (the bf16-dequantized operands'
    ``torch.mm``), itself checked against the fp32 product; K of three MX blocks."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "tp_kernels.bench.gpu_kernels", "--device", "cpu"]
    cmd += ["--M", "40", "--N", "48", "--K", "96", "--dtype", "mxfp8"]
    cmd += ["--warmup", "0", "--reps", "1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    baseline = gk.MX_EMULATED_BASELINE
    assert any(line.startswith("kernel ") and f"vs {baseline}" in line for line in lines)
    for name, against in [
        (baseline, "fp32"),
        ("ag_matmul_consumer", baseline),
        ("matmul_rs_producer", baseline),
    ]:
        row = next((line for line in lines if line.startswith(name + " ")), None)
        assert row is not None and " ok, " in row and row.endswith(f"vs {against}"), proc.stdout


def test_mxfp8_check_flags_a_wrong_block_scale():
    """The MXFP8 checks can fail: the consumer done by torch with one block's scale of row 0
    doubled."""
    p = gk.MxProblem(8, 16, 64, seed=0, device=CPU)
    tol = gk.matmul_tolerance(torch.bfloat16, 64, roundings=1)
    wrong = p.a_scale.view(torch.uint8).clone()
    wrong[0, 1] += 1

    def consumer() -> None:
        left = gk._mx_dequantize(p.a_data, wrong.view(torch.float8_e8m0fnu))
        right = gk._mx_dequantize(p.b_weight, p.b_scale)
        p.c.copy_(torch.mm(left, right.t()))

    run = {
        p.baseline: lambda: p.scaled_mm(out=p.c),
        "ag_matmul_consumer": consumer,
        "matmul_rs_producer": lambda: p.scaled_mm(out=p.slots[0]),
    }
    verdicts = {r.name: r for r in gk.check_scaled(p, run, tol)}
    assert verdicts[p.baseline].ok, verdicts[p.baseline].check
    assert verdicts["matmul_rs_producer"].ok, verdicts["matmul_rs_producer"].check
    assert not verdicts["ag_matmul_consumer"].ok
