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
* **One gather per block**: :class:`PrepareModuleInput` with one positional input (or else one
  keyword input of ``input_kwarg_layouts``, as Hugging Face models call
  ``self_attn(hidden_states=...)``) going from ``Shard(d)`` to ``Replicate()`` gathers it with
  a single ``all_gather_matmul`` whose ``bs`` are
  the weights of the module's direct children that are tp_kernels ``ColwiseParallel`` Linears
  taking a replicated input (``wq, wk, wv``; ``w1, w3``). The module receives the gathered input as
  PyTorch would give it; each such child called with exactly that tensor returns its precomputed
  output, so the backward issues one reduce-scatter for the sum of their input grads. Any other use
  of the gathered input (a child called with something else, a non-Linear op) sees the correctly
  gathered tensor, so results stay those of PyTorch; a precomputed output that no child claims is
  dropped after the module's forward. Grouping falls back to PyTorch's path (counted, and said
  once at INFO on the ``tp_kernels`` logger) when the input is not sharded as declared, the style
  gathers more than one input, or the children disagree on backend.

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

import functools
import logging
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import style as _torch_style
from torch.distributed.tensor.placement_types import Placement

from tp_kernels.backends.choice import check_backend_name
from tp_kernels.ops._checks import resolve_group
from tp_kernels.ops.ag_matmul import all_gather_matmul, colwise_linears
from tp_kernels.ops.comm_stats import record
from tp_kernels.ops.dtensors import eager_path, local_tensor
from tp_kernels.ops.matmul_rs import matmul_reduce_scatter, rowwise_linear

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

# Every style of torch.distributed.tensor.parallel, by name: tp_kernels offers each under it.
STYLE_NAMES = (
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
)

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


def _simulated_ranks() -> str | None:
    """Why no call can fuse in this process now (None: calls may fuse): under PyTorch's
    ``LocalTensorMode`` one process simulates every rank, and the fused ops need real peers."""
    try:
        from torch.distributed._local_tensor import local_tensor_mode
    except ImportError:  # torch before LocalTensorMode
        return None
    if local_tensor_mode() is None:
        return None
    return "LocalTensorMode simulates the ranks in one process; the fused ops need real peers"


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
    # The output hook would only take the local tensor of the fused op's result (the style's
    # use_local_output, with output_layouts the placement the fused op produces): the fused
    # Linear then returns that local tensor itself (see ops/ag_matmul.py).
    local_output: bool
    # A torchao low-precision Linear: "float8" (Float8Linear, on tp_kernels/float8.py's fused
    # path) or "mxfp8" (an MXFP8 Linear, on tp_kernels/mxfp8.py's); None: high precision.
    quantized: str | None = None
    # The grouping PrepareModuleInput of the parent module, once it has found this child.
    group: _GatherGroup | None = None

    @functools.cached_property
    def process_group(self) -> dist.ProcessGroup:
        """The mesh's group, resolved on the first call (not on every one)."""
        return resolve_group(self.mesh, op=f"{self.style}-parallel Linear")

    def __getstate__(self) -> dict:
        return _without_process_group(self.__dict__)

    def holds(self, module: nn.Module, x: Any) -> bool:
        """Whether the group left an output for ``module`` computed from exactly this input."""
        return self.group is not None and self.group.holds(module, x)

    def claim(self, module: nn.Module, x: Any) -> DTensor | None:
        """The output the group left for ``module`` from exactly this input (then forgotten)."""
        return None if self.group is None else self.group.claim(module, x)


def _without_process_group(state: dict) -> dict:
    """``state`` without the cached ``process_group``: a ProcessGroup cannot be copied or
    pickled (a parallelized model is, by ``copy.deepcopy`` and checkpointing); the copy resolves
    its mesh's group again on its first call."""
    return {k: v for k, v in state.items() if k != "process_group"}


