"""The cost model (tp_kernels.cost) and its tables (python -m tp_kernels.bench model): the formulas
checked by hand, each simulated part (waves, two streams, the copy engine) and each schedule on
cases small enough to work out on paper, the CLI's tables and errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tp_kernels import cost, tiling
from tp_kernels.bench import main as bench_main
from tp_kernels.bench import model

AG, RS = cost.AG, cost.RS
H100 = cost.DEVICES["h100"]


def tiny(**changes) -> cost.DeviceSpec:
    """A GPU of 2 SMs at 1 TFLOP/s each (bf16), no overheads unless asked: times by hand."""
    base = dataclasses.replace(
        H100, name="tiny", peak_tflops={"bf16": 2.0, "fp16": 2.0, "fp32": 1.0}, sms=2,
        gemm_efficiency=1.0, tile_overhead_s=0.0, link_efficiency=1.0, nccl_efficiency=1.0,
        hbm_efficiency=1.0, copy_latency_s=0.0, nccl_latency_s=0.0, barrier_s=0.0, nccl_sms=0,
        consumer_rate=1.0, producer_rate=1.0,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def problem(dev, m, k, ns, w=2, dtype="bf16") -> cost.Problem:
    return cost.Problem(m, k, tuple(ns), w, dtype, dev)


def tile_s(dev, bm, bn, k) -> float:
    return 2 * bm * bn * k / (dev.peak_tflops["bf16"] * 1e12 / dev.sms)


def test_compute_and_communication_follow_the_formulas():
    c = cost.op_cost(AG, 1024, 8192, 1280, 8, "bf16", H100)
    flops = 2 * 8 * 1024 * 8192 * 1280
    assert math.isclose(c.compute_s, flops / (989.4e12 * H100.gemm_efficiency))
    assert math.isclose(c.comm_s, 7 * 1024 * 8192 * 2 / (450e9 * H100.link_efficiency))
    assert c.speed_of_light_s == max(c.compute_s, c.comm_s)
    assert c.sequential_s == c.compute_s + c.comm_s
    # The reduce-scatter moves the N-wide partials, not the K-wide input.
    r = cost.op_cost(RS, 1024, 1280, 8192, 8, "bf16", H100)
    assert math.isclose(r.comm_s, c.comm_s) and math.isclose(r.compute_s, c.compute_s)
    for result in (c, r):
        assert set(result.schedules_s) == set(cost.SCHEDULES[AG if result is c else RS])
        for name, t in result.schedules_s.items():  # nothing beats the speed of light
            assert result.speed_of_light_s <= t, name


def test_a_gemm_takes_whole_waves_of_tiles():
    dev = tiny()
    one = tile_s(dev, 128, 256, 1024)

    def alone(rows, tile, cublas=False):
        return cost._alone_s(cost._gemm(dev, "bf16", rows, 1024, 256, cublas=cublas, tile=tile), 2)

    # 2 SMs: two 128x256 tiles are one wave, three are two.
    assert alone(256, cost.TILES[0]) == pytest.approx(one)
    assert alone(384, cost.TILES[0]) == pytest.approx(2 * one)
    # One tile alone leaves an SM idle: cuBLAS splits K in two and pays an fp32 pass over the
    # two partials and the result (3 x 128x256 x 4 bytes at the memory's rate); Triton does not.
    tail = 3 * 128 * 256 * 4 / (dev.hbm_gb_s * 1e9)
    assert alone(128, cost.TILES[0], cublas=True) == pytest.approx(one / 2 + tail)
    assert alone(128, cost.TILES[0]) == pytest.approx(one)
    # Left to choose, the Triton GEMM takes two 128x128 tiles (90% of the rate, one wave).
    assert cost.gemm_s(128, 1024, 256, "bf16", dev, cublas=False) == pytest.approx(one / 2 / 0.9)


def test_the_kernels_tiles_run_at_their_measured_rate_against_cublas():
    """A Triton tile takes 1/consumer_rate (1/producer_rate) of cuBLAS's time at the same tile;
    the H200's figures are its measurement (cuBLAS 0.620 ms, the consumer 0.737 ms and the
    producer 0.699 ms at M=8192 N=3584 K=8192 bf16), the other GPUs' say they assume it."""
    dev = tiny(consumer_rate=0.5, producer_rate=0.8)
    one = tile_s(dev, 128, 256, 1024)
    kernel = cost._gemm(dev, "bf16", 256, 1024, 256, cublas=False, tile=cost.TILES[0])
    assert cost._alone_s(kernel, 2) == pytest.approx(2 * one)
    p = problem(dev, 128, 1024, [256])
    assert cost._producer_tile(p)[2] == pytest.approx(one / 0.8)
    h200 = cost.DEVICES["h200"]
    assert h200.consumer_rate == pytest.approx(0.620 / 0.737)
    assert h200.producer_rate == pytest.approx(0.620 / 0.699)
    for figure in ("gemm_efficiency", "consumer_rate", "producer_rate"):
        assert h200.sources[figure].startswith("measured on one H200"), figure
        assert H100.sources[figure].startswith("assumed"), figure
    # The model's cuBLAS at the measured shape is what was measured, within 1%.
    measured = cost.gemm_s(8192, 8192, 3584, "bf16", h200, cublas=True)
    assert measured == pytest.approx(0.620e-3, rel=0.01)


