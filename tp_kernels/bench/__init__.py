"""``python -m tp_kernels.bench``: microbenchmarks of the fused ops against the reference and roof.

Usage::

    python -m tp_kernels.bench [ag_matmul|matmul_rs|all ...] [--world-size 2] [--M 4096 --K 2048
        --N 2048] [--dtype fp32|fp16|bf16|fp8-rowwise|fp8-tensorwise|mxfp8] [--rounds R]
        [--warmup N] [--providers P ...] [--threads T] [--out PATH]
    (the fp8 dtypes: ag_matmul and matmul_rs against torchao's Float8Linear under PyTorch's
    styles and the _scaled_mm roof, K and N multiples of 16, torchao installed; mxfp8: against
    torchao's MXFP8Linear and its MX GEMM, K and N multiples of 32; see tp_kernels.bench.ops_fp8)
    python -m tp_kernels.bench model [--gpu h100] [--tp 8] [--tokens 2048 8192]
        [--model llama3-70b | --fp8 | --mxfp8] [--param NAME=VALUE]   (the cost model's
        schedules for Llama-3's fused ops, with --model its plan of a whole model, with --fp8
        fused fp8 against torchao's unfused fp8 and fused bf16, with --mxfp8 the MXFP8 path
        against torchtitan's on B200 and GB200; see tp_kernels.bench.model)
    python -m tp_kernels.bench overhead [--world-sizes 1 2]   (the host's microseconds per fused
        call and TP Linear, see tp_kernels.bench.overhead)

Without a launcher it starts ``--world-size`` local gloo ranks
(:class:`tp_kernels.testing.LocalWorld`) on this machine; under ``torchrun`` (``RANK`` and
``WORLD_SIZE`` set) it runs on the launcher's ranks, with NCCL when CUDA is available. It prints
one table per benchmark (see :mod:`tp_kernels.bench.protocol` for the timing protocol) and writes a
JSON report, by default to ``bench_results/<benchmarks>-<timestamp>.json``. The exit status is 1
when a provider's output does not match the reference's.

A new benchmark is one function: decorate a builder ``(cfg, group, device) -> BenchCase`` with
:func:`tp_kernels.bench.protocol.register` in a module imported below.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tp_kernels.bench import llama_block as _llama_block  # noqa: F401  (registers llama_block)
from tp_kernels.bench import ops as _ops  # noqa: F401  (registers the op benchmarks)
from tp_kernels.bench.protocol import (
    BENCHMARKS,
    DTYPES,
    MXFP8,
    SCALED_DTYPES,
    BenchConfig,
    add_timeout_argument,
    format_table,
    machine_info,
    non_negative_int,
    positive_int,
    run_case,
    versions,
)
from tp_kernels.testing import LocalWorld

__all__ = ["main", "parse_args", "run_rank"]

# Small enough that `python -m tp_kernels.bench` with no arguments takes well under two minutes on
# two cores (each provider call is ~4 GFLOP per rank).
DEFAULT_M, DEFAULT_K, DEFAULT_N = 2048, 1024, 1024
DEFAULT_WORLD_SIZE = 2


def _size(text: str) -> tuple[str, int]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, positive_int(value)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tp_kernels.bench",
        description="Time the fused tensor-parallel ops against the reference and the "
        "compute-only roof.",
    )
    p.add_argument(
        "benchmarks",
        nargs="*",
        default=["all"],
        help=f"benchmarks to run: {', '.join(BENCHMARKS)} or all (default: all)",
    )
    p.add_argument(
        "--world-size",
        type=positive_int,
        default=None,
        help=f"local ranks to start (default {DEFAULT_WORLD_SIZE}; under torchrun: its WORLD_SIZE)",
    )
    p.add_argument("--M", type=positive_int, default=DEFAULT_M, help="rows, sharded over ranks")
    p.add_argument("--K", type=positive_int, default=DEFAULT_K, help="reduction dim")
    p.add_argument("--N", type=positive_int, default=DEFAULT_N, help="columns")
    p.add_argument(
        "--dtype",
        choices=[*DTYPES, *SCALED_DTYPES],
        default="fp32",
        help="the tensors' dtype (default fp32); fp8-rowwise, fp8-tensorwise and mxfp8 (ag_matmul "
        "and matmul_rs only; need torchao): e4m3 operands with torchao's row-wise, tensor-wise "
        "or MX block (32 along K) scales, bf16 inputs before the cast and bf16 outputs",
    )
    p.add_argument("--rounds", type=positive_int, default=10, help="timed rounds (default 10)")
    p.add_argument(
        "--warmup", type=non_negative_int, default=3, help="untimed iterations (default 3)"
    )
    p.add_argument(
        "--providers",
        nargs="+",
        default=None,
        help="providers to time, space- or comma-separated (default: every one that can run); "
        "the benchmark's baseline (reference, or torch for llama_block) always runs",
    )
    p.add_argument(
        "--size",
        type=_size,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a size a benchmark names itself, repeatable (llama_block: batch, seq, dim, heads, "
        "kv_heads, ffn)",
    )
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--out", type=Path, default=None, help="path of the JSON report")
    add_timeout_argument(p, 1800.0, "the whole run on local ranks")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate the command line; benchmark and provider names are resolved to lists."""
    parser = _parser()
    args = parser.parse_args(argv)
    names: list[str] = []
    for name in args.benchmarks:
        if name == "all":
            names.extend(BENCHMARKS)
        elif name in BENCHMARKS:
            names.append(name)
        else:
            parser.error(f"benchmark {name!r} is unknown; expected one of {[*BENCHMARKS, 'all']}")
    if args.dtype in SCALED_DTYPES:
        # "all" means every benchmark that takes the dtype; one named explicitly must take it.
        explicit = set(args.benchmarks) - {"all"}
        refused = [n for n in names if n in explicit and BENCHMARKS[n].fp8_providers is None]
        if refused:
            takers = [n for n, b in BENCHMARKS.items() if b.fp8_providers is not None]
            parser.error(f"--dtype {args.dtype}: {refused} take no fp8 dtype; only {takers} do")
        names = [n for n in names if BENCHMARKS[n].fp8_providers is not None]
        if importlib.util.find_spec("torchao") is None:
            parser.error(f"--dtype {args.dtype} needs torchao: pip install 'tp_kernels[fp8]'")
        # torch._scaled_mm (every fp8 provider's GEMM) takes K and N in multiples of 16 only;
        # the fused MXFP8 path takes whole MX blocks of every GEMM dim.
        multiple, why = (
            (32, "the fused MXFP8 path takes whole MX blocks of 32")
            if args.dtype == MXFP8
            else (16, "torch._scaled_mm's fp8 GEMM requires it")
        )
        for flag, value in (("--K", args.K), ("--N", args.N)):
            if value % multiple:
                parser.error(
                    f"{flag} {value}: --dtype {args.dtype} needs a multiple of {multiple} ({why})"
                )
    args.benchmarks = list(dict.fromkeys(names))
    if args.providers is not None:
        requested = [p for item in args.providers for p in item.split(",") if p]
        known = {
            p for name in args.benchmarks for p in BENCHMARKS[name].providers_for(args.dtype) or ()
        }
        unknown = [p for p in requested if p not in known]
        if unknown:
            parser.error(
                f"--providers: {unknown} unknown to {args.benchmarks} at --dtype {args.dtype}; "
                f"expected names from {sorted(known)}"
            )
        args.providers = requested
    return args


