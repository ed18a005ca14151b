"""The benchmark tool: its timing protocol on fake providers, its checks, table, JSON and CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

import tp_kernels
from tp_kernels.bench import _report, llama_block, main, parse_args, run_rank
from tp_kernels.bench.protocol import (
    BenchCase,
    BenchConfig,
    check_outputs,
    format_table,
    percentile,
    rotated,
    run_case,
    summarize,
    time_providers,
)
from tp_kernels.bench.tolerance import matmul_tolerance

CPU = torch.device("cpu")
WARMUP, ROUNDS = 2, 5
BASE_MS = {"a": 10.0, "b": 3.0, "c": 7.0}


def _fake_ms(name: str, round_index: int, rank: int) -> float:
    """Duration of call ``round_index`` (negative in warmup) of fake provider ``name`` on ``rank``:
    the rank whose parity matches the round's is slower by ``rank + 1`` ms, so the slowest rank
    changes from round to round and no single rank's times equal the max over ranks."""
    extra = float(rank + 1) if round_index % 2 == rank % 2 else 0.0
    return BASE_MS[name] * (max(round_index, 0) + 1) + extra


def _fake_protocol() -> tuple[dict[str, list[float]], list[str]]:
    rank = dist.get_rank()
    now = [0.0]
    log: list[str] = []

    def provider(name: str):
        calls = [0]

        def run() -> None:
            log.append(name)
            now[0] += _fake_ms(name, calls[0] - WARMUP, rank) / 1e3
            calls[0] += 1

        return run

    times = time_providers(
        {name: provider(name) for name in BASE_MS},
        rounds=ROUNDS,
        warmup=WARMUP,
        group=dist.group.WORLD,
        device=CPU,
        clock=lambda: now[0],
    )
    return times, log


def test_timing_takes_max_over_ranks_and_rotates(worlds):
    per_rank = worlds(2).run(_fake_protocol)
    (times, log), (times1, log1) = per_rank
    assert times == times1  # one all_reduce: every rank holds the same slowest-rank times
    for name in BASE_MS:
        want = [max(_fake_ms(name, i, r) for r in range(2)) for i in range(ROUNDS)]
        assert times[name] == pytest.approx(want, rel=1e-9)
    # warmup rounds 0, 1 then timed rounds 0..4, each rotated left by its index
    assert log == list("abc" + "bca" + "abc" + "bca" + "cab" + "abc" + "bca")
    assert log1 == log
    # provider a: rounds take 11, 22, 31, 42, 51 ms (slowest rank alternates)
    assert times["a"] == pytest.approx([11.0, 22.0, 31.0, 42.0, 51.0], rel=1e-9)
    assert summarize(times["a"]) == pytest.approx(
        {"median_ms": 31.0, "p20_ms": 19.8, "p80_ms": 43.8}, rel=1e-9
    )


