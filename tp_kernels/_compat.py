"""The torch version floor, checked once at import."""

from __future__ import annotations

import re

import torch

MIN_TORCH = (2, 7)


def _parse(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ImportError(f"tp_kernels cannot read the torch version {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch_version(version: str = torch.__version__) -> None:
    """Raise ImportError unless ``version`` is at least :data:`MIN_TORCH`."""
    if _parse(version) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ImportError(
            f"tp_kernels needs torch>={need} (for DTensor's public API and the src_data_rank "
            f"argument of the tensor-parallel styles); found torch {version}. "
            f"Install a newer torch first, e.g. `pip install torch==2.13.0`."
        )


def _collective(new_name: str, old_name: str):
    import torch.distributed as dist

    # torch 2.13 renamed the tensor collectives (`*_single`); older releases have the old names.
    return getattr(dist, new_name, None) or getattr(dist, old_name)


def all_gather_single(output, input, group, async_op: bool = False):
    """``output = cat([input of every rank of group], dim=0)``."""
    return _collective("all_gather_single", "all_gather_into_tensor")(
        output, input, group=group, async_op=async_op
    )


def reduce_scatter_single(output, input, group, async_op: bool = False):
    """``output = sum over ranks of input``, rows ``[rank*m:(rank+1)*m]``."""
    return _collective("reduce_scatter_single", "reduce_scatter_tensor")(
        output, input, group=group, async_op=async_op
    )
