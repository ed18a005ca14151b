"""Tensor-parallel styles: PyTorch's, with a ``backend`` for the fused sequence-parallel boundaries.

Every class here subclasses (or is) the class of the same name in
``torch.distributed.tensor.parallel`` and keeps its constructor, defaults, parameter placements and
results, so a plan written for PyTorch runs unchanged with these classes, and these classes run
inside PyTorch's ``parallelize_module``. Only the hooks that change are overridden.

Shard shapes on a mesh of ``W`` ranks (``nn.Linear(in, out)``, weight ``[out, in]``):

* ``ColwiseParallel``: weight ``Shard(0)`` -> local ``[out/W, in]``, bias ``Shard(0)``;
  ``nn.Embedding(num, dim)``: weight ``Shard(1)`` -> ``[num, dim/W]``.
  Input ``input_layouts`` (default ``Replicate()``) is redistributed to ``Replicate()``;
  output ``y = x @ W.T + b`` is ``Shard(-1)`` and redistributed to ``output_layouts``.
* ``RowwiseParallel``: weight ``Shard(1)`` -> ``[out, in/W]``, bias ``Replicate()``;
  ``nn.Embedding``: weight ``Shard(0)`` -> ``[num/W, dim]``.
  Input ``input_layouts`` (default ``Shard(-1)``) is redistributed to ``Shard(-1)`` (``Replicate()``
  for an embedding); output ``y`` is ``Partial(sum)`` and redistributed to ``output_layouts``
  (default ``Replicate()``: an all-reduce; ``Shard(d)``: a reduce-scatter).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import style as _torch_style
from torch.distributed.tensor.placement_types import Placement

from tp_kernels.backends import check_backend_name

# These styles have nothing to fuse: they are PyTorch's classes, re-exported.
ParallelStyle = _torch_style.ParallelStyle
SequenceParallel = _torch_style.SequenceParallel
PrepareModuleInput = _torch_style.PrepareModuleInput
PrepareModuleOutput = _torch_style.PrepareModuleOutput
PrepareModuleInputOutput = _torch_style.PrepareModuleInputOutput

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
]

_SUPPORTED = (nn.Linear, nn.Embedding)


def _check_module(style: ParallelStyle, module: nn.Module) -> None:
    # PyTorch raises NotImplementedError too, but without naming the module it was given.
    if not isinstance(module, _SUPPORTED):
        raise NotImplementedError(
            f"{type(style).__name__} cannot parallelize a {type(module).__module__}."
            f"{type(module).__qualname__}: it supports nn.Linear and nn.Embedding (and their "
            f"subclasses) only"
        )


class _FusableStyle:
    """The ``backend`` keyword shared by the two styles whose Linear boundaries can be fused."""

    backend: str | None

    def _set_backend(self, backend: str | None) -> None:
        self.backend = (
            check_backend_name(backend, argument="backend") if backend is not None else None
        )

    def _repr_with_backend(self, base: str) -> str:
        return base if self.backend is None else f"{base[:-1]}, backend={self.backend!r})"


class ColwiseParallel(_FusableStyle, _torch_style.ColwiseParallel):
    """PyTorch's ``ColwiseParallel``, plus ``backend`` (``None``: the process-wide default).

    Forward on a mesh of ``W`` ranks with an ``nn.Linear(in, out)``: ``x`` replicated ``[..., in]``
    (gathered from ``input_layouts`` first), ``y_local = x @ W_local.T + b_local`` ``[..., out/W]``.
    Backward: ``dx = dy_local @ W_local`` summed over ranks when ``x`` was gathered from a shard
    (a reduce-scatter) or replicated (a partial sum); ``dW_local = dy_local.T @ x``.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        backend: str | None = None,
    ) -> None:
        super().__init__(
            input_layouts=input_layouts,
            output_layouts=output_layouts,
            use_local_output=use_local_output,
        )
        self._set_backend(backend)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_module(self, module)
        return super()._apply(module, device_mesh)

    def __repr__(self) -> str:
        return self._repr_with_backend(super().__repr__())


class RowwiseParallel(_FusableStyle, _torch_style.RowwiseParallel):
    """PyTorch's ``RowwiseParallel``, plus ``backend`` (``None``: the process-wide default).

    Forward on a mesh of ``W`` ranks with an ``nn.Linear(in, out)``: ``x_local`` ``[..., in/W]``,
    ``y = sum_r x_r @ W_r.T`` reduced into ``output_layouts`` (``Replicate()``: all-reduce,
    ``Shard(d)``: reduce-scatter along ``d``), then ``+ b`` (replicated, added once).
    Backward: ``dy`` gathered to replicated, ``dx_local = dy @ W_local``,
    ``dW_local = dy.T @ x_local``.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        backend: str | None = None,
    ) -> None:
        super().__init__(
            input_layouts=input_layouts,
            output_layouts=output_layouts,
            use_local_output=use_local_output,
        )
        self._set_backend(backend)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_module(self, module)
        return super()._apply(module, device_mesh)

    def __repr__(self) -> str:
        return self._repr_with_backend(super().__repr__())