def test_percentile_and_rotation():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 10):
        values = rng.random(n).tolist()
        for q in (0, 20, 50, 80, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12)
    with pytest.raises(ValueError, match="values is empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"q=101 is outside"):
        percentile([1.0], 101)
    assert rotated(["x", "y", "z"], 4) == ["y", "z", "x"]


def _checks_and_run() -> tuple[dict, dict]:
    rank = dist.get_rank()
    ones = torch.ones(4, 3)
    case = BenchCase(
        name="fake",
        flops=24.0,
        shapes={"x": [4, 3]},
        providers={
            "reference": lambda: [None, ones.clone()],
            "close": lambda: [ones + 2.0**-20],  # exact in fp32
            "off_on_rank1": lambda: [ones + (0.5 if rank == 1 else 0.0)],
            "bad_shape": lambda: [torch.ones(3, 4)],
            "nan_on_rank0": lambda: [ones * (math.nan if rank == 0 else 1.0)],
            "roof": lambda: torch.zeros(7),
        },
        tolerance=1e-4,
        skipped={"symm": "not built", "other": "never asked for"},
    )
    checks = check_outputs(case, list(case.providers), dist.group.WORLD, CPU)
    cfg = BenchConfig(M=4, K=1, N=3, rounds=2, warmup=0)
    requested = ["close", "off_on_rank1", "bad_shape", "nan_on_rank0", "roof", "symm"]
    result = run_case(case, cfg, dist.group.WORLD, CPU, requested)
    return checks, result


def test_check_agrees_over_ranks_and_drops_mismatches(worlds):
    (checks, result), (checks1, result1) = worlds(2).run(_checks_and_run)
    # rank 0's own output of off_on_rank1 is right; the verdict must still be agreed
    assert checks == checks1
    assert checks["close"] == {"checked": True, "ok": True, "max_abs_err": 2.0**-20}
    assert checks["off_on_rank1"]["ok"] is False
    assert checks["off_on_rank1"]["max_abs_err"] == pytest.approx(0.5)
    for name in ("bad_shape", "nan_on_rank0"):
        assert checks[name]["ok"] is False and math.isinf(checks[name]["max_abs_err"])
    assert checks["roof"] == {"checked": False, "ok": True, "max_abs_err": 0.0}
    # the reference runs although not requested; mismatched providers are reported, not timed
    assert list(result["providers"]) == ["reference", "close", "roof"]
    assert set(result["mismatches"]) == {"off_on_rank1", "bad_shape", "nan_on_rank0"}
    assert result["skipped"] == {"symm": "not built"}
    assert all(len(p["times_ms"]) == 2 for p in result["providers"].values())
    assert result1["mismatches"].keys() == result["mismatches"].keys()


def _record(medians: dict[str, float], mismatches: dict[str, float] | None = None) -> dict:
    return {
        "name": "fake",
        "flops": 2e9,
        "shapes": {"a": [8, 4]},
        "tolerance": 1e-4,
        "skipped": {"symm": "not built"},
        "mismatches": mismatches or {},
        "providers": {
            name: {
                "median_ms": m,
                "p20_ms": m - 1,
                "p80_ms": m + 1,
                "times_ms": [m - 1, m, m + 1],
                "checked": name != "roof",
                "max_abs_err": 0.0,
            }
            for name, m in medians.items()
        },
    }


META = {"dtype": "fp32", "world_size": 2, "pg_backend": "gloo", "rounds": 3, "warmup": 1}


def test_table_columns():
    record = _record({"reference": 10.0, "pipelined": 5.0, "roof": 4.0})
    record["providers"]["pipelined"]["model_ms"] = 3.25
    record["model_note"] = "a test device"
    table = format_table(record, META)
    lines = table.splitlines()
    assert lines[1].split() == [
        "provider", "median", "ms", "p20", "ms", "p80", "ms", "model", "ms", "GFLOP/s", "vs",
        "reference", "%", "of", "roof",
    ]  # fmt: skip
    # pipelined: 2e9 flop / 5 ms = 400 GFLOP/s, 10/5 = 2x the reference, roof 4/5 = 80%; the
    # model's 3.25 ms beside it; no prediction for the reference.
    assert lines[3].split() == [
        "pipelined", "5.000", "4.000", "6.000", "3.250", "400.0", "2.00x", "80.0%",
    ]  # fmt: skip
    assert lines[2].split()[4] == "-" and lines[2].split()[-2:] == ["1.00x", "40.0%"]
    assert "(model ms: a test device)" in table
    assert "(skipped symm: not built)" in table


def test_report_json_and_mismatch_exit(tmp_path, capsys):
    args = parse_args(["ag_matmul", "--out", str(tmp_path / "r.json")])
    ok = {"meta": {**META, "machine": {}, "versions": {}}, "results": [_record({"reference": 2.0})]}
    assert _report(ok, args, ["ag_matmul"]) == 0
    bad = {**ok, "results": [_record({"reference": 2.0}, mismatches={"symm": math.inf})]}
    assert _report(bad, args, ["ag_matmul"]) == 1
    out, err = capsys.readouterr()
    assert "!!! MISMATCH: symm differs from reference" in out
    assert "ERROR: outputs differ from the reference for ['fake/symm']" in err
    # JSON has no inf: an infinite error is written as null
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["benchmarks"][0]["mismatches"] == {"symm": None}


def test_cli_rejects_bad_arguments(worlds, capsys):
    with pytest.raises(SystemExit):
        parse_args(["no_such_bench"])
    assert "benchmark 'no_such_bench' is unknown" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--providers", "reference,warp"])
    assert "--providers: ['warp'] unknown" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"--M 15 is not divisible by the world size 2"):
        main(["--M", "15"], world=worlds(2))
    with pytest.raises(SystemExit, match=r"--world-size 3 differs from the given LocalWorld \(2\)"):
        main(["--world-size", "3"], world=worlds(2))


