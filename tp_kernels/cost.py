"""A cost model of the two fused patterns that simulates each schedule as it is built.

For one call on each of ``W`` ranks, with ``m`` rows per rank, ``K`` the reduction dim and ``N``
the output columns (the sum over every ``b`` of an all-gather-matmul), in a dtype of ``e`` bytes::

    compute  = 2 * W*m * K * N / (peak_tflops[dtype] * gemm_efficiency)     every rank's GEMM
    comm     = (W-1) * m * X * e / (link_gb_s * link_efficiency)            X = K (AG), N (RS)
    speed of light = max(compute, comm)

An fp8 call (``dtype="fp8"``) computes at the fp8 rate; its bytes are not its compute dtype's
(:class:`Problem`): the all-gather's rows cross the link in the ``wire`` dtype (fp8: ``K + 16``
bytes a row, the packed row of :mod:`tp_kernels.backends.scaled`; bf16: ``2 K``, torchao's
gather before its cast) and the reduce-scatter moves bf16 partials (2 bytes), so ``X * e`` above
is the bytes of a row as they travel. An MXFP8 call (``dtype="mxfp8"``: e4m3 with one e8m0 scale per
32 elements along ``K``, torchao's MXFP8 recipes) computes at the dense MXFP8 rate, which only
Blackwell's tensor cores have (``peak_tflops["mxfp8"]``; absent on Hopper, where MX is emulated);
its all-gather moves :func:`tp_kernels.tiling.mx_row_bytes` a row (or bf16, torchtitan's gather
before its cast), its reduce-scatter bf16 partials. The block-scaled path runs on ``reference``,
``pipelined`` and, on a GPU (Blackwell: the only one with an MXFP8 rate), ``symm``, whose Triton
GEMMs take the block scales in the MMA (tile menu ``"mxfp8"``); ``torch_symm_mem`` refuses them,
and on a CPU ``symm`` runs torch's schedule over peer memory, which the model does not simulate.

``comm`` counts the bytes that cross this rank's link once each (on an NVSwitch node every GPU has
``link_gb_s`` in each direction to the switch, whatever the peer). The speed of light knows no
tiles; each schedule's time does. Every rank runs the same schedule on the same shapes, so one
rank is simulated and a peer's data is ready when this rank's own is.

How a GPU is simulated (:class:`_Timeline`, :func:`_gemm`):

* A GEMM is tiles over the SMs: a ``BM x BN`` tile takes ``tile_overhead_s + 2*BM*BN*K /
  (peak per SM * gemm_efficiency * the tile shape's relative rate)``, and a tile of the Triton
  kernels is ``consumer_rate`` (the all-gather's consumer) or ``producer_rate`` (the
  reduce-scatter's producer) times as fast as cuBLAS's (what one H200 measured); a launch's
  tiles go to the SM that frees first, so a GEMM of ``T`` tiles alone takes ``ceil(T / SMs)``
  waves and two GEMMs on two streams share the SMs (cuBLAS's tile shape: the menu's fastest
  for the shape). The tiles, their order, the chunks and the row blocks are the kernels' and
  the backends' own (:mod:`tp_kernels.tiling`).
* The copy engine moves one copy at a time (copies from two streams do not overlap, as torch's
  comment in ``_pipelined_all_gather_and_consume`` says) at ``link_gb_s * link_efficiency``,
  each copy paying ``copy_latency_s`` (launch, completion, the progress word's stream write).
* NCCL: a collective at ``link_gb_s * nccl_efficiency`` plus ``nccl_latency_s`` per message;
  its kernels hold ``nccl_sms`` SMs while it runs.
* A pass over memory (a local copy, the reduce-scatter's sum) moves its bytes at ``hbm_gb_s *
  hbm_efficiency``.

Schedules (one function each, its docstring says what it models): ``reference``
(:func:`reference_s`), ``torch_symm_mem`` (:func:`torch_symm_mem_s`), ``pipelined``
(:func:`pipelined_s`), and ``symm``'s: the all-gather's copy-engine producer
(:func:`symm_copy_engine_s`) and the matmul-reduce-scatter's producer whose blocks the copy
engine pushes, with its reduction pass (:func:`symm_reduce_scatter_s`). On a CPU (``sms is
None``) a GEMM is one piece of work at the measured rate and ``symm`` is its torch path
(:func:`symm_cpu_s`). The schedules ``symm`` ran before (its pulling consumer, its
reduce-scatter's direct stores) left the model after the backend; benchmarks/README.md records
them and the numbers that retired them.

Every figure of a :class:`DeviceSpec` names its source in ``sources``: a datasheet, or
"assumed" with the reasoning; :mod:`tp_kernels.bench.calibration` (run by ``gpu_check``) fits
the consumer kernel's per-tile rate and the copy engine's rate and latency on a GPU and prints
them beside these.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tp_kernels import config, tiling

__all__ = [
    "DEVICES",
    "DTYPE_NAMES",
    "SCHEDULES",
    "TILES",
    "DeviceSpec",
    "OpCost",
    "Problem",
    "copy_engine_chunks",
    "device_spec",
    "gemm_s",
    "measure_cpu",
    "op_cost",
    "pipelined_s",
    "quantize_s",
    "reference_s",
    "symm_copy_engine_s",
    "symm_cpu_s",
    "symm_reduce_scatter_s",
    "torch_symm_mem_s",
]

AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "mxfp8": 1}
# The scaled compute dtypes and the dtype of their GEMMs' output: their partials cross the
# reduce-scatter's link in it.
_SCALED = ("fp8", "mxfp8")
_SCALED_OUT = "bf16"
# What each compute dtype's all-gather may move: its own elements, or for a scaled dtype its
# packed rows (the fused ops) or the bf16 input torchao gathers before it casts (PyTorch's
# styles; torchtitan's MXFP8 TP).
_WIRES = {
    "fp32": ("fp32",), "bf16": ("bf16",), "fp16": ("fp16",), "fp8": ("fp8", "bf16"),
    "mxfp8": ("mxfp8", "bf16"),
}  # fmt: skip
# The model's dtype names for torch dtypes (other dtypes have no tensor-core rate to model; an
# fp8 call is modeled by name, "fp8", by the benchmarks, not looked up from a tensor's dtype).
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Columns of the schedule table, per op (on a GPU; a CPU has no torch_symm_mem).
SCHEDULES = {op: ("reference", "torch_symm_mem", "pipelined", "symm") for op in (AG, RS)}
# The rate of a tile shape (BM, BN) relative to the largest: smaller tiles reuse each loaded
# byte less (assumed). The model's GEMMs take the shapes of the kernels' menu that are rated
# here, three that 16-bit GEMMs use (cuBLAS's are similar); the menu's others are not modeled,
# nor the fp8 and fp32 menus (the model rates every dtype's tiles alike).
_TILE_RATES = {(128, 256): 1.0, (128, 128): 0.9, (64, 128): 0.75}
# (BM, BN, rate) of the model's tile shapes, in the menu's order (a tie goes to the first).
TILES: tuple[tuple[int, int, float], ...] = tuple(
    dict.fromkeys(
        (bm, bn, _TILE_RATES[bm, bn])
        for bm, bn, *_ in tiling.gemm_shapes("16bit")
        if (bm, bn) in _TILE_RATES
    )
)
# The Triton kernels' GEMMs over cuBLAS's at M=8192 N=3584 K=8192 bf16 on one H200 (2026-12-04,
# benchmarks/README.md "First contact: one H200"): cuBLAS 0.620 ms, the all-gather's consumer
# 0.737 ms, the reduce-scatter's producer 0.699 ms. Measured on the kernels before issue 35's
# rebuild (persistent, software-pipelined, TMA-store epilogue): the rebuilt ones are not.
_MEASURED_CONSUMER_RATE = 0.620 / 0.737
_MEASURED_PRODUCER_RATE = 0.620 / 0.699
# cuBLAS's steady tile rate on that H200: 0.620 ms for 7 waves of 128x256 tiles (896 tiles on
# 132 SMs, no split-K) at 1 us of overhead a tile is 81.8% of the dense bf16 peak per SM.
_H200_CUBLAS_EFFICIENCY = 0.818
# The tile menu (tiling.GEMM_KINDS) of each of the model's compute dtypes.
_GEMM_KINDS = {"fp32": "fp32", "bf16": "16bit", "fp16": "16bit", "fp8": "fp8", "mxfp8": "mxfp8"}
_NVIDIA = "https://www.nvidia.com/en-us/data-center"
_HOPPER = "https://developer.nvidia.com/blog/nvidia-hopper-architecture-in-depth/"

_ASSUMED = {
    "gemm_efficiency": "assumed: a tile's steady rate is 75% of the dense peak, the rate of the "
    "issue-20 sketch (cuBLAS bf16 GEMMs at these sizes reach 60-80%); gpu_check fits it",
    "tile_overhead_s": "assumed: 1 us per tile to fill the operand pipeline and store the tile; "
    "gpu_check fits it",
    "link_efficiency": "assumed: copy-engine and SM transfers reach 85% of NVLink's rate per "
    "direction",
    "nccl_efficiency": "assumed: NCCL's all-gather/reduce-scatter bus bandwidth at 80% of "
    "NVLink's rate per direction (nccl-tests on 8-GPU NVSwitch nodes report 350-370 GB/s)",
    "hbm_efficiency": "assumed: memory passes reach 85% of the datasheet's HBM bandwidth",
    "copy_latency_s": "assumed: 3 us per cudaMemcpyAsync on a side stream, its completion and "
    "the progress word's stream write (the field reports a fixed cost of a few microseconds per "
    "copy-engine transfer); gpu_check fits it",
    "consumer_rate": "assumed: the H200's measured ratio (0.84x of cuBLAS, 2026-12-04, the "
    "consumer before issue 35's rebuild; the rebuilt kernels are not measured yet)",
    "producer_rate": "assumed: the H200's measured ratio (0.89x of cuBLAS, 2026-12-04, the "
    "producer before issue 35's rebuild; the rebuilt kernels are not measured yet)",
    "nccl_latency_s": "assumed: 10 us per NCCL collective or point-to-point batch (kernel "
    "launch, protocol handshake)",
    "barrier_s": "assumed: 4 us for a symmetric-memory barrier (a signal to every peer over "
    "NVLink and a poll)",
    "nccl_sms": "assumed: NCCL's point-to-point kernels hold 8 SMs while they move bytes",
    "fp8": "assumed until measured: an fp8 GEMM reaches the same share of its dense peak "
    "(gemm_efficiency) with the same tile rates as a 16-bit one; an fp8 cast of a bf16 row is "
    "one memory pass (read 2 bytes, write 1, and 4 of scale a row: torch.compile's fused amax "
    "and cast)",
    "mxfp8": "assumed until measured: an MXFP8 GEMM (cuBLAS's block-scaled GEMM, torchao's mx_mm) "
    "reaches the same share of its dense peak (gemm_efficiency) with the same tile rates as a "
    "16-bit one; an MX cast of a bf16 row is one memory pass (read 2 bytes, write the packed "
    "row: tiling.mx_row_bytes); the fused path's second pass that packs data and scales into "
    "one row (backends/scaled.pack_mx_rows) is not counted, as fp8's pack_rows is not",
}


@dataclass(frozen=True)
class DeviceSpec:
    """A GPU (or this CPU) as the model sees it. Rates: dense tensor-core peak per dtype (TFLOP/s;
    fp32 matmuls at the TF32 rate), HBM and NVLink per direction (GB/s); ``sms`` streaming
    multiprocessors (``None``: not tiled, a CPU); the efficiencies, latencies (s) and sizes of
    the module docstring. ``sources[field]`` says where each figure comes from."""

    name: str
    peak_tflops: dict[str, float]
    sms: int | None
    hbm_gb_s: float
    link_gb_s: float
    sources: dict[str, str]
    gemm_efficiency: float = 0.75
    tile_overhead_s: float = 1e-6
    link_efficiency: float = 0.85
    nccl_efficiency: float = 0.8
    hbm_efficiency: float = 0.85
    copy_latency_s: float = 3e-6
    nccl_latency_s: float = 10e-6
    barrier_s: float = 4e-6
    nccl_sms: int = 8
    consumer_rate: float = _MEASURED_CONSUMER_RATE
    producer_rate: float = _MEASURED_PRODUCER_RATE

    @property
    def source(self) -> str:
        """The datasheet figures' source (one line)."""
        return self.sources["peak_tflops"]


