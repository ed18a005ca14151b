"""torchao's Float8Linear under tp_kernels' styles: the fused fp8 path (tp_kernels/float8.py),
against torchao under PyTorch's styles, counted; what does not fuse is counted as a fallback.

A SwiGLU TP block (the block's PrepareModuleInput gathers, w1/w3 colwise, w2 rowwise to
``Shard(1)``) converted with each of torchao's recipes runs one training step both ways.

Tolerances: at W=2 (and W=1) the fused step's output and input grad equal torchao's bit for bit
on ``reference`` (the same casts, the same ``_scaled_mm`` rows; a sum of two partials rounds
once either way). The weight grads reduce over the rows, which the fused path orders gathered-dim
first (``[S, B]``) where DTensor's GEMM takes ``[B, S]``: fp32 accumulation order, 2^-20
norm-relative, and in bf16 one rounding that may land the other way (2^-8). At W >= 3 DTensor's
reduce-scatter rounds each running sum to bf16 where tp_kernels sums the partials in fp32:
outputs differ by up to one bf16 rounding (2^-8); the gradients are cast to fp8 again from those,
and an element on a bucket edge moves one fp8 step (e4m3: 2^-3 of it; e5m2, tensorwise's
gradient dtype: 2^-2), which norm-relative stays under 2^-5 (2^-4 tensorwise).
fp32 master weights: rowwise's products are bf16 either way (torchao's rule), so W=3 stays exact.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel as torch_tp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import tp_kernels as tpk

pytest.importorskip("torchao.float8")

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
H, B = 64, 2  # _scaled_mm wants K and N in multiples of 16; batch > 1


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _plan(styles, *, local_gathered_input: bool = False) -> dict:
    """The block's plan from the module ``styles`` (tp_kernels or PyTorch's tensor.parallel).
    ``local_gathered_input``: the block's PrepareModuleInput hands its children the gathered
    input as a local tensor (``use_local_output=True``)."""
    return {
        "": styles.PrepareModuleInput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_output=local_gathered_input,
        ),
        "w1": styles.ColwiseParallel(),
        "w3": styles.ColwiseParallel(),
        "w2": styles.RowwiseParallel(output_layouts=Shard(1)),
    }


def _float8_plan(styles) -> dict:
    """The block's plan from torchao's float8 TP styles, or tp_kernels' classes of the same names
    (``styles``: either module)."""
    return {
        "": styles.PrepareFloat8ModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "w1": styles.Float8ColwiseParallel(),
        "w3": styles.Float8ColwiseParallel(),
        "w2": styles.Float8RowwiseParallel(output_layouts=Shard(1)),
    }


def _plans(kind: str) -> tuple[dict, dict]:
    """(tp_kernels' plan, the plan it is compared with) of one ``kind``.

    ``"float8 styles"``: tp_kernels' float8 TP styles against PyTorch's plain styles. torchao's
    float8 styles cannot run here (DTensor all-gathers their ``float8_e4m3fn`` tensor, which gloo
    refuses: "Invalid scalar type"); their numerics are the plain styles' under tensor-wise
    scaling, which they assume: a cast before the gather takes the amax of the DTensor (all-
    reduced), one after it the amax of the gathered tensor, the same maximum, so the same scale
    and fp8 values; the output gradient likewise, cast before its gather (rowwise) or on the
    shard it arrives as (colwise, its amax all-reduced)."""
    if kind == "float8 styles":
        import tp_kernels.float8_tensor_parallel as tpk_float8_tp

        return _float8_plan(tpk_float8_tp), _plan(torch_tp)
    local = kind == "local gathered input"
    return _plan(tpk, local_gathered_input=local), _plan(torch_tp, local_gathered_input=local)


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_()
    y = model(x)
    y = y.to_local() if isinstance(y, DTensor) else y
    y.float().pow(2).sum().backward()
    return (y.detach(), x.grad, *(p.grad.to_local() for p in model.parameters()))


def _block_pair(recipe: str, dtype: torch.dtype, plans: str = "plain", **config_changes):
    """The SwiGLU block converted with ``recipe`` (its config changed by ``config_changes``),
    parallelized by tp_kernels' styles and by PyTorch's (``plans``: see :func:`_plans`), and this
    rank's input shard: ``(ours, theirs, x, parameter names)``."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    warnings.filterwarnings("ignore", module="torchao")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    base = SwiGLU(H, 64 * world).to(dtype)
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(base, config=dataclasses.replace(config, **config_changes))
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    our_plan, their_plan = _plans(plans)
    ours = tpk.parallelize_module(copy.deepcopy(base), mesh, our_plan)
    theirs = torch_tp.parallelize_module(copy.deepcopy(base), mesh, their_plan)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, 8 * world, H, generator=g).to(dtype).chunk(world, dim=1)[rank]
    names = ["output", "input grad", *(f"{n} grad" for n, _ in ours.named_parameters())]
    return ours, theirs, x, names


