"""Train the small Llama with tensor + sequence parallelism, then check it against unsharded runs.

Run plainly, it starts its own gloo ranks on this machine::

    python -m tp_kernels.examples.train_llama --world-size 2 --steps 20

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set) it joins those ranks instead, with
NCCL on ``cuda:LOCAL_RANK`` when CUDA is available and gloo on the CPU otherwise::

    torchrun --nproc-per-node 2 -m tp_kernels.examples.train_llama --steps 20

Every rank trains three copies of the same model (same seed, same data, AdamW): the parallelized
one (``llama_tp_plan``, printed step by step from rank 0), an unsharded one in the same dtype and an
unsharded one in float64. The exit status is 1 when the parallel loss curve strays from the float64
curve by more than :func:`curve_tolerance` allows.

The data is a learnable synthetic pattern: each sequence is an arithmetic progression
``x_t = (x_0 + k t) mod vocab`` with a random start ``x_0`` and stride ``k`` in ``1..3``, so the
model must read the stride from the context and the loss falls well below ``ln(vocab)``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import tp_kernels
from tp_kernels.backends import check_backend_name
from tp_kernels.models import Llama, LlamaConfig
from tp_kernels.models.plans import check_tp_compatible, llama_tp_plan
from tp_kernels.testing import LocalWorld

__all__ = [
    "TrainOptions",
    "TrainRun",
    "announce",
    "check_curves",
    "curve_tolerance",
    "main",
    "parse_args",
    "parse_options",
    "synthetic_tokens",
    "train",
    "train_curves",
    "train_rank",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
VOCAB = 128
MAX_STRIDE = 3


@dataclass
class TrainRun:
    """The command-line options every training example shares (see ``--help``): the run, the
    optimizer and the model's depth and heads; ``world_size=None``: 2 locally, else torchrun's.
    Each example adds its model's width and its ``model_config()``."""

    world_size: int | None = None
    steps: int = 20
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    seq_len: int = 32
    batch: int = 8
    lr: float = 3e-3
    seed: int = 0
    backend: str | None = None
    dtype: str = "float32"
    loss_parallel: bool = False


@dataclass
class TrainOptions(TrainRun):
    """The options of this example: :class:`TrainRun`'s and the model width ``dim``."""

    dim: int = 64

    def model_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=VOCAB,
            dim=self.dim,
            n_layers=self.layers,
            n_heads=self.heads,
            n_kv_heads=self.kv_heads,
            ffn_hidden_dim=2 * self.dim,
            max_seq_len=self.seq_len,
        )


def parse_args(argv: Sequence[str] | None = None) -> TrainOptions:
    return parse_options(
        argv, TrainOptions, "python -m tp_kernels.examples.train_llama", __doc__, sizes=("dim",)
    )


def parse_options(
    argv: Sequence[str] | None,
    options: Callable[..., Any],
    prog: str,
    doc: str | None,
    *,
    sizes: tuple[str, ...],
    add_arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None,
) -> Any:
    """The command line of a training example into ``options(**flags)``: the flags every example
    shares, the model's own ``sizes`` (its width: ``dim``, ``hidden``) and whatever
    ``add_arguments`` adds; ``options(...).model_config()`` must accept the result."""
    defaults = options()
    p = argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n")[0])
    add_arguments(p)
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks to start locally (default 2); under torchrun, must equal WORLD_SIZE",
    )
    p.add_argument("--steps", type=int, default=defaults.steps)
    counts = (*sizes, "layers", "heads", "kv_heads")
    for name in counts:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    p.add_argument(
        "--seq-len",
        type=int,
        default=defaults.seq_len,
        help="tokens per sequence; must be divisible by the world size",
    )
    p.add_argument("--batch", type=int, default=defaults.batch)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument(
        "--backend",
        default=None,
        help="tp_kernels backend of the Colwise/Rowwise styles (default: process-wide)",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default=defaults.dtype)
    p.add_argument(
        "--loss-parallel",
        action="store_true",
        help="keep the logits vocab-sharded and compute the loss under loss_parallel()",
    )
    ns = p.parse_args(argv)
    for name in ("steps", *counts, "seq_len", "batch"):
        if getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    if ns.world_size is not None and ns.world_size < 1:
        p.error(f"--world-size must be >= 1, got {ns.world_size}")
    try:
        if ns.backend is not None:
            check_backend_name(ns.backend, argument="--backend")
        opts = options(**vars(ns))
        opts.model_config()
    except ValueError as e:
        p.error(str(e))
    return opts


