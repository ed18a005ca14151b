"""Train a small random Hugging Face decoder with tensor + sequence parallelism on tp_kernels' fused
path, then check it against unsharded runs.

Run plainly, it starts its own gloo ranks on this machine::

    python -m tp_kernels.examples.train_hf --model llama --world-size 2 --steps 20

Under ``torchrun`` it joins those ranks instead (NCCL on ``cuda:LOCAL_RANK`` when CUDA is
available, gloo on the CPU otherwise)::

    torchrun --nproc-per-node 4 -m tp_kernels.examples.train_hf --model qwen3 --steps 20

The model is transformers' own ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``
or ``Qwen3ForCausalLM`` from a tiny random config (needs ``pip install tp_kernels[hf]``),
parallelized with :func:`tp_kernels.integrations.hf.sequence_parallel_plan`. Every rank trains
three copies (same seed, same data, AdamW) side by side: the parallel one, an unsharded one in the
same dtype and an unsharded one in float64 (rank 0 prints each step's losses); data, tolerance
and report are those of :mod:`tp_kernels.examples.train_llama`. The exit status is 1 when the
parallel loss curve strays from the float64 curve by more than ``train_llama.curve_tolerance``
allows.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import transformers
from torch.distributed.device_mesh import init_device_mesh

import tp_kernels
from tp_kernels.examples import train_llama
from tp_kernels.integrations import hf
from tp_kernels.testing import LocalWorld

__all__ = ["TrainOptions", "build_model", "main", "parse_args", "train_rank"]

MODELS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}


@dataclass
class TrainOptions(train_llama.TrainRun):
    """The options of this example: :class:`~.train_llama.TrainRun`'s, the model family
    (:data:`MODELS`) and its width ``hidden``."""

    model: str = "llama"
    hidden: int = 64

    def model_config(self) -> transformers.PretrainedConfig:
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be a multiple of --heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"--heads {self.heads} must be a multiple of --kv-heads {self.kv_heads}"
            )
        return MODELS[self.model][0](
            vocab_size=train_llama.VOCAB,  # the synthetic data's alphabet
            hidden_size=self.hidden,
            intermediate_size=2 * self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.hidden // self.heads,
            max_position_embeddings=self.seq_len,
            tie_word_embeddings=False,
        )


def parse_args(argv: Sequence[str] | None = None) -> TrainOptions:
    def add_model(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", choices=sorted(MODELS), default=TrainOptions.model)

    return train_llama.parse_options(
        argv,
        TrainOptions,
        "python -m tp_kernels.examples.train_hf",
        __doc__,
        sizes=("hidden",),
        add_arguments=add_model,
    )


class _Logits(nn.Module):
    """``tokens [B, S] -> logits [B, S, V]`` of a transformers model: the interface of
    ``train_llama.training_steps``, which computes the loss itself (under ``loss_parallel`` if
    asked)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def build_model(opts: TrainOptions, device: torch.device) -> nn.Module:
    """The random ``*ForCausalLM`` of ``opts`` in ``opts.dtype``, the same on every rank."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(opts.seed)
        model = MODELS[opts.model][1](opts.model_config())
    return model.to(device=device, dtype=train_llama.DTYPES[opts.dtype])


def train_rank(opts: TrainOptions) -> dict[str, list[float]]:
    """Run on every rank of an initialised process group; return the three loss curves
    (``"tp"``, ``"unsharded"``, ``"float64"``, as ``train_llama.train_rank``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hf.check_tp_compatible(opts.model_config(), world, seq_len=opts.seq_len)
    device = train_llama.rank_device()
    base = build_model(opts, device)
    log = rank == 0
    if log:
        train_llama.announce(base, f"hidden {opts.hidden}", opts, device)
    mesh = init_device_mesh(device.type, (world,))
    tp_model = copy.deepcopy(base)
    plan = hf.sequence_parallel_plan(
        tp_model.config, loss_parallel=opts.loss_parallel, backend=opts.backend
    )
    tp_kernels.parallelize_module(tp_model, mesh, plan)
    return train_llama.train_curves(base, tp_model, opts, device, log=log, logits=_Logits)


def main(argv: Sequence[str] | None = None, *, world: LocalWorld | None = None) -> int:
    """Parse ``argv``, train on ``world`` (or torchrun's ranks, or a new local world); exit status
    0 when the parallel loss curve stays within ``train_llama.curve_tolerance``, else 1."""
    opts = parse_args(argv)
    return train_llama.launch(
        opts,
        train_rank,
        lambda ranks: hf.check_tp_compatible(opts.model_config(), ranks, seq_len=opts.seq_len),
        world,
    )


if __name__ == "__main__":
    # Import main from the package, not from __main__, so that the spawned ranks can unpickle
    # train_rank and TrainOptions by their module path.
    from tp_kernels.examples.train_hf import main as _main

    sys.exit(_main())