def _plain_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def _quantized_kind(module: nn.Module) -> str | None:
    """``"float8"`` for an fp8 Linear (torchao's Float8Linear, or a Linear whose weight
    ``quantize_`` wrapped for fp8 training), ``"mxfp8"`` for an MXFP8 Linear (torchao's
    ``MXFP8Linear``, or a Linear whose weight ``quantize_`` wrapped for MXFP8 training), else
    None. Asked without importing torchao: such a module exists only once torchao's module is."""
    if "torchao.float8.float8_linear" in sys.modules:
        from tp_kernels import float8

        if float8.configs(module) is not None:
            return "float8"
    if "torchao.prototype.moe_training" in sys.modules:
        from tp_kernels import mxfp8

        if mxfp8.recipe_of(module) is not None:
            return "mxfp8"
    return None


def _quantized_unfusable(kind: str, module: nn.Module) -> str | None:
    """Why a low-precision Linear never takes its fused path, or None."""
    if kind == "float8":
        from tp_kernels import float8

        return float8.unfusable_reason(module)
    from tp_kernels import mxfp8

    return mxfp8.unfusable_reason(module)


_PLAIN_WEIGHTS = (torch.Tensor, nn.Parameter)


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

    @classmethod
    def _prepare_output_fn(cls, output_layouts, use_local_output, mod, outputs, device_mesh):
        # A classmethod so that super() reaches PyTorch's (static) hook; _apply binds it.
        if not isinstance(outputs, DTensor):
            return outputs  # the fused Linear returned the local output itself
        return super()._prepare_output_fn(
            output_layouts, use_local_output, mod, outputs, device_mesh
        )

    def _has_fused_path(self) -> bool:
        """Whether a call would fuse a collective: colwise with a sequence-sharded input (a
        replicated one is gathered, if at all, by the parent's PrepareModuleInput), rowwise with
        a sequence-sharded output (the only case installed)."""
        layout = self.input_layouts[0] if self._kind == "colwise" else self.output_layouts[0]
        return isinstance(layout, Shard) and layout.dim != -1

    def _unfusable_reason(self, module: nn.Module) -> str | None:
        """Why ``module`` never takes the fused path under this style (None: its calls may)."""
        kind = _quantized_kind(module)
        if kind is not None:
            return _quantized_unfusable(kind, module)
        if not _plain_linear(module):
            return "a Linear subclass with its own forward is never fused"
        weight = local_tensor(module.weight)
        if type(weight) not in _PLAIN_WEIGHTS:
            # A tensor subclass may override the matmuls the fused ops run (torchao's training
            # wrappers do): its own forward keeps its semantics.
            kind = type(weight).__qualname__
            return f"its weight is a {kind}, which the fused path does not know"
        return None

    def _hands_on_local(self, module: nn.Module) -> bool:
        """Whether the module's output is handed on as the local tensor the fused op produces
        (``use_local_output``, and that tensor laid out as ``output_layouts``)."""
        produced = self.output_layouts[0]
        if self._kind == "colwise":  # the fused op leaves the output sharded on its last dim
            natural = isinstance(produced, Shard) and produced.dim in (-1, module.weight.ndim - 1)
        else:  # the installed rowwise forward produces exactly output_layouts
            natural = True
        return self.use_local_output and natural

    def _install(self, module: nn.Module, device_mesh: DeviceMesh, forward) -> None:
        why = self._unfusable_reason(module)
        if why is not None:
            if isinstance(module, nn.Linear) and self._has_fused_path():
                # Counted per call, as every other fallback: the module's own forward runs.
                where = f"{type(self).__name__} on {type(module).__qualname__}"
                module.register_forward_pre_hook(lambda mod, args: _fall_back(where, why))
            return
        module._tpk_fused = _FusedLinear(
            self._kind,
            device_mesh,
            self.backend,
            self.input_layouts,
            self.output_layouts,
            self._hands_on_local(module),
            quantized=_quantized_kind(module),
        )
        # An instance attribute shadows nn.Linear.forward for this module only; hooks still run.
        module.forward = forward.__get__(module)


