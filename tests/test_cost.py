"""The cost model (tp_kernels.cost) and its whole-model plan (python -m tp_kernels.bench model):
formulas checked by hand, schedules at their limits, the CLI's table and errors."""

from __future__ import annotations

import math

import pytest
import torch

from tp_kernels import cost
from tp_kernels.bench import main as bench_main
from tp_kernels.bench import model


def test_compute_and_communication_follow_the_formulas():
    h100 = cost.DEVICES["h100"]
    c = cost.op_cost("all_gather_matmul", 1024, 8192, 1280, 8, "bf16", h100)
    flops = 2 * 8 * 1024 * 8192 * 1280
    assert math.isclose(c.compute_s, flops / (989.4e12 * h100.mma_efficiency))
    wire = 7 * 1024 * 8192 * 2 / (450e9 * h100.link_efficiency)
    assert math.isclose(c.comm_s, wire + 7 * h100.signal_latency_s)
    assert c.speed_of_light_s == max(c.compute_s, c.comm_s)
    assert c.sequential_s == c.compute_s + c.comm_s
    # The reduce-scatter moves the N-wide partials, not the K-wide input.
    r = cost.op_cost("matmul_reduce_scatter", 1024, 1280, 8192, 8, "bf16", h100)
    assert math.isclose(r.comm_s, c.comm_s) and math.isclose(r.compute_s, c.compute_s)
    # reference = NCCL's collective, then the GEMM.
    nccl = wire + 7 * h100.nccl_latency_s
    assert math.isclose(c.backends_s["reference"], c.compute_s + nccl)
    for name, t in c.backends_s.items():
        assert c.speed_of_light_s <= t * (1 + 1e-12), name


@pytest.mark.parametrize("gather", [True, False])
def test_schedule_limits(gather):
    # No communication: the math; no math: the transfers; one peer: nothing to overlap but the
    # own block.
    assert cost.pipeline_time(3.0, 0.0, 4, gather=gather) == pytest.approx(3.0)
    assert cost.pipeline_time(0.0, 2.0, 4, gather=gather) == pytest.approx(2.0)
    assert cost.pipeline_time(2.0, 1.0, 1, gather=gather) == pytest.approx(2.0)
    # Link slower than math: only one block of math stays exposed (5 blocks of 1.0, 4 of 2.0).
    assert cost.pipeline_time(5.0, 8.0, 4, gather=gather) == pytest.approx(9.0)
    # Math slower than link: the transfers hide behind the math (AG computes its own block
    # while the first lands; RS computes its own block while the last travels).
    assert cost.pipeline_time(10.0, 4.0, 4, gather=gather) == pytest.approx(10.0)


def test_bad_arguments_are_named():
    h100 = cost.DEVICES["h100"]
    with pytest.raises(ValueError, match="op: got 'gemm'"):
        cost.op_cost("gemm", 1, 1, 1, 2, "bf16", h100)
    with pytest.raises(ValueError, match="dtype: got 'fp8'"):
        cost.op_cost("all_gather_matmul", 1, 1, 1, 2, "fp8", h100)
    with pytest.raises(ValueError, match=r"got \(0, 1, 1, 2\)"):
        cost.op_cost("all_gather_matmul", 0, 1, 1, 2, "bf16", h100)


def test_every_device_names_its_source():
    for spec in cost.DEVICES.values():
        assert spec.source.startswith("https://") and spec.peak_tflops["bf16"] > 0


def test_model_plan_for_llama3_70b(capsys):
    assert bench_main(["model", "--gpu", "h100", "--tp", "8", "--model", "llama3-70b"]) == 0
    out = capsys.readouterr().out
    # wq/wk/wv at TP=8: (64 + 2 * 8) heads x 128 / 8 columns per rank; w1/w3: 2 x 28672 / 8.
    assert "attention.wq/wk/wv  forward   AG+mm  1024x8192x1280" in out
    assert "feed_forward.w1/w3  forward   AG+mm  1024x8192x7168" in out
    assert "feed_forward.w2     forward   mm+RS  1024x3584x8192" in out
    assert "the model (80 blocks + output)" in out and "Meta-Llama-3-70B" in out
    rows = model.plan_rows("llama3-70b", cost.DEVICES["h100"], 8, 8192)
    assert len(rows) == 10 and all(r.sol_s <= r.fused_s * (1 + 1e-9) <= r.reference_s for r in rows)


def test_model_plan_refuses_a_tp_that_does_not_divide(capsys):
    with pytest.raises(SystemExit) as info:
        model.main(["--tp", "3", "--model", "llama3-8b"])
    assert info.value.code == 2
    assert "--tp 3" in capsys.readouterr().err


def test_the_local_cpu_is_measured_once_and_gpus_found_by_name(monkeypatch):
    spec = cost.device_spec(torch.device("cpu"))
    assert spec is cost.measure_cpu()  # measured once per process
    assert all(rate > 0 for rate in spec.peak_tflops.values()) and spec.link_gb_s > 0
    assert set(spec.peak_tflops) == set(cost.DTYPE_NAMES.values())
    names = iter(["NVIDIA H100 80GB HBM3", "NVIDIA H200", "Tesla V100-SXM2-16GB"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: next(names))
    cuda = torch.device("cuda", 0)
    assert cost.device_spec(cuda) is cost.DEVICES["h100"]
    assert cost.device_spec(cuda) is cost.DEVICES["h200"]
    assert cost.device_spec(cuda) is None  # not described: auto then times without ruling out