def _compare_unfused(recipe: str, dtype_name: str, change: str) -> list[str]:
    """The recipe with a config the fused path does not take (``change``: torchao's emulated
    GEMMs, or disabled input-grad casts)."""
    from torchao.float8.config import CastConfig, ScalingType

    changes = {
        "emulate": {"emulate": True},
        # A high-precision backward: torchao disables both operands of a GEMM or neither, and
        # grad_output in both of its GEMMs or in neither.
        "disabled input-grad casts": {
            f"cast_config_{name}": CastConfig(scaling_type=ScalingType.DISABLED)
            for name in (
                "grad_output",
                "weight_for_grad_input",
                "grad_output_for_grad_weight",
                "input_for_grad_weight",
            )
        },
    }[change]
    ours, theirs, x, names = _block_pair(recipe, getattr(torch, dtype_name), **changes)
    tpk.reset_comm_stats()
    got = _step(ours, x)
    counts = dict(tpk.comm_stats())
    want = _step(theirs, x)
    failures = [f"{n} differs" for n, a, b in zip(names, got, want) if not torch.equal(a, b)]
    if counts != {("forward", "fallback", "torch"): 2}:
        failures.append(f"counts {counts}: expected the gather's and w2's fallbacks only")
    return failures


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rowwise_cast_of_each_sequence_shard_is_the_cast_of_the_gathered_input(dtype):
    """The fused fp8 all-gather-matmul (issue 27, docs/DESIGN.md "FP8 Linears") will quantize
    each rank's sequence shard with torchao's own cast and gather fp8 bytes and per-row scales:
    that is exact only because a row's scale never spans ranks. Here, on one process and three
    shards: the concatenated casts equal the cast of the whole input (data and scales), and
    ``torch._scaled_mm`` on them (torchao's inverse scales, a bf16 result) gives Float8Linear's
    output bit for bit, for bf16 and fp32 master weights."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    config = Float8LinearConfig.from_recipe_name("rowwise")

    def cast(t: torch.Tensor, role: GemmInputRole, axiswise_dim: int):
        return hp_tensor_to_float8_dynamic(
            t,
            torch.float8_e4m3fn,
            LinearMMConfig(),
            gemm_input_role=role,
            scaling_granularity=ScalingGranularity.AXISWISE,
            axiswise_dim=axiswise_dim,
            round_scales_to_power_of_2=config.round_scales_to_power_of_2,
        )

    torch.manual_seed(0)
    world, m = 3, 16
    x = torch.randn(world * m, H, dtype=dtype)
    linear = convert_to_float8_training(nn.Sequential(nn.Linear(H, 48, bias=False)), config=config)
    linear = linear.to(dtype)[0]
    whole = cast(x, GemmInputRole.INPUT, -1)
    shards = [cast(s, GemmInputRole.INPUT, -1) for s in x.chunk(world)]
    data = torch.cat([s._data for s in shards])
    scales = torch.cat([s._scale for s in shards])
    assert torch.equal(data.view(torch.uint8), whole._data.view(torch.uint8))
    assert torch.equal(scales, whole._scale) and scales.shape == (world * m, 1)
    weight = cast(linear.weight.t(), GemmInputRole.WEIGHT, 0)
    out = torch._scaled_mm(
        data,
        weight._data,
        scale_a=scales.reciprocal(),
        scale_b=weight._scale.reciprocal(),
        out_dtype=torch.bfloat16,
    )
    assert torch.equal(out.to(dtype), linear(x))


def _norm_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _fused_step(recipe: str, dtype_name: str, backend: str, plans: str = "plain") -> dict:
    """One training step of the SwiGLU block converted with ``recipe``, under tp_kernels' styles
    on ``backend`` and under PyTorch's (``plans``: see :func:`_plans`): each result's error against
    PyTorch's (``exact``: equal; ``error``: norm-relative), the counters and the bytes each call
    sent."""
    ours, theirs, x, names = _block_pair(recipe, getattr(torch, dtype_name), plans)
    tpk.reset_comm_stats()
    with tpk.use_backend(backend):
        got = _step(ours, x)
    counts = tpk.comm_stats()
    want = _step(theirs, x)
    return {
        "exact": {n: torch.equal(a, b) for n, a, b in zip(names, got, want)},
        "error": {n: _norm_error(a, b) for n, a, b in zip(names, got, want)},
        "counts": dict(counts),
        "sent": dict(counts.sent_bytes),
    }


_GRAD_TOL = {"rowwise": 2**-5, "rowwise_with_gw_hp": 2**-5, "tensorwise": 2**-4}


def _numerics_failures(
    result: dict, recipe: str, dtype: str, world: int, backend: str
) -> list[str]:
    """The results of a block's :func:`_fused_step` (or any step of it reporting ``exact`` and
    ``error`` per result) outside the module docstring's tolerances."""
    failures = []
    for name, error in result["error"].items():
        weight = name.endswith("weight grad")
        if world <= 2 and backend == "reference" and not weight:
            ok = result["exact"][name]
        elif dtype == "float32":
            ok = error <= 2**-20
        elif name == "output" or world <= 2:
            ok = error <= 2**-8  # fp32 accumulation order, then one bf16 rounding
        else:
            ok = error <= _GRAD_TOL[recipe]
        if not ok:
            failures.append(f"{name}: error {error:.2e}")
    return failures


