"""Tensor-parallel styles: PyTorch's, whose sequence-parallel Linear boundaries run fused ops.

Every class here subclasses (or is) the class of the same name in
``torch.distributed.tensor.parallel`` and keeps its constructor, defaults, parameter placements and
results, so a plan written for PyTorch runs unchanged with these classes, and these classes run
inside PyTorch's ``parallelize_module``. Only the hooks that change are overridden.

Shard shapes on a mesh of ``W`` ranks (``nn.Linear(in, out)``, weight ``[out, in]``):

* ``ColwiseParallel``: weight ``Shard(0)`` -> local ``[out/W, in]``, bias ``Shard(0)``;
  ``nn.Embedding(num, dim)``: weight ``Shard(1)`` -> ``[num, dim/W]``.
* ``RowwiseParallel``: weight ``Shard(1)`` -> ``[out, in/W]``, bias ``Replicate()``;
  ``nn.Embedding``: weight ``Shard(0)`` -> ``[num/W, dim]``.

The fused paths (plain ``nn.Linear`` only; anything else runs PyTorch's code):

* **Colwise, input sharded** (``input_layouts=Shard(d)``, ``d`` not the last dim, or a DTensor
  input sharded that way): ``y_local = all_gather_matmul(x_local, [W_local^T], d) + b_local``
  instead of redistributing ``x`` to ``Replicate()`` and multiplying.
* **Rowwise, output sharded** (``output_layouts=Shard(d)``, ``d`` not the last dim):
  ``y_local = matmul_reduce_scatter(x_local, W_local^T, d, bias=b)`` instead of a ``Partial``
  product redistributed by a reduce-scatter; the replicated bias is added once, after it.
* **One gather per block**: :class:`PrepareModuleInput` with one positional input going from
  ``Shard(d)`` to ``Replicate()`` gathers it with a single ``all_gather_matmul`` whose ``bs`` are
  the weights of the module's direct children that are tp_kernels ``ColwiseParallel`` Linears
  taking a replicated input (``wq, wk, wv``; ``w1, w3``). The module receives the gathered input as
  PyTorch would give it; each such child called with exactly that tensor returns its precomputed
  output, so the backward issues one reduce-scatter for the sum of their input grads. Any other use
  of the gathered input (a child called with something else, a non-Linear op) sees the correctly
  gathered tensor, so results stay those of PyTorch; a precomputed output that no child claims is
  dropped after the module's forward. Grouping falls back to PyTorch's path (and says so once at
  INFO on the ``tp_kernels`` logger) when the input is not sharded as declared, or the children
  disagree on backend or mesh.

* **Sequence-parallel norms**: ``SequenceParallel`` on an ``nn.LayerNorm`` or ``nn.RMSNorm``
  whose normalized dims exclude the sequence dim normalizes each token of the local shard
  directly, ``y_local = norm(x_local)`` with the local values of its replicated weights, instead
  of dispatching every op through DTensor; the weights' grads come back as ``Partial`` sums, as
  PyTorch's do. Other modules (``Dropout``, whose random mask DTensor draws per global position)
  run PyTorch's path.

A style that cannot take its fused path for a call (uneven shards, an input not sharded as
declared, a Linear subclass with its own forward) runs PyTorch's path, counts a ``fallback`` in
:func:`tp_kernels.comm_stats` and logs the reason once at INFO.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import style as _torch_style
from torch.distributed.tensor.placement_types import Placement

from tp_kernels.backends import check_backend_name
from tp_kernels.ops import all_gather_matmul, matmul_reduce_scatter
from tp_kernels.ops.stats import record

# These styles have nothing to fuse: they are PyTorch's classes, re-exported.
ParallelStyle = _torch_style.ParallelStyle
PrepareModuleOutput = _torch_style.PrepareModuleOutput

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
]

logger = logging.getLogger("tp_kernels")
_SUPPORTED = (nn.Linear, nn.Embedding)
_reported: set[tuple[str, str]] = set()


def _check_module(style: ParallelStyle, module: nn.Module) -> None:
    # PyTorch raises NotImplementedError too, but without naming the module it was given.
    if not isinstance(module, _SUPPORTED):
        raise NotImplementedError(
            f"{type(style).__name__} cannot parallelize a {type(module).__module__}."
            f"{type(module).__qualname__}: it supports nn.Linear and nn.Embedding (and their "
            f"subclasses) only"
        )


def _fall_back(where: str, reason: str) -> None:
    """Count a call that took PyTorch's path instead of a fused one; log each reason once."""
    record("forward", "fallback", "torch")
    if (where, reason) not in _reported:
        _reported.add((where, reason))
        logger.info("%s takes PyTorch's path: %s", where, reason)


