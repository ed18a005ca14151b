"""The layout of a fused call's tensors: the 2-D rows the backends compute on, and back.

A backend sees row-major, rank-major 2-D rows with the gathered or scattered dim first
(``backends/base.py``); the ops move that dim first and flatten on the way in, and give the
results their caller's layout on the way out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["flatten_rows", "restore_dim", "unflatten_rows"]


def flatten_rows(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``t`` with ``dim`` moved first and flattened to 2-D rows ``[rows, K]``, and the leading
    shape those rows came from."""
    lead = t if dim == 0 else t.movedim(dim, 0)
    return (lead if lead.ndim == 2 else lead.reshape(-1, t.shape[-1])), lead.shape[:-1]


def restore_dim(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` (the gathered or scattered dim first, as the backends lay rows out rank-major) with
    that dim moved back to ``dim``, row-major, as PyTorch's collectives and matmuls return it:
    callers ``.view()`` results (``logits.view(-1, vocab)``). For ``dim == 0`` nothing moves; for
    another dim this is one copy of the output, O(M*N) against the matmul's O(M*N*K), that rank-
    major rows cannot avoid."""
    return t if dim == 0 else t.movedim(0, dim).contiguous()


def unflatten_rows(t: torch.Tensor, lead: Sequence[int], dim: int) -> torch.Tensor:
    """2-D rows ``t`` back to ``lead`` rows (``dim`` first) with ``dim`` moved home (``t`` itself
    for 2-D rows on dim 0: a no-op view costs the host microseconds per output)."""
    if dim == 0 and len(lead) == 1:
        return t
    return restore_dim(t.view(*lead, t.shape[-1]), dim)