def _gpu(name, peak, sms, hbm, link, datasheet, sms_source, **measured) -> DeviceSpec:
    """A GPU of the datasheet's figures and :data:`_ASSUMED`'s; ``measured``: figures measured
    on this GPU, as ``field=(value, source)``."""
    sources = {
        "peak_tflops": datasheet,
        "hbm_gb_s": datasheet,
        "link_gb_s": f"{datasheet}; NVLink's total is both directions, half of it each way",
        "sms": sms_source,
        **_ASSUMED,
    }
    values = {}
    for name_, (value, source) in measured.items():
        values[name_], sources[name_] = value, source
    return DeviceSpec(name, peak, sms, hbm, link, sources, **values)


_H200_GEMMS = "measured on one H200, 2026-12-04 (benchmarks/README.md, 'First contact')"


# fp8 (e4m3/e5m2) dense: twice the 16-bit rate on Hopper and Blackwell (the datasheets' sparse
# figures halved); A100 has no fp8 tensor cores, so no "fp8" entry (op_cost refuses it there).
# MXFP8 dense: the fp8 rate on Blackwell, whose tensor cores take the e8m0 block scales in the MMA
# (the datasheets give one FP8 figure); Hopper and Ampere have no MX tensor cores (torchao
# emulates MX there), so no "mxfp8" entry.
_MX_NATIVE = (
    "https://nvidia.github.io/TransformerEngine/support_matrix.html (MXFP8 native on compute "
    "capability 10.x only, not on Hopper's 9.0): MXFP8 at the datasheet's dense FP8 rate"
)
_HOPPER_PEAK = {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7, "fp8": 1978.9}
DEVICES: dict[str, DeviceSpec] = {
    "h100": _gpu(
        "H100 SXM5", _HOPPER_PEAK, 132, 3350.0, 450.0,
        f"{_NVIDIA}/h100/ (datasheet: FP8 3958, BF16/FP16 1979 and TF32 989 TFLOPS with "
        "sparsity, half dense; HBM3 3.35 TB/s; NVLink 900 GB/s)",
        f"{_HOPPER} (H100 SXM5: 132 SMs)",
    ),
    "h200": _gpu(
        "H200 SXM", _HOPPER_PEAK, 132, 4800.0, 450.0,
        f"{_NVIDIA}/h200/ (datasheet: the H100 SXM's tensor-core rates; HBM3e 4.8 TB/s; NVLink "
        "900 GB/s)",
        f"assumed: the H100 SXM5's 132 SMs ({_HOPPER}), as the H200 has its tensor-core rates",
        gemm_efficiency=(
            _H200_CUBLAS_EFFICIENCY,
            f"{_H200_GEMMS}: cuBLAS 0.620 ms at M=8192 N=3584 K=8192 bf16, 7 waves of 128x256 "
            "tiles at 1 us overhead each",
        ),
        consumer_rate=(
            _MEASURED_CONSUMER_RATE,
            f"{_H200_GEMMS}: the consumer 0.737 ms against cuBLAS's 0.620 ms (before issue 35's "
            "rebuild of the GEMMs; the rebuilt ones are not measured yet)",
        ),
        producer_rate=(
            _MEASURED_PRODUCER_RATE,
            f"{_H200_GEMMS}: the producer 0.699 ms against cuBLAS's 0.620 ms (before issue 35's "
            "rebuild of the GEMMs; the rebuilt ones are not measured yet)",
        ),
    ),
    "b200": _gpu(
        "B200 (HGX, 1000 W)",
        {"bf16": 2250.0, "fp16": 2250.0, "fp32": 1100.0, "fp8": 4500.0, "mxfp8": 4500.0},
        148, 8000.0, 900.0,
        f"{_NVIDIA}/hgx/ (HGX B200: FP8 9, BF16/FP16 4.5 and TF32 2.2 PFLOPS per GPU with "
        f"sparsity, half dense; HBM3e 8 TB/s; NVLink 5 1.8 TB/s per GPU); {_MX_NATIVE}",
        "assumed: 148 SMs (two dies of 74, as reported for B200; not on the datasheet)",
    ),
    "gb200": _gpu(
        "GB200 (NVL72, 1200 W)",
        {"bf16": 2500.0, "fp16": 2500.0, "fp32": 1250.0, "fp8": 5000.0, "mxfp8": 5000.0},
        148, 8000.0, 900.0,
        f"{_NVIDIA}/gb200-nvl72/ (GB200 NVL72, 72 GPUs: FP8/FP6 720, FP16/BF16 360 and TF32 180 "
        "PFLOPS with sparsity, so per GPU 10, 5 and 2.5, half dense; HBM3e 576 TB/s, 8 TB/s per "
        f"GPU; NVLink 130 TB/s, 1.8 TB/s per GPU); {_MX_NATIVE}",
        "assumed: 148 SMs, as the B200's (the GB200's GPU is a B200 at 1200 W; not on the "
        "datasheet)",
    ),
    "a100": _gpu(
        "A100 SXM4", {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}, 108, 2039.0, 300.0,
        f"{_NVIDIA}/a100/ (datasheet: BF16/FP16 312 and TF32 156 TFLOPS dense; HBM2e 2039 GB/s "
        "(80 GB); NVLink 600 GB/s)",
        "https://developer.nvidia.com/blog/nvidia-ampere-architecture-in-depth/ (A100: 108 SMs)",
    ),
}  # fmt: skip