def _sharded_dim(placement: Placement, ndim: int) -> int | None:
    """``d`` if ``placement`` is ``Shard(d)`` on a leading (non-contracted) dim, else None."""
    if isinstance(placement, Shard) and placement.dim % ndim != ndim - 1:
        return placement.dim % ndim
    return None


@dataclass
class _FusedLinear:
    """What a fused Linear carries (as ``module._tpk_fused``) between its hooks and forward."""

    style: str  # "colwise" | "rowwise"
    mesh: DeviceMesh
    backend: str | None
    input_layouts: tuple[Placement, ...]
    output_layouts: tuple[Placement, ...]
    # (the exact input object, the output) left by a grouping PrepareModuleInput
    precomputed: tuple[Any, DTensor] | None = None

    def holds(self, x: Any) -> bool:
        """Whether the grouping left an output for exactly this input object."""
        return self.precomputed is not None and self.precomputed[0] is x

    def claim(self, x: Any) -> DTensor | None:
        if not self.holds(x):
            return None
        out, self.precomputed = self.precomputed[1], None
        return out


def _plain_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


class _FusableStyle:
    """What Colwise and Rowwise add to PyTorch's classes: the ``backend`` keyword (in the
    constructor and the repr) and the install of a fused forward. Listed before PyTorch's class
    in the bases, so ``super()`` reaches it."""

    backend: str | None
    _kind: str

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
        self.backend = (
            check_backend_name(backend, argument="backend") if backend is not None else None
        )

    def __repr__(self) -> str:
        base = super().__repr__()
        return base if self.backend is None else f"{base[:-1]}, backend={self.backend!r})"

    def _install(self, module: nn.Module, device_mesh: DeviceMesh, forward) -> None:
        if not _plain_linear(module):
            if isinstance(module, nn.Linear):
                _fall_back(
                    f"{type(self).__name__} on {type(module).__qualname__}",
                    "a Linear subclass with its own forward is never fused",
                )
            return
        module._tpk_fused = _FusedLinear(
            self._kind, device_mesh, self.backend, self.input_layouts, self.output_layouts
        )
        # An instance attribute shadows nn.Linear.forward for this module only; hooks still run.
        module.forward = forward.__get__(module)


def _colwise_forward(self: nn.Linear, x: Any) -> Any:
    fused: _FusedLinear = self._tpk_fused
    pre = fused.claim(x)
    if pre is not None:
        return pre
    dim = _sharded_dim(x.placements[0], x.ndim) if isinstance(x, DTensor) else None
    if dim is not None:
        _, (y,) = all_gather_matmul(
            x.to_local(), [self.weight.to_local().t()], dim, fused.mesh, backend=fused.backend
        )
        if self.bias is not None:
            y = y + self.bias.to_local()
        return DTensor.from_local(y, fused.mesh, (Shard(y.ndim - 1),), run_check=False)
    return nn.Linear.forward(self, x)


def _rowwise_forward(self: nn.Linear, x: Any) -> Any:
    fused: _FusedLinear = self._tpk_fused
    where = f"RowwiseParallel on {type(self).__qualname__}"
    dim = _sharded_dim(fused.output_layouts[0], x.ndim)
    if dim is None:
        _fall_back(where, f"output {fused.output_layouts[0]} shards the last (feature) dim")
        return nn.Linear.forward(self, x)
    if not (isinstance(x.placements[0], Shard) and x.placements[0].dim % x.ndim == x.ndim - 1):
        _fall_back(where, f"input placements {x.placements} are not Shard(-1)")
        return nn.Linear.forward(self, x)
    world = fused.mesh.size()
    if x.shape[dim] % world:
        _fall_back(where, f"output dim {dim} of size {x.shape[dim]} is uneven over {world} ranks")
        return nn.Linear.forward(self, x)
    bias = None if self.bias is None else self.bias.to_local()
    y = matmul_reduce_scatter(
        x.to_local(), self.weight.to_local().t(), dim, fused.mesh, backend=fused.backend, bias=bias
    )
    return DTensor.from_local(y, fused.mesh, fused.output_layouts, run_check=False)


