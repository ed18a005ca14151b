"""torchao's Float8Linear under tp_kernels' styles: PyTorch's results bit for bit, every unfused
boundary counted; and the fact the fused fp8 all-gather will rest on.

tp_kernels does not fuse fp8 Linears yet (issue 27): a Float8Linear is a Linear subclass with its
own forward, so its colwise and rowwise boundaries take PyTorch's DTensor path, where torchao's
own TP handling runs (its amax all-reduces where a scale spans ranks). What must hold meanwhile:
a SwiGLU TP block converted with each of torchao's recipes gives, under tp_kernels' styles, the
output and every gradient PyTorch's styles give, bit for bit, and each boundary that took
PyTorch's path is counted: the block's gather (its children are Float8Linears, which it does not
group) and ``w2``'s reduce-scatter.
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


def _plan(styles) -> dict:
    return {
        "": styles.PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "w1": styles.ColwiseParallel(),
        "w3": styles.ColwiseParallel(),
        "w2": styles.RowwiseParallel(output_layouts=Shard(1)),
    }


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_()
    y = model(x)
    y = y.to_local() if isinstance(y, DTensor) else y
    y.float().pow(2).sum().backward()
    return (y.detach(), x.grad, *(p.grad.to_local() for p in model.parameters()))


def _compare(recipe: str, dtype_name: str) -> list[str]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    warnings.filterwarnings("ignore", module="torchao")
    dtype = getattr(torch, dtype_name)
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    base = SwiGLU(H, 64 * world).to(dtype)
    convert_to_float8_training(base, config=Float8LinearConfig.from_recipe_name(recipe))
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    ours = tpk.parallelize_module(copy.deepcopy(base), mesh, _plan(tpk))
    theirs = torch_tp.parallelize_module(copy.deepcopy(base), mesh, _plan(torch_tp))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, 8 * world, H, generator=g).to(dtype).chunk(world, dim=1)[rank]
    tpk.reset_comm_stats()
    got = _step(ours, x)
    counts = dict(tpk.comm_stats())
    want = _step(theirs, x)
    names = ["output", "input grad", *(f"{n} grad" for n, _ in ours.named_parameters())]
    failures = [f"{n} differs" for n, a, b in zip(names, got, want) if not torch.equal(a, b)]
    if counts != {("forward", "fallback", "torch"): 2}:
        failures.append(f"counts {counts}: expected the gather's and w2's fallbacks only")
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_block_is_pytorch_s_bit_for_bit_and_counted(worlds, world_size, recipe):
    for dtype in ("bfloat16", "float32"):
        for failures in worlds(world_size).run(_compare, recipe, dtype):
            assert failures == [], (recipe, dtype)


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