def _check_fused(result: dict, recipe: str, dtype: str, world: int, backend: str) -> list[str]:
    """What the module docstring says must hold of one rank's :func:`_fused_step`, and the
    counts: zero fallbacks, one fused fp8 call each way per Linear boundary, the gather's bytes
    fp8 (with each row's scale beside it when row-wise)."""
    failures = _numerics_failures(result, recipe, dtype, world, backend)
    counts, sent = result["counts"], result["sent"]
    if any(kind == "fallback" for _, kind, _ in counts):
        failures.append(f"fallbacks counted: {counts}")
    for phase in ("forward", "backward"):
        for kind in ("scaled_all_gather_matmul", "scaled_matmul_reduce_scatter"):
            if counts.get((phase, kind, backend)) != 1:
                failures.append(f"{phase} {kind}: {counts.get((phase, kind, backend))} calls")
    if world > 1:
        rows = B * 8  # this rank's tokens
        row_bytes = H + 16 if recipe != "tensorwise" else H  # fp8 bytes (+ the packed scale)
        want = rows * row_bytes * (world - 1)
        got = sent.get(("forward", "scaled_all_gather_matmul", backend))
        if got != want:
            failures.append(f"forward gather sent {got} bytes, expected {want}")
    return failures


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_block_fuses_with_torchao_s_numerics_at_two_ranks(worlds, recipe):
    for dtype in ("bfloat16", "float32"):
        for result in worlds(2).run(_fused_step, recipe, dtype, "reference"):
            assert _check_fused(result, recipe, dtype, 2, "reference") == [], (recipe, dtype)


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_float8_block_fuses_at_other_world_sizes(worlds, world_size):
    for recipe in ("rowwise", "tensorwise"):
        for result in worlds(world_size).run(_fused_step, recipe, "bfloat16", "reference"):
            assert _check_fused(result, recipe, "bfloat16", world_size, "reference") == []


