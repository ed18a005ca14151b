"""The cost model's calibration (tp_kernels.bench.calibration): the fit recovers the figures that
made its timings, and refuses samples that fit no line; the report prints the fitted figures
beside the assumed ones; the measurement runs the consumer kernel as built, in Triton's
interpreter on a CPU, and a launch that waits or computes wrong fails it; a calibration that
raises is a failed check of gpu_check, not a crash."""

from __future__ import annotations

import os

# The measurement runs the consumer kernel in this process, in the interpreter, which must be
# chosen before triton is first imported.
os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tp_kernels import cost, kernels, signals  # noqa: E402
from tp_kernels.bench import calibration  # noqa: E402

H100 = cost.DEVICES["h100"]


def synthetic_gemms(device, efficiency, overhead):
    """GEMM timings a GPU of the model's kind would give: whole waves of 128x256 tiles."""
    per_sm = device.peak_tflops["bf16"] * 1e12 / device.sms * efficiency
    out = []
    for rows, k, n in ((8192, 4096, 1792), (8192, 8192, 3584), (8192, 16384, 6656)):
        waves = math.ceil(math.ceil(rows / 128) * math.ceil(n / 256) / device.sms)
        seconds = waves * (overhead + 2 * 128 * 256 * k / per_sm)
        out.append(calibration.GemmTiming.in_whole_waves(rows, k, n, seconds, device.sms))
    return out


def test_calibration_recovers_the_figures_that_made_the_timings():
    copies = [(mib << 20, 4e-6 + (mib << 20) / 1.5e12) for mib in (1, 4, 16)]
    assert calibration.fit_copies(copies) == pytest.approx((1500.0, 4e-6))
    gemms = synthetic_gemms(H100, 0.62, 2e-6)
    assert [g.waves for g in gemms] == [4, 7, 13]  # 448, 896, 1664 tiles over 132 SMs
    assert calibration.fit_tiles(gemms, H100) == pytest.approx((0.62, 2e-6))
    fitted, rate = calibration.fit(H100, copies, gemms)
    assert rate == pytest.approx(1500.0)
    assert (fitted.gemm_efficiency, fitted.tile_overhead_s, fitted.copy_latency_s) == (
        pytest.approx(0.62),
        pytest.approx(2e-6),
        pytest.approx(4e-6),
    )
    assert fitted.sources["gemm_efficiency"].startswith("fitted by tp_kernels.bench.gpu_check")
    assert "consumer kernel's tiles" in fitted.sources["tile_overhead_s"]
    assert fitted.link_gb_s == H100.link_gb_s  # a copy within one GPU says nothing of NVLink
    # Noise moves the fit, not its meaning: 2% on every timing stays within a few percent.
    noisy = [
        dataclasses.replace(g, seconds=g.seconds * (1.02 if i % 2 else 0.98))
        for i, g in enumerate(gemms)
    ]
    assert calibration.fit_tiles(noisy, H100)[0] == pytest.approx(0.62, rel=0.05)