def test_cli_model_fp8_prints_the_modeled_tables_without_ranks(capsys):
    """``bench model --fp8`` runs no rank: the cost model's fp8 comparison, labelled modeled,
    a row per forward fused op and a per-layer total per model and token count."""
    assert main(["model", "--fp8", "--tokens", "2048"]) == 0
    out = capsys.readouterr().out
    assert "(MODELED, nothing measured)" in out and "on H100 SXM5" in out
    header = next(line for line in out.splitlines() if line.startswith("model        tokens  lin"))
    for column in ("bf16 fused", "fp8 torchao", "fp8 fused", "fp8 SoL", "vs torchao", "vs bf16"):
        assert column in header
    ops = [line for line in out.splitlines() if "  AG+mm  " in line or "  mm+RS  " in line]
    assert len(ops) == 12  # 3 models x 4 forward fused ops at one token count
    layers = [line.split() for line in out.splitlines() if line.startswith("llama3-")]
    totals = [cells for cells in layers if len(cells) == 7]
    assert [cells[:2] for cells in totals] == [
        ["llama3-8b", "2048"], ["llama3-70b", "2048"], ["llama3-405b", "2048"]
    ]  # fmt: skip


def test_cli_end_to_end(worlds, tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["ag_matmul", "matmul_rs", "--M", "16", "--K", "8", "--N", "4", "--rounds", "3",
            "--warmup", "1", "--out", str(path)]  # fmt: skip
    assert main(argv, world=worlds(2)) == 0
    printed = capsys.readouterr().out
    assert "== ag_matmul  a_shard[8,8]  b[8,4]  out[16,4]  fp32  world=2 (gloo)" in printed
    assert "== matmul_rs  a[16,8]  b[8,4]  out[8,4]  fp32  world=2 (gloo)" in printed
    report = json.loads(path.read_text())
    assert report["argv"] == argv
    assert report["world_size"] == 2 and report["pg_backend"] == "gloo"
    assert report["dtype"] == "fp32" and report["rounds"] == 3 and report["warmup"] == 1
    assert report["machine"]["cpu_count"] >= 1 and report["machine"]["gpu"] is None
    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["tp_kernels"] == tp_kernels.__version__
    symm_ok = tp_kernels.available_backends()["symm"] == "ok"
    for bench in report["benchmarks"]:
        assert bench["mismatches"] == {}
        assert bench["flops"] == 2 * 16 * 8 * 4
        expected = ["reference", "pipelined", *(["symm"] if symm_ok else []), "auto", "roof"]
        assert list(bench["providers"]) == expected
        assert "torch_symm_mem" in bench["skipped"]  # CPU run
        assert bench["model_note"] == "tp_kernels.cost for this CPU (measured)"
        for rec in bench["providers"].values():
            assert len(rec["times_ms"]) == 3 and all(t > 0 for t in rec["times_ms"])
            assert rec["p20_ms"] <= rec["median_ms"] <= rec["p80_ms"]
            assert rec["model_ms"] > 0  # the model's prediction beside every measured row


def test_matmul_tolerance_values():
    # the values quoted in matmul_tolerance's docstring
    assert matmul_tolerance(torch.float32, 2048, 1) == pytest.approx(8.7e-5, rel=0.01)
    assert matmul_tolerance(torch.float16, 2048, 3) == pytest.approx(3.0e-3, rel=0.01)
    assert matmul_tolerance(torch.bfloat16, 2048, 3) == pytest.approx(2.4e-2, rel=0.03)


# --- llama_block ----------------------------------------------------------------------------

# GQA (2 query heads per key/value head), every size divisible by 2 ranks, head dim 8.
TINY_BLOCK = {"batch": 2, "seq": 8, "dim": 32, "heads": 4, "kv_heads": 2, "ffn": 64}
PHASE_KINDS = (
    "forward/all_gather_matmul",  # attention and feed-forward inputs, one gather each
    "forward/matmul_reduce_scatter",  # wo, w2
    "backward/matmul_reduce_scatter",  # the gathered inputs' grads
    "backward/all_gather",  # the gathered inputs again, for the weight grads
    "backward/all_gather_matmul",  # wo's and w2's output grads
)


def _reset_and_run_llama_block(cfg: BenchConfig) -> dict:
    tp_kernels.reset_comm_stats()
    return run_rank(cfg, ["llama_block"], None)


def test_llama_block_end_to_end(worlds, tmp_path, capsys):
    cfg = BenchConfig(M=16, K=8, N=4, rounds=2, warmup=1, sizes=TINY_BLOCK)
    out = worlds(2).run(_reset_and_run_llama_block, cfg)[0]
    path = tmp_path / "block.json"
    assert _report(out, parse_args(["llama_block", "--out", str(path)]), ["llama_block"]) == 0

    symm_ok = tp_kernels.available_backends()["symm"] == "ok"
    tp_providers = ["reference", "pipelined", *(["symm"] if symm_ok else [])]
    providers = ["torch", *tp_providers, "auto", "roof"]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(
        "== llama_block  x[2,4,32]  wq[16,32]  wk[8,32]  w1[32,32]  out[2,4,32]  fp32  world=2"
    )
    assert lines[1].split() == [
        "provider", "median", "ms", "p20", "ms", "p80", "ms", "model", "ms", "GFLOP/s",
        "tokens/s", "vs", "torch", "%", "of", "roof", "saved", "MiB",
    ]  # fmt: skip
    rows = {line.split()[0]: line.split() for line in lines[2 : 2 + len(providers)]}
    assert list(rows) == providers
    assert rows["torch"][7] == "1.00x" and rows["roof"][8] == "100.0%"
    assert "(model ms: tp_kernels.cost for this CPU (measured): the block's Linears only" in (
        "\n".join(lines)
    )

    bench = json.loads(path.read_text())["benchmarks"][0]
    assert bench["name"] == "llama_block" and bench["baseline"] == "torch"
    assert bench["mismatches"] == {} and list(bench["providers"]) == providers
    tokens = 2 * 8
    assert bench["rate"] == {"unit": "tokens", "per_call": tokens}
    # 3 x (projections 2*T*D*(2*H*d + 2*kv*d + 3*F) + attention 2*B*S^2*d*H) / W
    assert bench["flops"] == 3 * (2 * tokens * 32 * (2 * 4 * 8 + 2 * 2 * 8 + 3 * 64)
                                  + 2 * 2 * 8**2 * 8 * 4) / 2  # fmt: skip
    # fp32 floor of the tolerance: 2 eps; the measured baseline error may raise it
    assert 2 * torch.finfo(torch.float32).eps <= bench["tolerance"] < 1e-3
    # torch keeps each sub-block's gathered input [B, S, D] fp32 for its weight grads
    gathered_mib = 2 * (2 * 8 * 32 * 4) / 2**20
    for name, rec in bench["providers"].items():
        assert rec["tokens_per_s"] == pytest.approx(tokens / (rec["median_ms"] * 1e-3), rel=1e-9)
        assert rows[name][6] == f"{rec['tokens_per_s']:.0f}"
        assert rows[name][4] == f"{rec['model_ms']:.3f}"
        assert rows[name][-1] == f"{rec['saved_mib']:.1f}"
        assert rec["saved_mib"] > 0
        assert len(rec["times_ms"]) == 2
    assert bench["providers"]["torch"]["saved_mib"] >= gathered_mib
    # the fused path fired once per boundary in the probed step; nothing fell back
    for name in tp_providers:
        assert bench["providers"][name]["comm"] == {f"{pk}/{name}": 2 for pk in PHASE_KINDS}
    # auto chose per op and shape class (timed): each boundary under one of the backends.
    auto = bench["providers"]["auto"]["comm"]
    by_phase_kind = {key.rsplit("/", 1)[0]: n for key, n in auto.items()}
    assert by_phase_kind == {pk: 2 for pk in PHASE_KINDS}, auto
    assert {key.rsplit("/", 1)[1] for key in auto} <= set(tp_providers)
    assert bench["providers"]["torch"]["comm"] == bench["providers"]["roof"]["comm"] == {}

    # The process counters saw every step of every provider (the check, warmup, rounds and
    # probe: 5 steps) and no fallback; auto's steps count under the backend it chose.
    counts = worlds(2).run(tp_kernels.comm_stats)
    assert counts[0] == counts[1]
    assert counts[0].total(kind="fallback") == 0
    for pk in PHASE_KINDS:
        phase, kind = pk.split("/")
        auto_backends = {key.rsplit("/", 1)[1] for key in auto if key.startswith(pk + "/")}
        for name in tp_providers:
            runs = 5 * (2 if name in auto_backends else 1)
            assert counts[0].total(phase, kind, name) == 2 * runs, (name, pk)


class _LinearRelu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 8, bias=False)

    def forward(self, x: torch.Tensor, rope: object) -> torch.Tensor:
        return self.lin(x).relu()


