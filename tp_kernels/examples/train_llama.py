"""Train the small Llama with tensor + sequence parallelism, then check it against unsharded runs.

Run plainly, it starts its own gloo ranks on this machine::

    python -m tp_kernels.examples.train_llama --world-size 2 --steps 20

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set) it joins those ranks instead, with
NCCL on ``cuda:LOCAL_RANK`` when CUDA is available and gloo on the CPU otherwise::

    torchrun --nproc-per-node 2 -m tp_kernels.examples.train_llama --steps 20

Every rank trains three copies of the same model (same seed, same data, AdamW) step by step side
by side: the parallelized one (``llama_tp_plan``), an unsharded one in the same dtype and
precision recipe and an unsharded one in float64 (no recipe); rank 0 prints each step's three
losses and how many calls have fallen back to PyTorch's path. The exit status is 1 when the
parallel loss curve strays from the float64 curve by more than :func:`curve_tolerance` allows.

``--recipe`` converts every Linear but ``output`` to one of torchao's low-precision training
Linears, which tp_kernels' styles run on their fused path (fp8 or MXFP8 bytes gathered)::

    python -m tp_kernels.examples.train_llama --recipe fp8-rowwise
    python -m tp_kernels.examples.train_llama --recipe mxfp8 --plot loss.png

``fp8-tensorwise``, ``fp8-rowwise`` and ``fp8-rowwise-gw-hp`` are torchao's ``Float8Linear``
recipes (``convert_to_float8_training``); ``mxfp8`` is torchao's ``MXFP8Linear``, its GEMMs
emulated except on an sm_100 GPU (B200, GB200: torchao's kernels). MXFP8 scales blocks of 32
elements along every GEMM's reduction dim, the tokens included, so at ``W`` ranks it fuses when
``seq_len / W``, ``dim / W``, ``2 * dim / W`` (the feed-forward) and ``kv_heads * dim / heads / W``
are multiples of 32 (a call that does not is counted as a fallback): its defaults
(``--dim 128 --seq-len 64``) fuse at W=2; at W=4 use ``--dim 256 --seq-len 128``.

The data is a learnable synthetic pattern: each sequence is an arithmetic progression
``x_t = (x_0 + k t) mod vocab`` with a random start ``x_0`` and stride ``k`` in ``1..3``, so the
model must read the stride from the context and the loss falls well below ``ln(vocab)``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import tp_kernels
from tp_kernels.backends.choice import check_backend_name
from tp_kernels.models import Llama, LlamaConfig
from tp_kernels.models.plans import check_tp_compatible, llama_tp_plan
from tp_kernels.testing import LocalWorld

__all__ = [
    "TrainOptions",
    "TrainRun",
    "announce",
    "check_curves",
    "curve_tolerance",
    "convert",
    "convert_to_mxfp8_linears",
    "describe_recipe",
    "main",
    "mxfp8_kernel_preference",
    "parse_args",
    "parse_options",
    "plot_curves",
    "synthetic_tokens",
    "train_curves",
    "training_steps",
    "train_rank",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
VOCAB = 128
MAX_STRIDE = 3
# --recipe: torchao's Float8LinearConfig recipe names, and MXFP8.
FLOAT8_RECIPES = {
    "fp8-tensorwise": "tensorwise",
    "fp8-rowwise": "rowwise",
    "fp8-rowwise-gw-hp": "rowwise_with_gw_hp",
}
RECIPES = ("none", *FLOAT8_RECIPES, "mxfp8")
# Sizes whose every MXFP8 block lies in one rank's shard at W=2 (module docstring).
MXFP8_SIZES = {"dim": 128, "seq_len": 64}
PROG = "python -m tp_kernels.examples.train_llama"


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
    plot: str | None = None


@dataclass
class TrainOptions(TrainRun):
    """The options of this example: :class:`TrainRun`'s, the model width ``dim`` and the
    low-precision ``recipe`` of its Linears (one of :data:`RECIPES`)."""

    dim: int = 64
    recipe: str = "none"

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
    def add_recipe(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--recipe",
            choices=RECIPES,
            default="none",
            help="convert every Linear but output to torchao's fp8 (Float8Linear, three recipes) "
            "or MXFP8 (MXFP8Linear) training Linear; none: Linears in --dtype. mxfp8 fuses when "
            "seq-len/W, dim/W, 2*dim/W and kv-heads*dim/heads/W are multiples of 32: its "
            f"defaults --dim {MXFP8_SIZES['dim']} --seq-len {MXFP8_SIZES['seq_len']} do at "
            "W=2 (at W=4: --dim 256 --seq-len 128)",
        )

    # The recipe decides the size defaults, so it is read before the full parse.
    recipe_only = argparse.ArgumentParser(prog=PROG, add_help=False)
    add_recipe(recipe_only)
    recipe = recipe_only.parse_known_args(argv)[0].recipe
    sizes = MXFP8_SIZES if recipe == "mxfp8" else {}
    return parse_options(
        argv,
        functools.partial(TrainOptions, **sizes),
        PROG,
        __doc__,
        sizes=("dim",),
        add_arguments=add_recipe,
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
    p.add_argument(
        "--plot",
        metavar="PATH",
        default=None,
        help="write the three loss curves to this picture (needs matplotlib)",
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


def training_steps(
    model: nn.Module, opts: TrainRun, device: torch.device, *, loss_parallel: bool
) -> Iterator[tuple[float, float]]:
    """Train ``model`` for ``opts.steps`` AdamW steps on :func:`synthetic_tokens`, yielding each
    step's loss and its time in ms. ``loss_parallel``: the model's logits are a vocab-sharded
    DTensor."""
    optim = torch.optim.AdamW(model.parameters(), lr=opts.lr)
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
        value = loss.item()  # .item() waits for the device: the step time is complete
        yield value, (time.perf_counter() - start) * 1e3


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
    dtype and recipe) and ``"float64"`` (the unsharded model in float64 without a recipe, the
    reference for rounding).
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
        print(f"recipe {opts.recipe}: {describe_recipe(opts.recipe, device)}", flush=True)
    mesh = init_device_mesh(device.type, (world,))
    tp_model = convert(copy.deepcopy(base), opts.recipe, device)
    tp_model = tp_kernels.parallelize_module(
        tp_model,
        mesh,
        llama_tp_plan(tp_model, loss_parallel=opts.loss_parallel, backend=opts.backend),
    )
    return train_curves(
        base,
        tp_model,
        opts,
        device,
        log=log,
        convert=lambda model: convert(model, opts.recipe, device),
    )


def mxfp8_kernel_preference(device: torch.device):
    """torchao's ``KernelPreference`` for MXFP8 on ``device``: ``AUTO`` (its cast kernels and
    block-scaled GEMMs) on an sm_100 GPU (B200, GB200, B300), which they need; ``EMULATED``
    (the same casts and GEMMs in plain torch) elsewhere."""
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 10:
        return KernelPreference.AUTO
    return KernelPreference.EMULATED


def describe_recipe(recipe: str, device: torch.device) -> str:
    """One line on what ``recipe`` makes of the Linears on ``device``."""
    if recipe == "none":
        return "every Linear in the model's dtype"
    if recipe in FLOAT8_RECIPES:
        return f"torchao Float8Linear ({FLOAT8_RECIPES[recipe]}) on every Linear but output"
    kernels = mxfp8_kernel_preference(device)
    why = "an sm_100 GPU" if kernels.name == "AUTO" else "no sm_100 GPU, torch ops"
    return f"torchao MXFP8Linear on every Linear but output, {kernels} ({why})"


def convert(model: nn.Module, recipe: str, device: torch.device) -> nn.Module:
    """``model`` with every ``nn.Linear`` but ``output`` (the logits: kept in high precision, as
    torchtitan's converters skip it by default) made ``recipe``'s torchao training Linear, in
    place; unchanged for ``"none"``."""

    def chosen(module: nn.Module, name: str) -> bool:
        return type(module) is nn.Linear and name != "output"

    if recipe in FLOAT8_RECIPES:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(FLOAT8_RECIPES[recipe])
        return convert_to_float8_training(model, config=config, module_filter_fn=chosen)
    if recipe == "mxfp8":
        kernels = mxfp8_kernel_preference(device)
        return convert_to_mxfp8_linears(model, kernel_preference=kernels, module_filter_fn=chosen)
    return model


def convert_to_mxfp8_linears(
    model: nn.Module,
    *,
    kernel_preference: Any,
    module_filter_fn: Callable[[nn.Module, str], bool],
    wgrad_with_hp: bool = False,
) -> nn.Module:
    """``model`` with every module that ``module_filter_fn(module, name)`` chooses (an
    ``nn.Linear``) made torchao's ``MXFP8Linear`` of the same weights, in place, as
    ``convert_to_float8_training`` makes Float8Linears (torchao 0.18 has no such converter for
    MXFP8Linear). ``kernel_preference``: torchao's ``KernelPreference``;
    ``wgrad_with_hp``: the weight grad in high precision."""
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

    for name, module in list(model.named_modules()):
        if not module_filter_fn(module, name):
            continue
        mx = MXFP8Linear(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            kernel_preference=kernel_preference,
            wgrad_with_hp=wgrad_with_hp,
            device=module.weight.device,
            dtype=module.weight.dtype,
        )
        mx.weight, mx.bias = module.weight, module.bias  # the same initial weights
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, mx)
    return model


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
    convert: Callable[[nn.Module], nn.Module] = lambda model: model,
) -> dict[str, list[float]]:
    """Train ``tp_model`` (``base`` converted and parallelized), ``convert`` of a copy of
    ``base`` unsharded, and a copy of ``base`` in float64, step by step side by side from the
    same weights; return the loss curves ``"tp"``, ``"unsharded"`` and ``"float64"``.
    ``logits`` wraps a model into the ``tokens -> logits`` module :func:`training_steps`
    takes; ``log``: print each step's losses, the parallel step's time and the fallbacks so far
    (only the parallel model calls tp_kernels' ops), then how often the fused ops ran."""
    tp_kernels.reset_comm_stats()
    models = {
        "tp": tp_model,
        "unsharded": convert(copy.deepcopy(base)),
        "float64": copy.deepcopy(base).to(torch.float64),
    }
    runs = [
        training_steps(logits(model), opts, device, loss_parallel=opts.loss_parallel and tp)
        for tp, model in zip((True, False, False), models.values(), strict=True)
    ]
    curves: dict[str, list[float]] = {name: [] for name in models}
    tokens_per_step = opts.batch * opts.seq_len
    for step, results in enumerate(zip(*runs, strict=True)):
        for name, (loss, _) in zip(models, results, strict=True):
            curves[name].append(loss)
        if log:
            (tp_loss, ms), (unsharded, _), (in_float64, _) = results
            print(
                f"step {step + 1:3d}/{opts.steps}  loss tp {tp_loss:.4f}  "
                f"unsharded {unsharded:.4f}  float64 {in_float64:.4f}  "
                f"fallbacks {tp_kernels.comm_stats().total(kind='fallback')}  "
                f"tokens/s {tokens_per_step / ms * 1e3:9.0f}  ms/step {ms:7.1f}",
                flush=True,
            )
    if log:
        stats = tp_kernels.comm_stats()
        fused = sorted({backend for (_, kind, backend) in stats if kind != "fallback"})
        per_step = {kind: stats.total(kind=kind) // opts.steps for (_, kind, _) in stats}
        print(
            f"fused path: {fused_calls(stats, 'all_gather_matmul')} all-gather-matmuls, "
            f"{fused_calls(stats, 'matmul_reduce_scatter')} matmul-reduce-scatters "
            f"(backends {', '.join(fused) or 'none'}), {stats.total(kind='fallback')} fallbacks; "
            f"per step (forward + backward) {per_step}",
            flush=True,
        )
    return curves


def fused_calls(stats: Any, op: str) -> int:
    """How many ``op`` calls ran fused, unscaled or scaled (fp8, MXFP8)."""
    return stats.total(kind=op) + stats.total(kind=f"scaled_{op}")


def curve_tolerance(curves: dict[str, list[float]], dtype: str) -> float:
    """Largest allowed ``max_t |tp_t - float64_t|``: ``max(2 * max_t |unsharded_t - float64_t|,
    2 * eps(dtype) * |float64_0|)``.

    The unsharded model's own deviation from float64 measures what rounding in ``dtype`` does to
    this training run (AdamW amplifies it step by step); the parallel run reorders sums, so it may
    deviate as much, not more than twice as much. Under a ``--recipe`` the unsharded run has the
    same low-precision Linears and the float64 run none, so its deviation includes what the
    recipe's casts do, which the parallel run makes too. The floor (``2 * eps(dtype)`` times the
    first loss: four half-ulp roundings of it, as in the tests) covers a run whose reference
    happens to round almost exactly.
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


def plot_curves(curves: dict[str, list[float]], path: str) -> str:
    """Draw the loss curves into the picture ``path`` (its format from the suffix) with
    matplotlib; return what was done, or why nothing was."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # a file, no display
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot {path}: matplotlib is not installed (pip install matplotlib); no picture"
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(curves["tp"]) + 1)
    for name, style in (("float64", ":"), ("unsharded", "--"), ("tp", "-")):
        ax.plot(steps, curves[name], style, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.savefig(path)
    plt.close(fig)
    return f"loss curves written to {path}"


def report(curves: dict[str, list[float]], dtype: str, *, plot: str | None = None) -> bool:
    """Print how the curves compare (and draw them into ``plot``, a picture's path); return
    whether the parallel run stayed within tolerance."""
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
    if plot is not None:
        print(plot_curves(curves, plot), flush=True)
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
            return 0 if report(curves, opts.dtype, plot=opts.plot) else 1
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
    return 0 if report(curves, opts.dtype, plot=opts.plot) else 1


if __name__ == "__main__":
    # Import main from the package, not from __main__, so that the spawned ranks can unpickle
    # train_rank and TrainOptions by their module path.
    from tp_kernels.examples.train_llama import main as _main

    sys.exit(_main())
