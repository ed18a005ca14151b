"""A cost model of the two fused patterns: what each should take on a given GPU, on paper.

For one call on each of ``W`` ranks, with ``m`` rows per rank, ``K`` the reduction dim and ``N``
the output columns (the sum over every ``b`` for an all-gather-matmul), in a dtype of ``e`` bytes::

    compute  = 2 * W*m * K * N / (peak_tflops[dtype] * mma_efficiency)        every rank's GEMM
    comm     = (W-1) * m * X * e / (link_gb_s * link_efficiency)               X = K (AG), N (RS)
               + (W-1) * signal_latency                                        one step per peer
    speed of light = max(compute, comm)        sequential = compute + comm

``comm`` counts the bytes that cross this rank's link once each: the ``W-1`` peer shards coming in
(all-gather) or the ``W-1`` partial blocks going out (reduce-scatter); on an NVSwitch node every
GPU has ``link_gb_s`` in each direction to the switch, whatever the peer.

Each backend's expected time follows its schedule, one peer step at a time (see
:func:`pipeline_time`): ``reference`` moves everything, then computes (``sequential``); the
overlapped backends compute their own block while the first peer's block moves, then each
peer's block as it lands (all-gather), or send each partial block as soon as it is computed
(reduce-scatter): when the link is faster than the math the transfers hide behind it entirely
(the own block covers the first transfer (AG) or the last (RS)), and when it is slower only one
block of math stays exposed. ``pipelined`` pays NCCL's
per-message latency and shares the SMs with NCCL's kernels; ``symm`` and ``torch_symm_mem`` copy
with the copy engines and signal through memory.

The efficiencies are assumptions, not measurements: a good GEMM reaches about 75-80% of a
Hopper's dense peak at these shapes, and NCCL's all-gather bus bandwidth about 80% of NVLink's.
Every figure of a :class:`DeviceSpec` names its source.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

__all__ = [
    "DEVICES",
    "DTYPE_NAMES",
    "DeviceSpec",
    "OpCost",
    "device_spec",
    "measure_cpu",
    "op_cost",
    "pipeline_time",
]

_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# The model's dtype names for torch dtypes (other dtypes have no tensor-core rate to model).
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_NVIDIA = "https://www.nvidia.com/en-us/data-center"


@dataclass(frozen=True)
class DeviceSpec:
    """A GPU as the model sees it: dense tensor-core peak per dtype (TFLOP/s; fp32 matmuls at the
    TF32 rate), NVLink bandwidth per direction (GB/s), per-step latency (s) of a point-to-point
    message (NCCL) and of a signal through memory (symm), and the assumed efficiencies."""

    name: str
    peak_tflops: dict[str, float]
    link_gb_s: float
    nccl_latency_s: float
    signal_latency_s: float
    source: str
    mma_efficiency: float = 0.78
    link_efficiency: float = 0.8
    # NCCL's kernels take SMs from the GEMM while they move bytes (a few percent of the math).
    nccl_sm_share: float = 0.05


DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec(
        "H100 SXM5",
        {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7},
        450.0,
        20e-6,
        3e-6,
        f"{_NVIDIA}/h100/ (datasheet: BF16/FP16 1979 and TF32 989 TFLOPS with sparsity, half "
        "dense; NVLink 900 GB/s, both directions)",
    ),
    "h200": DeviceSpec(
        "H200 SXM",
        {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7},
        450.0,
        20e-6,
        3e-6,
        f"{_NVIDIA}/h200/ (datasheet: the H100 SXM's tensor-core rates; NVLink 900 GB/s)",
    ),
    "b200": DeviceSpec(
        "B200 (HGX, 1000 W)",
        {"bf16": 2250.0, "fp16": 2250.0, "fp32": 1100.0},
        900.0,
        20e-6,
        3e-6,
        f"{_NVIDIA}/hgx/ (HGX B200: BF16/FP16 4.5 and TF32 2.2 PFLOPS per GPU with sparsity, "
        "half dense; NVLink 5 1.8 TB/s per GPU, both directions)",
    ),
    "a100": DeviceSpec(
        "A100 SXM4",
        {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
        300.0,
        25e-6,
        4e-6,
        f"{_NVIDIA}/a100/ (datasheet: BF16/FP16 312 and TF32 156 TFLOPS dense; NVLink 600 GB/s, "
        "both directions)",
    ),
}


# On a CPU, "the link" is a copy through shared memory (symm) or gloo's loopback TCP, and the
# latencies are what this project's 2-core test machine showed for a 64-byte gloo send/receive
# pair (~0.5 ms, median of 200) and for a host-polled signal in shared memory (tens of us).
_CPU_GLOO_LATENCY_S = 500e-6
_CPU_SIGNAL_LATENCY_S = 50e-6
_GPU_NAMES = (("H100", "h100"), ("H200", "h200"), ("B200", "b200"), ("A100", "a100"))


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
    GFLOP/s per dtype at 256x256x256 and the bandwidth of one 32 MB copy, best of 3. The
    efficiencies are 1 (these are measured rates, not peaks); copies and matmuls share the cores,
    so the overlap the model assumes is optimistic here, which is why ``auto`` also times."""
    n = 256
    peak = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        x = torch.randn(n, n).to(dtype)
        peak[name] = 2 * n**3 / _timed_s(lambda x=x: x @ x, 3) / 1e12
    src, dst = torch.empty(8 << 20), torch.empty(8 << 20)
    link_gb_s = src.nbytes / _timed_s(lambda: dst.copy_(src), 3) / 1e9
    return DeviceSpec(
        "this CPU (measured)",
        peak,
        link_gb_s,
        _CPU_GLOO_LATENCY_S,
        _CPU_SIGNAL_LATENCY_S,
        "measured by tp_kernels.cost.measure_cpu (matmul and copy rates); latencies estimated",
        mma_efficiency=1.0,
        link_efficiency=1.0,
        nccl_sm_share=0.0,
    )


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