def _eager(x: Any, weights: list[Any], biases: list[Any]) -> bool:
    """Whether a fused call on these (DTensor or local) arguments may take its op's single
    autograd node: not compiling, no dispatch mode, plain local tensors."""
    if torch.compiler.is_compiling():
        return False
    return eager_path((local_tensor(x), *map(local_tensor, weights), *map(local_tensor, biases)))


def _eager_linear(module: nn.Linear, x: Any) -> bool:
    """Whether this call of a fused Linear takes that node (:func:`_eager`, and the output handed
    on as its local tensor)."""
    return module._tpk_fused.local_output and _eager(x, [module.weight], [module.bias])


def _colwise_forward(self: nn.Linear, x: Any) -> Any:
    fused: _FusedLinear = self._tpk_fused
    pre = fused.claim(self, x)
    if pre is not None:
        return pre
    # A local x was left local by the input hook for the eager fused path: laid out as
    # input_layouts.
    layout = x.placements[0] if isinstance(x, DTensor) else fused.input_layouts[0]
    dim = _sharded_dim(layout, x.ndim)
    why = None if dim is None or not fused.quantized else _quantized_why_not([self], x, dim, fused)
    if dim is not None and fused.quantized and why is None:
        (y,) = _quantized_colwise([self], x, dim, fused)
        return _handed_on(y, fused, (Shard(y.ndim - 1),))
    if dim is not None and not fused.quantized and _eager_linear(self, x):
        _, (y,) = colwise_linears(
            x, [self.weight], [self.bias], dim, fused.process_group, fused.backend
        )
        return y
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, fused.mesh, fused.input_layouts, run_check=False)
    if why is not None:
        _fall_back(f"ColwiseParallel on {type(self).__qualname__}", why)
        # PyTorch's style gathers the input before the forward (desired_input_layouts): a
        # Float8Linear casts a sharded input itself, and its GEMM's redistribute of the fp8
        # tensor fails in torchao (no all-gather of a row-wise-scaled Float8TrainingTensor;
        # eagerly, no index_select of one).
        return type(self).forward(self, x.redistribute(fused.mesh, (Replicate(),)))
    if dim is not None:
        _, (y,) = all_gather_matmul(
            x.to_local(), [self.weight.to_local().t()], dim, fused.mesh, backend=fused.backend
        )
        if self.bias is not None:
            y = y + self.bias.to_local()
        return DTensor.from_local(y, fused.mesh, (Shard(y.ndim - 1),), run_check=False)
    return type(self).forward(self, x)  # nothing to gather: the module's own forward


def _rowwise_forward(self: nn.Linear, x: Any) -> Any:
    fused: _FusedLinear = self._tpk_fused
    # A local x was left local by the input hook for the eager fused path: laid out as
    # input_layouts, which is Shard(-1) there.
    local = not isinstance(x, DTensor)
    dim = _sharded_dim(fused.output_layouts[0], x.ndim)
    world = fused.mesh.size()
    why = _simulated_ranks()
    if why is None and dim is None:
        why = f"output {fused.output_layouts[0]} shards the last (feature) dim"
    if why is None and not local and not _sharded_last(x.placements[0], x.ndim):
        why = f"input placements {x.placements} are not Shard(-1)"
    if why is None and x.shape[dim] % world:
        why = f"output dim {dim} of size {x.shape[dim]} is uneven over {world} ranks"
    if why is None and fused.quantized:
        why = _quantized_why_not([self], x, dim, fused)
        if why is None:
            y = _quantized_rowwise(self, x, dim, fused)
            return _handed_on(y, fused, fused.output_layouts)
    if why is None and _eager_linear(self, x):
        return rowwise_linear(x, self.weight, self.bias, dim, fused.process_group, fused.backend)
    if local:
        x = DTensor.from_local(x, fused.mesh, fused.input_layouts, run_check=False)
    if why is not None:
        _fall_back(f"RowwiseParallel on {type(self).__qualname__}", why)
        return type(self).forward(self, x)
    bias = None if self.bias is None else self.bias.to_local()
    y = matmul_reduce_scatter(
        x.to_local(), self.weight.to_local().t(), dim, fused.mesh, backend=fused.backend, bias=bias
    )
    return DTensor.from_local(y, fused.mesh, fused.output_layouts, run_check=False)