def test_the_models_tiles_are_on_the_kernels_menu():
    """Every rated tile shape is one the kernels take (one off the menu would drop out of the
    model's tiles unseen), in the menu's order."""
    assert {(bm, bn) for bm, bn, _ in cost.TILES} == set(cost._TILE_RATES)
    menu = [(bm, bn) for bm, bn, *_ in tiling.gemm_shapes("16bit")]
    assert [menu.index(t[:2]) for t in cost.TILES] == sorted(menu.index(t[:2]) for t in cost.TILES)


def test_two_streams_share_the_sms_and_copies_take_turns():
    dev = tiny()
    g = cost._Gemm(1, 1.0)
    # One tile on each stream: both SMs busy at once. On one stream: one after the other.
    both = cost._run_streams([[("gemm", g, ())], [("gemm", g, ())]], cost._Timeline(dev))
    assert both == pytest.approx(1.0)
    one = cost._run_streams([[("gemm", g, ()), ("gemm", g, ())]], cost._Timeline(dev))
    assert one == pytest.approx(2.0)
    # Copies from two streams do not overlap; a step waits for its dependency on the other.
    copies = [[("copy", 1.0, ())], [("copy", 1.0, ()), ("delay", 0.5, ((0, 0),))]]
    assert cost._run_streams(copies, cost._Timeline(dev)) == pytest.approx(2.5)
    with pytest.raises(AssertionError, match="never runs"):
        cost._run_streams([[("delay", 1.0, ((0, 1),)), ("delay", 1.0, ())]], cost._Timeline(dev))


def test_the_copy_engine_schedule_waits_for_chunks_and_hides_them_behind_the_own_tiles():
    k = 1024
    slow = tiny(link_gb_s=0.5)  # the link is the bottleneck
    p = problem(slow, 128, k, [256])
    # The own shard is copied twice before the barrier: into its buffer and into A.
    own_copies = 2 * (2 * 128 * k * 2 / (slow.hbm_gb_s * 1e9))
    shard = 128 * k * 2 / 0.5e9
    t = tile_s(slow, 128, 256, k)
    # One chunk (one M tile per shard): the peer's tile starts when its shard has landed.
    assert cost.copy_engine_chunks(p, 4) == 1
    assert cost.symm_copy_engine_s(p) == pytest.approx(own_copies + shard + t)
    # A fast link: the peer's tile starts as soon as its shard lands, beside the own tile.
    fast = tiny(link_gb_s=1e3)
    assert cost.symm_copy_engine_s(problem(fast, 128, k, [256])) == pytest.approx(
        own_copies + 128 * k * 2 / 1e12 + t
    )
    # Per-copy latency is paid once per copy, in sequence: the own shard's two, then the peer's.
    late = tiny(link_gb_s=0.5, copy_latency_s=1e-3)
    assert cost.symm_copy_engine_s(problem(late, 128, k, [256])) == pytest.approx(
        2 * 1e-3 + own_copies + 1e-3 + shard + t
    )


def test_the_copy_engine_consumer_takes_up_to_three_right_hand_matrices_in_one_launch():
    """Two right-hand matrices (w1/w3) over a slow link: one launch holds both products' tiles,
    so the own shard's two tiles run on the 2 SMs while the peer's shard copies and the peer's
    two tiles after it: one tile after the copy, where a launch per matrix would add a second
    launch's wave after the first (as the model had it before). A fourth matrix is a launch of
    its own, after."""
    k = 1024
    dev = tiny(link_gb_s=0.5)
    own_copies = 2 * (2 * 128 * k * 2 / (dev.hbm_gb_s * 1e9))
    shard = 128 * k * 2 / 0.5e9
    t = tile_s(dev, 128, 256, k)
    assert cost.symm_copy_engine_s(problem(dev, 128, k, [256, 256])) == pytest.approx(
        own_copies + shard + t
    )
    # Four: the first launch's three peer tiles take two waves of the 2 SMs after the copy.
    four = problem(dev, 128, k, [256, 256, 256, 256])
    fourth = cost.gemm_s(2 * 128, k, 256, "bf16", dev, cublas=False)
    assert cost.symm_copy_engine_s(four) == pytest.approx(own_copies + shard + 2 * t + fourth)