def pipeline_time(compute_s: float, comm_s: float, steps: int, *, gather: bool) -> float:
    """The overlapped schedule of one call with ``steps`` peer blocks (``W-1``).

    All-gather (``gather``): block 0 (own) computes at once; block k (k = 1..steps) lands at
    ``k * comm/steps`` and computes after it has landed and block k-1 is done. Reduce-scatter:
    blocks compute back to back (the peers' first, own last); block k's transfer starts once it
    is computed and the link is free. Returns when the last block is computed (AG) or the last
    transfer has landed and the own block is done (RS).
    """
    if steps == 0:
        return compute_s
    blocks = steps + 1
    c, t = compute_s / blocks, comm_s / steps
    if gather:
        done = c  # own block
        for k in range(1, blocks):
            done = max(done, k * t) + c
        return done
    link_free, computed = 0.0, 0.0
    for _ in range(steps):
        computed += c
        link_free = max(link_free, computed) + t
    return max(link_free, computed + c)


@dataclass(frozen=True)
class OpCost:
    """The model's times (seconds) for one call: see the module docstring."""

    compute_s: float
    comm_s: float
    speed_of_light_s: float
    sequential_s: float
    backends_s: dict[str, float]


def op_cost(
    op: str, m: int, k: int, n: int, world_size: int, dtype: str, device: DeviceSpec
) -> OpCost:
    """The model for ``op`` ("all_gather_matmul" or "matmul_reduce_scatter") with ``m`` rows per
    rank, ``k`` the reduction dim and ``n`` the output columns, on ``world_size`` GPUs."""
    if op not in ("all_gather_matmul", "matmul_reduce_scatter"):
        raise ValueError(f"op: got {op!r}, expected all_gather_matmul or matmul_reduce_scatter")
    if dtype not in _ELEMENT_BYTES:
        raise ValueError(f"dtype: got {dtype!r}, expected one of {sorted(_ELEMENT_BYTES)}")
    if min(m, k, n, world_size) < 1:
        raise ValueError(f"m, k, n, world_size: got {(m, k, n, world_size)}, expected >= 1")
    gather = op == "all_gather_matmul"
    steps = world_size - 1
    flops = 2.0 * world_size * m * k * n
    compute = flops / (device.peak_tflops[dtype] * 1e12 * device.mma_efficiency)
    moved = steps * m * (k if gather else n) * _ELEMENT_BYTES[dtype]
    wire = moved / (device.link_gb_s * 1e9 * device.link_efficiency)
    nccl_comm = wire + steps * device.nccl_latency_s
    comm = wire + steps * device.signal_latency_s  # the cheapest way to move the same bytes
    shared_sms = compute / (1.0 - device.nccl_sm_share)
    backends = {
        "reference": compute + nccl_comm,
        "pipelined": pipeline_time(shared_sms, nccl_comm, steps, gather=gather),
        "symm": pipeline_time(compute, comm, steps, gather=gather),
    }
    backends["torch_symm_mem"] = backends["symm"]
    return OpCost(compute, comm, max(compute, comm), compute + comm, backends)
