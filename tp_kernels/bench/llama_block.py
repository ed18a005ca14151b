"""The ``llama_block`` benchmark: forward and backward of one tensor-parallel Llama block.

One step on rank ``r`` of ``W`` ranks, with ``T = B*S`` tokens, head dim ``d = D/H``::

    x    [B, S/W, D]   rank r's sequence shard of a fixed random x [B, S, D]
    out  [B, S/W, D] = block(x, rope)       a TransformerBlock of tp_kernels.models.Llama,
                                            parallelized by the block entries of llama_tp_plan
                                            (sequence parallel: gather before attention and the
                                            feed-forward, reduce-scatter after wo and w2)
    loss = sum(out * g)                     g [B, S/W, D]: rank r's shard of a fixed random g
    loss.backward()                         gradients are reset to None before every step

Sizes (``BenchConfig.sizes`` keys, defaults in :data:`DEFAULT_SIZES`; ``--M/--K/--N`` are not
used): ``batch`` B, ``seq`` S, ``dim`` D, ``heads`` H, ``kv_heads``, ``ffn`` F. The block comes from
a one-layer ``Llama(seed=cfg.seed)``, so every provider gets a copy with the same weights.

Providers (the baseline is ``torch``: the check and the speedup column are against it):

* ``torch``: the block parallelized with PyTorch's styles (``llama_tp_plan(styles="torch")``);
* ``reference``, ``pipelined``, ``symm``: tp_kernels' styles with that backend, when
  ``tp_kernels.available_backends()`` says ``"ok"``; ``auto``: tp_kernels' automatic choice;
* ``roof``: the same step with no communication: an unsharded block holding rank ``r``'s weight
  shards (``H/W`` heads, ``F/W`` hidden units), run on the full ``[B, S, D]`` input. It does the
  same matmuls as a tensor-parallel rank; only its norms and residual adds cover ``S`` tokens
  instead of ``S/W``. Timed, not checked.

Flops per rank and step (for GFLOP/s), the usual 3x the forward's matmul flops::

    3 * (2*T*D*(2*H*d + 2*kv_heads*d + 3*F) + 2*B*S^2*d*H) / W

(the projections ``wq, wk, wv, wo`` and ``w1, w3, w2``, then ``q k^T`` and ``p v`` over the causal
half). The ``tokens/s`` column is ``T / median``: the global batch's tokens, which the ``W`` ranks
process together in one step.

Correctness: each provider's loss, ``x``'s gradient and the local gradients of ``wq, wo, w1, w2``
and ``ffn_norm`` on every rank must be ``allclose`` to ``torch``'s with ``rtol = atol = tol``,
``tol = max(2 * e, 2 * eps(dtype))``, where ``e = max |torch - exact| / (1 + |exact|)`` over those
tensors and ranks is the baseline's own rounding error, measured against the same step in float64
(same dtype-rounded weights and inputs, exact RoPE tables). The providers only reorder sums
(split matmuls, another reduction order), so they err about as much as ``torch``, possibly in the
other direction: hence twice ``e``; the floor covers a baseline that happens to round almost
exactly.

Memory (one extra step per provider, after the timing, one provider at a time; the maximum over
ranks):

* ``saved MiB``: the bytes of the distinct storages that autograd keeps for the backward (seen by
  ``torch.autograd.graph.saved_tensors_hooks``; a DTensor counts its local tensor), minus the
  storages that exist before the step (parameters, ``x``, ``g``, the RoPE tables). That is the
  activation memory held between forward and backward, which sequence parallelism is about; it
  leaves out transient buffers (communication buffers, the symmetric heap, backward temporaries)
  and the gradients.
* ``peak MiB`` (CUDA only): ``torch.cuda.max_memory_allocated`` during the step minus
  ``torch.cuda.memory_allocated`` before it, after ``reset_peak_memory_stats``: everything the
  caching allocator handed out for the step, gradients and buffers included.

The same step also records ``comm``: the :func:`tp_kernels.comm_stats` calls it made, keyed
``"phase/kind/backend"`` (empty for ``torch`` and ``roof``, which run no tp_kernels op).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel as torch_tp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import tp_kernels
from tp_kernels import cost
from tp_kernels.bench.model import block_prediction
from tp_kernels.bench.op_case import FUSED_BACKENDS, runnable_backends
from tp_kernels.bench.protocol import ROOF, BenchCase, BenchConfig, register
from tp_kernels.models.llama import Llama, LlamaConfig, TransformerBlock, rope_tables
from tp_kernels.models.plans import check_tp_compatible, llama_tp_plan

__all__ = ["BASELINE", "DEFAULT_SIZES", "LLAMA_PROVIDERS", "block_flops", "llama_block"]

BASELINE = "torch"
LLAMA_PROVIDERS = (BASELINE, *FUSED_BACKENDS, "auto", ROOF)

# One step is 5.4 GFLOP per rank on two ranks, ~0.3 s on a shared 2-core machine (so the default
# run of every provider stays well under a minute); Llama's FFN width (8/3 D rounded up to a
# multiple of 256) and head dim 64.
DEFAULT_SIZES: dict[str, int] = {
    "batch": 2,
    "seq": 256,
    "dim": 512,
    "heads": 8,
    "kv_heads": 8,
    "ffn": 1536,
}

# The gradients compared by the correctness check: one colwise and one rowwise Linear of each
# sub-block, and a norm (its weight gradient is a per-rank partial sum under sequence parallelism).
CHECKED_GRADS = (
    "attention.wq.weight",
    "attention.wo.weight",
    "feed_forward.w1.weight",
    "feed_forward.w2.weight",
    "ffn_norm.weight",
)
_BLOCK_KEYS = "layers.*."
_MIB = float(2**20)


def block_flops(
    batch: int, seq: int, dim: int, heads: int, kv_heads: int, ffn: int, world: int
) -> float:
    """Flops of one forward + backward step on one of ``world`` ranks (see the module docstring)."""
    d = dim // heads
    tokens = batch * seq
    projections = 2 * tokens * dim * (2 * heads * d + 2 * kv_heads * d + 3 * ffn)
    attention = 2 * batch * seq * seq * d * heads
    return 3.0 * (projections + attention) / world


def _sizes(cfg: BenchConfig) -> dict[str, int]:
    unknown = sorted(set(cfg.sizes) - set(DEFAULT_SIZES))
    if unknown:
        raise ValueError(
            f"llama_block: unknown sizes {unknown} in BenchConfig.sizes; expected keys from "
            f"{list(DEFAULT_SIZES)}"
        )
    sizes = {**DEFAULT_SIZES, **cfg.sizes}
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError(f"llama_block: sizes must be positive ints, got {bad}")
    return sizes


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding ``t``'s data; a tensor subclass (DTensor) is looked through."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        inner = [getattr(t, attr) for attr in attrs]
        return [s for i in inner if isinstance(i, torch.Tensor) for s in _storages(i)]
    return [t.untyped_storage()]


@dataclass
class _Step:
    """One provider: ``step()`` runs forward + backward and returns the loss, ``x``'s gradient
    and the local gradients of the parameters named in ``checked``."""

    block: nn.Module
    x: torch.Tensor
    g: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]
    checked: tuple[str, ...] = CHECKED_GRADS

    def __call__(self) -> list[torch.Tensor]:
        self.block.zero_grad(set_to_none=True)
        x = self.x.detach().requires_grad_()
        loss = (self.block(x, self.rope) * self.g).sum()
        loss.backward()
        grads = [_local(self.block.get_parameter(name).grad) for name in self.checked]
        return [loss.detach(), x.grad, *grads]

    def resident(self) -> list[torch.Tensor]:
        """Tensors alive before a step: not activation memory when autograd saves them."""
        return [*self.block.parameters(), *self.block.buffers(), self.x, self.g, *self.rope]


def _saved_bytes(step: _Step) -> int:
    """Bytes of the distinct non-resident storages autograd saves during one ``step()``."""
    resident = {s.data_ptr() for t in step.resident() for s in _storages(t)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        for s in _storages(t):
            if s.data_ptr() not in resident:
                saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    saved.pop(0, None)  # empty storages
    return sum(saved.values())


def _probe(step: _Step, group: dist.ProcessGroup, device: torch.device) -> dict[str, Any]:
    """``saved_mib``, on CUDA ``peak_mib`` (maxima over ranks), and ``comm`` of one step."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    stats = tp_kernels.comm_stats()
    saved = _saved_bytes(step)
    comm = tp_kernels.comm_stats() - stats
    values = [float(saved)]
    if cuda:
        torch.cuda.synchronize(device)
        values.append(float(torch.cuda.max_memory_allocated(device) - before))
    agreed = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    mib = (agreed / _MIB).cpu().tolist()
    out: dict[str, Any] = {"saved_mib": mib[0]}
    if cuda:
        out["peak_mib"] = mib[1]
    out["comm"] = {"/".join(key): n for key, n in sorted(comm.items())}
    return out


