"""tp_kernels' styles are drop-in: same results as PyTorch's styles, in every case PyTorch supports.

Every multi-rank case builds one model twice from the same seed, parallelizes one copy with
PyTorch (``torch.distributed.tensor.parallel`` styles and ``parallelize_module``) and the other with
tp_kernels (or a mix of both), runs forward and backward on the same inputs and compares, with
:func:`_compare.compare`: parameters (kinds, placements, local shapes, values bitwise), outputs
(kinds, placements, shapes, values), parameter and input gradients, and ``state_dict()`` (keys,
kinds, placements, full values). Values are bitwise PyTorch's where no fused op runs; where one
does, they obey the float64-truth rule of tests/_compare.py against a third copy: PyTorch's styles
on the same dtype-rounded weights and inputs, upcast to float64.

Shapes: ``B = S = 12`` (batch, sequence), ``H = 24`` (hidden), ``F = 48`` (feature), ``V = 48``
(vocabulary): every sharded dim splits evenly over 2, 3 and 4 ranks; the uneven cases use 49 and
25, which none of those world sizes divides.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel as torch_tp
import torch.nn as nn
from _compare import EXACT, Tol, compare
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

import tp_kernels as tpk
from tp_kernels.backends.choice import BACKEND_NAMES

B, S, H, F, V = 12, 12, 24, 48, 48
UNEVEN, UNEVEN_SMALL = 49, 25
DTYPES = (torch.float32, torch.bfloat16)
# fp32 runs every layout combination. bf16, whose rounding is what a fused path would change,
# runs the fused boundaries (ColwiseParallel with a sharded input, RowwiseParallel with a sharded
# output) and one case of every other kind, to keep the file within its time budget.
FULL_GRID_DTYPE = torch.float32

# Values: a fused path sums in another order than PyTorch, so its values differ by rounding, and
# in bf16 those differences grow through norms and layers until comparing two bf16 runs with each
# other says nothing. Both are instead measured against the exact result for the same rounded
# weights and inputs (a float64 run of PyTorch's styles): ours may be off by at most 2x what
# PyTorch is off by, plus the floor of _compare's docstring (fp32 2e-6, bf16 2e-2, x max|truth|).
# Training-mode dropout draws a random mask: only kinds, placements and shapes are compared (an
# infinite bound accepts every finite value); _dropout_mask_is_real checks the values' form.
SHAPES_ONLY = Tol(math.inf, math.inf)

STYLE_NAMES = tpk.styles.STYLE_NAMES
FUSABLE = ("ColwiseParallel", "RowwiseParallel")
# Subclassed without a new argument (to group the gather of a block; to run norms locally).
SUBCLASSED = FUSABLE + ("SequenceParallel", "PrepareModuleInput", "PrepareModuleInputOutput")


# --- checks with no process group ---------------------------------------------------------------


def test_every_pytorch_style_is_named() -> None:
    """STYLE_NAMES (what tp_kernels offers and the integrations rebind) is every concrete style
    PyTorch exports."""
    theirs = {
        name
        for name in torch_tp.__all__
        if isinstance(getattr(torch_tp, name), type)
        and issubclass(getattr(torch_tp, name), torch_tp.ParallelStyle)
        and name != "ParallelStyle"
    }
    assert set(STYLE_NAMES) == theirs


@pytest.mark.parametrize("name", STYLE_NAMES + ("ParallelStyle",))
def test_styles_are_pytorch_classes_or_subclasses(name: str) -> None:
    ours, theirs = getattr(tpk, name), getattr(torch_tp, name)
    if name in SUBCLASSED:
        assert ours is not theirs and issubclass(ours, theirs)
        assert ours.__name__ == theirs.__name__
    else:
        assert ours is theirs


def test_loss_parallel_is_pytorch_s() -> None:
    assert tpk.loss_parallel is torch_tp.loss_parallel


def _params(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    # Annotations are left out: tp_kernels defers them (strings), PyTorch evaluates them.
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", STYLE_NAMES + ("parallelize_module",))
def test_signatures_match_pytorch(name: str) -> None:
    ours, theirs = _params(getattr(tpk, name)), _params(getattr(torch_tp, name))
    if name in FUSABLE:
        assert ours == theirs + [("backend", inspect.Parameter.KEYWORD_ONLY, None)]
    else:
        assert ours == theirs


REPR_KWARGS = (
    {},
    {"input_layouts": Shard(1), "output_layouts": Replicate(), "use_local_output": False},
    {"output_layouts": Shard(0)},
)


@pytest.mark.parametrize("name", FUSABLE)
@pytest.mark.parametrize("kwargs", REPR_KWARGS, ids=("defaults", "all", "output"))
def test_repr_matches_pytorch_and_adds_backend_only_when_given(name: str, kwargs: dict) -> None:
    ours, theirs = getattr(tpk, name), getattr(torch_tp, name)
    base = repr(theirs(**kwargs))
    assert repr(ours(**kwargs)) == base
    assert repr(ours(**kwargs, backend=None)) == base
    for backend in BACKEND_NAMES:
        style = ours(**kwargs, backend=backend)
        assert style.backend == backend
        assert repr(style) == f"{base[:-1]}, backend={backend!r})"


@pytest.mark.parametrize("name", FUSABLE)
@pytest.mark.parametrize("backend", ["nope", "Reference", 3])
def test_unknown_backend_is_a_value_error_naming_the_argument(name: str, backend: Any) -> None:
    with pytest.raises(ValueError, match=rf"backend.*{backend!r}.*expected one of.*'reference'"):
        getattr(tpk, name)(backend=backend)


@pytest.mark.parametrize("name", FUSABLE)
def test_empty_backend_name_is_rejected(name: str) -> None:
    # "" names no backend; taking it for "use the default" would hide a misspelt config value.
    with pytest.raises(ValueError, match=r"backend.*''"):
        getattr(tpk, name)(backend="")


def test_plan_entry_that_is_not_a_style_is_a_type_error() -> None:
    # The plan is checked before the mesh is looked at, so no mesh or process group is needed.
    with pytest.raises(TypeError, match=r"parallelize_plan\['w1'\] must be a ParallelStyle.*str"):
        tpk.parallelize_module(nn.Linear(2, 2), None, {"w1": "colwise"})


def test_compare_reports_each_kind_of_difference() -> None:
    t = torch.tensor([1.0, 2.0, float("nan")])
    assert compare("x", t, t.clone()) == []
    assert compare("x", t + 1e-3, t, Tol(atol=2e-3)) == []
    (line,) = compare("x", t + torch.tensor([0.0, 1e-3, 0.0]), t)
    assert "x: 1 of 3 values differ" in line and "first at (1,)" in line
    assert compare("x", torch.tensor([0.0, 1.0]), torch.tensor([0.0, float("nan")])) != []
    assert compare("x", t, t.to(torch.bfloat16)) == ["x: dtype torch.float32 != torch.bfloat16"]
    assert compare("x", t[:2], t) == ["x: shape (2,) != (3,)"]
    assert compare("x", nn.Parameter(t), t) == [
        "x: requires_grad True != False",
        "x: is a Parameter True != False",
    ]
    assert compare("o", (t, None, "tag"), (t, t, "tag")) == ["o[1]: type NoneType != Tensor"]
    assert compare("o", (t,), (t, t)) == ["o: length 1 != 2"]
    assert compare("sd", {"a": t}, {"b": t}) == ["sd: keys ['a'] != ['b']"]
    assert compare("s", "tag", "gat") == ["s: 'tag' != 'gat'"]
    assert SHAPES_ONLY.rtol == math.inf and compare("x", t * 3, t, SHAPES_ONLY) == []


def test_compare_against_a_truth_allows_twice_the_reference_error_plus_the_floor() -> None:
    truth = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    step = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
    want = (truth + 1e-3 * step).float()  # PyTorch's error: 1e-3 (to within fp32 rounding)
    # bound = 2 * 1e-3 + 2e-6 * max|truth| (4) = 2.008e-3
    assert compare("x", (truth + 1.9e-3 * step).float(), want, truth=truth) == []
    (line,) = compare("x", (truth - 2.1e-3 * step).float(), want, truth=truth)
    assert line.startswith("x: max |got - truth| 0.0021 > bound 0.00201")
    # An exact reference leaves the floor alone: 2e-6 x 4 = 8e-6 here, 2e-2 x 4 = 8e-2 in bf16.
    exact = truth.float()
    assert compare("x", (truth + 7e-6 * step).float(), exact, truth=truth) == []
    assert compare("x", (truth + 9e-6 * step).float(), exact, truth=truth) != []
    got = (truth + 3e-2 * step).bfloat16()
    assert compare("x", got, truth.bfloat16(), truth=truth) == []
    # Structure still compared against the reference, and the truth must mirror it.
    assert compare("x", got, exact, truth=truth) == ["x: dtype torch.bfloat16 != torch.float32"]
    assert compare("g", [exact], [exact], truth=[None]) == ["g[0]: truth type NoneType != Tensor"]
    assert compare("d", {"a": exact}, {"a": exact}, truth={"b": truth}) == [
        "d: truth keys ['b'] != ['a']"
    ]
    with pytest.raises(ValueError, match="tol=.*and a truth"):
        compare("x", exact, exact, Tol(atol=1.0), truth=truth)


# --- the equivalence engine (runs on every rank) ------------------------------------------------


@dataclass
class Ctx:
    """What a case's input factory sees: this rank's place in the mesh and the case's dtype."""

    mesh: DeviceMesh
    dtype: torch.dtype
    gen: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(1234))

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    @property
    def world(self) -> int:
        return self.mesh.size()

    def randn(self, *shape: int) -> torch.Tensor:
        """A global tensor, the same on every rank (one generator, one seed)."""
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def randint(self, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.gen)

    def local(self, full: torch.Tensor, layout: Placement | None) -> torch.Tensor:
        """This rank's part of ``full`` under ``layout`` (``None``, ``Replicate()``: all of it)."""
        if isinstance(layout, Shard):
            return full.chunk(self.world, layout.dim)[self.rank]
        return full