def test_chunks_pay_where_a_tile_can_start_on_a_half_shard_sooner_than_a_copy_costs():
    """Shards of 512 rows (4 M tiles of 128 on the 2 SMs) over a slow link: in 2 chunks of 256
    rows the first two peer tiles run while the second half copies, so the call ends one tile
    sooner; that pays while a copy's latency is under a tile (4 chunks round up to the same 2)."""
    k = 1024
    t = tile_s(tiny(), 128, 256, k)
    free = problem(tiny(link_gb_s=0.5), 512, k, [256])
    assert cost._launch_tile(free, (256,))[:2] == (128, 256)
    one, two = cost._copy_engine_s(free, 1), cost._copy_engine_s(free, 2)
    assert one - two == pytest.approx(t)
    assert cost._copy_engine_s(free, 4) == pytest.approx(two)
    assert cost.copy_engine_chunks(free, 4) == 2
    assert cost.copy_engine_chunks(free, 1) == 1
    costly = problem(tiny(link_gb_s=0.5, copy_latency_s=2 * t), 512, k, [256])
    assert cost.copy_engine_chunks(costly, 4) == 1


def test_the_reduce_scatter_producer_pushes_each_block_then_reduces():
    # W=2, m=256 (two M tiles), n=256, 2 SMs: both tiles owed to the peer are done at t and
    # pushed as one block while the own tiles compute; the push (256 x 256 x 2 bytes at 1 GB/s)
    # outlasts them; then the reduction pass over 2 slots and the result.
    k = 1024
    dev = tiny(link_gb_s=1.0)
    p = problem(dev, 256, k, [256])
    t = tile_s(dev, 128, 256, k)
    push = 256 * 256 * 2 / 1e9
    reduce = 3 * 256 * 256 * 2 / (dev.hbm_gb_s * 1e9)
    assert cost.symm_reduce_scatter_s(p) == pytest.approx(t + push + reduce)


def test_the_reduce_scatter_producer_is_simulated_on_the_kernels_tile():
    """The producer's tile is the kernel's (tiling.producer_shape): 128x256 in 16 bits once
    N >= 256, but 128x128 in fp32, whose stages would not fit in shared memory at 128x256, and in
    fp8, whose two accumulators would spill at 128x256."""
    assert cost._producer_tile(problem(H100, 1024, 3584, [8192]))[:2] == (128, 256)
    for dtype in ("fp32", "fp8"):
        assert cost._producer_tile(problem(H100, 1024, 3584, [8192], dtype=dtype))[:2] == (128, 128)


def test_reference_and_the_decompositions_on_paper():
    dev = tiny(link_gb_s=1.0)
    k, n = 1024, 256
    p = problem(dev, 256, k, [n])
    wave = tile_s(dev, 128, 256, k)
    # reference AG: the all-gather (256 rows x K) then a 512-row GEMM: 4 tiles on 2 SMs.
    assert cost.reference_s(p, AG) == pytest.approx(256 * k * 2 / 1e9 + 2 * wave)
    # torch's AG: the own shard's GEMM (2 tiles, one wave) while the peer's shard is pulled,
    # then the peer's GEMM; the own shard's two local copies (into its buffer, into A) queue
    # on the copy engine too.
    local = 2 * 256 * k * 2 / (dev.hbm_gb_s * 1e9)
    pulled = local + 256 * k * 2 / 1e9
    assert cost.torch_symm_mem_s(p, AG) == pytest.approx(max(local + wave, pulled) + wave)


def test_fp8_peaks_are_the_datasheets_dense_twice_bf16():
    for name in ("h100", "h200", "b200"):
        peak = cost.DEVICES[name].peak_tflops
        assert peak["fp8"] == pytest.approx(2 * peak["bf16"], rel=1e-4)
    assert H100.peak_tflops["fp8"] == cost.DEVICES["h200"].peak_tflops["fp8"] == 1978.9
    assert "fp8" not in cost.DEVICES["a100"].peak_tflops  # no fp8 tensor cores
    assert H100.sources["fp8"].startswith("assumed")