def test_saved_bytes_counts_new_storages_once():
    x, g = torch.randn(3, 5, 4), torch.randn(3, 5, 8)
    rope = (torch.ones(1), torch.ones(1))
    step = llama_block._Step(_LinearRelu(), x, g, rope, checked=("lin.weight",))
    # The matmul saves x and the weight (resident: not counted); relu saves its output, which
    # the loss's multiply saves again (one storage): 3*5*8 fp32.
    assert llama_block._saved_bytes(step) == 3 * 5 * 8 * 4


def test_llama_block_sizes_checked():
    with pytest.raises(ValueError, match=r"unknown sizes \['dims'\] in BenchConfig.sizes"):
        llama_block._sizes(BenchConfig(M=1, K=1, N=1, sizes={"dims": 64}))
    with pytest.raises(ValueError, match=r"sizes must be positive ints, got \{'seq': 0\}"):
        llama_block._sizes(BenchConfig(M=1, K=1, N=1, sizes={"seq": 0}))
    assert llama_block._sizes(BenchConfig(M=1, K=1, N=1, sizes={"dim": 64}))["dim"] == 64


def test_table_with_baseline_rate_and_probe_columns():
    record = _record({"torch": 8.0, "auto": 4.0}, mismatches={"symm": 0.5})
    record.update(
        baseline="torch", rate={"unit": "tokens", "per_call": 2048.0}, columns={"mem": "mem MiB"}
    )
    record["providers"]["auto"].update(tokens_per_s=512000.0, mem=1.5)
    record["providers"]["torch"].update(tokens_per_s=256000.0)
    lines = format_table(record, META).splitlines()
    assert lines[1].split()[10:] == ["tokens/s", "vs", "torch", "%", "of", "roof", "mem", "MiB"]
    # auto: 2048 tokens / 4 ms, 8/4 = 2x torch, no roof; torch has no "mem" field
    assert lines[3].split()[6:] == ["512000", "2.00x", "-", "1.5"]
    assert lines[2].split()[6:] == ["256000", "1.00x", "-", "-"]
    assert "!!! MISMATCH: symm differs from torch" in lines[-1]