def _rank_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_rank(cfg: BenchConfig, benchmarks: list[str], providers: list[str] | None) -> dict:
    """Run ``benchmarks`` on this rank of the default process group (every rank calls this).

    Returns ``{"meta": {...}, "results": [run_case record, ...]}``, the same on every rank except
    the per-process machine details.
    """
    group = dist.group.WORLD
    device = _rank_device()
    results = []
    for name in benchmarks:
        case = BENCHMARKS[name].build(cfg, group, device)
        results.append(run_case(case, cfg, group, device, providers))
        del case  # free this benchmark's tensors before the next one allocates
    meta = {
        "machine": machine_info(device),
        "versions": versions(),
        "world_size": dist.get_world_size(),
        "pg_backend": dist.get_backend(),
        "dtype": cfg.dtype,
        "rounds": cfg.rounds,
        "warmup": cfg.warmup,
        "seed": cfg.seed,
        "threads_per_rank": torch.get_num_threads(),
    }
    return {"meta": meta, "results": results}


def _finite(obj: Any) -> Any:
    # JSON has no inf/nan; an infinite error (shape mismatch) is written as null.
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _report(out: dict, args: argparse.Namespace, argv: Sequence[str]) -> int:
    mismatched = []
    for result in out["results"]:
        print(format_table(result, out["meta"]), flush=True)
        print()
        mismatched += [f"{result['name']}/{name}" for name in result["mismatches"]]
    path = args.out
    if path is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path("bench_results") / f"{'+'.join(args.benchmarks)}-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"argv": list(argv), **out["meta"], "benchmarks": out["results"]}
    path.write_text(json.dumps(_finite(report), indent=2) + "\n")
    print(f"wrote {path}")
    if mismatched:
        print(
            f"ERROR: outputs differ from the reference for {mismatched}; see the tables above",
            file=sys.stderr,
        )
        return 1
    return 0


