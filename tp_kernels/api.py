"""``parallelize_module``: PyTorch's, with argument checks that name what was wrong."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module as _torch_parallelize_module

from tp_kernels.styles import ParallelStyle

__all__ = ["parallelize_module"]


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Apply a tensor-parallel plan to ``module`` in place and return it.

    Same arguments and semantics as ``torch.distributed.tensor.parallel.parallelize_module``:
    ``parallelize_plan`` is one style or a dict from module paths (``fnmatch`` wildcards per
    dot-separated token, ``""`` for ``module`` itself) to styles; styles from tp_kernels and from
    PyTorch may be mixed. ``device_mesh`` must be 1-D (slice a 2-D mesh with ``mesh["tp"]``).
    ``src_data_rank``: the rank whose parameters are scattered/broadcast (``None``: every rank keeps
    its own local values).
    """
    if device_mesh is not None and device_mesh.ndim != 1:
        raise ValueError(
            f"parallelize_module: device_mesh must be 1-D, got a {device_mesh.ndim}-D mesh "
            f"{tuple(device_mesh.shape)}; slice it first, e.g. mesh['tp']"
        )
    if isinstance(parallelize_plan, dict):
        for key, style in parallelize_plan.items():
            if not isinstance(style, ParallelStyle):
                raise TypeError(
                    f"parallelize_module: parallelize_plan[{key!r}] must be a ParallelStyle, "
                    f"got {type(style).__name__}"
                )
    return _torch_parallelize_module(
        module, device_mesh, parallelize_plan, src_data_rank=src_data_rank
    )