# --- fp8 (issue 27) -------------------------------------------------------------------------

FP8_ARGV = ["ag_matmul", "matmul_rs", "--M", "32", "--K", "32", "--N", "16", "--rounds", "2",
            "--warmup", "1"]  # fmt: skip


@pytest.mark.parametrize("dtype", ["fp8-rowwise", "fp8-tensorwise"])
def test_cli_fp8_every_provider_runs_and_passes_its_check(dtype, worlds, tmp_path, capsys):
    """Both fp8 dtypes, W=2 on gloo: every provider (tp_kernels' backends on the public scaled
    ops, auto with its casts, torchao's Float8Linear under PyTorch's styles, the roof) runs,
    is checked against the reference within the fp8 tolerance and is timed; no prediction on a
    CPU (the cost model has no fp8 rate for it)."""
    pytest.importorskip("torchao.float8")
    from tp_kernels.bench.ops_fp8 import fp8_tolerance

    path = tmp_path / f"{dtype}.json"
    assert main([*FP8_ARGV, "--dtype", dtype, "--out", str(path)], world=worlds(2)) == 0
    printed = capsys.readouterr().out
    assert f"== ag_matmul  a_shard[16,32]  b[32,16]  out[32,16]  {dtype}  world=2" in printed
    assert f"== matmul_rs  a[32,32]  b[32,16]  out[16,16]  {dtype}  world=2" in printed
    report = json.loads(path.read_text())
    assert report["dtype"] == dtype
    symm_ok = tp_kernels.available_backends()["symm"] == "ok"
    expected = ["reference", "pipelined", *(["symm"] if symm_ok else []), "auto", "auto+cast",
                "torchao", "roof"]  # fmt: skip
    for bench, roundings in zip(report["benchmarks"], (1, 2 + 1)):
        assert bench["mismatches"] == {}, bench["name"]
        assert list(bench["providers"]) == expected
        assert bench["tolerance"] == pytest.approx(fp8_tolerance(32, roundings))
        assert "no fp8 rate" in bench["model_note"]
        for name, rec in bench["providers"].items():
            assert rec["checked"] is (name != "roof")
            assert rec["max_abs_err"] <= bench["tolerance"]
            assert len(rec["times_ms"]) == 2 and all(t > 0 for t in rec["times_ms"])
            assert rec["model_ms"] is None


