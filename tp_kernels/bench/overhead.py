"""``python -m tp_kernels.bench overhead``: the host's microseconds per fused call and TP Linear.

A GPU runs a Llama TP layer in about 2 ms, so what the host spends launching each fused call
decides whether the GPU waits for it. This bench measures only the host: tiny shapes (``--rows``
rows per rank, ``--dim`` features), one thread, on local gloo ranks, consistency checks off (as
on CUDA; ``--consistency`` turns them on), per world size of ``--world-sizes``:

* ``torch.mm``: the matmul the fused ops run at these shapes (``[W*rows, dim] @ [dim, dim]``);
* per backend, ``all_gather_matmul`` and ``matmul_reduce_scatter``, and their excess over the mm;
* one ``ColwiseParallel(input_layouts=Shard(0))`` Linear, forward and forward + backward, and a
  Colwise(Shard(0)) -> Rowwise(output_layouts=Shard(0)) MLP step, forward + backward, with
  PyTorch's styles and with tp_kernels' (per backend), and the ratio to PyTorch's; with
  ``--fp8`` (torchao installed, ``--dim`` a multiple of 16 as fp8 GEMMs want), the same MLP step
  with its Linears converted to Float8Linear (rowwise recipe).

``--hot-path`` instead lists what one eager ``ColwiseParallel(input_layouts=Shard(0))`` Linear
forward runs of tp_kernels (its modules, then its functions, in first-call order) on ``symm``'s
Triton path (the GPU's protocol, in Triton's interpreter), at W=2: what a newcomer reads.

Each sample is ``--calls`` calls in a loop divided by ``--calls``; samples interleave the
providers, rotated round by round (:func:`tp_kernels.bench.protocol.time_providers`), and the
table gives the median over ``--rounds`` rounds of the slowest rank, with p20 and p80.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import threading
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor import parallel as torch_tp

import tp_kernels as tpk
from tp_kernels import config
from tp_kernels.bench.protocol import percentile, positive_int, render_table, time_providers
from tp_kernels.testing import LocalWorld

__all__ = ["main", "measure"]

BACKENDS = ("reference", "pipelined", "symm")


def _loop(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(calls):
            fn()

    return run


def _mlp(styles, mesh, dim: int, *, recipe: str | None = None) -> nn.Module:
    """The Colwise -> Rowwise MLP; ``recipe``: its Linears converted to torchao's Float8Linear
    with that recipe first (tp_kernels' fused fp8 path)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim))
    if recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    plan = {
        "0": styles.ColwiseParallel(input_layouts=Shard(0)),
        "1": styles.RowwiseParallel(output_layouts=Shard(0)),
    }
    return styles.parallelize_module(model, mesh, plan)


def _linear(styles, mesh, dim: int) -> nn.Module:
    torch.manual_seed(0)
    return styles.parallelize_module(
        nn.Linear(dim, dim), mesh, styles.ColwiseParallel(input_layouts=Shard(0))
    )


def _step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        y = model(x)
        (y.to_local() if isinstance(y, DTensor) else y).sum().backward()

    return run


def _providers(rows: int, dim: int, calls: int, *, fp8: bool) -> dict[str, Callable[[], None]]:
    group = dist.group.WORLD
    world = group.size()
    mesh = init_device_mesh("cpu", (world,))
    a = torch.randn(rows, dim)
    b = torch.randn(dim, dim)
    gathered = torch.randn(world * rows, dim)
    x = torch.randn(rows, dim, requires_grad=True)
    out: dict[str, Callable[[], object]] = {"torch.mm": lambda: torch.mm(gathered, b)}
    for name in BACKENDS:
        out[f"all_gather_matmul {name}"] = lambda n=name: tpk.all_gather_matmul(
            a, [b], 0, group, backend=n
        )
        out[f"matmul_reduce_scatter {name}"] = lambda n=name: tpk.matmul_reduce_scatter(
            gathered, b, 0, group, backend=n
        )
    torch_linear, torch_mlp = _linear(torch_tp, mesh, dim), _mlp(torch_tp, mesh, dim)
    out["Linear fwd, PyTorch"] = lambda: torch_linear(x)
    out["Linear fwd+bwd, PyTorch"] = _step(torch_linear, x)
    out["MLP fwd+bwd, PyTorch"] = _step(torch_mlp, x)
    for name in BACKENDS:
        linear = _linear(tpk, mesh, dim)
        mlp = _mlp(tpk, mesh, dim)
        out[f"Linear fwd, tp_kernels {name}"] = _with_backend(name, lambda m=linear: m(x))
        out[f"Linear fwd+bwd, tp_kernels {name}"] = _with_backend(name, _step(linear, x))
        out[f"MLP fwd+bwd, tp_kernels {name}"] = _with_backend(name, _step(mlp, x))
    if fp8:
        out[f"{_FP8_MLP}, PyTorch"] = _step(_mlp(torch_tp, mesh, dim, recipe="rowwise"), x)
        for name in BACKENDS:
            mlp = _mlp(tpk, mesh, dim, recipe="rowwise")
            out[f"{_FP8_MLP}, tp_kernels {name}"] = _with_backend(name, _step(mlp, x))
    return {name: _loop(fn, calls) for name, fn in out.items()}


_FP8_MLP = "fp8 MLP fwd+bwd (rowwise Float8Linear)"


def _with_backend(name: str, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with tpk.use_backend(name):
            return fn()

    return run


def measure(
    rows: int, dim: int, calls: int, rounds: int, consistency: bool, fp8: bool = False
) -> dict:
    """On every rank: per provider, the per-call microseconds of each round (slowest rank);
    ``fp8``: with the fp8 MLP step's providers."""
    torch.set_num_threads(1)
    config.CHECK_CONSISTENCY.set(consistency)
    try:
        providers = _providers(rows, dim, calls, fp8=fp8)
        times_ms = time_providers(
            providers, rounds=rounds, warmup=2, group=dist.group.WORLD, device=torch.device("cpu")
        )
    finally:
        config.CHECK_CONSISTENCY.reset()
    return {name: [t * 1e3 / calls for t in samples] for name, samples in times_ms.items()}


def hot_path() -> tuple[list[str], list[str]]:
    """On every rank: the modules (paths under ``tp_kernels/``) and the functions (``module:
    name``) of tp_kernels whose Python code one eager colwise Linear forward runs on ``symm``'s
    Triton path, each in first-call order, after two warmup calls. Needs ``TRITON_INTERPRET=1``
    on a CPU, set before Triton's first import."""
    root = os.path.dirname(tpk.__file__)
    modules: list[str] = []
    functions: list[str] = []

    def profile(frame, event, arg) -> None:
        path = frame.f_code.co_filename
        if event != "call" or not path.startswith(root):
            return
        module = os.path.relpath(path, root)
        if module not in modules:
            modules.append(module)
        function = f"{module}:{frame.f_code.co_name}"
        if function not in functions:
            functions.append(function)

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with config.SYMM_TRITON.overriding(True), config.CHECK_CONSISTENCY.overriding(False):
        with tpk.use_backend("symm"):
            linear = _linear(tpk, mesh, 64)
            x = torch.randn(32, 64)
            for _ in range(2):
                linear(x)
            # The copier's host thread runs tp_kernels code too.
            threading.setprofile(profile)
            sys.setprofile(profile)
            try:
                linear(x)
            finally:
                sys.setprofile(None)
                threading.setprofile(None)
    return modules, functions


def _baseline(name: str) -> str | None:
    """The row a row is compared with: an op with torch.mm, a tp_kernels style with PyTorch's."""
    if name.startswith(("all_gather_matmul", "matmul_reduce_scatter")):
        return "torch.mm"
    if ", tp_kernels " in name:
        return name.split(", tp_kernels ")[0] + ", PyTorch"
    return None


def render(world: int, us: dict[str, list[float]]) -> str:
    medians = {name: statistics.median(samples) for name, samples in us.items()}
    rows = []
    for name, samples in us.items():
        base = _baseline(name)
        vs = "-"
        if base == "torch.mm":
            vs = f"+{medians[name] - medians[base]:.1f} us"
        elif base is not None:
            vs = f"{medians[name] / medians[base]:.2f}x"
        rows.append(
            [
                name,
                f"{medians[name]:.1f}",
                f"{percentile(samples, 20):.1f}",
                f"{percentile(samples, 80):.1f}",
                vs,
            ]
        )
    header = ["host time per call", "median us", "p20 us", "p80 us", "vs mm / PyTorch"]
    return f"== world={world} (gloo, one thread per rank)\n" + render_table(header, rows)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tp_kernels.bench overhead",
        description="Host microseconds per fused call and per TP Linear (tiny shapes).",
    )
    p.add_argument("--world-sizes", type=positive_int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=positive_int, default=8, help="rows per rank (default 8)")
    p.add_argument("--dim", type=positive_int, default=64, help="features (default 64)")
    p.add_argument("--calls", type=positive_int, default=50, help="calls per sample (50)")
    p.add_argument("--rounds", type=positive_int, default=15, help="samples (default 15)")
    p.add_argument("--consistency", action="store_true", help="agree on every call (CPU default)")
    p.add_argument(
        "--fp8",
        action="store_true",
        help="also the MLP step with rowwise Float8Linears (needs torchao; ~5x slower per call)",
    )
    p.add_argument(
        "--hot-path",
        action="store_true",
        help="list the modules and functions one eager colwise Linear runs (symm, W=2), no timing",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.fp8 and args.dim % 16:
        parser.error(f"--fp8: --dim is {args.dim}; fp8 GEMMs need a multiple of 16")
    if args.fp8 and importlib.util.find_spec("torchao") is None:
        parser.error("--fp8: torchao is not installed (pip install torchao)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.hot_path:
        with LocalWorld(2, env={"TRITON_INTERPRET": "1"}, timeout_s=600) as world:
            modules, functions = world.run(hot_path)[0]
        print(f"{len(modules)} modules: " + " -> ".join(modules))
        print(f"{len(functions)} functions:\n  " + "\n  ".join(functions))
        return 0
    for world_size in args.world_sizes:
        world = LocalWorld(world_size)
        try:
            us = world.run(
                measure, args.rows, args.dim, args.calls, args.rounds, args.consistency, args.fp8
            )[0]
        finally:
            world.close()
        print(render(world_size, us), flush=True)
    return 0