@dataclass
class Case:
    """One model, one plan, one input: parallelized by PyTorch and by ``styles``/``parallelize``."""

    name: str
    build: Callable[[], nn.Module]
    plan: Callable[[Any], Any]  # a styles namespace -> a style or a dict plan
    inputs: Callable[[Ctx], tuple[tuple, dict]]
    dtype: torch.dtype = torch.float32
    styles: Any = tpk
    parallelize: Callable[..., nn.Module] = tpk.parallelize_module
    src_data_rank: int | None = 0
    # Seed each rank's model differently (for src_data_rank checks); the default is one seed.
    per_rank_weights: bool = False
    train: bool = False
    # Extra checks on our side: (ctx, model, args, output) -> failures.
    post: Callable[[Ctx, nn.Module, tuple, Any], list[str]] | None = None
    # A documented difference: (ctx, PyTorch's output, in the case's dtype or float64) -> what ours
    # must then equal. None: ours is PyTorch's.
    pytorch_output_to_ours: Callable[[Ctx, Any], Any] | None = None


WEIGHT_SEED = 7


def _leaves(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)


def _leaf_copy(value: Any, dtype: torch.dtype | None = None) -> Any:
    """``value`` with every tensor a fresh leaf, floating ones requiring grad (and cast to
    ``dtype`` if given)."""
    if isinstance(value, torch.Tensor):
        copy = value.detach().clone()
        if not copy.is_floating_point():
            return copy
        return (copy if dtype is None else copy.to(dtype)).requires_grad_()
    if isinstance(value, tuple):
        return tuple(_leaf_copy(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _leaf_copy(v, dtype) for k, v in value.items()}
    return value


def _build(build: Callable[[], nn.Module], ctx: Ctx, seed_rank: int) -> nn.Module:
    """``build()`` in ``ctx.dtype`` from the global generator seeded for rank ``seed_rank``."""
    torch.manual_seed(WEIGHT_SEED + seed_rank)
    return build().to(ctx.dtype)


def _forward_backward(
    case: Case,
    ctx: Ctx,
    styles: Any,
    parallelize: Callable[..., nn.Module],
    inputs: tuple[tuple, dict],
    *,
    in_float64: bool = False,
) -> dict[str, Any]:
    """Build, parallelize, ``out = model(*args, **kwargs)``, then backward from every output
    tensor's local part with a fixed pseudo-random gradient (drawn in ``ctx.dtype``); returns
    what is compared, by name. ``in_float64``: the model is built in ``ctx.dtype`` and then
    upcast, the truth run (``inputs`` already upcast)."""
    model = _build(case.build, ctx, ctx.rank if case.per_rank_weights else 0)
    if in_float64:
        model = model.to(torch.float64)
    parallelize(model, ctx.mesh, case.plan(styles), src_data_rank=case.src_data_rank)
    model.train(case.train)
    args, kwargs = inputs
    out = model(*args, **kwargs)
    outs = [t for t in _leaves(out) if t.requires_grad]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in outs]
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(t.shape, generator=gen).to(ctx.dtype).to(t.dtype) for t in local]
    torch.autograd.backward(local, grads)
    return {
        "model": model,
        "params": dict(model.named_parameters()),
        "output": out,
        "param grads": {n: p.grad for n, p in model.named_parameters()},
        "input grads": [t.grad for t in _leaves(inputs) if t.requires_grad],
        "state_dict": model.state_dict(),
    }