def _fp8_outputs(dtype: str) -> dict[str, list[torch.Tensor]]:
    """Every fp8 ag_matmul provider's output on this rank (one call each)."""
    from tp_kernels.bench import ops

    case = ops.ag_matmul(BenchConfig(M=32, K=32, N=16, dtype=dtype), dist.group.WORLD, CPU)
    return {name: case.providers[name]() for name in case.providers}


@pytest.mark.parametrize("dtype", ["fp8-rowwise", "fp8-tensorwise", "mxfp8"])
def test_fp8_outputs_are_the_scaled_product_of_the_bf16_inputs(dtype, worlds):
    """The check above compares providers with one another; this one ties them to the inputs:
    the reference's fp8 all-gather-matmul is within fp8's quantization error of the bf16
    product it stands for (e4m3 keeps 3 mantissa bits: each operand within 2^-4 relative;
    the products' errors add up like a random walk, so 2^-3 of the output's rms bounds it), and
    torchao's Float8Linear (MXFP8Linear) under PyTorch's styles gives the reference's output bit
    for bit (the same casts, the same GEMM rows)."""
    pytest.importorskip("torchao.float8")
    outs = worlds(2).run(_fp8_outputs, dtype)[0]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(32, 32, generator=gen).bfloat16().float()
    b = (torch.randn(16, 32, generator=torch.Generator().manual_seed(1)) / math.sqrt(32)).t()
    want = a @ b.bfloat16().float()
    got = outs["reference"][0].float()
    assert got.shape == (32, 16) and got.dtype == torch.float32
    assert ((got - want).norm() / want.norm()).item() < 2**-3
    assert torch.equal(outs["torchao"][0], outs["reference"][0])