@pytest.mark.parametrize("backend", ["pipelined", "symm"])
def test_float8_block_fuses_on_every_cpu_backend(worlds, backend):
    for recipe in RECIPES:
        for dtype in ("bfloat16", "float32"):
            for result in worlds(3).run(_fused_step, recipe, dtype, backend):
                assert _check_fused(result, recipe, dtype, 3, backend) == [], (recipe, dtype)


def test_the_fp8_gather_moves_half_of_bf16_s_bytes_plus_the_scales(worlds):
    """The same block unconverted (bf16) against rowwise fp8: the forward gather's bytes."""
    (fp8,) = worlds(2).run(_fused_step, "rowwise", "bfloat16", "reference")[:1]
    (bf16,) = worlds(2).run(_bf16_gather_bytes)[:1]
    got = fp8["sent"][("forward", "scaled_all_gather_matmul", "reference")]
    assert got == bf16 // 2 + B * 8 * 16, (got, bf16)


def _bf16_gather_bytes() -> int:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = SwiGLU(H, 64 * world).to(torch.bfloat16)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    model = tpk.parallelize_module(model, mesh, _plan(tpk))
    x = torch.randn(B, 8 * world, H).to(torch.bfloat16).chunk(world, dim=1)[rank]
    tpk.reset_comm_stats()
    with tpk.use_backend("reference"):
        _step(model, x)
    return tpk.comm_stats().total_bytes("forward", "all_gather_matmul")


@pytest.mark.parametrize("recipe", RECIPES)
def test_an_unfusable_float8_block_is_pytorch_s_bit_for_bit_and_counted(worlds, recipe):
    for failures in worlds(2).run(_compare_unfused, recipe, "bfloat16", "emulate"):
        assert failures == [], recipe


def test_a_disabled_input_grad_cast_is_not_fused(worlds):
    """The fused input-grad GEMMs are fp8: a config whose input-grad casts are disabled takes
    PyTorch's path (before, it was fused and its backward failed)."""
    for failures in worlds(2).run(
        _compare_unfused, "rowwise", "bfloat16", "disabled input-grad casts"
    ):
        assert failures == []


def test_torchao_s_float8_tp_styles_fuse_with_their_numerics(worlds):
    """tp_kernels' Float8ColwiseParallel, Float8RowwiseParallel and PrepareFloat8ModuleInput on
    a tensor-wise block (what torchao's assume) against torchao's numerics (see :func:`_plans`):
    the plain styles' checks, fp8 bytes on the wire and zero fallbacks, at 2 ranks (exact) and
    3."""
    for world in (2, 3):
        for result in worlds(world).run(
            _fused_step, "tensorwise", "bfloat16", "reference", "float8 styles"
        ):
            assert _check_fused(result, "tensorwise", "bfloat16", world, "reference") == []


def _compare_local_gathered_input(recipe: str, plans: str) -> list[str]:
    """The block's gather handed to the children as a local tensor: the fused fp8 gather has no
    high-precision gathered input to hand over, so the gather falls back (counted), and the
    children, given a replicated input, must run Float8Linear's own forward."""
    ours, theirs, x, names = _block_pair(recipe, torch.bfloat16, plans)
    tpk.reset_comm_stats()
    got = _step(ours, x)
    counts = dict(tpk.comm_stats())
    want = _step(theirs, x)
    failures = [f"{n} differs" for n, a, b in zip(names, got, want) if not torch.equal(a, b)]
    fallbacks = {key: n for key, n in counts.items() if key[1] == "fallback"}
    if fallbacks != {("forward", "fallback", "torch"): 1}:
        failures.append(f"fallbacks {fallbacks}: expected the gather's only")
    return failures


def test_a_float8_child_of_an_unfused_gather_runs_float8_linear_s_forward(worlds):
    """Before, a fused-installed Float8Linear handed a replicated input ran ``nn.Linear.forward``
    (a high-precision matmul): its output differed from torchao's."""
    for failures in worlds(2).run(_compare_local_gathered_input, "rowwise", "local gathered input"):
        assert failures == []