# On a CPU, "the link" is a copy through shared memory (symm) or gloo's loopback TCP, and the
# latencies are what this project's 2-core test machine showed for a 64-byte gloo send/receive
# pair (~0.5 ms, median of 200) and for a host-polled signal in shared memory (tens of us).
_CPU_GLOO_LATENCY_S = 500e-6
_CPU_SIGNAL_LATENCY_S = 50e-6
_GPU_NAMES = (("H100", "h100"), ("H200", "h200"), ("GB200", "gb200"), ("B200", "b200"),
              ("A100", "a100"))  # fmt: skip


def _timed_s(fn, reps: int) -> float:
    fn()  # warm up (first-touch, thread pool start)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def measure_cpu() -> DeviceSpec:
    """This machine's CPU as a :class:`DeviceSpec`, measured once per process (~0.1 s): matmul
    GFLOP/s per dtype at 256x256x256 and the bandwidth of one 32 MB copy, best of 3, standing for
    both the link and memory. The efficiencies are 1 (these are measured rates, not peaks); a
    GEMM is not tiled (``sms=None``); copies and matmuls share the cores, so overlap is
    optimistic here, which is why ``auto`` also times."""
    n = 256
    peak = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        x = torch.randn(n, n).to(dtype)
        peak[name] = 2 * n**3 / _timed_s(lambda x=x: x @ x, 3) / 1e12
    src, dst = torch.empty(8 << 20), torch.empty(8 << 20)
    copy_gb_s = src.nbytes / _timed_s(lambda: dst.copy_(src), 3) / 1e9
    measured = "measured by tp_kernels.cost.measure_cpu (matmul and copy rates)"
    estimated = "estimated: gloo send/receive pair and host-polled signal on the test machine"
    sources = {f.name: "not used on a CPU" for f in dataclasses.fields(DeviceSpec)}
    sources.update(peak_tflops=measured, hbm_gb_s=measured, link_gb_s=measured)
    sources.update(copy_latency_s=estimated, nccl_latency_s=estimated, barrier_s=estimated)
    return DeviceSpec(
        "this CPU (measured)", peak, None, copy_gb_s, copy_gb_s, sources,
        gemm_efficiency=1.0, tile_overhead_s=0.0, link_efficiency=1.0, nccl_efficiency=1.0,
        hbm_efficiency=1.0, copy_latency_s=_CPU_SIGNAL_LATENCY_S,
        nccl_latency_s=_CPU_GLOO_LATENCY_S, barrier_s=_CPU_SIGNAL_LATENCY_S, nccl_sms=0,
        consumer_rate=1.0, producer_rate=1.0,
    )  # fmt: skip