_NOT_EAGER = {
    "float8": "a Float8Linear does not fuse under a dispatch mode (it does eagerly and compiled)",
    "mxfp8": "an MXFP8 Linear fuses eagerly only (not under torch.compile or a dispatch mode)",
}


def _quantized_why_not(
    children: list[nn.Module], x: Any, dim: int, fused: _FusedLinear
) -> str | None:
    """Why this call of low-precision Linears ``children`` (one kind, one config) on ``x``
    gathered or scattered along ``dim`` takes PyTorch's path, or None: an fp8 call fuses eagerly
    (:func:`_eager`) and while torch.compile traces (``float8.py``'s Functions then call its
    custom ops); an MXFP8 call eagerly, when its shapes and backend allow
    (:func:`tp_kernels.mxfp8.call_unfusable_reason`)."""
    weights, biases = [c.weight for c in children], [c.bias for c in children]
    from tp_kernels.quantized_linears import plain_param

    # quantize_'s parameters are torchao's wrapper subclass: the path reads the tensor inside.
    eager = _eager(x, [plain_param(p) for p in weights + biases], [])
    if fused.quantized == "float8":
        return None if torch.compiler.is_compiling() or eager else _NOT_EAGER["float8"]
    if not eager:
        return _NOT_EAGER["mxfp8"]
    from tp_kernels import mxfp8

    colwise = fused.style == "colwise"
    world = fused.mesh.size()
    return mxfp8.call_unfusable_reason(children, local_tensor(x), dim, fused.backend, world,
                                       colwise=colwise)  # fmt: skip


def _traced_group(fused: _FusedLinear) -> dist.ProcessGroup:
    """The fused Linear's group; while torch.compile traces, from its mesh (the cached property
    takes a lock on Python 3.11, which dynamo cannot enter: a graph break)."""
    return fused.mesh.get_group() if torch.compiler.is_compiling() else fused.process_group


def _traced_locals(*args: Any) -> tuple:
    """While torch.compile traces, the local tensors of DTensor arguments by ``to_local()``
    (differentiable: the grads come back as DTensors of each argument's spec), so the fp8
    Functions trace plain tensors; eagerly, the arguments themselves (the Functions read the
    local tensors and return DTensor grads, in one autograd node)."""
    if not torch.compiler.is_compiling():
        return args
    return tuple(a.to_local() if isinstance(a, DTensor) else a for a in args)


def _handed_on(y: torch.Tensor, fused: _FusedLinear, placements: tuple) -> Any:
    """A fused fp8 Linear's local output ``y``, laid out as ``placements``, as the output hook
    expects it: itself where the style hands on the local tensor, else a DTensor for the hook
    to redistribute (a Replicate output, a loss-parallel Shard(-1) kept as DTensor)."""
    if fused.local_output:
        return y
    return DTensor.from_local(y, fused.mesh, placements, run_check=False)


def _quantized_path(kind: str) -> ModuleType:
    """The module of a low-precision Linear's fused path (``float8`` or ``mxfp8``): its
    ``call_for`` makes the call that ``quantized_linears``' Functions run."""
    if kind == "float8":
        from tp_kernels import float8

        return float8
    from tp_kernels import mxfp8

    return mxfp8


def _quantized_colwise(children: list[nn.Module], x: Any, dim: int, fused: _FusedLinear) -> tuple:
    """The local outputs of fused low-precision colwise Linears ``children`` (one torchao config)
    on the input ``x`` (local or DTensor) gathered along ``dim``."""
    from tp_kernels.quantized_linears import ColwiseLinears

    path = _quantized_path(fused.quantized)
    group = _traced_group(fused)
    call = path.call_for(children, local_tensor(x), dim, group, fused.backend, colwise=True)
    args = _traced_locals(x, *[c.weight for c in children], *[c.bias for c in children])
    return ColwiseLinears.apply(call, *args)