# Compared by value (the truth rule); parameters, copies of the same weights, are compared bitwise.
VALUES = ("output", "param grads", "input grads", "state_dict")


def _compare_values(
    ours: dict[str, Any],
    ref: dict[str, Any],
    tol: Tol = EXACT,
    truth: dict | None = None,
    *,
    full: bool = True,
) -> list[str]:
    return [
        line
        for key in VALUES
        for line in compare(
            key,
            ours[key],
            ref[key],
            tol,
            truth=None if truth is None else truth[key],
            full=full and key == "state_dict",
        )
    ]


def _on_any_rank(mesh: DeviceMesh, flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group())
    return bool(t.item())


def _check(case: Case, mesh: DeviceMesh) -> list[str]:
    """Every difference between PyTorch's result and ours for ``case`` (empty: equivalent)."""
    ctx = Ctx(mesh, case.dtype)
    args, kwargs = case.inputs(ctx)
    ref_in, our_in = _leaf_copy((args, kwargs)), _leaf_copy((args, kwargs))
    ref = _forward_backward(case, ctx, torch_tp, torch_tp.parallelize_module, ref_in)
    ours = _forward_backward(case, ctx, case.styles, case.parallelize, our_in)
    if case.pytorch_output_to_ours is not None:
        ref["output"] = case.pytorch_output_to_ours(ctx, ref["output"])
    failures = compare("params", ours["params"], ref["params"])
    if case.train:
        failures += _compare_values(ours, ref, SHAPES_ONLY)
    # Equal local tensors, kinds and placements on every rank leave nothing to report (equal full
    # tensors follow, and the truth rule holds with err(ours) = err(PyTorch)): only a case whose
    # values differ somewhere (a fused op ran) pays for the float64 run. The decision is made
    # on all ranks together since the run has collectives.
    elif _on_any_rank(mesh, bool(_compare_values(ours, ref, full=False))):
        truth_in = _leaf_copy((args, kwargs), torch.float64)
        truth = _forward_backward(
            case, ctx, torch_tp, torch_tp.parallelize_module, truth_in, in_float64=True
        )
        if case.pytorch_output_to_ours is not None:
            truth["output"] = case.pytorch_output_to_ours(ctx, truth["output"])
        failures += _compare_values(ours, ref, truth=truth)
    if case.post is not None:
        failures += case.post(ctx, ours["model"], our_in[0], ours["output"])
    return failures