def test_the_float8_tp_styles_check_their_modules_as_torchao_s_do():
    """A plain nn.Linear under Float8ColwiseParallel: torchao's ValueError, from tp_kernels' class
    too (raised at apply time, before any communication)."""
    import torchao.float8.float8_tensor_parallel as torchao_tp

    import tp_kernels.float8_tensor_parallel as tpk_float8_tp

    for styles in (torchao_tp, tpk_float8_tp):
        with pytest.raises(ValueError, match="Expecting module to be Float8Linear"):
            styles.Float8ColwiseParallel()._apply(nn.Linear(16, 16), None)


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing: under it a Float8Linear takes PyTorch's path."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _colwise_under_a_dispatch_mode(recipe: str) -> list[str]:
    """A Float8Linear under ``ColwiseParallel(input_layouts=Shard(1))`` (its own gather, no
    PrepareModuleInput) called under a dispatch mode, which the fused fp8 path does not take:
    PyTorch's path, counted, equal to PyTorch's styles bit for bit."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    warnings.filterwarnings("ignore", module="torchao")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(H, 32 * world, bias=False)).to(torch.bfloat16)
    convert_to_float8_training(base, config=Float8LinearConfig.from_recipe_name(recipe))
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    ours, theirs = (
        styles.parallelize_module(
            copy.deepcopy(base), mesh, {"0": styles.ColwiseParallel(input_layouts=Shard(1))}
        )
        for styles in (tpk, torch_tp)
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, 8 * world, H, generator=g).to(torch.bfloat16).chunk(world, dim=1)[rank]
    tpk.reset_comm_stats()
    with _PassThrough():
        got = _step(ours, x)
    counts = dict(tpk.comm_stats())
    want = _step(theirs, x)
    names = ("output", "input grad", "weight grad")
    failures = [f"{n} differs" for n, a, b in zip(names, got, want) if not torch.equal(a, b)]
    if counts != {("forward", "fallback", "torch"): 1}:
        failures.append(f"counts {counts}: expected one fallback")
    return failures


def test_a_colwise_float8_linear_falls_back_under_a_dispatch_mode(worlds):
    """Before, the fallback handed the Float8Linear its input still sequence-sharded; torchao's
    GEMM then redistributed an fp8 tensor and failed ("all_gather_into_tensor with axiswise
    scaling is not supported yet"). PyTorch's style gathers the input first, and so does the
    fallback."""
    for failures in worlds(2).run(_colwise_under_a_dispatch_mode, "rowwise"):
        assert failures == []


# The project's Llama (tp_kernels/models), converted with each recipe.

LLAMA_LAYERS = 2


def _llama_config(world: int):
    """A Llama whose every local GEMM dim is a multiple of 16 on ``world`` ranks (the head counts
    must divide by ``world``, so the sizes grow with it): head dim 16, per rank 2 query heads
    and 1 key/value head (grouped-query attention), 64 ffn and 48 vocabulary columns, and 8
    tokens of the sequence."""
    from tp_kernels.models import LlamaConfig

    return LlamaConfig(
        vocab_size=48 * world,
        dim=32 * world,
        n_layers=LLAMA_LAYERS,
        n_heads=2 * world,
        n_kv_heads=world,
        ffn_hidden_dim=64 * world,
        max_seq_len=8 * world,
    )


def _llama_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The next-token cross entropy (fp32) of ``model`` on ``tokens [B, S+1]``, backward run."""
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach()


def _llama_steps(recipe: str, dtype_name: str) -> dict:
    """One training step of the Llama converted with ``recipe`` under PyTorch's styles and under
    tp_kernels' on each backend: per backend, each result's ``exact`` and ``error`` against
    PyTorch's (the loss and every parameter's whole gradient) and the counters; and which
    Linears torchao converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    from tp_kernels.models import Llama
    from tp_kernels.models.plans import llama_tp_plan

    warnings.filterwarnings("ignore", module="torchao")
    world = dist.get_world_size()
    config = _llama_config(world)
    base = Llama(config, seed=3, dtype=getattr(torch, dtype_name))
    linears = sorted(n for n, m in base.named_modules() if isinstance(m, nn.Linear))
    convert_to_float8_training(base, config=Float8LinearConfig.from_recipe_name(recipe))
    fp8 = sorted(n for n, m in base.named_modules() if isinstance(m, Float8Linear))
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, config.vocab_size, (B, config.max_seq_len + 1), generator=g)
    names = ["loss", *(f"{n} grad" for n, _ in base.named_parameters())]

    def results(model: nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
        return [loss, *(p.grad.full_tensor() for p in model.parameters())]

    theirs = torch_tp.parallelize_module(
        copy.deepcopy(base), mesh, llama_tp_plan(base, styles="torch")
    )
    want = results(theirs, _llama_loss(theirs, tokens))
    steps = {}
    for backend in ("reference", "pipelined", "symm"):
        plan = llama_tp_plan(base, backend=backend)
        ours = tpk.parallelize_module(copy.deepcopy(base), mesh, plan)
        tpk.reset_comm_stats()
        loss = _llama_loss(ours, tokens)
        counts = dict(tpk.comm_stats())
        got = results(ours, loss)
        steps[backend] = {
            "exact": {n: torch.equal(a, b) for n, a, b in zip(names, got, want)},
            "error": {n: _norm_error(a, b) for n, a, b in zip(names, got, want)},
            "counts": counts,
        }
    return {"linears": linears, "fp8": fp8, "steps": steps}


def _check_llama(step: dict, fp8: list[str], dtype: str, backend: str) -> list[str]:
    """What :func:`test_the_llama_converted_with_each_recipe_fuses_every_boundary`'s docstring
    says must hold of one backend's step."""
    failures = []
    weight_grads = {f"{name}.weight grad" for name in fp8}
    for name, error in step["error"].items():
        if dtype == "float32":
            ok = error <= 2**-20  # fp32 reassociation
        elif name in weight_grads:
            ok = error <= 2**-8  # the rows' order in the reduction, then one bf16 rounding
        else:
            ok = step["exact"][name]
        if not ok:
            failures.append(f"{name}: error {error:.2e}")
    counts = step["counts"]
    fallbacks = {k: n for k, n in counts.items() if k[1] == "fallback"}
    if fallbacks:
        failures.append(f"fallbacks counted: {fallbacks}")
    per_boundary = {k: n for k, n in counts.items() if k[1] != "amax_all_reduce"}
    blocks = LLAMA_LAYERS
    expected = {
        # attention's and feed_forward's grouped gathers, and the output Linear's
        ("forward", "scaled_all_gather_matmul", backend): 2 * blocks + 1,
        ("forward", "scaled_matmul_reduce_scatter", backend): 2 * blocks,  # wo, w2
        # the input grad of each gathered input, and each rowwise Linear's output grad gathered
        ("backward", "scaled_matmul_reduce_scatter", backend): 2 * blocks + 1,
        ("backward", "scaled_all_gather_matmul", backend): 2 * blocks,
        # the weight grads' operands: each gathered input's cast shard, each wo/w2 output grad's
        ("backward", "all_gather", backend): 4 * blocks + 1,
    }
    if per_boundary != expected:
        failures.append(f"fused calls {per_boundary}, expected {expected}")
    for phase in ("forward", "backward"):  # the casts whose scales span ranks
        if not counts.get((phase, "amax_all_reduce", backend)):
            failures.append(f"no {phase} amax all-reduce on {backend}")
    return failures


@pytest.mark.parametrize(("world_size", "dtype"), [(2, "bfloat16"), (3, "float32")])
def test_the_llama_converted_with_each_recipe_fuses_every_boundary(worlds, world_size, dtype):
    """tp_kernels' Llama (``LLAMA_LAYERS`` blocks, :func:`_llama_config`) converted with each
    recipe by ``convert_to_float8_training`` without a module filter: every ``nn.Linear`` is a
    Float8Linear (``wq``, ``wk``, ``wv``, ``wo``, ``w1``, ``w2``, ``w3`` of each block and the
    vocabulary ``output``; torchao's automatic filter, which skips dims that are not multiples
    of 16, is applied only when asked for, and every dim here is one anyway). It is
    parallelized by ``llama_tp_plan`` with tp_kernels' styles on each backend and with
    PyTorch's (the same plan from torch's classes), and one step (cross entropy, backward)
    runs both ways: zero fallbacks, and each boundary's fused fp8 call once each way.

    Tolerances against PyTorch's styles. At W=2 in bf16 the loss and every gradient but the fp8
    Linears' weight grads are bit-exact on every backend: the casts are torchao's with the same
    scales (amaxes all-reduced where DTensor's span ranks), each fused GEMM is the same
    ``_scaled_mm`` on the same rows (on CPU, symm's GEMMs are torch's too), and a sum of two
    bf16 partials rounds once either way. A weight grad reduces over the rows, gathered-dim
    first here and batch first in DTensor's GEMM: fp32 accumulation order, then one bf16
    rounding that may land the other way (2^-8 norm-relative at most; 4e-6 measured).

    At W=3 in bf16 nothing is compared: DTensor's reduce-scatter rounds its running sum to bf16
    after each partial where tp_kernels sums them in fp32, and a block output one bf16 step
    apart moves elements across fp8 rounding edges in the next casts; over two blocks the
    gradients drift 3-13% apart (norm-relative) -- measured as far as torchao's unsharded model
    is from torchao under PyTorch's styles, with all three equally far from an unquantized
    float64 run, so no tolerance would tell a defect from it. W=3 runs with fp32 master
    weights instead, where the partials are fp32 (tensorwise) or bf16-valued (row-wise: torchao
    makes row-wise products in bf16) and summed in fp32 both ways: 2^-20 norm-relative for the
    reassociation (measured: row-wise recipes bit-exact, tensorwise 3e-7). One fp32 ulp could
    still flip an fp8 cast of an element sitting on a rounding edge, which would show as a
    larger error; none does with these seeds, and a wrong scale, amax or row shows at 2^-8 or
    more."""
    for recipe in RECIPES:
        for result in worlds(world_size).run(_llama_steps, recipe, dtype):
            assert result["fp8"] == result["linears"], result
            assert len(result["fp8"]) == 7 * LLAMA_LAYERS + 1
            for backend, step in result["steps"].items():
                assert _check_llama(step, result["fp8"], dtype, backend) == [], (recipe, backend)


# Frozen weights and an input without grad: backward skips their work (as
# tests/test_backward_work.py checks of the bf16 path). What needs a grad: (the block's input,
# the frozen Linears).
FROZEN_CASES = {
    "all": (True, ()),
    "frozen_weights": (True, ("w1", "w2", "w3")),  # LoRA-style: only the input grad
    "input_no_grad": (False, ()),
    "w1_frozen": (True, ("w1",)),
    "w2_frozen": (True, ("w2",)),
}
_MATMULS = ("aten::mm", "aten::addmm", "aten::_scaled_mm")


def _runs_a_matmul(event) -> bool:
    return any(c.name in _MATMULS or _runs_a_matmul(c) for c in event.cpu_children)


def _matmul_flops(prof) -> int:
    """2*M*K*N summed over the innermost matmul events (torchao's ``mm`` of its fp8 tensors
    runs a ``_scaled_mm`` inside; the fused ops' GEMMs are ``_scaled_mm``s too)."""
    total = 0
    for event in prof.events():
        if event.name not in _MATMULS or _runs_a_matmul(event):
            continue
        shapes = event.input_shapes[1:] if event.name == "aten::addmm" else event.input_shapes
        (m, k), (_, n) = shapes[0], shapes[1]
        total += 2 * m * k * n
    return total


def _frozen_steps(recipe: str, case: str) -> dict:
    """The SwiGLU block converted with ``recipe``, the Linears of ``case`` frozen: its backward
    under tp_kernels' styles on each backend (the GEMMs it ran, in units of one Linear's GEMM,
    and its counted calls) and every result against PyTorch's styles with the same frozen
    Linears (:func:`_fused_step`'s ``exact`` and ``error``)."""
    # Imported in the ranks: the profiler imports Triton, after conftest set TRITON_INTERPRET.
    from torch.profiler import ProfilerActivity, profile

    input_grad, frozen = FROZEN_CASES[case]
    ours, theirs, x, _ = _block_pair(recipe, torch.bfloat16)
    for model in (ours, theirs):
        for name, p in model.named_parameters():
            p.requires_grad_(name.split(".")[0] not in frozen)

    def step(model: nn.Module) -> tuple:
        """Forward, then backward profiled and counted: the profile and every result."""
        model.zero_grad(set_to_none=True)
        xin = x.clone().requires_grad_(input_grad)
        y = model(xin)
        y = y.to_local() if isinstance(y, DTensor) else y
        loss = y.float().pow(2).sum()
        tpk.reset_comm_stats()  # the backward's calls only
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            loss.backward()
        got = {"output": y.detach(), "input grad": xin.grad}
        got.update((f"{n} grad", p.grad) for n, p in model.named_parameters())
        return prof, {n: t.to_local() if isinstance(t, DTensor) else t
                      for n, t in got.items() if t is not None}  # fmt: skip

    want = step(theirs)[1]
    world = dist.get_world_size()
    gemm = 2 * (B * 8 * world) * H * 64  # every GEMM of this block: [W*m rows] x H x 64
    results = {}
    for backend in ("reference", "pipelined", "symm"):
        with tpk.use_backend(backend):
            prof, got = step(ours)
        counts = dict(tpk.comm_stats())
        results[backend] = {
            "gemms": _matmul_flops(prof) / gemm,
            "counts": counts,
            "grads": sorted(got),
            "exact": {n: torch.equal(got[n], want[n]) for n in want if n in got},
            "error": {n: _norm_error(got[n], want[n]) for n in want if n in got},
        }
    return {"want": sorted(want), "backends": results}


@pytest.mark.parametrize("case", list(FROZEN_CASES))
def test_frozen_weights_and_an_input_without_grad_skip_their_backward_work(worlds, case):
    """The fused fp8 block's backward runs a Linear's weight-grad GEMM (and the gather of its
    cast operand: the colwise input's, w2's output grad's) only for a weight that needs its
    grad, the input-grad GEMMs of w1/w3 and their reduce-scatter only when the block's input
    needs one, and w2's input-grad GEMM with its gather only when anything upstream does. The
    GEMMs that ran are counted by the profiler (every GEMM of this block is one size, so the
    FLOPs count them), the calls by ``comm_stats``: exactly what is needed, on every backend
    (torchao's own backward runs both GEMMs of every Linear, so PyTorch's styles are no gauge
    of the work). The grads that remain are those of torchao under PyTorch's styles with the
    same frozen Linears, within the module docstring's tolerances (W=2)."""
    input_grad, frozen = FROZEN_CASES[case]
    trains = {w: w not in frozen for w in ("w1", "w2", "w3")}
    upstream = input_grad or trains["w1"] or trains["w3"]  # w2's input needs its grad
    gemms = int(upstream) + 2 * int(input_grad) + sum(trains.values())
    expected = {
        ("backward", "scaled_all_gather_matmul"): int(upstream),  # w2's dgrad
        ("backward", "scaled_matmul_reduce_scatter"): int(input_grad),  # w1/w3's dgrad
        # the gathered input's cast for w1/w3's wgrad, w2's output grad's for its wgrad
        ("backward", "all_gather"): int(trains["w1"] or trains["w3"]) + int(trains["w2"]),
    }
    for recipe in RECIPES:
        for result in worlds(2).run(_frozen_steps, recipe, case):
            for backend, got in result["backends"].items():
                where = (recipe, case, backend)
                assert got["gemms"] == gemms, where
                calls = {k[:2]: n for k, n in got["counts"].items() if k[1] != "amax_all_reduce"}
                assert calls == {k: n for k, n in expected.items() if n}, where
                assert got["grads"] == result["want"], where
                assert _numerics_failures(got, recipe, "bfloat16", 2, backend) == [], where
