"""The public scaled (fp8) fused ops against ``torch._scaled_mm`` of the gathered operands (on
the CPU, gloo ranks), on every CPU backend; and their argument errors.

The all-gather's product is each gathered row's ``_scaled_mm``: bit for bit on ``reference``
(one ``_scaled_mm`` of the whole gathered A), and on ``pipelined`` and ``symm`` (one per row
block) within one rounding of the output dtype (2^-8 relative for bf16: a CPU GEMM may block
rows differently). The reduce-scatter's sum is in fp32 in rank order over bf16 partials, the
reference's likewise, so one final bf16 rounding (2^-8).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tp_kernels as tpk

E4M3 = torch.float8_e4m3fn


def _operands(world: int, rowwise: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    m, k, n = 6, 32, 48
    a = torch.randn(world, 2, m // 2, k, generator=g).to(E4M3)  # [W, 2, 3, K]: dim 0 gathered
    b = torch.randn(n, k, generator=g).to(E4M3).t()  # column-major [K, N], as _scaled_mm wants
    if rowwise:
        a_scale = torch.rand(world, 2, 3, 1, generator=g) + 0.5
        b_scale = torch.rand(1, n, generator=g) + 0.5
    else:
        a_scale, b_scale = torch.tensor(0.75), torch.tensor(1.25)
    return a, a_scale, b, b_scale


def _all_gather(backend: str, rowwise: bool) -> float:
    world, rank = dist.get_world_size(), dist.get_rank()
    a, a_scale, b, b_scale = _operands(world, rowwise)
    shard_scale = a_scale[rank] if rowwise else a_scale
    (out,) = tpk.all_gather_scaled_matmul(
        a[rank], [b], shard_scale, [b_scale], 0, dist.group.WORLD, backend=backend
    )
    whole = a.reshape(world * 2 * 3, -1)
    scale = a_scale.reshape(-1, 1) if rowwise else a_scale
    want = torch._scaled_mm(whole, b, scale_a=scale, scale_b=b_scale, out_dtype=torch.bfloat16)
    assert out.shape == (world * 2, 3, b.shape[1])
    got = out.reshape(-1, b.shape[1]).float()
    return ((got - want.float()).abs().max() / want.float().abs().max()).item()


def _reduce_scatter(backend: str, rowwise: bool) -> float:
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(1)
    k, n = 32, 16
    a = [torch.randn(world * 4, k, generator=g).to(E4M3) for _ in range(world)]
    b = [torch.randn(n, k, generator=g).to(E4M3).t() for _ in range(world)]
    if rowwise:
        sa = [torch.rand(world * 4, 1, generator=g) + 0.5 for _ in range(world)]
        sb = [torch.rand(1, n, generator=g) + 0.5 for _ in range(world)]
    else:
        sa, sb = [torch.tensor(0.5)] * world, [torch.tensor(2.0)] * world
    out = tpk.scaled_matmul_reduce_scatter(
        a[rank], b[rank], sa[rank], sb[rank], 0, dist.group.WORLD, backend=backend
    )
    partials = [
        torch._scaled_mm(a[s], b[s], scale_a=sa[s], scale_b=sb[s], out_dtype=torch.bfloat16)
        for s in range(world)
    ]
    want = sum(p.float() for p in partials)[rank * 4 : (rank + 1) * 4]
    return ((out.float() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("backend", ["reference", "pipelined", "symm"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_scaled_ops_are_scaled_mm_of_the_gathered_or_summed_operands(worlds, backend, world_size):
    for rowwise in (True, False):
        for error in worlds(world_size).run(_all_gather, backend, rowwise):
            assert error == 0.0 if backend == "reference" else error <= 2**-8, (rowwise, error)
        for error in worlds(world_size).run(_reduce_scatter, backend, rowwise):
            assert error <= 2**-8, (rowwise, error)


def test_scaled_op_errors_name_the_argument(worlds):
    worlds(1).run(_bad_calls)


def _bad_calls() -> None:
    a = torch.zeros(4, 32).to(E4M3)
    b = torch.zeros(32, 16).to(E4M3)
    one = torch.tensor(1.0)
    with pytest.raises(TypeError, match="a must be an fp8 tensor"):
        tpk.all_gather_scaled_matmul(a.float(), [b], one, [one], 0, None)
    with pytest.raises(ValueError, match=r"a_scale has shape \(4, 2\)"):
        tpk.all_gather_scaled_matmul(a, [b], torch.ones(4, 2), [one], 0, None)
    with pytest.raises(ValueError, match="multiple of 16"):
        tpk.all_gather_scaled_matmul(a[:, :24], [b[:24]], one, [one], 0, None)
    with pytest.raises(ValueError, match="both tensor-wise or both row-wise"):
        tpk.scaled_matmul_reduce_scatter(a, b, one, torch.ones(1, 16), 0, None)
    # A scale on another device (meta stands for a CUDA one here): said before any communication.
    with pytest.raises(ValueError, match=r"b_scales\[0\] is on meta; expected a's device, cpu"):
        tpk.all_gather_scaled_matmul(a, [b], one, [torch.tensor(1.0, device="meta")], 0, None)