def test_calibration_fits_each_launch_by_the_tiles_it_ran():
    """The consumer's launches report their tuned tile and their waves (tiles over the
    persistent programs, here 8 shards' tiles over 132 programs); the fit gives each tile shape
    the model's rate for it: 256x128 as 128x256 (1.0), 128x128 0.9, 64x256 and 64x64 as the
    nearest in reuse, 64x128 (0.75). Timings made that way give back the figures."""
    efficiency, overhead = 0.58, 3e-6
    per_sm = H100.peak_tflops["bf16"] * 1e12 / H100.sms * efficiency
    launches = [  # (rows, k, n, bm, bn, the model's rate of that tile)
        (8192, 4096, 1792, 128, 128, 0.9),
        (8192, 8192, 3584, 256, 128, 1.0),
        (8192, 3584, 8192, 64, 256, 0.75),
        (8192, 16384, 6656, 128, 256, 1.0),
        (8192, 2048, 1024, 64, 64, 0.75),
    ]
    samples = []
    for rows, k, n, bm, bn, rate in launches:
        tiles = 8 * math.ceil(rows // 8 / bm) * math.ceil(n / bn)
        waves = math.ceil(tiles / min(tiles, H100.sms))
        seconds = waves * (overhead + 2 * bm * bn * k / (per_sm * rate))
        samples.append(calibration.GemmTiming(rows, k, n, seconds, bm, bn, waves))
    assert calibration.fit_tiles(samples, H100) == pytest.approx((efficiency, overhead))
    # Taken as whole waves of 128x256 tiles, as cuBLAS's are, the same timings fit otherwise.
    as_cublas = [
        calibration.GemmTiming.in_whole_waves(s.rows, s.k, s.n, s.seconds, H100.sms)
        for s in samples
    ]
    assert calibration.fit_tiles(as_cublas, H100)[0] != pytest.approx(efficiency, rel=0.05)


def test_calibration_refuses_samples_that_cannot_fit():
    with pytest.raises(ValueError, match="copy samples: got 2 samples at 1 distinct sizes"):
        calibration.fit_copies([(1 << 20, 1e-5), (1 << 20, 2e-5)])
    with pytest.raises(ValueError, match="copy samples: time does not grow"):
        calibration.fit_copies([(1 << 20, 2e-5), (2 << 20, 1e-5)])
    with pytest.raises(ValueError, match="GEMM samples: got 1 samples"):
        calibration.fit_tiles(
            [calibration.GemmTiming.in_whole_waves(8192, 4096, 1792, 1e-3, 132)], H100
        )
    with pytest.raises(ValueError, match="has no SMs"):
        calibration.fit_tiles(synthetic_gemms(H100, 0.7, 0.0), cost.measure_cpu())


def _tile_timing(device, rows, k, n, efficiency, overhead, bm=128, bn=256):
    """A launch of the model's kind: ``seconds`` of whole waves of ``bm x bn`` tiles."""
    per_sm = device.peak_tflops["bf16"] * 1e12 / device.sms * efficiency
    waves = math.ceil(math.ceil(rows / bm) * math.ceil(n / bn) / device.sms)
    seconds = waves * (overhead + 2 * bm * bn * k / per_sm)
    return calibration.GemmTiming(rows, k, n, seconds, bm, bn, waves)


def test_calibration_prints_the_fitted_figures_beside_the_assumed():
    h100 = cost.DEVICES["h100"]
    shapes = calibration.GEMMS
    timings = calibration.Timings(
        copies=[(mib << 20, 5e-6 + (mib << 20) / 2e12) for mib in calibration.CHUNK_MIB],
        consumer=[_tile_timing(h100, *shape, 0.6, 1.5e-6) for shape in shapes],
        cublas=[_tile_timing(h100, *shape, 0.7, 1e-6) for shape in shapes],
    )
    out = calibration.report(h100, timings)
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    # figure, assumed, fitted from the consumer, cuBLAS's fit beside it
    assert rows["gemm_efficiency"][1:] == ["0.75", "0.6", "0.7"]
    assert rows["tile_overhead_s"][1:] == ["1e-06", "1.5e-06", "1e-06"]
    assert rows["copy_latency_s"][1:] == ["3e-06", "5e-06"]
    assert " ".join(rows["copy"]) == "copy rate GB/s 382 (NVLink) 2000 (within one GPU)"
    assert "copies: 1 MiB 5.5 us, 2 MiB 6.0 us" in out
    # 8192x8192x3584: 896 tiles of 128x256 in 7 waves of 121 us at 60% of 7.5 TFLOP/s per SM
    consumer = out.index("consumer (rank 0 of 8, no wait):\n  8192x4096x1792 0.245 ms")
    line = "\n  8192x8192x3584 0.846 ms (569 TFLOP/s; 128x256 tiles, 7 waves, 120.9 us each)\n"
    assert out.index(line) > consumer
    assert out.index("cuBLAS (torch.mm, tiles assumed):\n  8192x4096x1792 0.209 ms") > consumer
    assert (
        "python -m tp_kernels.bench model --param gemm_efficiency=0.6 "
        "--param tile_overhead_s=1.5e-06 --param copy_latency_s=5e-06" in out
    )
    # cuBLAS's fit is beside the figures, not one of them: timings that fit no line say so there.
    flat = [dataclasses.replace(t, seconds=1e-3, waves=1) for t in timings.cublas]
    out = calibration.report(h100, dataclasses.replace(timings, cublas=flat))
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["gemm_efficiency"][1:5] == ["0.75", "0.6", "no", "fit:"]
    assert "GEMM samples: time does not grow with K" in out


def _host_clock(returned: list[float]):
    """A timer for the CPU: the median of ``reps`` runs on the host clock, kept in ``returned``."""

    def timer(fn, reps: int) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        returned.append(statistics.median(times))
        return returned[-1]

    return timer


def _counting(monkeypatch, launch=None) -> list[dict]:
    """Replace ``kernels.ag_matmul_consumer`` by ``launch`` (default: the kernel itself) that
    records the arguments of each call."""
    real = kernels.ag_matmul_consumer
    calls: list[dict] = []

    def consumer(a, bs, outs, **kw):
        calls.append(kw)
        (launch or real)(a, bs, outs, **kw)

    monkeypatch.setattr(kernels, "ag_matmul_consumer", consumer)
    return calls


# Two ranks' gathered A of 16 and 24 rows per shard (the second not a whole 16-row tile), K and N
# not multiples of the interpreter's 16x16x16 tiles.
TINY_GEMMS = ((32, 16, 24), (48, 40, 20))


def test_calibration_times_the_consumer_as_built_in_the_interpreter(monkeypatch):
    """The measurement end to end on a CPU: the consumer launched as rank 0 of 2, every progress
    word already raised, checked against torch.mm (it raises otherwise), then timed
    by the injected clock; its tiles (the interpreter's one 16x16 config) and waves (tiles over
    the interpreter's 2 persistent programs) as launched."""
    assert kernels.INTERPRET, "tp_kernels.kernels was imported before TRITON_INTERPRET=1"
    calls = _counting(monkeypatch)
    returned: list[float] = []
    timings = calibration.measure(
        True, device=torch.device("cpu"), timer=_host_clock(returned), gemms=TINY_GEMMS,
        chunk_mib=(1, 2), world_size=2,
    )  # fmt: skip
    # Timed in order: the copies, then per shape the consumer and torch.mm.
    assert [b for b, _ in timings.copies] == [1 << 20, 2 << 20]
    assert [t for _, t in timings.copies] == returned[:2]
    # 2 shards x ceil(16/16) x ceil(24/16) = 4 tiles; 2 x ceil(24/16) x ceil(20/16) = 8 tiles
    assert timings.consumer == [
        calibration.GemmTiming(32, 16, 24, returned[2], 16, 16, 2),
        calibration.GemmTiming(48, 40, 20, returned[4], 16, 16, 4),
    ]
    assert timings.cublas == [
        calibration.GemmTiming(32, 16, 24, returned[3], 128, 256, 1),
        calibration.GemmTiming(48, 40, 20, returned[5], 128, 256, 1),
    ]
    # One checked launch and 5 timed ones (--quick) per shape, each as rank 0 of 2 with one
    # chunk per shard and its progress words raised.
    assert len(calls) == 2 * (1 + 5)
    assert {(c["rank"], c["world_size"]) for c in calls} == {(0, 2)}
    assert [c["chunk_rows"] for c in calls] == [16] * 6 + [24] * 6
    assert all(c["progress"].tolist() == [signals.RAISED] * 2 for c in calls)


@pytest.mark.parametrize(
    ("wrong", "error"),
    [
        ("words", "a tile waited past 0.05 s for a progress word already raised"),
        ("output", "its output differs from torch.mm by"),
    ],
)
def test_a_wrong_consumer_launch_fails_the_calibration(monkeypatch, wrong, error):
    """The check before the timing sees a launch that waits (words not raised) and one whose
    output is wrong (an element off)."""
    assert kernels.INTERPRET, "tp_kernels.kernels was imported before TRITON_INTERPRET=1"
    real = kernels.ag_matmul_consumer

    def launch(a, bs, outs, **kw):
        if wrong == "words":
            kw = {**kw, "progress": torch.zeros_like(kw["progress"])}
        real(a, bs, outs, **kw)
        if wrong == "output":
            outs[0][0, 0] += 1.0

    _counting(monkeypatch, launch)
    monkeypatch.setattr(calibration, "WAIT_S", 0.05)
    with pytest.raises(RuntimeError, match=error):
        calibration.measure(
            True, device=torch.device("cpu"), timer=_host_clock([]), gemms=TINY_GEMMS[:1],
            chunk_mib=(1, 2), world_size=2,
        )  # fmt: skip


def test_a_calibration_that_raises_is_a_failed_check_not_a_crash(monkeypatch, capsys):
    def broken(quick):
        raise RuntimeError("no CUDA here")

    monkeypatch.setattr(calibration, "measure", broken)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert calibration.run(quick=True) is False
    assert "FAIL: the calibration raised RuntimeError: no CUDA here" in capsys.readouterr().out