def test_cli_fp8_rejects_bad_arguments(capsys):
    argv = ["ag_matmul", "--dtype", "fp8-rowwise"]
    for flag in ("--K", "--N"):
        with pytest.raises(SystemExit):
            parse_args([*argv, flag, "24"])
        err = capsys.readouterr().err
        assert f"{flag} 24: --dtype fp8-rowwise needs a multiple of 16" in err
    with pytest.raises(SystemExit):
        parse_args(["llama_block", "--dtype", "fp8-tensorwise"])
    assert "['llama_block'] take no fp8 dtype; only ['ag_matmul', 'matmul_rs'] do" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):  # torchao's provider exists under fp8 dtypes only
        parse_args(["ag_matmul", "--dtype", "bf16", "--providers", "torchao"])
    assert "--providers: ['torchao'] unknown" in capsys.readouterr().err
    # "all" means the benchmarks that take the dtype
    assert parse_args(["--dtype", "fp8-rowwise"]).benchmarks == ["ag_matmul", "matmul_rs"]
    assert parse_args([*argv, "--providers", "torchao,roof"]).providers == ["torchao", "roof"]


def test_fp8_predictions_on_a_gpu_the_model_knows(monkeypatch):
    """On an H100 the fp8 rows get the cost model's times as ``bench model --fp8`` computes
    them: the fused fp8 schedules, torchao's unfused call (bf16 gather) plus the cast of all
    ``W*m`` rows, ``auto+cast`` the best schedule plus the cast of the rank's own ``m`` rows."""
    from tp_kernels import cost
    from tp_kernels.bench.ops_fp8 import fp8_predictions_ms

    h100 = cost.DEVICES["h100"]
    monkeypatch.setattr(cost, "device_spec", lambda device: h100)
    m, k, n, w = 1024, 4096, 3584, 8
    runnable = ["reference", "pipelined", "symm", "torch_symm_mem"]
    times, note = fp8_predictions_ms("all_gather_matmul", m, k, n, w, runnable, device=CPU)
    fused = cost.op_cost("all_gather_matmul", m, k, n, w, "fp8", h100)
    unfused = cost.op_cost("all_gather_matmul", m, k, n, w, "fp8", h100, wire="bf16")
    best = min(fused.backends_s.values()) * 1e3
    assert times["auto"] == pytest.approx(best)
    assert times["auto+cast"] == pytest.approx(best + cost.quantize_s(m, k, h100) * 1e3)
    want = (unfused.backends_s["reference"] + cost.quantize_s(w * m, k, h100)) * 1e3
    assert times["torchao"] == pytest.approx(want)
    assert times["roof"] == pytest.approx(fused.compute_s * 1e3) and "H100" in note
    assert times["torchao"] > times["auto+cast"]  # a bf16 gather and 8x the rows to cast


# --- MXFP8 (issue 36) -----------------------------------------------------------------------

MX_ARGV = ["ag_matmul", "matmul_rs", "--M", "64", "--K", "64", "--N", "32", "--rounds", "2",
           "--warmup", "1", "--dtype", "mxfp8"]  # fmt: skip