def test_fp8_gathers_packed_rows_and_reduce_scatters_bf16_partials():
    """The fp8 all-gather moves K + 16 bytes a row (the packed row of backends.scaled) against
    bf16's 2 K; torchao's unfused path gathers bf16; the reduce-scatter moves bf16 partials in
    both; the fp8 GEMM takes half bf16's time at the same efficiency."""
    m, k, n = 1024, 8192, 1280
    bf16 = cost.op_cost(AG, m, k, n, 8, "bf16", H100)
    fp8 = cost.op_cost(AG, m, k, n, 8, "fp8", H100)
    assert fp8.comm_s == pytest.approx(bf16.comm_s * (k + 16) / (2 * k))
    flops = 2 * 8 * m * k * n
    assert fp8.compute_s == pytest.approx(flops / (1978.9e12 * H100.gemm_efficiency))
    assert fp8.compute_s == pytest.approx(bf16.compute_s / 2, rel=1e-4)  # 1978.9 vs 2 x 989.4
    torchao = cost.op_cost(AG, m, k, n, 8, "fp8", H100, wire="bf16")
    assert torchao.comm_s == pytest.approx(bf16.comm_s)
    assert torchao.compute_s == pytest.approx(fp8.compute_s)
    assert cost.op_cost(AG, m, k, n, 8, "fp8", H100, wire="fp8") == fp8  # the default wire
    rs16 = cost.op_cost(RS, m, n, k, 8, "bf16", H100)
    rs8 = cost.op_cost(RS, m, n, k, 8, "fp8", H100)
    assert rs8.comm_s == pytest.approx(rs16.comm_s)
    assert rs8.compute_s == pytest.approx(fp8.compute_s)
    # NCCL's collective in reference moves the same bytes as the comm above.
    gemm = cost.gemm_s(8 * m, k, n, "fp8", H100, cublas=True)
    nccl = H100.nccl_latency_s + 7 * m * (k + 16) / (450e9 * H100.nccl_efficiency)
    assert fp8.schedules_s["reference"] == pytest.approx(nccl + gemm)
    nccl16 = H100.nccl_latency_s + 7 * m * 2 * k / (450e9 * H100.nccl_efficiency)
    assert torchao.schedules_s["reference"] == pytest.approx(nccl16 + gemm)


def test_fp8_schedules_copy_the_packed_rows():
    """symm's copy-engine all-gather by hand (the case above's), in fp8: the own shard's two
    copies and the peer's shard are K + 16 bytes a row, the tile at the fp8 rate."""
    k = 1024
    slow = tiny(link_gb_s=0.5, peak_tflops={"bf16": 2.0, "fp16": 2.0, "fp32": 1.0, "fp8": 4.0})
    p = problem(slow, 128, k, [256], dtype="fp8")
    assert (p.row_bytes, p.out_e) == (k + 16, 2)
    own_copies = 2 * (2 * 128 * (k + 16) / (slow.hbm_gb_s * 1e9))
    shard = 128 * (k + 16) / 0.5e9
    t = tile_s(slow, 128, 256, k) / 2
    assert cost.symm_copy_engine_s(p) == pytest.approx(own_copies + shard + t)
    # The reduce-scatter pushes bf16 partials: with the link the bottleneck, as bf16's pushes.
    rs8, rs16 = (problem(slow, 128, k, [256], dtype=d) for d in ("fp8", "bf16"))
    push = 128 * 256 * 2 / 0.5e9
    reduce = 3 * 128 * 256 * 2 / (slow.hbm_gb_s * 1e9)  # the two slots read, the sum written
    # fp8's producer tile is 128x128 (rated 0.9): the peer's block is the first wave of two, and
    # its push hides the second; bf16's one wave of 128x256 tiles takes 2 t.
    first_wave = tile_s(slow, 128, 128, k) / 2 / 0.9
    assert cost.symm_reduce_scatter_s(rs8) == pytest.approx(first_wave + push + reduce)
    assert cost.symm_reduce_scatter_s(rs16) - cost.symm_reduce_scatter_s(rs8) == pytest.approx(
        2 * t - first_wave
    )


def test_quantize_is_one_memory_pass():
    rows, k = 2048, 4096
    assert cost.quantize_s(rows, k, H100) == pytest.approx(
        rows * (3 * k + 4) / (3350e9 * H100.hbm_efficiency)
    )


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="op: got 'gemm'"):
        cost.op_cost("gemm", 1, 1, 1, 2, "bf16", H100)
    with pytest.raises(ValueError, match="dtype: got 'fp4'"):
        cost.op_cost(AG, 1, 1, 1, 2, "fp4", H100)
    with pytest.raises(ValueError, match="A100 SXM4 has no fp8 rate"):
        cost.op_cost(AG, 1, 16, 1, 2, "fp8", cost.DEVICES["a100"])
    with pytest.raises(ValueError, match="wire: got 'fp8' for a bf16 all_gather_matmul"):
        cost.op_cost(AG, 1, 16, 1, 2, "bf16", H100, wire="fp8")
    with pytest.raises(ValueError, match="wire: got 'bf16' for a fp8 matmul_reduce_scatter"):
        cost.op_cost(RS, 1, 16, 1, 2, "fp8", H100, wire="bf16")
    with pytest.raises(ValueError, match=r"got \(0, 1, 1, 2\)"):
        cost.op_cost(AG, 0, 1, 1, 2, "bf16", H100)
    with pytest.raises(ValueError, match=r"ns: got \(1, 2\)"):
        cost.op_cost(AG, 1, 1, 4, 2, "bf16", H100, ns=[1, 2])


