"""What the whole-model tests (tests/test_llama.py, test_hf.py, test_torchtitan.py) share: a
next-token loss and its gradients gathered whole, and the relative error against a float64 run."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import tp_kernels


def full(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a DTensor's ``full_tensor()`` (a collective), a local tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def relative_error(x: torch.Tensor, truth: torch.Tensor) -> float:
    """``||x - truth|| / ||truth||`` in float64."""
    truth = truth.double()
    return ((x.double() - truth).norm() / truth.norm()).item()


def next_token_loss_and_grads(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, loss_parallel: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Cross entropy of ``model(inputs)`` [B, S, V] against ``targets`` [B, S] (in fp32),
    ``backward()``; the whole loss and every parameter's whole gradient, by name (activation
    checkpointing's wrapper prefix removed, so names match the unwrapped model's)."""
    with tp_kernels.loss_parallel() if loss_parallel else contextlib.nullcontext():
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
    grads = {
        name.replace("_checkpoint_wrapped_module.", ""): full(p.grad)
        for name, p in model.named_parameters()
    }
    return full(loss).detach(), grads
