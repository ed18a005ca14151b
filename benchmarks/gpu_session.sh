#!/usr/bin/env bash
# Issue 35's GPU check, one command for a session with one H100 or H200 (run from the repository
# root; torch with CUDA, TRITON_INTERPRET unset). Each step has its own limit, the whole at
# most 580 s (a device call may take 600); every step runs even when one before it failed.
# What each step shows and the targets: benchmarks/README.md, "Issue 35".
set -u
export PYTHONPATH=.
export TP_KERNELS_TUNING_CACHE="${TP_KERNELS_TUNING_CACHE:-$(mktemp -d)}"  # a first call tunes
step() { echo "=== $* ($(date +%T))"; }
# The compile facts (spills, async wgmma, TMA stores, shared memory) for this GPU's arch.
arch="sm_$(python -c 'import torch; a, b = torch.cuda.get_device_capability(); print(f"{a}{b}")')"
step compile_check "$arch"
timeout 60 python -m tp_kernels.kernels.compile_check --arch "$arch" --out /tmp/ptx | tail -4
# The GEMMs against cuBLAS (bf16) and _scaled_mm (fp8 rowwise) at Llama-3 70B TP=8's shapes:
# w1/w3 (8192x3584x8192), wqkv (8192x1280x8192) and w2 (8192x8192x3584).
for shape in "3584 8192" "1280 8192" "8192 3584"; do
    set -- $shape
    for dtype in bf16 fp8-rowwise; do
        step gpu_kernels "$dtype" M=8192 N=$1 K=$2
        timeout 40 python -m tp_kernels.bench.gpu_kernels --dtype "$dtype" --M 8192 --N "$1" --K "$2"
    done
done
# fp32 once: its first call (compile and tuning) logs how long it took (target: 10 s).
step gpu_kernels fp32 first call
timeout 40 python -m tp_kernels.bench.gpu_kernels --dtype fp32 --M 4096 --N 3584 --K 4096 --reps 5
# The overlap check: probes, two ranks under MPS (or local peers), each op and shape.
step overlap
timeout 240 python -m tp_kernels.bench.overlap
step done