def _check_world_size(args: argparse.Namespace, world_size: int, source: str) -> None:
    if args.world_size is not None and args.world_size != world_size:
        raise SystemExit(f"--world-size {args.world_size} differs from {source} ({world_size})")
    if args.M % world_size:
        raise SystemExit(
            f"--M {args.M} is not divisible by the world size {world_size} (rows are sharded "
            "over ranks); pick a multiple"
        )


def main(argv: Sequence[str] | None = None, *, world: LocalWorld | None = None) -> int:
    """Entry point of ``python -m tp_kernels.bench``; returns the exit status.

    ``world``: an already started local world to run on (tests reuse theirs); otherwise ranks come
    from torchrun's environment, or a new :class:`LocalWorld` of ``--world-size`` gloo ranks.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["model"]:  # the cost model's plan: nothing to time, no ranks
        from tp_kernels.bench import model

        return model.main(argv[1:])
    if argv[:1] == ["overhead"]:  # host time per call: its own ranks per world size
        from tp_kernels.bench import overhead

        return overhead.main(argv[1:])
    args = parse_args(argv)
    cfg = BenchConfig(
        M=args.M,
        K=args.K,
        N=args.N,
        dtype=args.dtype,
        rounds=args.rounds,
        warmup=args.warmup,
        seed=args.seed,
        sizes=dict(args.size),
    )
    job = (run_rank, cfg, args.benchmarks, args.providers)
    if world is not None:
        _check_world_size(args, world.world_size, "the given LocalWorld")
        out = world.run(*job, timeout_s=args.timeout_s)[0]
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _check_world_size(args, int(os.environ["WORLD_SIZE"]), "WORLD_SIZE")
        return _main_torchrun(args, argv, job)
    else:
        world_size = args.world_size or DEFAULT_WORLD_SIZE
        _check_world_size(args, world_size, "--world-size")
        with LocalWorld(world_size, threads=args.threads, timeout_s=args.timeout_s) as local:
            out = local.run(*job)[0]
    return _report(out, args, argv)


def _main_torchrun(args: argparse.Namespace, argv: Sequence[str], job: tuple) -> int:
    torch.set_num_threads(args.threads)
    owned = not dist.is_initialized()
    if owned:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("gloo")
    fn, *rest = job
    out = fn(*rest)
    rank = dist.get_rank()
    if owned:
        dist.destroy_process_group()
    if rank == 0:
        return _report(out, args, argv)
    return 1 if any(result["mismatches"] for result in out["results"]) else 0