def test_every_figure_names_its_source():
    numeric = [f.name for f in dataclasses.fields(cost.DeviceSpec) if f.type != "str"]
    for spec in cost.DEVICES.values():
        assert spec.source.startswith("https://") and spec.peak_tflops["bf16"] > 0
        for name in numeric:
            if name == "sources":
                continue
            where = spec.sources[name]
            assert where.startswith(("https://", "assumed: ", "measured on one ")), (
                spec.name,
                name,
            )


def test_a_cpu_is_not_tiled_and_every_backend_has_a_prediction():
    cpu = cost.measure_cpu()
    assert cpu.sms is None
    for op in (AG, RS):
        c = cost.op_cost(op, 64, 32, 16, 2, "fp32", cpu)
        assert set(c.backends_s) == {"reference", "pipelined", "symm", "torch_symm_mem"}
        assert all(t > 0 for t in c.backends_s.values())
    one = cost.op_cost(AG, 64, 32, 16, 1, "fp32", cpu)
    assert len(set(one.backends_s.values())) == 1  # one rank: the GEMM alone, whatever backend


def test_schedule_table_covers_the_llama_shapes_and_marks_where_fusion_loses(capsys):
    assert bench_main(["model"]) == 0
    out = capsys.readouterr().out
    # wq/wk/wv at TP=8 on 70B: (64 + 2 * 8) heads x 128 / 8 columns per rank; w2: 28672 / 8.
    assert "llama3-70b   8192    attention.wq/wk/wv  1024x8192x1280" in out
    assert "llama3-405b  2048    feed_forward.w2  256x6656x16384" in out
    table = model.schedule_rows(H100, 8)
    assert [len(rows) for rows in table.values()] == [12, 12]  # 3 models x 2 token counts x 2
    for rows in table.values():
        for *_, times, verdict in rows:
            fused_best = min(t for s, t in times.items() if s != "reference")
            loses = fused_best >= times["reference"]
            assert verdict.startswith("NONE") == loses
            assert loses or times[verdict] == fused_best