def test_cli_mxfp8_every_provider_runs_and_passes_its_check(worlds, tmp_path, capsys):
    """``--dtype mxfp8``, W=2 on gloo: tp_kernels' block-scaled path on each backend that takes
    block scales (operands cast by torchao's MXTensor.to_mx), auto with its casts, torchao's
    MXFP8Linear under PyTorch's styles and the MX GEMM roof run, each checked against the
    reference; the table says the kernels are EMULATED here and the model has no rate."""
    pytest.importorskip("torchao.prototype.moe_training")
    from tp_kernels.bench.ops_fp8 import fp8_tolerance

    path = tmp_path / "mxfp8.json"
    assert main([*MX_ARGV, "--out", str(path)], world=worlds(2)) == 0
    printed = capsys.readouterr().out
    assert "== ag_matmul  a_shard[32,64]  b[64,32]  out[64,32]  mxfp8  world=2" in printed
    assert "== matmul_rs  a[64,64]  b[64,32]  out[32,32]  mxfp8  world=2" in printed
    assert printed.count("(EMULATED: torchao's MX casts and GEMMs in torch's ops") == 2
    report = json.loads(path.read_text())
    symm_ok = tp_kernels.available_backends()["symm"] == "ok"
    expected = ["reference", "pipelined", *(["symm"] if symm_ok else []), "auto", "auto+cast",
                "torchao", "roof"]  # fmt: skip
    for bench, roundings in zip(report["benchmarks"], (1, 2 + 1)):
        assert bench["mismatches"] == {}, bench["name"]
        assert list(bench["providers"]) == expected
        assert bench["tolerance"] == pytest.approx(fp8_tolerance(64, roundings))
        assert "no mxfp8 rate" in bench["model_note"] and "EMULATED" in bench["note"]
        for name, rec in bench["providers"].items():
            assert rec["checked"] is (name != "roof")
            assert rec["max_abs_err"] <= bench["tolerance"]
            assert len(rec["times_ms"]) == 2 and all(t > 0 for t in rec["times_ms"])


def test_cli_mxfp8_takes_whole_mx_blocks(capsys):
    for flag in ("--K", "--N"):
        with pytest.raises(SystemExit):
            parse_args(["ag_matmul", "--dtype", "mxfp8", flag, "48"])
        err = capsys.readouterr().err
        assert f"{flag} 48: --dtype mxfp8 needs a multiple of 32 (the fused MXFP8 path" in err
    assert parse_args(["--dtype", "mxfp8"]).benchmarks == ["ag_matmul", "matmul_rs"]


def test_mxfp8_predictions_on_blackwell_and_none_on_hopper(monkeypatch):
    """On a B200 the mxfp8 rows get ``bench model --mxfp8``'s times: the block-scaled schedules
    the model has (reference, pipelined, symm: its kernels take the scales on Blackwell),
    torchao's path as torchtitan's (bf16 gather, the MX cast of all W*m rows); on an H100 none
    (no MX tensor cores)."""
    from tp_kernels import cost
    from tp_kernels.bench.ops_fp8 import fp8_predictions_ms

    b200 = cost.DEVICES["b200"]
    monkeypatch.setattr(cost, "device_spec", lambda device: b200)
    m, k, n, w = 1024, 8192, 7168, 8
    runnable = ["reference", "pipelined", "symm"]
    times, note = fp8_predictions_ms(cost.AG, m, k, n, w, runnable, device=CPU, dtype="mxfp8")
    fused = cost.op_cost(cost.AG, m, k, n, w, "mxfp8", b200)
    titan = cost.op_cost(cost.AG, m, k, n, w, "mxfp8", b200, wire="bf16")
    assert "mxfp8" in note
    assert times["symm"] == pytest.approx(fused.backends_s["symm"] * 1e3)
    assert times["auto"] == pytest.approx(min(fused.backends_s.values()) * 1e3)
    cast_all = cost.quantize_s(w * m, k, b200, "mxfp8")
    assert times["torchao"] == pytest.approx((titan.backends_s["reference"] + cast_all) * 1e3)
    monkeypatch.setattr(cost, "device_spec", lambda device: cost.DEVICES["h100"])
    times, note = fp8_predictions_ms(cost.AG, m, k, n, w, runnable, device=CPU, dtype="mxfp8")
    assert times == {} and "no mxfp8 rate for H100 SXM5" in note