def device_spec(device: torch.device) -> DeviceSpec | None:
    """The model's description of ``device``: a GPU of :data:`DEVICES` found by its name, this
    CPU measured (:func:`measure_cpu`), or ``None`` for a GPU the model does not know."""
    if device.type == "cpu":
        return measure_cpu()
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for marker, key in _GPU_NAMES:
            if marker in name:
                return DEVICES[key]
    return None


# --------------------------------------------------------------------------------------------
# The GPU's parts: GEMM tiles, a timeline of streams over SMs and the copy engine.


@dataclass(frozen=True)
class Problem:
    """One call: ``m`` rows per rank, ``k``, the right-hand widths ``ns``, ``w`` ranks, the GEMM
    in ``dtype`` (its rate), on ``dev``. ``wire``: the dtype the all-gather's rows cross the
    link in (``None``: ``dtype``; an fp8 call may gather ``"bf16"`` and cast after, as torchao
    does under PyTorch's styles). Bytes: ``row_bytes`` per gathered row, ``out_e`` per element
    of the output and of the reduce-scatter's partials (bf16 for an fp8 GEMM)."""

    m: int
    k: int
    ns: tuple[int, ...]
    w: int
    dtype: str
    dev: DeviceSpec
    wire: str | None = None

    @property
    def e(self) -> int:
        """Bytes per element of the compute dtype."""
        return _ELEMENT_BYTES[self.dtype]

    @property
    def wire_dtype(self) -> str:
        return self.wire or self.dtype

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of the all-gather's input as it crosses the link (and is copied):
        ``K`` elements of the wire dtype; an fp8 row is packed with its scale, ``K + 16``; an
        MXFP8 row with its block scales, :func:`tp_kernels.tiling.mx_row_bytes`."""
        if self.wire_dtype == "fp8":
            return self.k + tiling.ROW_SCALE_BYTES  # an fp8 row as tp_kernels gathers it
        if self.wire_dtype == "mxfp8":
            return tiling.mx_row_bytes(self.k)
        return self.k * _ELEMENT_BYTES[self.wire_dtype]

    @property
    def out_e(self) -> int:
        """Bytes per element of the GEMM's output: the reduce-scatter's partials and sum."""
        return _ELEMENT_BYTES[_SCALED_OUT if self.dtype in _SCALED else self.dtype]

    @property
    def n(self) -> int:
        return sum(self.ns)

    def link_s(self, nbytes: float) -> float:
        """Seconds of ``nbytes`` over the link at the copy engine's (or the SMs') best rate."""
        return nbytes / (self.dev.link_gb_s * 1e9 * self.dev.link_efficiency)

    def hbm_s(self, nbytes: float) -> float:
        """Seconds of a pass over memory that reads and writes ``nbytes`` in all."""
        return _hbm_s(self.dev, nbytes)

    def nccl_s(self, nbytes: float) -> float:
        """One NCCL message or collective that moves ``nbytes`` over this rank's link."""
        return self.dev.nccl_latency_s + nbytes / (
            self.dev.link_gb_s * 1e9 * self.dev.nccl_efficiency
        )


@dataclass(frozen=True)
class _Gemm:
    """``tiles`` tiles of ``tile_s`` seconds each (CPU: one piece of work), then ``tail_s``
    (split-K's reduction)."""

    tiles: int
    tile_s: float
    tail_s: float = 0.0


def _tile_s(
    dev: DeviceSpec, dtype: str, bm: int, bn: int, k: int, rel: float, kernel_rate: float = 1.0
) -> float:
    """A tile's seconds: cuBLAS's (``kernel_rate`` 1), or a Triton kernel's at its rate
    relative to cuBLAS (``DeviceSpec.consumer_rate``, ``producer_rate``)."""
    per_sm = dev.peak_tflops[dtype] * 1e12 / dev.sms * dev.gemm_efficiency * rel * kernel_rate
    return dev.tile_overhead_s + 2.0 * bm * bn * k / per_sm


# cuBLAS splits K when a GEMM has too few tiles to fill the SMs; the Triton kernels never do.
_SPLIT_K = (1, 2, 4, 8)