def _run_cases(cases: list[Case], mesh: DeviceMesh) -> list[tuple[str, list[str]]]:
    results = []
    for case in cases:
        try:
            results.append((case.name, _check(case, mesh)))
        except Exception as e:
            # Stop at the first error: the ranks may now disagree on which collective comes next.
            raise RuntimeError(f"case {case.name!r} raised") from e
    return results


# --- cases --------------------------------------------------------------------------------------


def _style(name: str, **kwargs: Any) -> Callable[[Any], Any]:
    return lambda styles: getattr(styles, name)(**kwargs)


def _one_input(shape: tuple[int, ...], layout: Placement | None, *, high: int = 0):
    """Inputs factory: a global tensor of ``shape`` (indices below ``high`` if given), this rank's
    part under ``layout``."""

    def inputs(ctx: Ctx) -> tuple[tuple, dict]:
        full = ctx.randint(high, *shape) if high else ctx.randn(*shape)
        return (ctx.local(full, layout),), {}

    return inputs


def _layout_grid(
    ins: list[Placement | None], outs: list[Placement | None]
) -> Iterator[tuple[Placement | None, Placement | None, bool, bool]]:
    """Every (input, output) layout pair, with use_local_output and bias alternating over them
    so that each of their four combinations meets several layout pairs."""
    for i, (il, ol) in enumerate((il, ol) for il in ins for ol in outs):
        yield il, ol, i % 2 == 0, (i // 2) % 2 == 0


def _linear_cases(dtype: torch.dtype) -> list[Case]:
    cases = []

    def add(style: str, in_f: int, out_f: int, bias: bool, il, ol, local: bool, x_layout) -> None:
        cases.append(
            Case(
                f"{style} Linear({in_f}, {out_f}, bias={bias}) input_layouts={il} "
                f"output_layouts={ol} use_local_output={local} {dtype}",
                functools.partial(nn.Linear, in_f, out_f, bias=bias),
                _style(style, input_layouts=il, output_layouts=ol, use_local_output=local),
                _one_input((B, S, in_f), x_layout),
                dtype,
            )
        )

    full = dtype == FULL_GRID_DTYPE
    col_in = [None, Shard(0), Shard(1), Shard(-1)] if full else [Shard(0), Shard(1)]
    col_out = [None, Replicate(), Shard(0), Shard(1)] if full else [None, Replicate()]
    for il, ol, local, bias in _layout_grid(col_in, col_out):
        add("ColwiseParallel", H, F, bias, il, ol, local, il)
    # out_features % world != 0, replicated input
    for ol in (None, Replicate(), Shard(1)) if full else (None,):
        add("ColwiseParallel", H, UNEVEN, True, None, ol, True, None)
    # Rowwise input_layouts=None means Shard(-1): each rank passes x[..., in/W].
    row_in = [None, Replicate(), Shard(0), Shard(1)] if full else [None, Replicate()]
    row_out = [None, Shard(0), Shard(1), Shard(-1)] if full else [Shard(0), Shard(1)]
    for il, ol, local, bias in _layout_grid(row_in, row_out):
        add("RowwiseParallel", F, H, bias, il, ol, local, il or Shard(-1))
    # in_features % world != 0: only a replicated input splits it
    for ol in (None, Shard(1)) if full else (Shard(1),):
        add("RowwiseParallel", UNEVEN, H, True, Replicate(), ol, False, Replicate())
    return cases


def _embedding_cases(dtype: torch.dtype) -> list[Case]:
    cases = []

    def add(style: str, num: int, dim: int, il, ol, local: bool, idx_layout) -> None:
        cases.append(
            Case(
                f"{style} Embedding({num}, {dim}) input_layouts={il} output_layouts={ol} "
                f"use_local_output={local} {dtype}",
                functools.partial(nn.Embedding, num, dim),
                _style(style, input_layouts=il, output_layouts=ol, use_local_output=local),
                _one_input((B, S), idx_layout, high=num),
                dtype,
            )
        )

    if dtype != FULL_GRID_DTYPE:
        add("ColwiseParallel", V, H, None, None, True, None)
        add("RowwiseParallel", V, H, Replicate(), Shard(1), True, Replicate())
        return cases
    for il, ol, local, _ in _layout_grid([None, Shard(0), Shard(1)], [None, Replicate(), Shard(1)]):
        add("ColwiseParallel", V, H, il, ol, local, il)
    # Rowwise input_layouts=None means Shard(-1): each rank passes idx[:, S/W].
    for il, ol, local, _ in _layout_grid([Replicate(), None], [None, Shard(0), Shard(1)]):
        add("RowwiseParallel", V, H, il, ol, local, il or Shard(-1))
    add("ColwiseParallel", V, UNEVEN_SMALL, None, Replicate(), True, None)
    add("RowwiseParallel", UNEVEN, H, Replicate(), None, True, Replicate())
    return cases


def _randomized(module: nn.Module) -> nn.Module:
    """``module`` with its parameters redrawn from the global generator (norms start at ones and
    zeros, which would hide a mix-up of weight and bias)."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


def _dropout_mask_is_real(ctx: Ctx, model: nn.Module, args: tuple, out: Any) -> list[str]:
    """Training-mode dropout(p=0.5): every output is 0 or x / (1 - p), and about half are 0."""
    x = args[0].to_local() if isinstance(args[0], DTensor) else args[0]
    y = out.to_local() if isinstance(out, DTensor) else out
    # One rounding of x * 2 in the dtype: exact for powers of two, so equality is fair.
    kept = y == x.detach() * 2
    zero_fraction = float((y == 0).float().mean())
    failures = []
    if not bool((kept | (y == 0)).all()):
        failures.append("dropout: outputs that are neither 0 nor 2 * x")
    if not 0.35 < zero_fraction < 0.65:  # binomial(>= 864, 0.5): 0.35 is > 8 sigma away
        failures.append(f"dropout: fraction of zeros {zero_fraction:.3f}, expected about 0.5")
    return failures


def _sequence_cases(dtype: torch.dtype) -> list[Case]:
    full = dtype == FULL_GRID_DTYPE
    modules = {
        "LayerNorm": lambda: _randomized(nn.LayerNorm(H)),
        "RMSNorm": lambda: _randomized(nn.RMSNorm(H)),
        "Dropout(eval)": lambda: nn.Dropout(0.5),
    }
    dims_locals = (
        [(0, False), (0, True), (1, False), (1, True)] if full else [(0, False), (1, True)]
    )
    cases = [
        Case(
            f"SequenceParallel {mod} sequence_dim={dim} use_local_output={local} {dtype}",
            build,
            _style("SequenceParallel", sequence_dim=dim, use_local_output=local),
            _one_input((B, S, H), Shard(dim)),
            dtype,
        )
        for mod, build in modules.items()
        for dim, local in dims_locals
    ]

    def replicated_dtensor(ctx: Ctx) -> tuple[tuple, dict]:
        return (DTensor.from_local(ctx.randn(B, S, H), ctx.mesh, [Replicate()]),), {}

    cases.append(
        Case(
            f"SequenceParallel LayerNorm given a Replicate() DTensor {dtype}",
            modules["LayerNorm"],
            _style("SequenceParallel"),
            replicated_dtensor,
            dtype,
        )
    )
    for dim in (0, 1) if full else (1,):
        cases.append(
            Case(
                f"SequenceParallel Dropout(0.5) training sequence_dim={dim} {dtype}",
                functools.partial(nn.Dropout, 0.5),
                _style("SequenceParallel", sequence_dim=dim),
                _one_input((B, S, H), Shard(dim)),
                dtype,
                train=True,
                post=_dropout_mask_is_real,
            )
        )
    return cases


class Gated(nn.Module):
    """``y = down(up(x) * scale) (+ extra)``, returned as ``(y, up(x), "tag")``: a positional
    non-tensor input, a keyword tensor input and a non-tensor output for the Prepare* styles."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(H, F)
        self.down = nn.Linear(F, H)

    def forward(self, x: torch.Tensor, scale: float, extra: torch.Tensor | None = None):
        h = self.up(x)
        y = self.down(h * scale)
        return (y if extra is None else y + extra), h, "tag"


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Gated()

    def forward(self, x: torch.Tensor, scale: float, extra: torch.Tensor):
        return self.inner(x, scale, extra=extra)


def _gated_inputs(ctx: Ctx) -> tuple[tuple, dict]:
    x, extra = ctx.randn(B, S, H), ctx.randn(B, S, H)
    return (ctx.local(x, Shard(1)), 0.5, ctx.local(extra, Shard(1))), {}


def _prepare_cases(dtype: torch.dtype) -> list[Case]:
    # inner's inputs: x and extra arrive sharded on the sequence dim and are gathered; scale (a
    # float) passes through a None placeholder. Its outputs: y is replicated, h = up(x) is
    # Shard(-1) (a local tensor from ColwiseParallel); they leave as Shard(1) and Replicate().
    inputs = {
        "input_layouts": (Shard(1), None),
        "desired_input_layouts": (Replicate(), None),
        "input_kwarg_layouts": {"extra": Shard(1)},
        "desired_input_kwarg_layouts": {"extra": Replicate()},
    }
    outputs = {
        "output_layouts": (Replicate(), Shard(-1), None),
        "desired_output_layouts": (Shard(1), Replicate(), None),
    }

    def plan(separate: bool, local_in: bool, local_out: bool) -> Callable[[Any], Any]:
        def make(styles: Any) -> dict:
            layers = {
                "inner.up": styles.ColwiseParallel(),
                # With DTensor inputs, extra is a DTensor: y must be one too to be added to it.
                "inner.down": styles.RowwiseParallel(use_local_output=local_in),
            }
            if separate:
                return {
                    "inner": styles.PrepareModuleInput(**inputs, use_local_output=local_in),
                    **layers,
                    "": styles.PrepareModuleOutput(**outputs, use_local_output=local_out),
                }
            both = styles.PrepareModuleInputOutput(
                **inputs, use_local_input=local_in, **outputs, use_local_output=local_out
            )
            return {"inner": both, **layers}

        return make

    return [
        Case(
            f"{'PrepareModuleInput/Output' if separate else 'PrepareModuleInputOutput'}"
            f" use_local_input={local_in} use_local_output={local_out} {dtype}",
            Outer,
            plan(separate, local_in, local_out),
            _gated_inputs,
            dtype,
        )
        for separate in (True, False)
        for local_in, local_out in (
            ((True, True), (False, False), (False, True))
            if dtype == FULL_GRID_DTYPE
            else ((separate, separate),)
        )
    ]


# The models' activation is smooth (SiLU, as in Llama), not ReLU: in bf16 a rounding that moves a
# pre-activation across 0 switches a whole term of the weight grads on or off, and which terms
# switch differs between any two roundings of the same sums, so with ReLU the errors of two correct
# bf16 runs against the float64 truth differ by up to 10x and no 2x rule can hold.
class Block(nn.Module):
    """``x + w2(silu(w1(norm(x))))``, ``x`` ``[B, S, H]``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.w1 = nn.Linear(H, F)
        self.w2 = nn.Linear(F, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(nn.functional.silu(self.w1(self.norm(x))))


class Stack(nn.Module):
    """Two blocks, a final norm and a head: ``[B, S, H] -> [B, S, F]``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, F)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _stack() -> nn.Module:
    return _randomized(Stack())