def synthetic_tokens(step: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """Tokens ``[batch, seq_len + 1]`` int64 of step ``step``: ``(x0 + k * t) mod VOCAB``, ``t`` the
    position, ``x0`` uniform in ``[0, VOCAB)`` and ``k`` uniform in ``[1, MAX_STRIDE]`` per row.

    Drawn on the CPU from a generator seeded by ``(seed, step)``: identical on every rank.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, VOCAB, (batch, 1), generator=gen)
    stride = torch.randint(1, MAX_STRIDE + 1, (batch, 1), generator=gen)
    return (start + stride * torch.arange(seq_len + 1)) % VOCAB


def train(
    model: nn.Module, opts: TrainRun, device: torch.device, *, loss_parallel: bool, log: bool
) -> list[float]:
    """Train ``model`` for ``opts.steps`` AdamW steps on :func:`synthetic_tokens`; return losses.

    ``loss_parallel``: the model's logits are a vocab-sharded DTensor. ``log``: print one line per
    step (step, loss, tokens/s, ms/step).
    """
    optim = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    tokens_per_step = opts.batch * opts.seq_len
    losses = []
    for step in range(opts.steps):
        start = time.perf_counter()
        tokens = synthetic_tokens(step, opts.batch, opts.seq_len, opts.seed).to(device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        # The loss (and its backward) must run under loss_parallel when the logits stay sharded.
        with tp_kernels.loss_parallel() if loss_parallel else contextlib.nullcontext():
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if isinstance(loss, torch.distributed.tensor.DTensor):
            loss = loss.to_local()
        losses.append(loss.item())  # .item() waits for the device: the step time is complete
        ms = (time.perf_counter() - start) * 1e3
        if log:
            print(
                f"step {step + 1:3d}/{opts.steps}  loss {losses[-1]:.4f}  "
                f"tokens/s {tokens_per_step / ms * 1e3:9.0f}  ms/step {ms:7.1f}",
                flush=True,
            )
    return losses


def rank_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (made current) under NCCL, else the CPU."""
    if dist.get_backend() != "nccl":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    torch.cuda.set_device(device)
    return device


def train_rank(opts: TrainOptions) -> dict[str, list[float]]:
    """Run on every rank of an initialised process group; return the three loss curves.

    Keys: ``"tp"`` (the parallelized model on a 1-D mesh over all ranks), ``"unsharded"`` (same
    dtype) and ``"float64"`` (the unsharded model in float64, the reference for rounding).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = opts.model_config()
    check_tp_compatible(cfg, world, seq_len=opts.seq_len)
    device = rank_device()
    dtype = DTYPES[opts.dtype]
    base = Llama(cfg, seed=opts.seed, device=device, dtype=dtype)
    log = rank == 0
    if log:
        announce(base, f"dim {cfg.dim}", opts, device)
    mesh = init_device_mesh(device.type, (world,))
    tp_model = tp_kernels.parallelize_module(
        copy.deepcopy(base),
        mesh,
        llama_tp_plan(base, loss_parallel=opts.loss_parallel, backend=opts.backend),
    )
    return train_curves(base, tp_model, opts, device, log=log)


def announce(base: nn.Module, width: str, opts: TrainRun, device: torch.device) -> None:
    """Print one line on the model (``width``: how it names its width) and the run."""
    n_params = sum(p.numel() for p in base.parameters())
    print(
        f"{type(base).__name__} {n_params / 1e3:.0f}k params, {width}, {opts.layers} layers, "
        f"{opts.heads}/{opts.kv_heads} heads; TP+SP on {dist.get_world_size()} ranks "
        f"({dist.get_backend()}, {device.type}), {opts.dtype}, "
        f"batch {opts.batch} x seq {opts.seq_len}",
        flush=True,
    )


def train_curves(
    base: nn.Module,
    tp_model: nn.Module,
    opts: TrainRun,
    device: torch.device,
    *,
    log: bool,
    logits: Callable[[nn.Module], nn.Module] = lambda model: model,
) -> dict[str, list[float]]:
    """Train ``tp_model`` (``base`` parallelized), then copies of ``base`` unsharded and in
    float64, each from the same weights; return the loss curves ``"tp"``, ``"unsharded"`` and
    ``"float64"``. ``logits`` wraps a model into the ``tokens -> logits`` module :func:`train`
    takes; ``log``: print the steps of the parallel run and how often its fused ops ran."""
    tp_kernels.reset_comm_stats()
    curves = {
        "tp": train(logits(tp_model), opts, device, loss_parallel=opts.loss_parallel, log=log)
    }
    if log:
        stats = tp_kernels.comm_stats()
        fused = sorted({backend for (_, kind, backend) in stats if kind != "fallback"})
        per_step = {kind: stats.total(kind=kind) // opts.steps for (_, kind, _) in stats}
        print(
            f"fused path: {stats.total(kind='all_gather_matmul')} all-gather-matmuls, "
            f"{stats.total(kind='matmul_reduce_scatter')} matmul-reduce-scatters "
            f"(backends {', '.join(fused) or 'none'}), {stats.total(kind='fallback')} fallbacks; "
            f"per step (forward + backward) {per_step}",
            flush=True,
        )
    unsharded, in_float64 = copy.deepcopy(base), copy.deepcopy(base).to(torch.float64)
    for name, model in (("unsharded", unsharded), ("float64", in_float64)):
        curves[name] = train(logits(model), opts, device, loss_parallel=False, log=False)
    return curves


def curve_tolerance(curves: dict[str, list[float]], dtype: str) -> float:
    """Largest allowed ``max_t |tp_t - float64_t|``: ``max(2 * max_t |unsharded_t - float64_t|,
    2 * eps(dtype) * |float64_0|)``.

    The unsharded model's own deviation from float64 measures what rounding in ``dtype`` does to
    this training run (AdamW amplifies it step by step); the parallel run reorders sums, so it may
    deviate as much, not more than twice as much. The floor (``2 * eps(dtype)`` times the first
    loss: four half-ulp roundings of it, as in the tests) covers a run whose reference happens to
    round almost exactly.
    """
    first = abs(curves["float64"][0])
    floor = 2 * torch.finfo(DTYPES[dtype]).eps * first
    own = max(abs(a - b) for a, b in zip(curves["unsharded"], curves["float64"], strict=True))
    return max(2 * own, floor)


def check_curves(curves: dict[str, list[float]], dtype: str) -> tuple[bool, float, float]:
    """``(ok, deviation, tolerance)``: ``deviation = max_t |tp_t - float64_t|`` against
    :func:`curve_tolerance`."""
    dev = max(abs(a - b) for a, b in zip(curves["tp"], curves["float64"], strict=True))
    tol = curve_tolerance(curves, dtype)
    return dev <= tol, dev, tol


def report(curves: dict[str, list[float]], dtype: str) -> bool:
    """Print how the curves compare; return whether the parallel run stayed within tolerance."""
    for a, b in (("tp", "unsharded"), ("tp", "float64"), ("unsharded", "float64")):
        abs_d = [abs(x - y) for x, y in zip(curves[a], curves[b], strict=True)]
        rel_d = max(d / abs(y) for d, y in zip(abs_d, curves[b], strict=True))
        print(f"loss curves {a} vs {b}: max abs diff {max(abs_d):.3e}, max rel diff {rel_d:.3e}")
    ok, dev, tol = check_curves(curves, dtype)
    print(
        f"loss {curves['tp'][0]:.4f} -> {curves['tp'][-1]:.4f}; "
        f"tp vs float64 {dev:.3e} {'<=' if ok else '>'} tolerance {tol:.3e} "
        f"(2x the unsharded {dtype} run's own deviation from float64, floor 2 eps): "
        f"{'OK' if ok else 'DIVERGED'}",
        flush=True,
    )
    return ok


def main(argv: Sequence[str] | None = None, *, world: LocalWorld | None = None) -> int:
    """Parse ``argv``, train on ``world`` (or torchrun's ranks, or a new local world); exit status.

    Returns 0 when the parallel loss curve stays within :func:`curve_tolerance`, 1 otherwise.
    """
    opts = parse_args(argv)
    return launch(
        opts,
        train_rank,
        lambda ranks: check_tp_compatible(opts.model_config(), ranks, seq_len=opts.seq_len),
        world,
    )


def launch(
    opts: Any,
    train_rank: Callable[[Any], dict[str, list[float]]],
    check_compatible: Callable[[int], None],
    world: LocalWorld | None,
) -> int:
    """Run ``train_rank(opts)`` on ``world``, or on torchrun's ranks, or on a new local world of
    ``opts.world_size`` (default 2) ranks, after ``check_compatible(ranks)`` (which raises when
    the model cannot be split over that many); 0 when the curves pass :func:`check_curves`."""
    if world is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        ranks = int(os.environ["WORLD_SIZE"])
        if opts.world_size not in (None, ranks):
            raise SystemExit(
                f"--world-size {opts.world_size} does not match torchrun's WORLD_SIZE={ranks}"
            )
        check_compatible(ranks)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            curves = train_rank(opts)
        finally:
            dist.destroy_process_group()
        # Every rank holds the same curves, so every rank reaches the same verdict.
        if int(os.environ["RANK"]) == 0:
            return 0 if report(curves, opts.dtype) else 1
        return 0 if check_curves(curves, opts.dtype)[0] else 1
    size = opts.world_size or 2
    check_compatible(size)  # before spawning ranks
    if world is not None:
        if world.world_size != size:
            raise ValueError(
                f"main: --world-size is {size} but the given world has {world.world_size} ranks"
            )
        curves = world.run(train_rank, opts)[0]
    else:
        with LocalWorld(size, timeout_s=600.0) as new_world:
            curves = new_world.run(train_rank, opts)[0]
    return 0 if report(curves, opts.dtype) else 1


if __name__ == "__main__":
    # Import main from the package, not from __main__, so that the spawned ranks can unpickle
    # train_rank and TrainOptions by their module path.
    from tp_kernels.examples.train_llama import main as _main

    sys.exit(_main())