class ColwiseParallel(_FusableStyle, _torch_style.ColwiseParallel):
    """PyTorch's ``ColwiseParallel``, plus ``backend`` (``None``: the process-wide default).

    Forward on a mesh of ``W`` ranks with an ``nn.Linear(in, out)``: ``x`` ``[..., in]`` gathered
    from ``input_layouts`` (fused with the matmul when sharded on a leading dim),
    ``y_local = x @ W_local^T + b_local`` ``[..., out/W]``, then redistributed to
    ``output_layouts``. Backward: ``dx = sum_r dy_r @ W_r`` (reduce-scattered back to the input's
    shards, fused with the matmul), ``dW_local = dy_local^T @ x``, ``db_local = sum dy_local``.
    """

    _kind = "colwise"

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        fused: _FusedLinear | None = getattr(mod, "_tpk_fused", None)
        x = inputs[0]
        if fused is not None:
            if fused.holds(x):
                return inputs  # the forward returns the grouped gather's output
            layout = x.placements[0] if isinstance(x, DTensor) else input_layouts[0]
            if _sharded_dim(layout, x.ndim) is not None:
                world = device_mesh.size()
                dim = _sharded_dim(layout, x.ndim)
                if not isinstance(x, DTensor):
                    return DTensor.from_local(x, device_mesh, input_layouts, run_check=False)
                if x.shape[dim] % world == 0:
                    return x
                _fall_back(
                    f"ColwiseParallel on {type(mod).__qualname__}",
                    f"input dim {dim} of size {x.shape[dim]} is uneven over {world} ranks",
                )
        return _torch_style.ColwiseParallel._prepare_input_fn(
            input_layouts, desired_input_layouts, mod, inputs, device_mesh
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_module(self, module)
        module = super()._apply(module, device_mesh)
        self._install(module, device_mesh, _colwise_forward)
        return module


class RowwiseParallel(_FusableStyle, _torch_style.RowwiseParallel):
    """PyTorch's ``RowwiseParallel``, plus ``backend`` (``None``: the process-wide default).

    Forward on a mesh of ``W`` ranks with an ``nn.Linear(in, out)``: ``x_local`` ``[..., in/W]``,
    ``y = sum_r x_r @ W_r^T`` reduced into ``output_layouts`` (``Replicate()``: all-reduce;
    ``Shard(d)`` on a leading dim: a reduce-scatter fused with the matmul), then ``+ b``
    (replicated, added once). Backward: ``dy`` gathered to replicated (fused with
    ``dx_local = dy @ W_local``), ``dW_local = dy^T @ x_local``, ``db = sum dy``.
    """

    _kind = "rowwise"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_module(self, module)
        module = super()._apply(module, device_mesh)
        if isinstance(self.output_layouts[0], Shard):
            self._install(module, device_mesh, _rowwise_forward)
        return module


def _sequence_local_forward(self: nn.Module, x: Any) -> Any:
    mesh = self._tpk_sequence_mesh
    normalized = len(self.normalized_shape)
    placement = x.placements[0] if isinstance(x, DTensor) else None
    if not isinstance(placement, Shard) or placement.dim % x.ndim >= x.ndim - normalized:
        return type(self).forward(self, x)  # the sequence dim is normalized: not per token

    def local(p: nn.Parameter | None) -> torch.Tensor | None:
        return None if p is None else p.to_local(grad_placements=(Partial(),))

    x_local = x.to_local()
    if isinstance(self, nn.LayerNorm):
        y = F.layer_norm(
            x_local, self.normalized_shape, local(self.weight), local(self.bias), self.eps
        )
    else:
        y = F.rms_norm(x_local, self.normalized_shape, local(self.weight), self.eps)
    return DTensor.from_local(y, mesh, x.placements, run_check=False)


class SequenceParallel(_torch_style.SequenceParallel):
    """PyTorch's ``SequenceParallel``; LayerNorm and RMSNorm run on the local shard (see the module
    docstring): ``y_local = norm(x_local)``, the same values, placements and grads as PyTorch's."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        if type(module) in (nn.LayerNorm, nn.RMSNorm):
            module._tpk_sequence_mesh = device_mesh
            module.forward = _sequence_local_forward.__get__(module)
        return module


class PrepareModuleInput(_torch_style.PrepareModuleInput):
    """PyTorch's ``PrepareModuleInput``; one ``Shard(d) -> Replicate()`` input is gathered once,
    fused with the matmuls of the module's colwise children (see the module docstring)."""

    def _grouped_index(self) -> int | None:
        """The positional input this style would gather, if exactly one goes Shard -> Replicate."""
        if self.input_layouts is None:
            return None
        gathered = [
            i
            for i, (have, want) in enumerate(zip(self.input_layouts, self.desired_input_layouts))
            if isinstance(have, Shard) and isinstance(want, Replicate)
        ]
        return gathered[0] if len(gathered) == 1 else None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        index = self._grouped_index()
        if index is None:
            return super()._apply(module, device_mesh)

        def pre_hook(mod, inputs, kwargs=None):
            args = self._grouped_prepare(mod, inputs, index, device_mesh)
            if kwargs is None:
                return args
            return args, {
                key: self._prepare_input_arg(
                    value,
                    device_mesh,
                    self.input_kwarg_layouts.get(key),
                    self.desired_input_kwarg_layouts.get(key),
                )
                for key, value in kwargs.items()
            }

        module.register_forward_pre_hook(pre_hook, with_kwargs=self.with_kwargs)
        module.register_forward_hook(_drop_unclaimed)
        return module

    def _grouped_prepare(self, mod, inputs, index, device_mesh) -> tuple:
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        children = [
            c
            for c in mod.children()
            if getattr(c, "_tpk_fused", None) is not None
            and c._tpk_fused.style == "colwise"
            and c._tpk_fused.input_layouts == (Replicate(),)
            and c._tpk_fused.mesh == device_mesh
        ]
        if len(inputs) != len(self.input_layouts):  # PyTorch's path raises the error
            return self._prepare_input_fn(inputs, device_mesh)
        x, layout = inputs[index], self.input_layouts[index]
        reason = _why_not_grouped(children, x, layout, device_mesh)
        if reason is not None:
            if reason != "no tp_kernels ColwiseParallel Linear children":
                _fall_back(f"PrepareModuleInput on {type(mod).__qualname__}", reason)
            return self._prepare_input_fn(inputs, device_mesh)
        local = x.to_local() if isinstance(x, DTensor) else x
        gathered, outs = all_gather_matmul(
            local,
            [c.weight.to_local().t() for c in children],
            layout.dim % local.ndim,
            device_mesh,
            backend=children[0]._tpk_fused.backend,
            return_a=True,
        )
        passed = (
            gathered
            if self.use_local_output
            else DTensor.from_local(gathered, device_mesh, (Replicate(),), run_check=False)
        )
        for child, y in zip(children, outs):
            if child.bias is not None:
                y = y + child.bias.to_local()
            child._tpk_fused.precomputed = (
                passed,
                DTensor.from_local(y, device_mesh, (Shard(y.ndim - 1),), run_check=False),
            )
        prepared = []
        for i, (arg, have, want) in enumerate(
            zip(inputs, self.input_layouts, self.desired_input_layouts)
        ):
            prepared.append(
                passed if i == index else self._prepare_input_arg(arg, device_mesh, have, want)
            )
        return tuple(prepared)


def _why_not_grouped(children, x, layout, device_mesh) -> str | None:
    if not children:
        return "no tp_kernels ColwiseParallel Linear children"
    if isinstance(x, DTensor):
        if x.placements != (layout,):
            return f"input placements {x.placements} are not the declared ({layout},)"
        if x.shape[layout.dim % x.ndim] % device_mesh.size():
            return f"input dim {layout.dim} of size {x.shape[layout.dim]} is uneven"
    elif not isinstance(x, torch.Tensor):
        return f"the input is a {type(x).__name__}, not a tensor"
    if _sharded_dim(layout, x.ndim) is None:
        return f"{layout} shards the contracted (last) dim"
    if len({c._tpk_fused.backend for c in children}) > 1:
        return "its colwise children ask for different backends"
    return None


def _drop_unclaimed(mod, inputs, outputs):
    for child in mod.children():
        fused = getattr(child, "_tpk_fused", None)
        if fused is not None:
            fused.precomputed = None


class PrepareModuleInputOutput(_torch_style.PrepareModuleInputOutput):
    """PyTorch's ``PrepareModuleInputOutput``, whose input side is tp_kernels'
    :class:`PrepareModuleInput` (one gather per block)."""

    def __init__(
        self,
        *,
        input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_input: bool = False,
        output_layouts: Placement | tuple[Placement | None, ...],
        desired_output_layouts: Placement | tuple[Placement, ...],
        use_local_output: bool = True,
    ) -> None:
        input_kwargs = dict(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
        )
        super().__init__(
            **input_kwargs,
            use_local_input=use_local_input,
            output_layouts=output_layouts,
            desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )
        self.prepare_module_input = PrepareModuleInput(
            **input_kwargs, use_local_output=use_local_input
        )