def _stack_plan(styles: Any) -> dict:
    """Sequence parallel around every Linear pair: the all-gather -> matmul (w1, head) and
    matmul -> reduce-scatter (w2) boundaries, keys with a wildcard, dots and ``""``."""
    return {
        "": styles.PrepareModuleInput(
            input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True
        ),
        "layers.*.w1": styles.ColwiseParallel(input_layouts=Shard(1)),
        "layers.*.w2": styles.RowwiseParallel(output_layouts=Shard(1)),
        "layers.0.norm": styles.SequenceParallel(),
        "layers.1.norm": styles.SequenceParallel(),
        "norm": styles.SequenceParallel(),
        "head": styles.ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def _styles(colwise: Any, rowwise: Any) -> SimpleNamespace:
    """A styles namespace whose Linear styles come from the given classes, the rest PyTorch's."""
    ns = SimpleNamespace(**{name: getattr(torch_tp, name) for name in STYLE_NAMES})
    ns.ColwiseParallel, ns.RowwiseParallel = colwise, rowwise
    return ns


def _plan_cases(dtype: torch.dtype) -> list[Case]:
    variants = {
        "tp_kernels styles, tp_kernels.parallelize_module": (tpk, tpk.parallelize_module),
        "tp_kernels styles in torch's parallelize_module": (tpk, torch_tp.parallelize_module),
        "torch styles in tp_kernels.parallelize_module": (torch_tp, tpk.parallelize_module),
        "mixed plan (our Colwise, torch Rowwise)": (
            _styles(tpk.ColwiseParallel, torch_tp.RowwiseParallel),
            tpk.parallelize_module,
        ),
        "mixed plan (torch Colwise, our Rowwise) in torch's parallelize_module": (
            _styles(torch_tp.ColwiseParallel, tpk.RowwiseParallel),
            torch_tp.parallelize_module,
        ),
        "tp_kernels styles with backend='reference'": (
            _styles(
                functools.partial(tpk.ColwiseParallel, backend="reference"),
                functools.partial(tpk.RowwiseParallel, backend="reference"),
            ),
            tpk.parallelize_module,
        ),
    }
    if dtype != FULL_GRID_DTYPE:
        variants = dict(list(variants.items())[:1])
    return [
        Case(
            f"Stack: {what} {dtype}",
            _stack,
            _stack_plan,
            _one_input((B, S, H), None),
            dtype,
            styles=styles,
            parallelize=parallelize,
        )
        for what, (styles, parallelize) in variants.items()
    ]


class EmbedMLP(nn.Module):
    """``w2(silu(w1(tok(idx))))``: idx ``[B, S]`` -> ``[B, S, H]``; ``w2`` has a bias if
    ``bias``."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, H)
        self.w1 = nn.Linear(H, F)
        self.w2 = nn.Linear(F, H, bias=bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(self.tok(idx))))


def _embed_mlp_plan(styles: Any) -> dict:
    return {
        "tok": styles.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "w1": styles.ColwiseParallel(input_layouts=Shard(1)),
        "w2": styles.RowwiseParallel(output_layouts=Shard(1)),
    }


def _shards_come_from(
    src_data_rank: int | None, build: Callable[[], nn.Module]
) -> Callable[..., list[str]]:
    """Post-check: each local shard is this rank's part of the model ``build`` made on rank
    ``src_data_rank`` (``None``: on this rank itself)."""

    def post(ctx: Ctx, model: nn.Module, args: tuple, out: Any) -> list[str]:
        source = ctx.rank if src_data_rank is None else src_data_rank
        want = dict(_build(build, ctx, source).named_parameters())
        failures = []
        for name, p in model.named_parameters():
            expected = ctx.local(want[name].detach(), p.placements[0])
            if not torch.equal(p.to_local().detach(), expected):
                failures.append(f"{name}: local shard is not rank {source}'s")
        return failures

    return post


def _src_cases(dtype: torch.dtype) -> list[Case]:
    # PyTorch applies a "" entry without passing src_data_rank on, so the style keeps its
    # default of 0: tp_kernels must behave the same, whichever that is.
    empty_key = Case(
        f"Linear under a '' plan key, src_data_rank=None, each rank seeded differently {dtype}",
        functools.partial(nn.Linear, H, F),
        lambda styles: {"": styles.ColwiseParallel()},
        _one_input((B, S, H), None),
        dtype,
        src_data_rank=None,
        per_rank_weights=True,
    )
    # With src_data_rank=None, w2's "replicated" bias differs per rank, and tp_kernels adds it
    # otherwise than PyTorch (see test_documented_difference_...): that case has no bias.
    return [empty_key] + [
        Case(
            f"EmbedMLP(bias={bias}) src_data_rank={src}, each rank seeded differently {dtype}",
            functools.partial(EmbedMLP, bias),
            _embed_mlp_plan,
            _one_input((B, S), Replicate(), high=V),
            dtype,
            src_data_rank=src,
            per_rank_weights=True,
            post=_shards_come_from(src, functools.partial(EmbedMLP, bias)),
        )
        for src, bias in ((0, True), (None, False))
    ]


GROUPS = {
    "linear": _linear_cases,
    "embedding": _embedding_cases,
    "sequence": _sequence_cases,
    "prepare": _prepare_cases,
    "plans": _plan_cases,
    "src_data_rank": _src_cases,
}


def _run_groups(groups: list[str]) -> list[tuple[str, list[str]]]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cases = [case for g in groups for dtype in DTYPES for case in GROUPS[g](dtype)]
    return _run_cases(cases, mesh)


def _assert_all_equivalent(
    per_rank: list[list[tuple[str, list[str]]]], expected_cases: int
) -> None:
    assert all(len(res) == expected_cases for res in per_rank), [len(r) for r in per_rank]
    lines = [
        f"rank {rank} | {case}: {line}"
        for rank, results in enumerate(per_rank)
        for case, failures in results
        for line in failures
    ]
    assert not lines, f"{len(lines)} differences from PyTorch:\n" + "\n".join(lines)


def _count(groups: list[str]) -> int:
    return sum(len(GROUPS[g](dtype)) for g in groups for dtype in DTYPES)


# --- checks on gloo worlds ----------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize(
    "groups",
    [["linear", "embedding"], ["sequence", "prepare", "plans", "src_data_rank"]],
    ids=["linear+embedding", "sequence+prepare+plans+src"],
)
def test_same_results_as_pytorch(worlds, world_size: int, groups: list[str]) -> None:
    _assert_all_equivalent(worlds(world_size).run(_run_groups, groups), _count(groups))


def _own_bias_minus_mean(ctx: Ctx) -> torch.Tensor:
    """``b_rank - mean_r(b_r)`` (float64, ``[H]``) of ``w2.bias`` of ``EmbedMLP(bias=True)``, each
    rank's model seeded by its rank."""
    biases = [
        _build(functools.partial(EmbedMLP, True), ctx, r).w2.bias.detach().double()
        for r in range(ctx.world)
    ]
    return biases[ctx.rank] - torch.stack(biases).mean(0)


def _bias_per_rank() -> tuple[list[tuple[str, list[str]]], float]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    case = Case(
        "EmbedMLP(bias=True) src_data_rank=None, each rank seeded differently",
        functools.partial(EmbedMLP, True),
        _embed_mlp_plan,
        _one_input((B, S), Replicate(), high=V),
        src_data_rank=None,
        per_rank_weights=True,
        # w2's output is a local tensor, Shard(1) of [B, S, H]: the shift broadcasts over H.
        pytorch_output_to_ours=lambda ctx, out: out + _own_bias_minus_mean(ctx).to(out.dtype),
    )
    shift = float(_own_bias_minus_mean(Ctx(mesh, case.dtype)).abs().max())
    return _run_cases([case], mesh), shift


@pytest.mark.parametrize("world_size", [2, 4])
def test_documented_difference_rowwise_sharded_output_adds_own_bias_not_mean_of_ranks(
    worlds, world_size: int
) -> None:
    """With ``src_data_rank=None`` each rank keeps its own "replicated" bias of a
    ``RowwiseParallel(output_layouts=Shard(1))`` Linear. PyTorch adds it inside the ``Partial``
    sum (``Replicate -> Partial`` divides it by W), so its output carries ``mean_r(b_r)``;
    tp_kernels' fused rowwise adds the local bias once, after the reduce-scatter (by design, see
    tp_kernels/styles.py). So ours = PyTorch's - ``mean_r(b_r)`` + ``b_rank``, by the float64-truth
    rule in fp32, and gradients and state_dict are PyTorch's."""
    per_rank = worlds(world_size).run(_bias_per_rank)
    # Were the biases (nearly) equal, the relation would hold without showing anything.
    assert all(shift > 0.05 for _, shift in per_rank), [shift for _, shift in per_rank]
    _assert_all_equivalent([results for results, _ in per_rank], 1)


def _unsupported_modules() -> list[str]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    messages = []
    for name in FUSABLE:
        for module in (nn.Conv1d(4, 4, 1), nn.LayerNorm(4)):
            with pytest.raises(NotImplementedError):
                torch_tp.parallelize_module(module, mesh, getattr(torch_tp, name)())
            for parallelize in (tpk.parallelize_module, torch_tp.parallelize_module):
                with pytest.raises(NotImplementedError) as err:
                    parallelize(module, mesh, getattr(tpk, name)())
                messages.append(str(err.value))
    return messages


def test_unsupported_module_is_not_implemented_naming_it(worlds) -> None:
    messages = worlds(2).run(_unsupported_modules)[0]
    classes = ["torch.nn.modules.conv.Conv1d", "torch.nn.modules.normalization.LayerNorm"]
    expected = [(style, cls) for style in FUSABLE for cls in classes for _ in range(2)]
    assert len(messages) == len(expected)
    for message, (style, cls) in zip(messages, expected, strict=True):
        assert style in message and cls in message, message
        assert "nn.Linear and nn.Embedding" in message, message


def _two_d_mesh() -> list[tuple[str, list[str]]]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"device_mesh must be 1-D, got a 2-D mesh \(2, 2\).*'tp'"):
        tpk.parallelize_module(nn.Linear(H, F), mesh, tpk.ColwiseParallel())
    # PyTorch rejects it with the same type, later and less clearly (a placements-length check).
    with pytest.raises(ValueError):
        torch_tp.parallelize_module(nn.Linear(H, F), mesh, torch_tp.ColwiseParallel())
    # The sliced mesh is what the message asks for: it then behaves exactly like PyTorch.
    sliced = Case(
        "Stack on mesh['tp'] of a (2, 2) mesh", _stack, _stack_plan, _one_input((B, S, H), None)
    )
    return _run_cases([sliced], mesh["tp"])


def test_2d_mesh_is_a_value_error_and_its_slice_works(worlds) -> None:
    _assert_all_equivalent(worlds(4).run(_two_d_mesh), 1)