def _gemm(
    dev: DeviceSpec, dtype: str, rows: int, k: int, n: int, *, cublas: bool, tile=None
) -> _Gemm:
    """The tiles of one ``rows x k x n`` GEMM: of shape ``tile`` (an entry of :data:`TILES`), or
    of the menu's shape (and, for cuBLAS, split of K: each of ``s`` slices computes a partial
    tile, then a memory pass over the ``s`` fp32 partials) that finishes soonest alone, which is
    what cuBLAS's heuristics and the kernels' tuning aim for; not cuBLAS, the all-gather's
    consumer (its later launches: the only Triton GEMM run alone). On a CPU: one piece of work
    at the measured rate."""
    if dev.sms is None:
        return _Gemm(1, 2.0 * rows * k * n / (dev.peak_tflops[dtype] * 1e12 * dev.gemm_efficiency))
    best = None
    for bm, bn, rel in [tile] if tile is not None else TILES:
        tiles = math.ceil(rows / bm) * math.ceil(n / bn)
        for split in _SPLIT_K if cublas else (1,):
            if split > 1 and (tiles * split > dev.sms or k // split < 256):
                break
            tail = 0.0 if split == 1 else _hbm_s(dev, (split + 1) * rows * n * 4)
            rate = 1.0 if cublas else dev.consumer_rate
            g = _Gemm(tiles * split, _tile_s(dev, dtype, bm, bn, k / split, rel, rate), tail)
            if best is None or _alone_s(g, dev.sms) < _alone_s(best, dev.sms):
                best = g
    return best


def _alone_s(g: _Gemm, sms: int | None) -> float:
    return math.ceil(g.tiles / (sms or 1)) * g.tile_s + g.tail_s


def _hbm_s(dev: DeviceSpec, nbytes: float) -> float:
    return nbytes / (dev.hbm_gb_s * 1e9 * dev.hbm_efficiency)


def gemm_s(rows: int, k: int, n: int, dtype: str, device: DeviceSpec, *, cublas: bool) -> float:
    """Seconds of one ``rows x k x n`` GEMM alone on ``device`` (cuBLAS, or one of the Triton
    kernels' launches without waits): its waves of tiles, and split-K's reduction."""
    return _alone_s(_gemm(device, dtype, rows, k, n, cublas=cublas), device.sms)


class _Timeline:
    """Streams of work on one GPU. ``gemm`` places a launch's tiles on the SMs that free first
    (from ``ready`` on); ``copy`` queues on the copy engine, one copy at a time; both return when
    the work is done. Callers issue work in the order it becomes ready, so a later launch takes
    the SMs an earlier one leaves (as the hardware dispatches blocks in launch order)."""

    def __init__(self, dev: DeviceSpec, sms: int | None = None) -> None:
        self._sms = [0.0] * (sms or dev.sms or 1)
        self._engine_free = 0.0

    def gemm(self, ready: float, g: _Gemm) -> float:
        done = ready
        for _ in range(g.tiles):
            start = max(heapq.heappop(self._sms), ready)
            heapq.heappush(self._sms, start + g.tile_s)
            done = max(done, start + g.tile_s)
        return done + g.tail_s

    def copy(self, ready: float, seconds: float) -> float:
        self._engine_free = max(self._engine_free, ready) + seconds
        return self._engine_free


def _run_streams(streams: list[list[tuple]], timeline: _Timeline) -> float:
    """Run ``streams`` (lists of ``(kind, what, after)`` steps: ``"gemm"`` with a :class:`_Gemm`,
    ``"copy"`` or ``"delay"`` with seconds; ``after``: names of steps it waits for, on other
    streams) in the order their steps become ready; returns when the last step is done. Each
    step is named ``(stream, index)``."""
    done: dict[tuple[int, int], float] = {}
    heads = [0] * len(streams)
    while True:
        ready = []
        for s, steps in enumerate(streams):
            i = heads[s]
            if i == len(steps) or any(d not in done for d in steps[i][2]):
                continue
            before = done[(s, i - 1)] if i else 0.0
            ready.append((max([before, *(done[d] for d in steps[i][2])]), s))
        if not ready:
            break
        at, s = min(ready)
        kind, what, _ = streams[s][heads[s]]
        if kind == "gemm":
            end = timeline.gemm(at, what)
        elif kind == "copy":
            end = timeline.copy(at, what)
        else:
            end = at + what
        done[(s, heads[s])] = end
        heads[s] += 1
    if any(h != len(steps) for h, steps in zip(heads, streams)):
        raise AssertionError("a step waits for one that never runs")
    return max(done.values(), default=0.0)


# --------------------------------------------------------------------------------------------
# The schedules.


def reference_s(p: Problem, op: str) -> float:
    """``reference``: NCCL's collective, then cuBLAS, nothing overlapped (what DTensor does).

    AG: one all-gather of ``(W-1)*m*K*e`` bytes, then one GEMM ``W*m x K x N_j`` per right-hand
    matrix. RS: one GEMM ``W*m x K x N``, then NCCL's reduce-scatter of ``(W-1)*m*N*e`` bytes
    (the reduction runs inside NCCL's kernels at its bus rate)."""
    row = p.row_bytes if op == AG else p.n * p.out_e
    comm = p.nccl_s((p.w - 1) * p.m * row)
    compute = sum(
        gemm_s(p.w * p.m, p.k, n, p.dtype, p.dev, cublas=True)
        for n in (p.ns if op == AG else (p.n,))
    )
    return comm + compute


def torch_symm_mem_s(p: Problem, op: str) -> float:
    """``torch_symm_mem``: torch 2.13's decomposition in ``torch.distributed._symmetric_memory``.

    AG (``_pipelined_all_gather_and_consume``): a barrier, the own shard copied into the
    symmetric buffer on the compute stream, a second barrier; the own shard's GEMMs (cuBLAS, one
    per ``b``); then for step ``k = 1..W-1`` alternately on the backend stream (odd ``k``) and
    the compute stream: the copy engine pulls peer ``r+k``'s whole shard, then its GEMMs; then
    the own rows copied into the gathered ``A`` (``return_A``; assumed asked for, as the backward
    keeps it) and a barrier. The two streams' GEMMs share the SMs, so one step's thin GEMM fills
    the waves the other leaves. (torch takes other paths for ``W*m <= 2048`` without
    ``return_A`` on a multicast board, and with ``TORCH_SYMM_MEM_ENABLE_NATIVE_ASYNC_TP``: not
    modeled.)

    RS (``_pipelined_produce_and_all2all``): for ``k = 1..W-1``, alternately on the backend and
    the compute stream: the GEMM of the rows owed to ``r+k`` into a local buffer, a barrier, the
    copy engine pulls ``r-k``'s block for this rank, a barrier; the own rows' GEMM; a barrier;
    then ``torch.sum`` of the ``[W, m, N]`` partials (a memory pass reading ``W*m*N*e`` and
    writing ``m*N*e``)."""
    dev, w, m = p.dev, p.w, p.m
    streams: list[list[tuple]] = [[], []]  # 0: compute, 1: backend
    if op == AG:
        gemms = [_gemm(dev, p.dtype, m, p.k, n, cublas=True) for n in p.ns]
        shard = dev.copy_latency_s + p.link_s(m * p.row_bytes)
        streams[0] += [
            ("delay", dev.barrier_s, ()),
            ("copy", dev.copy_latency_s + p.hbm_s(2 * m * p.row_bytes), ()),
            ("delay", dev.barrier_s, ()),
        ]
        streams[1].append(("delay", 0.0, ((0, 2),)))
        streams[0] += [("gemm", g, ()) for g in gemms]
        for step in range(1, w):
            s = step % 2
            streams[s].append(("copy", shard, ()))
            streams[s] += [("gemm", g, ()) for g in gemms]
        streams[0].append(("copy", dev.copy_latency_s + p.hbm_s(2 * m * p.row_bytes), ()))
        streams[0].append(("delay", dev.barrier_s, ((1, len(streams[1]) - 1),)))
        return _run_streams(streams, _Timeline(dev))
    g = _gemm(dev, p.dtype, m, p.k, p.n, cublas=True)
    block = dev.copy_latency_s + p.link_s(m * p.n * p.out_e)
    streams[0].append(("delay", dev.barrier_s, ()))
    streams[1].append(("delay", 0.0, ((0, 0),)))
    for step in range(1, w):
        streams[step % 2] += [
            ("gemm", g, ()),
            ("delay", dev.barrier_s, ()),
            ("copy", block, ()),
            ("delay", dev.barrier_s, ()),
        ]
    streams[0].append(("gemm", g, ()))
    streams[0].append(("delay", dev.barrier_s, ((1, len(streams[1]) - 1),)))
    return _run_streams(streams, _Timeline(dev)) + p.hbm_s((w + 1) * m * p.n * p.out_e)


def pipelined_s(p: Problem, op: str) -> float:
    """``pipelined``: :mod:`tp_kernels.backends.schedule`'s order with NCCL point-to-point blocks.

    Each peer's block is split into row blocks (:func:`tp_kernels.tiling.transfer_blocks`: one
    per MiB, at most 4, or the count set), one NCCL batch each, run one after another on NCCL's
    stream while NCCL's kernels hold ``nccl_sms`` SMs (the GEMMs get the rest). AG: every
    transfer posted up front; the own shard's GEMMs (one per row block and ``b``), then each
    peer's row block's GEMMs once it has landed, peers in the order ``r+1, r+2, ...``. RS: the
    row blocks owed to ``r+1, ..., r-1`` computed one by one, each sent as soon as it is
    computed, the own block last; then the ``W`` partials summed in fp32 in rank order
    (``sum_in_rank_order``: a conversion pass and ``W-1`` additions of an fp32 accumulator). On a
    CPU the "link" is gloo's."""
    dev, w, m = p.dev, p.w, p.m
    chunks = tiling.transfer_blocks(m, p.row_bytes if op == AG else p.n * p.out_e)
    bounds = [m * i // chunks for i in range(chunks + 1)]
    rows = [b - a for a, b in zip(bounds, bounds[1:])]
    compute_sms = dev.sms - dev.nccl_sms if dev.sms else None
    timeline = _Timeline(dev, compute_sms)
    compute: list[tuple] = []
    transfers: list[tuple] = []

    def transfer_s(i: int, nbytes: int) -> float:
        # NCCL runs a rank's batches one after another on its stream; gloo runs the batches
        # posted up front at once, so on a CPU only the first pays the per-message latency.
        t = p.nccl_s(nbytes)
        return t - dev.nccl_latency_s if dev.sms is None and i else t

    if op == AG:
        for i, r in enumerate(rows * (w - 1)):
            transfers.append(("copy", transfer_s(i, r * p.row_bytes), ()))
        for r in rows:
            compute += [("gemm", _gemm(dev, p.dtype, r, p.k, n, cublas=True), ()) for n in p.ns]
        for i, r in enumerate(rows * (w - 1)):
            compute += [
                ("gemm", _gemm(dev, p.dtype, r, p.k, n, cublas=True), ((1, i),)) for n in p.ns
            ]
        return _run_streams([compute, transfers], timeline)
    for i, r in enumerate(rows * (w - 1)):
        compute.append(("gemm", _gemm(dev, p.dtype, r, p.k, p.n, cublas=True), ()))
        transfers.append(("copy", transfer_s(i, r * p.n * p.out_e), ((0, len(compute) - 1),)))
    compute.append(("gemm", _gemm(dev, p.dtype, m, p.k, p.n, cublas=True), ()))
    e = p.out_e
    sum_bytes = m * p.n * ((e + 4) + (w - 1) * (4 + e + 4) + (4 + e))
    compute.append(("delay", p.hbm_s(sum_bytes), ((1, len(transfers) - 1),)))
    return _run_streams([compute, transfers], timeline)


def _shard_order_tiles(
    p: Problem, ns: Sequence[int], bm: int, bn: int
) -> list[tuple[int, int, int]]:
    """``(shard step, M tile in the shard, column tile)`` of every tile of a launch over the
    right-hand widths ``ns`` in the kernels' order (:func:`tp_kernels.kernels._shared.
    _tile_coords`): shard by shard from this rank's own (step 0), inside a shard each width's
    tiles in turn, and for one width in groups of :data:`tp_kernels.tiling.GROUP_M` M tiles that
    walk the column tiles together, column tile 0 of every M tile of the group first."""
    m_tiles = math.ceil(p.m / bm)
    order = []
    for step in range(p.w):
        for n in ns:
            for first in range(0, m_tiles, tiling.GROUP_M):
                group = range(first, min(first + tiling.GROUP_M, m_tiles))
                order += [(step, mt, col) for col in range(math.ceil(n / bn)) for mt in group]
    return order


def _persistent(ready: Sequence[float], tile_s: float, programs: int, start: float) -> list[float]:
    """A persistent launch of ``programs`` programs from ``start``, each taking the next tile
    when it frees (by ticket, or strided: equal tiles make them the same), tile ``i`` not before
    ``ready[i]``; returns when each tile is done."""
    free = [start] * programs
    done = []
    for at in ready:
        begin = max(heapq.heappop(free), at)
        heapq.heappush(free, begin + tile_s)
        done.append(begin + tile_s)
    return done


def _launch_tile(p: Problem, ns: Sequence[int]) -> tuple[int, int, float]:
    """The consumer's tile for one launch over the right-hand widths ``ns``: the menu's fastest
    for all their tiles alone (tuned per shape)."""

    def alone_s(tile: tuple[int, int, float]) -> float:
        bm, bn, rel = tile
        tiles = math.ceil(p.w * p.m / bm) * sum(math.ceil(n / bn) for n in ns)
        tile_s = _tile_s(p.dev, p.dtype, bm, bn, p.k, rel, p.dev.consumer_rate)
        return _alone_s(_Gemm(tiles, tile_s), p.dev.sms)

    return min(TILES, key=alone_s)


def copy_engine_chunks(p: Problem, most: int) -> int:
    """Chunks per peer shard of the copy-engine all-gather: of 1 to ``most``, the count whose
    simulated call (:func:`_copy_engine_s`) is the fastest, the fewest on a tie. A chunk lets
    tiles start on part of a shard (the first peer's behind the own shard's tiles, the last
    peer's at the end), but each pays ``copy_latency_s`` on the one copy engine."""
    return min(range(1, most + 1), key=lambda chunks: (_copy_engine_s(p, chunks), chunks))


def symm_copy_engine_s(p: Problem) -> float:
    """``symm``'s all-gather as built (issue 20): :func:`_copy_engine_s` with the chunk count the
    backend takes (:func:`tp_kernels.backends.symm_gather.chunks_per_shard`, which asks
    :func:`copy_engine_chunks`, 1 to :data:`tp_kernels.config.SYMM_MAX_CHUNKS`)."""
    return _copy_engine_s(p, copy_engine_chunks(p, config.SYMM_MAX_CHUNKS))


def _copy_engine_s(p: Problem, chunks: int) -> float:
    """``symm``'s all-gather with the copy-engine producer, each peer shard in ``chunks`` chunks.

    The own shard is copied into its symmetric buffer and into its rows of the gathered ``A``
    (two memory passes, each paying ``copy_latency_s``), then a barrier; on a side stream the
    copy engine copies each peer's shard (``r+1, r+2, ...``) into ``A`` in chunks of
    :func:`tp_kernels.tiling.chunk_rows` rows, each copy paying ``copy_latency_s`` (its launch
    and the progress word's stream write). The consumer's first launch takes up to
    :data:`tp_kernels.tiling.MAX_BS_PER_LAUNCH` right-hand matrices (QKV's, w1/w3's: all of
    them); it is persistent over every SM, its tiles in the kernels' order, each tile of a
    peer's shard not before the word of the chunk that holds its last row; it reads only local
    memory (TMA), so no SM moves bytes and none waits for a tile that is not running. Further
    launches (more matrices) read ``A`` after it: back-to-back waves."""
    dev = p.dev
    start = 2 * (dev.copy_latency_s + p.hbm_s(2 * p.m * p.row_bytes))
    per_launch = tiling.MAX_BS_PER_LAUNCH
    first, rest = p.ns[:per_launch], p.ns[per_launch:]
    bm, bn, rel = _launch_tile(p, first)
    rows = tiling.chunk_rows(p.m, chunks, interpret=False)
    landed = {}  # (step, chunk) -> when its word is written
    at = start + dev.barrier_s
    for step in range(1, p.w):
        for c in range(math.ceil(p.m / rows)):
            at += dev.copy_latency_s + p.link_s((min(p.m, (c + 1) * rows) - c * rows) * p.row_bytes)
            landed[(step, c)] = at
    order = _shard_order_tiles(p, first, bm, bn)
    ready = [
        landed[(s, (min(p.m, (mt + 1) * bm) - 1) // rows)] if s else start for s, mt, _ in order
    ]
    tile_s = _tile_s(dev, p.dtype, bm, bn, p.k, rel, dev.consumer_rate)
    done = max(_persistent(ready, tile_s, min(len(order), dev.sms), start))
    return done + sum(
        gemm_s(p.w * p.m, p.k, sum(rest[i : i + per_launch]), p.dtype, dev, cublas=False)
        for i in range(0, len(rest), per_launch)
    )


def _producer_tile(p: Problem) -> tuple[int, int, float]:
    """``(BM, BN, seconds)`` of the producer's tile (:func:`tp_kernels.tiling.producer_shape`,
    which the kernel takes)."""
    bm, bn, *_ = tiling.producer_shape(p.m, p.n, _GEMM_KINDS[p.dtype])
    rel = next((r for tm, tn, r in TILES if (tm, tn) == (bm, bn)), TILES[-1][2])
    return bm, bn, _tile_s(p.dev, p.dtype, bm, bn, p.k, rel, p.dev.producer_rate)


def symm_reduce_scatter_s(p: Problem) -> float:
    """``symm``'s matmul-reduce-scatter as built (``kernels/matmul_rs.py``,
    ``backends/symm_scatter.py``).

    The producer is persistent, ``min(tiles, SMs)`` programs (``_producer_config``: 128x256
    tiles in 16 bits once ``N >= 256``), the rows owed to ``r+1`` first and the own rows last;
    every tile stores locally (a staging block per peer, the own slot), so an SM takes its next
    tile when its math is done. Once destination ``d``'s tiles are all done, the side stream's copy
    engine pushes the ``m x N`` block into ``d``'s slot and writes ``d``'s word (one copy at a
    time, ``copy_latency_s`` each, in the order ``r+1, r+2, ...``); then ``reduce_slots`` as
    before: a memory pass reading the ``W`` slots and writing ``m*N*e``, once the last push has
    landed (every peer runs the same schedule)."""
    dev = p.dev
    bm, bn, tile_s = _producer_tile(p)
    per_slot = math.ceil(p.m / bm) * math.ceil(p.n / bn)
    done = _persistent([0.0] * (p.w * per_slot), tile_s, min(p.w * per_slot, dev.sms), 0.0)
    pushed = 0.0
    for step in range(p.w - 1):
        block_done = max(done[step * per_slot : (step + 1) * per_slot])
        pushed = max(pushed, block_done) + dev.copy_latency_s + p.link_s(p.m * p.n * p.out_e)
    finish = max(max(done), pushed)
    return finish + dev.copy_latency_s + p.hbm_s((p.w + 1) * p.m * p.n * p.out_e)


def symm_cpu_s(p: Problem, op: str) -> float:
    """``symm``'s torch path on a CPU (``backends/schedule.py`` over shared memory, one thread).

    AG: the own shard copied into the shared buffer; then, shard by shard from the own, a copy
    into the gathered ``A`` (peers' after their signal) and its matmuls, all in sequence. RS:
    each block's matmul written straight into the destination's slot (zero copy), a signal per
    peer, then the fp32 sum of the ``W`` slots."""
    dev, w, m = p.dev, p.w, p.m
    compute = 2.0 * w * m * p.k * p.n / (dev.peak_tflops[p.dtype] * 1e12 * dev.gemm_efficiency)
    if op == AG:
        return compute + p.hbm_s((w + 1) * m * p.row_bytes) + (w - 1) * dev.barrier_s
    e = p.out_e
    sum_bytes = m * p.n * ((e + 4) + (w - 1) * (4 + e + 4) + (4 + e))
    return compute + (w - 1) * dev.barrier_s + p.hbm_s(sum_bytes)


def quantize_s(rows: int, k: int, device: DeviceSpec, dtype: str = "fp8") -> float:
    """Seconds of casting ``rows`` bf16 rows of ``k`` to ``dtype``: one memory pass reading
    ``2 k`` bytes a row and writing, for fp8, ``k + 4`` (the row's e4m3 bytes and its fp32
    scale: torchao's row-wise cast, torch.compile fusing the row's amax and its cast), for
    MXFP8 the packed row, :func:`tp_kernels.tiling.mx_row_bytes` (assumed, both:
    :data:`DeviceSpec.sources` ``["fp8"]``, ``["mxfp8"]``). The fused all-gather casts its
    ``m`` rows before they travel, the unfused path the ``W*m`` gathered rows after; a
    reduce-scatter's ``W*m`` local rows are cast either way."""
    if dtype not in _SCALED:
        raise ValueError(f"dtype: got {dtype!r}, expected one of {list(_SCALED)}")
    written = k + 4 if dtype == "fp8" else tiling.mx_row_bytes(k)
    return _hbm_s(device, rows * (2 * k + written))


@dataclass(frozen=True)
class OpCost:
    """The model's times (seconds) for one call: the module docstring's compute, comm and speed
    of light; ``schedules_s`` every schedule of :data:`SCHEDULES` for the op (a CPU: the three
    that run there; an MXFP8 call: ``reference``, ``pipelined`` and on a GPU ``symm``);
    ``backends_s`` per backend (an MXFP8 call: those)."""

    compute_s: float
    comm_s: float
    speed_of_light_s: float
    sequential_s: float
    backends_s: dict[str, float]
    schedules_s: dict[str, float] = field(default_factory=dict)


def op_cost(
    op: str,
    m: int,
    k: int,
    n: int,
    world_size: int,
    dtype: str,
    device: DeviceSpec,
    *,
    ns: Sequence[int] | None = None,
    wire: str | None = None,
) -> OpCost:
    """The model for ``op`` ("all_gather_matmul" or "matmul_reduce_scatter") with ``m`` rows per
    rank, ``k`` the reduction dim and ``n`` the output columns, on ``world_size`` ranks;
    ``ns``: the right-hand matrices' widths of an all-gather-matmul (summing to ``n``; default:
    one of ``n``). ``dtype`` "fp8" or "mxfp8": a scaled call at that rate with bf16 output;
    ``wire``: the dtype an all-gather moves (default ``dtype``: the packed rows; ``"bf16"`` is
    torchao's gather before its cast; the cast itself is :func:`quantize_s`, not in these
    times). A reduce-scatter moves its output dtype. An "mxfp8" call has no ``torch_symm_mem``
    schedule, and on a CPU no ``symm`` one (module docstring)."""
    if op not in (AG, RS):
        raise ValueError(f"op: got {op!r}, expected all_gather_matmul or matmul_reduce_scatter")
    if dtype not in _ELEMENT_BYTES:
        raise ValueError(f"dtype: got {dtype!r}, expected one of {sorted(_ELEMENT_BYTES)}")
    if dtype not in device.peak_tflops:
        raise ValueError(f"dtype: {device.name} has no {dtype} rate in the model")
    if wire is not None and (op == RS or wire not in _WIRES[dtype]):
        raise ValueError(
            f"wire: got {wire!r} for a {dtype} {op}; expected None"
            + ("" if op == RS else f" or one of {list(_WIRES[dtype])}")
        )
    if min(m, k, n, world_size) < 1:
        raise ValueError(f"m, k, n, world_size: got {(m, k, n, world_size)}, expected >= 1")
    widths = tuple(ns) if ns is not None else (n,)
    if sum(widths) != n or min(widths) < 1 or (op == RS and len(widths) != 1):
        raise ValueError(f"ns: got {widths}, expected positive widths summing to n={n} (RS: one)")
    p = Problem(m, k, widths, world_size, dtype, device, wire)
    flops = 2.0 * world_size * m * k * n
    compute = flops / (device.peak_tflops[dtype] * 1e12 * device.gemm_efficiency)
    comm = p.link_s((world_size - 1) * m * (p.row_bytes if op == AG else n * p.out_e))
    sol = max(compute, comm)
    if world_size == 1:  # nothing to overlap: every backend runs the GEMM alone
        only = reference_s(p, op)
        backends = dict.fromkeys(("reference", "pipelined", "symm", "torch_symm_mem"), only)
        return OpCost(compute, 0.0, compute, compute, backends, {"reference": only})
    schedules = {"reference": reference_s(p, op), "pipelined": pipelined_s(p, op)}
    if dtype == "mxfp8":  # the backends that run block scales as the model simulates them
        if device.sms is not None:
            schedules["symm"] = symm_copy_engine_s(p) if op == AG else symm_reduce_scatter_s(p)
        return OpCost(compute, comm, sol, compute + comm, dict(schedules), schedules)
    if device.sms is None:
        schedules["symm"] = symm_cpu_s(p, op)
    else:
        schedules["torch_symm_mem"] = torch_symm_mem_s(p, op)
        schedules["symm"] = symm_copy_engine_s(p) if op == AG else symm_reduce_scatter_s(p)
    backends = dict(schedules)
    if "torch_symm_mem" not in backends:
        backends["torch_symm_mem"] = backends["symm"]  # not on a CPU: never a candidate there
    return OpCost(compute, comm, sol, compute + comm, backends, schedules)