def _block_plan(model: Llama, **plan_kwargs: Any) -> dict[str, torch_tp.ParallelStyle]:
    """The per-block entries of ``llama_tp_plan(model, **plan_kwargs)``, keyed inside the block."""
    plan = llama_tp_plan(model, **plan_kwargs)
    return {k.removeprefix(_BLOCK_KEYS): v for k, v in plan.items() if k.startswith(_BLOCK_KEYS)}


def _roof_block(base: TransformerBlock, model: Llama, world: int, rank: int) -> TransformerBlock:
    """A plain copy of ``base`` holding rank ``rank``'s shard of every Linear the plan splits."""
    block = copy.deepcopy(base)
    for key, style in _block_plan(model, styles="torch").items():
        if isinstance(style, torch_tp.ColwiseParallel):
            dim = 0
        elif isinstance(style, torch_tp.RowwiseParallel):
            dim = 1
        else:
            continue
        linear = block.get_submodule(key)
        linear.weight = nn.Parameter(linear.weight.detach().chunk(world, dim)[rank].clone())
    return block


def _own_error(got: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    """``max |got - exact| / (1 + |exact|)`` over every element of every tensor."""
    return max(
        ((g.double() - e).abs() / (1.0 + e.abs())).max().item()
        for g, e in zip(got, exact, strict=True)
    )


@register("llama_block", providers=LLAMA_PROVIDERS)
def llama_block(cfg: BenchConfig, group: dist.ProcessGroup, device: torch.device) -> BenchCase:
    """Forward + backward of one sequence-parallel Llama block; see the module docstring."""
    sizes = _sizes(cfg)
    world, rank = group.size(), group.rank()
    b, s, dim = sizes["batch"], sizes["seq"], sizes["dim"]
    # vocab_size=world: the model's embedding and output are never used, only kept divisible.
    config = LlamaConfig(
        vocab_size=world,
        dim=dim,
        n_layers=1,
        n_heads=sizes["heads"],
        n_kv_heads=sizes["kv_heads"],
        ffn_hidden_dim=sizes["ffn"],
        max_seq_len=s,
    )
    check_tp_compatible(config, world, seq_len=s)
    dtype = cfg.torch_dtype
    model = Llama(config, seed=cfg.seed, device=device, dtype=dtype)
    base = model.layers["0"]
    rope = (model.rope_cos, model.rope_sin)
    mesh = DeviceMesh.from_group(group, device.type)

    gen = torch.Generator().manual_seed(cfg.seed + 1)
    x_full = torch.randn(b, s, dim, generator=gen).to(device=device, dtype=dtype)
    g_full = torch.randn(b, s, dim, generator=gen).to(device=device, dtype=dtype)
    x, g = (t.chunk(world, dim=1)[rank].contiguous() for t in (x_full, g_full))

    def parallel(dtype_: torch.dtype = dtype, **plan_kwargs: Any) -> nn.Module:
        block = copy.deepcopy(base).to(dtype_)
        return tp_kernels.parallelize_module(block, mesh, _block_plan(model, **plan_kwargs))

    steps: dict[str, _Step] = {BASELINE: _Step(parallel(styles="torch"), x, g, rope)}
    runnable, skipped = runnable_backends(group, device)
    for backend in runnable:
        steps[backend] = _Step(parallel(backend=backend), x, g, rope)
    steps["auto"] = _Step(parallel(backend="auto"), x, g, rope)
    steps[ROOF] = _Step(_roof_block(base, model, world, rank), x_full, g_full, rope)

    exact_rope = tuple(t.to(device) for t in rope_tables(config.head_dim, s, config.rope_theta))
    f64 = torch.float64
    exact = _Step(parallel(f64, styles="torch"), x.to(f64), g.to(f64), exact_rope)
    err = torch.tensor(_own_error(steps[BASELINE](), exact()), dtype=f64, device=device)
    dist.all_reduce(err, op=dist.ReduceOp.MAX, group=group)
    del exact
    tolerance = max(2.0 * err.item(), 2.0 * torch.finfo(dtype).eps)

    local_heads = config.n_heads * config.head_dim // world
    local_kv = config.n_kv_heads * config.head_dim // world

    def probe(name: str) -> dict[str, Any]:
        return _probe(steps[name], group, device)

    spec = cost.device_spec(device)
    predicted, note = {}, f"no description of {device} in tp_kernels.cost"
    if spec is not None:
        dims = dict(dim=dim, heads=sizes["heads"], kv_heads=sizes["kv_heads"], ffn=sizes["ffn"])
        block_s = block_prediction(dims, world, b * s, cfg.dtype, spec)
        predicted = {p: block_s[p] * 1e3 for p in (*runnable, ROOF)}
        predicted[BASELINE] = block_s["reference"] * 1e3  # DTensor: collective, then matmul
        predicted["auto"] = min(predicted[p] for p in runnable)
        note = (
            f"tp_kernels.cost for {spec.name}: the block's Linears only (forward, backward, "
            "weight gradients); attention's own math and the norms are not modeled"
        )
    columns = {"saved_mib": "saved MiB"}
    if device.type == "cuda":
        columns["peak_mib"] = "peak MiB"
    return BenchCase(
        name="llama_block",
        flops=block_flops(
            b, s, dim, config.n_heads, config.n_kv_heads, config.ffn_hidden_dim, world
        ),
        shapes={
            "x": list(x.shape),
            "wq": [local_heads, dim],
            "wk": [local_kv, dim],
            "w1": [config.ffn_hidden_dim // world, dim],
            "out": list(x.shape),
        },
        providers=dict(steps),
        tolerance=tolerance,
        skipped=skipped,
        baseline=BASELINE,
        rate=("tokens", float(b * s)),
        probe=probe,
        probe_columns=columns,
        predicted_ms=predicted,
        model_note=note,
    )