def _quantized_rowwise(module: nn.Module, x: Any, dim: int, fused: _FusedLinear) -> torch.Tensor:
    """The local output of a fused low-precision rowwise Linear (its replicated bias added after
    the scatter, as :func:`rowwise_linear` adds it)."""
    from tp_kernels.quantized_linears import RowwiseLinear

    path = _quantized_path(fused.quantized)
    group = _traced_group(fused)
    call = path.call_for([module], local_tensor(x), dim, group, fused.backend, colwise=False)
    return RowwiseLinear.apply(call, *_traced_locals(x, module.weight, module.bias))


def _sharded_last(placement: Placement, ndim: int) -> bool:
    return isinstance(placement, Shard) and placement.dim % ndim == ndim - 1


class ColwiseParallel(_FusableStyle, _torch_style.ColwiseParallel):
    """PyTorch's ``ColwiseParallel``, plus ``backend`` (``None``: the process-wide default).

    Forward on a mesh of ``W`` ranks with an ``nn.Linear(in, out)``: ``x`` ``[..., in]`` gathered
    from ``input_layouts`` (fused with the matmul when sharded on a leading dim),
    ``y_local = x @ W_local^T + b_local`` ``[..., out/W]``, then redistributed to
    ``output_layouts``. Backward: ``dx = sum_r dy_r @ W_r`` (reduce-scattered back to the input's
    shards, fused with the matmul), ``dW_local = dy_local^T @ x``, ``db_local = sum dy_local``.
    """

    _kind = "colwise"

    @classmethod
    def _prepare_input_fn(cls, input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        # A classmethod so that an unfused call takes the next class's hook in the MRO: PyTorch's,
        # or torchao's in Float8ColwiseParallel (tp_kernels/float8_tensor_parallel.py).
        fused: _FusedLinear | None = getattr(mod, "_tpk_fused", None)
        x = inputs[0]
        if fused is not None:
            if fused.holds(mod, x):
                return inputs  # the forward returns the grouped gather's output
            layout = x.placements[0] if isinstance(x, DTensor) else input_layouts[0]
            dim = _sharded_dim(layout, x.ndim)
            if dim is not None:
                world = device_mesh.size()
                why = _simulated_ranks()
                if why is None:
                    if not isinstance(x, DTensor):
                        if _eager_linear(mod, x):
                            return inputs  # the fused Linear reads it as input_layouts
                        return DTensor.from_local(x, device_mesh, input_layouts, run_check=False)
                    if x.shape[dim] % world == 0:
                        return x
                    why = f"input dim {dim} of size {x.shape[dim]} is uneven over {world} ranks"
                _fall_back(f"ColwiseParallel on {type(mod).__qualname__}", why)
        return super()._prepare_input_fn(
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

    @classmethod
    def _prepare_input_fn(cls, input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        # A classmethod for the reason ColwiseParallel's is one.
        fused: _FusedLinear | None = getattr(mod, "_tpk_fused", None)
        x = inputs[0]
        if (
            fused is not None
            and not isinstance(x, DTensor)
            and input_layouts == desired_input_layouts
            and _simulated_ranks() is None
            and _eager_linear(mod, x)
        ):
            return inputs  # the fused Linear reads it as input_layouts (Shard(-1))
        return super()._prepare_input_fn(
            input_layouts, desired_input_layouts, mod, inputs, device_mesh
        )

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
    # The input's global shape and strides, not ones inferred from this rank's shard: with an
    # uneven sequence the shards differ in length.
    return DTensor.from_local(
        y, mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
    )


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
    """PyTorch's ``PrepareModuleInput``; one ``Shard(d) -> Replicate()`` input, positional or
    keyword, is gathered once, fused with the matmuls of the module's colwise children (see the
    module docstring and :class:`_GatherGroup`)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        gathered = _gathered_input(self)
        if gathered is None:
            return super()._apply(module, device_mesh)
        if hasattr(module, "_tpk_gather_group"):
            raise ValueError(
                f"PrepareModuleInput: {type(module).__qualname__} already has a grouping "
                f"PrepareModuleInput; a module takes one (its Shard -> Replicate input is "
                f"gathered once for every colwise child)"
            )
        # The group lives on the module and the hooks look it up there, so that a copy of the
        # module (deepcopy: an EMA copy, a checkpoint) carries its own group, linked to its own
        # children; a hook closing over the group would run the original's.
        module._tpk_gather_group = _GatherGroup(self, gathered, device_mesh)
        if self.with_kwargs:
            module.register_forward_pre_hook(_prepare_by_keyword, with_kwargs=True)
        else:
            module.register_forward_pre_hook(_prepare_positionally)
        module.register_forward_hook(_forget_unclaimed)
        return module


def _prepare_positionally(mod: nn.Module, args: tuple) -> tuple:
    return mod._tpk_gather_group.prepare(mod, args, {})[0]


def _prepare_by_keyword(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return mod._tpk_gather_group.prepare(mod, args, kwargs)


def _forget_unclaimed(mod: nn.Module, args: tuple, out: Any) -> None:
    mod._tpk_gather_group.forget()


@dataclass(frozen=True)
class _Gathered:
    """The input a grouping :class:`PrepareModuleInput` gathers: positional ``index`` or keyword
    ``key`` (the other is None), declared ``layout`` ``Shard(d)``; or, in ``problem``, why the
    style cannot group (it gathers several inputs)."""

    index: int | None
    key: str | None
    layout: Placement | None
    problem: str | None = None


def _gathered_input(style: PrepareModuleInput) -> _Gathered | None:
    """Which input ``style`` turns from ``Shard`` into ``Replicate`` and groups: the positional
    one, else the keyword one (None: it gathers none). Other gathered inputs take PyTorch's path."""

    def gathers(have: Placement | None, want: Placement | None) -> bool:
        return isinstance(have, Shard) and isinstance(want, Replicate)

    pairs = zip(style.input_layouts or (), style.desired_input_layouts or ())
    positional = [
        _Gathered(i, None, have) for i, (have, want) in enumerate(pairs) if gathers(have, want)
    ]
    keyword = [
        _Gathered(None, key, have)
        for key, have in style.input_kwarg_layouts.items()
        if gathers(have, style.desired_input_kwarg_layouts.get(key))
    ]
    found = positional or keyword
    if len(found) > 1:
        names = [f"input {g.index}" if g.key is None else f"{g.key}=" for g in found]
        return _Gathered(None, None, None, f"it gathers {len(found)} inputs ({', '.join(names)})")
    return found[0] if found else None


class _Deferred(NamedTuple):
    """A compiled fused fp8 gather's outputs, not yet computed (see
    :meth:`_GatherGroup._gather_quantized`): the children sharing it and the gathered dim."""

    children: list[nn.Module]
    dim: int


class _GatherGroup:
    """One grouping :class:`PrepareModuleInput` on one module: the single owner of its fused
    gather. It knows the input it gathers, finds the module's eligible children once (on the
    first call: a plan applies the parent's style before its children's), decides per call
    whether to fuse (:func:`_why_not_grouped`), and holds the outputs it computed for the children
    until they claim them or the module's forward ends."""

    def __init__(self, style: PrepareModuleInput, gathered: _Gathered, mesh: DeviceMesh) -> None:
        self.style, self.gathered, self.mesh = style, gathered, mesh
        self._children: list[nn.Module] | None = None
        self._outputs: dict[int, tuple[Any, DTensor]] = {}  # id(child) -> (its input, output)

    @functools.cached_property
    def process_group(self) -> dist.ProcessGroup:
        """The mesh's group, resolved on the first call (not on every one)."""
        return resolve_group(self.mesh, op="PrepareModuleInput")

    def __getstate__(self) -> dict:
        return _without_process_group(self.__dict__)

    def children(self, mod: nn.Module) -> list[nn.Module]:
        """The direct children that are tp_kernels colwise Linears taking a replicated input on
        this mesh; each learns its group."""
        if self._children is None:
            self._children = [
                c
                for c in mod.children()
                if getattr(c, "_tpk_fused", None) is not None
                and c._tpk_fused.style == "colwise"
                and c._tpk_fused.input_layouts == (Replicate(),)
                and c._tpk_fused.mesh == self.mesh
            ]
            for child in self._children:
                child._tpk_fused.group = self
        return self._children

    def holds(self, child: nn.Module, x: Any) -> bool:
        kept = self._outputs.get(id(child))
        return kept is not None and kept[0] is x

    def claim(self, child: nn.Module, x: Any) -> DTensor | None:
        if not self.holds(child, x):
            return None
        y = self._outputs.pop(id(child))[1]
        if isinstance(y, _Deferred):  # the compiled fp8 gather, run by its first child's call
            ys = _quantized_colwise(y.children, x, y.dim, y.children[0]._tpk_fused)
            for other, y_other in zip(y.children, ys):
                if other is child:
                    y = self._handed(other, y_other, True)
                elif self.holds(other, x):
                    self._outputs[id(other)] = (x, self._handed(other, y_other, True))
        return y

    def forget(self) -> None:
        """Drop outputs no child claimed (a child called with another input, or not at all)."""
        self._outputs.clear()

    def prepare(self, mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The module's inputs as PyTorch's style prepares them, the gathered one by the fused
        op when the call can fuse (every colwise child's output computed alongside)."""
        style, gathered, mesh = self.style, self.gathered, self.mesh
        if not isinstance(args, tuple):
            args = (args,)
        if style.input_layouts is not None and len(args) != len(style.input_layouts):
            return self._torch_path(args, kwargs)  # PyTorch's path raises its error
        if gathered.key is not None and gathered.key not in kwargs:
            return self._torch_path(args, kwargs)  # passed positionally: PyTorch converts nothing
        children = self.children(mod)
        x = kwargs.get(gathered.key) if gathered.index is None else args[gathered.index]
        reason = gathered.problem or _why_not_grouped(mod, children, x, gathered.layout, mesh)
        if reason is None and style.use_local_output and children[0]._tpk_fused.quantized:
            reason = (
                "use_local_output=True asks for the gathered input as a local tensor, and the "
                "fused low-precision gather moves fp8 bytes: no high-precision gathered input "
                "exists"
            )
        if reason is not None:
            _fall_back(f"PrepareModuleInput on {type(mod).__qualname__}", reason)
            return self._torch_path(args, kwargs)
        passed = self._gather(x, children)
        unset = (None,) * len(args)
        layouts = zip(style.input_layouts or unset, style.desired_input_layouts or unset)
        new_args = tuple(
            passed if i == gathered.index else style._prepare_input_arg(a, mesh, have, want)
            for i, (a, (have, want)) in enumerate(zip(args, layouts))
        )
        new_kwargs = {
            key: passed
            if key == gathered.key
            else style._prepare_input_arg(
                value,
                mesh,
                style.input_kwarg_layouts.get(key),
                style.desired_input_kwarg_layouts.get(key),
            )
            for key, value in kwargs.items()
        }
        return new_args, new_kwargs

    def _torch_path(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.style.with_kwargs:
            return self.style._prepare_input_kwarg_fn(args, kwargs, self.mesh)
        return self.style._prepare_input_fn(args, self.mesh), kwargs

    def _gather(self, x: Any, children: list[nn.Module]) -> Any:
        """One all-gather-matmul of ``x`` with every child's weight; the gathered input (as
        PyTorch's style would pass it) is returned and each child's output kept for it."""
        local = local_tensor(x)
        dim = self.gathered.layout.dim % local.ndim
        backend = children[0]._tpk_fused.backend
        weights, biases = [c.weight for c in children], [c.bias for c in children]
        eager = _eager(x, weights, biases)
        if children[0]._tpk_fused.quantized:
            return self._gather_quantized(x, children, dim)
        if eager:
            gathered, ys = colwise_linears(
                x, weights, biases, dim, self.process_group, backend, return_a=True
            )
        else:
            gathered, outs = all_gather_matmul(
                x.to_local() if isinstance(x, DTensor) else x,
                [w.to_local().t() for w in weights],
                dim,
                self.mesh,
                backend=backend,
                return_a=True,
            )
            ys = [y if b is None else y + b.to_local() for y, b in zip(outs, biases)]
        passed = (
            gathered
            if self.style.use_local_output
            else DTensor.from_local(gathered, self.mesh, (Replicate(),), run_check=False)
        )
        return self._keep(passed, children, ys, eager=eager)

    def _keep(self, passed: Any, children: list[nn.Module], ys: Any, *, eager: bool) -> Any:
        """Keep each child's output for it to claim when called with ``passed``."""
        for child, y in zip(children, ys):
            self._outputs[id(child)] = (passed, self._handed(child, y, eager))
        return passed

    def _handed(self, child: nn.Module, y: Any, eager: bool) -> Any:
        """A child's output ``y`` (local) as its forward returns it."""
        if isinstance(y, _Deferred) or (eager and child._tpk_fused.local_output):
            return y  # the output hook takes the local y
        return DTensor.from_local(y, self.mesh, (Shard(y.ndim - 1),), run_check=False)

    def _gather_quantized(self, x: Any, children: list[nn.Module], dim: int) -> DTensor:
        """The fused low-precision gather (:func:`_quantized_colwise`): it moves fp8 bytes, so no
        high-precision gathered input exists to pass on. The module gets ``x`` itself as a
        DTensor sharded as declared: the same global tensor, which any use other than the
        children's redistributes by itself (only ``use_local_output=False`` styles group fp8
        children, see :func:`_why_not_grouped`)."""
        if torch.compiler.is_compiling():
            # torch.compile traces this hook and the module's forward as two graphs: an output
            # of the first that the second does not use would get a plain zero tangent where
            # AOTAutograd expects a DTensor (an error). So the children's outputs are computed
            # from the DTensor passed on, by the first child that claims one (_Deferred).
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, self.mesh, (self.gathered.layout,), run_check=False)
            return self._keep(x, children, [_Deferred(children, dim)] * len(children), eager=True)
        ys = _quantized_colwise(children, x, dim, children[0]._tpk_fused)
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.mesh, (self.gathered.layout,), run_check=False)
        return self._keep(x, children, ys, eager=True)


def _why_not_grouped(module, children, x, layout, device_mesh) -> str | None:
    """Why a call of a grouping PrepareModuleInput on ``module`` cannot fuse its gather (None: it
    can). A gather whose children it does not recognise (a Linear subclass with its own forward,
    such as torchao's Float8Linear, or no Linear at all) is a boundary that does not fuse."""
    if not children:
        found = ", ".join(f"{n} ({type(c).__name__})" for n, c in module.named_children())
        return (
            "none of its children is a tp_kernels ColwiseParallel nn.Linear on its mesh taking "
            f"the gathered input (children: {found or 'none'})"
        )
    why = _simulated_ranks()
    if why is not None:
        return why
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
    kinds = {c._tpk_fused.quantized for c in children}
    if kinds != {None}:
        return _why_not_grouped_quantized(children, kinds, x, layout)
    return None


def _why_not_grouped_quantized(children, kinds, x, layout) -> str | None:
    """Why low-precision children cannot share one fused gather (None: they can)."""
    if len(kinds) > 1:
        return f"its colwise children mix Linears of kinds {sorted(map(str, kinds))}"
    fused = children[0]._tpk_fused
    if len({_quantized_config(c, fused.quantized) for c in children}) > 1:
        return "its low-precision children differ in their torchao config"
    return _quantized_why_not(children, x, layout.dim % x.ndim, fused)


def _quantized_config(module: nn.Module, kind: str) -> tuple:
    """What must be the same for low-precision Linears to share one fused call."""
    if kind == "float8":
        from tp_kernels import float8

        return float8.configs(module)
    from tp_kernels import mxfp8

    return mxfp8.recipe_of(module)


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