def test_fp8_table_compares_fused_fp8_with_torchaos_unfused_path_and_fused_bf16(capsys):
    assert bench_main(["model", "--fp8", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cost model (MODELED, nothing measured): fp8 against bf16")
    assert "Llama-3 TP=8 on H200 SXM" in out and "dense fp8 1978.9 and bf16 989.4" in out
    assert "llama3-70b   8192    attention.wq/wk/wv  AG+mm  1024x8192x1280" in out
    assert "llama3-405b  2048    feed_forward.w2     mm+RS  256x6656x16384" in out
    assert "per layer (forward: wq/wk/wv, wo, w1/w3, w2), ms:" in out
    assert "fp8: assumed until measured" in out
    h200 = cost.DEVICES["h200"]
    rows = model.scaled_rows(h200, 8)
    assert len(rows) == 24  # 3 models x 2 token counts x 4 forward fused ops
    assert {(r.model, r.tokens) for r in rows} == {
        (name, t) for name in model.MODELS for t in model.TOKENS
    }
    for r in rows:
        ns = None
        if r.op == AG:
            ns = next(w for name, _, w, _ in model._linears(model.MODELS[r.model], 8)
                      if name == r.linear)  # fmt: skip
        bf16 = cost.op_cost(r.op, r.m, r.k, r.n, 8, "bf16", h200, ns=ns).backends_s
        fp8 = cost.op_cost(r.op, r.m, r.k, r.n, 8, "fp8", h200, ns=ns).backends_s
        wire = "bf16" if r.op == AG else None
        unfused = cost.op_cost(r.op, r.m, r.k, r.n, 8, "fp8", h200, ns=ns, wire=wire)
        # torchao casts every gathered row (W*m) after a bf16 gather; the fused gather casts the
        # rank's m rows before they travel; a reduce-scatter's W*m local rows are cast in both.
        own = r.m if r.op == AG else 8 * r.m
        assert r.unfused_s == pytest.approx(
            unfused.schedules_s["reference"] + cost.quantize_s(8 * r.m, r.k, h200)
        )
        assert r.fused_s == pytest.approx(
            min(fp8[b] for b in model.FUSED) + cost.quantize_s(own, r.k, h200)
        )
        assert r.bf16_fused_s == min(bf16[b] for b in model.FUSED)
        assert r.sol_s <= r.fused_s
    # Where the GEMMs bound the call (70B's w1/w3 at 8192 tokens), fp8 nearly halves bf16.
    w13 = next(r for r in rows if (r.model, r.tokens, r.linear) ==
               ("llama3-70b", 8192, "feed_forward.w1/w3"))  # fmt: skip
    assert 1.8 < w13.bf16_fused_s / w13.fused_s < 2.0


def test_fp8_table_refuses_a_gpu_without_fp8_and_a_model_plan(capsys):
    for argv in (["--fp8", "--gpu", "a100"], ["--fp8", "--model", "llama3-8b"]):
        with pytest.raises(SystemExit) as info:
            model.main(argv)
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "A100 SXM4 has no fp8 tensor cores" in err and "leave out --model" in err


# --- MXFP8 (issue 36) ------------------------------------------------------------------------

B200, GB200 = cost.DEVICES["b200"], cost.DEVICES["gb200"]


def test_mxfp8_rates_are_blackwells_fp8_and_hopper_has_none():
    """Dense MXFP8 is the datasheet's dense FP8 on Blackwell; Hopper and Ampere have no MX tensor
    cores, so the model has no rate there and refuses the dtype rather than invent one."""
    for spec in (B200, GB200):
        assert spec.peak_tflops["mxfp8"] == spec.peak_tflops["fp8"] == 2 * spec.peak_tflops["bf16"]
        assert "TransformerEngine/support_matrix" in spec.source
        assert spec.sources["mxfp8"].startswith("assumed")
    assert GB200.peak_tflops["mxfp8"] == 5000.0 and B200.peak_tflops["mxfp8"] == 4500.0
    for name in ("h100", "h200", "a100"):
        assert "mxfp8" not in cost.DEVICES[name].peak_tflops
        with pytest.raises(ValueError, match="has no mxfp8 rate"):
            cost.op_cost(AG, 32, 64, 32, 2, "mxfp8", cost.DEVICES[name])


def test_mxfp8_gathers_mx_rows_and_runs_the_block_scaled_schedules():
    """The MXFP8 all-gather moves tiling.mx_row_bytes(K) a row (K + K/32 padded to 16: about
    0.52 of bf16's 2 K), torchtitan's gather bf16; the reduce-scatter bf16 partials; the GEMM
    at the MXFP8 rate; reference, pipelined and symm (its kernels take the block scales on
    Blackwell, with the mxfp8 tile menu) run block scales, torch_symm_mem does not, and on a CPU
    symm's torch schedule is not simulated."""
    m, k, n = 1024, 8192, 1280
    bf16 = cost.op_cost(AG, m, k, n, 8, "bf16", B200)
    mx = cost.op_cost(AG, m, k, n, 8, "mxfp8", B200)
    assert tiling.mx_row_bytes(k) == k + k // 32  # 256 scale bytes: already a multiple of 16
    assert cost.Problem(m, k, (n,), 8, "mxfp8", B200).row_bytes == tiling.mx_row_bytes(k)
    assert mx.comm_s == pytest.approx(bf16.comm_s * tiling.mx_row_bytes(k) / (2 * k))
    assert 0.51 < mx.comm_s / bf16.comm_s < 0.52
    assert mx.compute_s == pytest.approx(2 * 8 * m * k * n / (4500e12 * B200.gemm_efficiency))
    assert set(mx.schedules_s) == set(mx.backends_s) == {"reference", "pipelined", "symm"}
    cpu = cost.DeviceSpec(**{**vars(B200), "name": "cpu-like", "sms": None})
    assert set(cost.op_cost(AG, m, k, n, 8, "mxfp8", cpu).backends_s) == {"reference", "pipelined"}
    nccl = B200.nccl_latency_s + 7 * m * tiling.mx_row_bytes(k) / (900e9 * B200.nccl_efficiency)
    gemm = cost.gemm_s(8 * m, k, n, "mxfp8", B200, cublas=True)
    assert mx.schedules_s["reference"] == pytest.approx(nccl + gemm)
    titan = cost.op_cost(AG, m, k, n, 8, "mxfp8", B200, wire="bf16")
    assert titan.comm_s == pytest.approx(bf16.comm_s)
    rs = cost.op_cost(RS, m, n, k, 8, "mxfp8", B200)
    assert rs.comm_s == pytest.approx(cost.op_cost(RS, m, n, k, 8, "bf16", B200).comm_s)
    # An odd K: the scale bytes padded to 16.
    assert cost.Problem(1, 4128, (32,), 2, "mxfp8", B200).row_bytes == 4128 + 144


def test_mxfp8_cast_writes_the_packed_row():
    rows, k = 2048, 4096
    assert cost.quantize_s(rows, k, B200, "mxfp8") == pytest.approx(
        rows * (2 * k + tiling.mx_row_bytes(k)) / (8000e9 * B200.hbm_efficiency)
    )
    with pytest.raises(ValueError, match="dtype: got 'bf16'"):
        cost.quantize_s(rows, k, B200, "bf16")


def test_mxfp8_table_prints_blackwell_against_torchtitan_and_fused_bf16(capsys):
    """``bench model --mxfp8`` prints one table per GPU with MX tensor cores (B200, GB200): per
    forward op, fused bf16, torchtitan's path (bf16 gather, cast after) and tp_kernels' MXFP8
    path (the MX rows on the wire), each row's times as op_cost and quantize_s give them."""
    assert bench_main(["model", "--mxfp8"]) == 0
    out = capsys.readouterr().out
    titles = [line for line in out.splitlines() if line.startswith("cost model (MODELED")]
    assert titles == [
        "cost model (MODELED, nothing measured): mxfp8 against bf16, the forward fused ops of "
        f"Llama-3 TP=8 on {spec.name}; ms per call"
        for spec in (B200, GB200)
    ]
    assert "dense mxfp8 4500 and bf16 2250" in out and "dense mxfp8 5000 and bf16 2500" in out
    header = next(line for line in out.splitlines() if line.startswith("model        tokens  lin"))
    for column in ("bf16 fused", "mxfp8 titan", "mxfp8 wire", "mxfp8 SoL", "vs titan", "vs bf16"):
        assert column in header
    assert out.count("per layer (forward: wq/wk/wv, wo, w1/w3, w2), ms:") == 2
    rows = model.scaled_rows(GB200, 8, dtype="mxfp8")
    assert len(rows) == 24
    for r in rows:
        ns = None
        if r.op == AG:
            ns = next(w for name, _, w, _ in model._linears(model.MODELS[r.model], 8)
                      if name == r.linear)  # fmt: skip
        mx = cost.op_cost(r.op, r.m, r.k, r.n, 8, "mxfp8", GB200, ns=ns).backends_s
        wire = "bf16" if r.op == AG else None
        titan = cost.op_cost(r.op, r.m, r.k, r.n, 8, "mxfp8", GB200, ns=ns, wire=wire)
        own = r.m if r.op == AG else 8 * r.m
        assert r.unfused_s == pytest.approx(
            titan.schedules_s["reference"] + cost.quantize_s(8 * r.m, r.k, GB200, "mxfp8")
        )
        assert r.fused_backend in ("reference", "pipelined", "symm")
        assert r.fused_s == pytest.approx(
            min(mx.values()) + cost.quantize_s(own, r.k, GB200, "mxfp8")
        )
        assert r.sol_s <= r.fused_s
        if r.op == RS:  # bf16 partials and the same casts both ways: never slower than titan
            assert r.fused_s <= r.unfused_s


def test_mxfp8_table_refuses_hopper_and_a_second_comparison(capsys):
    for argv in (
        ["--mxfp8", "--gpu", "h200"],
        ["--mxfp8", "--fp8"],
        ["--mxfp8", "--model", "llama3-8b"],
    ):
        with pytest.raises(SystemExit) as info:
            model.main(argv)
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "H200 SXM has no mxfp8 tensor cores in the model (MX block scales are native" in err
    assert "one comparison at a time" in err and "leave out --model" in err


def test_param_replaces_a_figure_and_bad_ones_are_refused(capsys):
    assert bench_main(["model", "--tokens", "8192", "--param", "nccl_sms=16"]) == 0
    out = capsys.readouterr().out
    assert "nccl_sms = 16: given with --param" in out
    with pytest.raises(SystemExit) as info:
        model.main(["--param", "warp_speed=3"])
    assert info.value.code == 2
    assert "expected NAME=VALUE with NAME one of" in capsys.readouterr().err


def test_model_plan_for_llama3_70b(capsys):
    assert bench_main(["model", "--gpu", "h100", "--tp", "8", "--model", "llama3-70b"]) == 0
    out = capsys.readouterr().out
    assert "attention.wq/wk/wv  forward   AG+mm  1024x8192x1280" in out
    assert "feed_forward.w1/w3  forward   AG+mm  1024x8192x7168" in out
    assert "feed_forward.w2     forward   mm+RS  1024x3584x8192" in out
    assert "the model (80 blocks + output)" in out and "Meta-Llama-3-70B" in out
    rows = model.plan_rows("llama3-70b", H100, 8, 8192)
    assert len(rows) == 10 and all(r.sol_s <= r.fused_s for r in rows)


def test_b200_is_the_hgx_datasheet_dense_per_direction_and_plans_with_bench_model(capsys):
    """B200 (sm_100): the HGX B200 datasheet's per-GPU figures, the tensor-core rates dense (half
    its sparse 4.5 and 2.2 PFLOPS) and NVLink 5 per direction (half its 1.8 TB/s); the SM count
    is marked assumed (not on the datasheet). ``bench model --gpu b200`` prints its plan, which
    is faster than H100's wherever the GEMMs bound it."""
    b200 = cost.DEVICES["b200"]
    assert b200.peak_tflops == {
        "bf16": 4500 / 2, "fp16": 4500 / 2, "fp32": 2200 / 2, "fp8": 9000 / 2, "mxfp8": 9000 / 2
    }  # fmt: skip
    assert (b200.hbm_gb_s, b200.link_gb_s) == (8000.0, 1800 / 2)
    assert b200.sources["peak_tflops"].startswith("https://www.nvidia.com/")
    assert b200.sms == 148 and b200.sources["sms"].startswith("assumed: ")
    assert bench_main(["model", "--gpu", "b200", "--tp", "8", "--model", "llama3-70b"]) == 0
    out = capsys.readouterr().out
    assert "llama3-70b TP=8 on B200 (HGX, 1000 W)" in out and "hgx/ (HGX B200" in out
    on_b200, on_h100 = (model.plan_rows("llama3-70b", dev, 8, 8192) for dev in (b200, H100))
    compute_bound = [(b, h) for b, h in zip(on_b200, on_h100) if h.compute_s > h.comm_s]
    assert compute_bound and all(b.fused_s < h.fused_s for b, h in compute_bound)


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
    names = iter(["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA B200", "Tesla V100-SXM2-16GB"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: next(names))
    cuda = torch.device("cuda", 0)
    assert cost.device_spec(cuda) is cost.DEVICES["h100"]
    assert cost.device_spec(cuda) is cost.DEVICES["h200"]
    assert cost.device_spec(cuda) is cost.DEVICES["b200"]
    assert cost.device_spec(cuda) is None  # not described: auto then times without ruling out


class _Group:
    """What auto's rule-out asks of a group: its size (the agreement is replaced below)."""

    def size(self) -> int:
        return 8


# Llama-3 at TP=8: 8B's QKV and 70B's at 2048 tokens (wq 8x wider than wk and wv), 70B's w1/w3
# at 8192 tokens.
@pytest.mark.parametrize(
    ("m", "k", "ns", "fusion"),
    [
        (256, 4096, (512, 128, 128), False),
        (256, 8192, (1024, 128, 128), False),
        (1024, 8192, (3584, 3584), True),
    ],
)
def test_auto_rules_fusion_out_where_the_model_says_none_beats_reference(
    monkeypatch, m, k, ns, fusion
):
    from tp_kernels.backends import choice

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(choice, "_agreed_max", lambda values, group, device: values)
    # Built from the call's tensors as the ops build it (meta tensors: only shapes are read).
    a_shard = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
    bs = [torch.empty(k, n, dtype=torch.bfloat16, device="meta") for n in ns]
    shape = dataclasses.replace(
        choice.Shape.of_all_gather_matmul(a_shard, bs), device=torch.device("cuda", 0)
    )
    assert (shape.ns, shape.n, shape.num_bs) == (ns, sum(ns), len(ns))
    names = ("torch_symm_mem", "symm", "pipelined", "reference")
    found = choice._ruled_out_by_model(shape, _Group(), choice.Candidates(names, {}, {}))
    predicted = cost.op_cost(AG, m, k, sum(ns), 8, "bf16", H100, ns=ns).backends_s
    assert found.predicted_s == {b: predicted[b] for b in names}
    fused = min(predicted[b] for b in names[:3])
    assert (fused < predicted["reference"]) == fusion  # the case is what it says
    within = tuple(b for b in names if predicted[b] <= choice.RULE_OUT * min(predicted.values()))
    if fusion:
        assert found.names == within and within[0] == "torch_symm_mem"
    else:
        assert found.names == ("reference",)
        assert "no fused backend beating reference's" in found.ruled_out["symm"]
    # On a CPU the timing decides: the same predictions rule out only past RULE_OUT.
    cpu = dataclasses.replace(shape, device=torch.device("cpu"))
    monkeypatch.setattr(cost, "device_spec", lambda device: H100)
    found = choice._ruled_out_by_model(cpu, _Group(), choice.Candidates(names, {}, {}))
    assert found.names == within


def test_auto_predicts_each_right_hand_width_not_an_even_split():
    """The premise of the 70B QKV case above (2048 tokens, TP=8): splitting its 1280 columns
    evenly over the three matrices, as auto did before its shape carried the widths, gives a
    fused backend beating reference; the true widths (wq 1024, wk and wv 128) give none."""
    m, k, ns = 256, 8192, (1024, 128, 128)
    even = cost.op_cost(AG, m, k, sum(ns), 8, "bf16", H100, ns=(427, 427, 426)).backends_s
    true = cost.op_cost(AG, m, k, sum(ns), 8, "bf16", H100, ns=ns).backends_s
    assert even["torch_symm_mem"] < even["reference"]  # the even split would keep fusion
    assert min(true[b] for b in ("torch_symm_mem", "symm", "pipelined")) >= true["reference"]
