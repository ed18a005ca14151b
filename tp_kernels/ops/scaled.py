"""The scaled (fp8) fused ops: torch's ``fused_all_gather_scaled_matmul`` and
``fused_scaled_matmul_reduce_scatter`` semantics on every backend.

On rank ``r`` of ``W`` (rows flattened, the gathered/scattered dim first; scales are dequant
multipliers, as ``torch._scaled_mm`` takes them; shapes and the block product in
:mod:`tp_kernels.backends.scaled`)::

    all_gather_scaled_matmul:     C_j = _scaled_mm(cat_s a_s, b_j, cat_s a_scale_s, b_scale_j)
    scaled_matmul_reduce_scatter: out = rows r of sum over s of _scaled_mm(a, b, a_scale, b_scale)

The all-gather moves the fp8 bytes with each row's scale beside them (``K + 16`` bytes a row,
against ``2 K`` for bf16); the reduce-scatter moves ``out_dtype`` partials and sums them in fp32
in rank order. Like torch's, these ops take fp8 tensors, which carry no gradient: the
differentiable fp8 path is :mod:`tp_kernels.float8` (torchao's Float8Linear under the styles),
which quantizes high-precision activations and gradients where torchao does and runs
:func:`gather_scaled` and :func:`reduce_scatter_scaled` forward and backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from tp_kernels import config, deadline
from tp_kernels.backends import base, choice
from tp_kernels.backends.base import Backend, CaptureNeed
from tp_kernels.backends.choice import Choice, Shape
from tp_kernels.backends.scaled import FP8_DTYPES, Scaled, Scaling, pack_rows
from tp_kernels.ops._checks import GroupLike
from tp_kernels.ops.comm_stats import gather_bytes, record
from tp_kernels.ops.layout import flatten_rows, unflatten_rows
from tp_kernels.ops.planning import resolve_group_or_note

__all__ = [
    "all_gather_scaled_matmul",
    "gather_scaled",
    "reduce_scatter_scaled",
    "run_gather",
    "run_reduce_scatter",
    "scaled_backend",
    "scaled_matmul_reduce_scatter",
]

_AG = "scaled_all_gather_matmul"
_RS = "scaled_matmul_reduce_scatter"

# group -> {call key -> the choice}: a Float8Linear asks on every call. Weak, as the plan cache.
_chosen: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, Choice]]
_chosen = weakref.WeakKeyDictionary()
_MAX_CHOSEN_PER_GROUP = 1024


def scaled_backend(
    backend: str | None, group: dist.ProcessGroup, op: str, m: int, k: int, ns: Sequence[int],
    out_dtype: torch.dtype, device: torch.device,
    capture_needs: Callable[[], Sequence[CaptureNeed]] = tuple, *, block_scaled: bool = False,
) -> Backend:  # fmt: skip
    """The backend a scaled call runs on: :mod:`tp_kernels.backends.choice`'s for the unscaled
    call of the same shape class and output dtype (a scaled call times nothing), asked once per
    call key and settings (``use_backend`` included) and kept. Under CUDA graph capture the kept
    choice must capture ``capture_needs()`` (the call's and its backward's buffers), or the choice
    falls back or refuses, as for the unscaled ops. ``block_scaled``: an MXFP8 call."""
    key = (backend, op, m, k, tuple(ns), out_dtype, device, block_scaled, config.settings_key())
    chosen = _chosen.setdefault(group, {})
    kept = chosen.get(key)
    capturing = base.capturing(device)
    if kept is not None and not capturing:
        return kept.impl
    unscaled = "all_gather_matmul" if op == _AG else "matmul_reduce_scatter"
    shape = Shape(unscaled, m, k, tuple(ns), out_dtype, device)
    if capturing:
        return choice.captured(op, kept, shape, group, capture_needs()).impl
    made = choice.choose(backend, shape, group, may_time=False, block_scaled=block_scaled)
    if len(chosen) >= _MAX_CHOSEN_PER_GROUP:
        chosen.clear()
    chosen[key] = made
    return made.impl


def gather_scaled(
    impl: Backend,
    group: dist.ProcessGroup,
    a: torch.Tensor,
    a_scale: torch.Tensor,
    bs: Sequence[torch.Tensor],
    b_scales: Sequence[torch.Tensor],
    *,
    out_dtype: torch.dtype,
    fast_accum: bool,
    phase: str,
    post_scale: bool = False,
) -> list[torch.Tensor]:
    """``[C_j [W*m, N_j]]`` of the shard's fp8 rows ``a [m, K]`` with ``a_scale`` (``[m, 1]``:
    packed beside the rows; ``[]``: the same on every rank) and ``bs[j] [K, N_j]`` with
    ``b_scales[j]``; counted under ``phase`` with the bytes it sends. ``post_scale``: torchao's
    block product (:mod:`tp_kernels.backends.scaled`)."""
    rowwise = a_scale.dim() == 2
    shard = pack_rows(a, a_scale) if rowwise else a.view(torch.uint8)
    scaling = Scaling(
        None if rowwise else a_scale, tuple(b_scales), out_dtype, fast_accum, a.dtype, post_scale
    )
    return run_gather(impl, group, shard, bs, scaling, phase=phase)


def run_gather(
    impl: Backend,
    group: dist.ProcessGroup,
    shard: torch.Tensor,
    bs: Sequence[torch.Tensor],
    scaling: Scaled,
    *,
    phase: str,
) -> list[torch.Tensor]:
    """``[C_j [W*m, N_j]]``: ``scaling``'s products of the gathered ``shard`` (its rows' bytes,
    as :func:`gather_scaled` or ``tp_kernels/mxfp8.py`` packs them) with ``bs[j]``; counted
    under ``phase`` with the bytes it sends."""
    record(phase, _AG, impl.name, sent_bytes=gather_bytes(shard, group))
    with deadline.fused_call(group, _AG, phase):
        _, outs = impl.all_gather_matmul(shard, bs, group, return_a=False, scaling=scaling)
    return outs


def reduce_scatter_scaled(
    impl: Backend,
    group: dist.ProcessGroup,
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    fast_accum: bool,
    phase: str,
    addend: torch.Tensor | None = None,
    post_scale: bool = False,
) -> torch.Tensor:
    """This rank's ``[m, N]`` rows of the sum over ranks of ``scaled(a [W*m, K]) @ scaled(b
    [K, N]) (+ addend [W*m, N], added in ``out_dtype``)``; counted under ``phase`` with the
    partials it sends."""
    scaling = Scaling(a_scale, (b_scale,), out_dtype, fast_accum, a.dtype, post_scale)
    return run_reduce_scatter(impl, group, a, b, scaling, phase=phase, addend=addend)


def run_reduce_scatter(
    impl: Backend,
    group: dist.ProcessGroup,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: Scaled,
    *,
    phase: str,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's rows of the sum over ranks of ``scaling``'s product of ``a [W*m, K]`` and
    ``b [K, N]`` (``+ addend``); counted under ``phase`` with the partials it sends."""
    world = group.size()
    sent = (world - 1) * (a.shape[0] // world) * b.shape[1] * scaling.out_dtype.itemsize
    record(phase, _RS, impl.name, sent_bytes=sent)
    with deadline.fused_call(group, _RS, phase):
        return impl.matmul_reduce_scatter(a, b, group, addend=addend, scaling=scaling)


def _check_operands(
    op: str,
    a: object,
    a_scale: object,
    bs: Sequence[object],
    b_scales: Sequence[object],
    dim: object,
) -> int:
    """``dim`` normalized; raises naming the argument for what ``op`` cannot take."""
    if not isinstance(a, torch.Tensor) or a.dtype not in FP8_DTYPES:
        raise TypeError(f"{op}: a must be an fp8 tensor ({FP8_DTYPES}); got {_what(a)}")
    if not isinstance(dim, int) or not -a.ndim <= dim < a.ndim - 1:
        raise ValueError(f"{op}: dim {dim!r} must be a dim of a's {a.ndim} other than the last")
    k = a.shape[-1]
    if k % 16:
        raise ValueError(f"{op}: a's last dim (K) is {k}; fp8 GEMMs need a multiple of 16")
    if not isinstance(a_scale, torch.Tensor) or a_scale.dtype != torch.float32:
        raise TypeError(f"{op}: a_scale must be an fp32 tensor; got {_what(a_scale)}")
    rowwise_shape = (*a.shape[:-1], 1)
    if a_scale.dim() != 0 and tuple(a_scale.shape) != rowwise_shape:
        raise ValueError(
            f"{op}: a_scale has shape {tuple(a_scale.shape)}; expected [] (tensor-wise) or "
            f"{list(rowwise_shape)} (row-wise)"
        )
    if len(bs) != len(b_scales) or not bs:
        raise ValueError(f"{op}: got {len(bs)} b and {len(b_scales)} b_scales; need one each")
    for j, (b, scale) in enumerate(zip(bs, b_scales)):
        if not isinstance(b, torch.Tensor) or b.dtype not in FP8_DTYPES or b.ndim != 2:
            raise TypeError(f"{op}: b[{j}] must be a 2-D fp8 tensor; got {_what(b)}")
        if b.shape[0] != k:
            raise ValueError(f"{op}: b[{j}] has shape {tuple(b.shape)}; expected [{k}, N]")
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
            raise TypeError(f"{op}: b_scales[{j}] must be an fp32 tensor; got {_what(scale)}")
        if scale.dim() != 0 and tuple(scale.shape) != (1, b.shape[1]):
            raise ValueError(
                f"{op}: b_scales[{j}] has shape {tuple(scale.shape)}; expected [] or "
                f"[1, {b.shape[1]}]"
            )
        if (scale.dim() == 0) != (a_scale.dim() == 0):
            raise ValueError(
                f"{op}: a_scale and b_scales[{j}] must be both tensor-wise or both row-wise"
            )
    named = {"a_scale": a_scale, **{f"b[{j}]": b for j, b in enumerate(bs)}}
    named.update({f"b_scales[{j}]": scale for j, scale in enumerate(b_scales)})
    for name, t in named.items():
        if t.device != a.device:
            raise ValueError(f"{op}: {name} is on {t.device}; expected a's device, {a.device}")
    return dim % a.ndim


def _what(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {t.dtype} tensor of shape {tuple(t.shape)}"
    return type(t).__name__


def all_gather_scaled_matmul(
    a_shard: torch.Tensor,
    bs: Sequence[torch.Tensor],
    a_scale: torch.Tensor,
    b_scales: Sequence[torch.Tensor],
    gather_dim: int,
    group: GroupLike,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = False,
    backend: str | None = None,
) -> list[torch.Tensor]:
    """All-gather the fp8 ``a_shard`` (and its row-wise scales) along ``gather_dim`` and take
    each scaled product with ``bs``.

    On each of the ``W`` ranks, ``a_shard [..., s, ..., K]`` fp8 (``K`` a multiple of 16),
    ``a_scale`` ``[]`` (tensor-wise: the same on every rank) or ``[..., s, ..., 1]`` (row-wise),
    ``bs[j] [K, N_j]`` fp8 and ``b_scales[j]`` ``[]`` or ``[1, N_j]`` (both tensor-wise or both
    row-wise)::

        A, A_scale = cat over ranks of (a_shard, a_scale), along gather_dim
        returns [_scaled_mm(A, b_j, A_scale, b_scale_j, out_dtype, use_fast_accum)]
                                                         each [..., W*s, ..., N_j]

    ``group`` and ``backend`` as :func:`tp_kernels.all_gather_matmul`. Not differentiable (fp8
    tensors carry no gradient; see the module docstring)."""
    op = "all_gather_scaled_matmul"
    pg = resolve_group_or_note(group, op=op)
    dim = _check_operands(op, a_shard, a_scale, bs, b_scales, gather_dim)
    rows, lead = flatten_rows(a_shard, dim)
    scale = a_scale if a_scale.dim() == 0 else flatten_rows(a_scale, dim)[0]
    ns = [b.shape[1] for b in bs]
    impl = scaled_backend(
        backend, pg, _AG, rows.shape[0], rows.shape[1], ns, out_dtype, rows.device
    )
    outs = gather_scaled(
        impl,
        pg,
        rows.contiguous(),
        scale.contiguous(),
        bs,
        b_scales,
        out_dtype=out_dtype,
        fast_accum=use_fast_accum,
        phase="forward",
    )
    gathered_lead = (pg.size() * lead[0], *lead[1:])
    return [unflatten_rows(out, gathered_lead, dim) for out in outs]


def scaled_matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    scatter_dim: int,
    group: GroupLike,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """Take the scaled product of ``a`` and ``b`` and reduce-scatter it along ``scatter_dim``.

    On each of the ``W`` ranks, ``a [..., W*s, ..., K]`` fp8 (``K`` a multiple of 16; ``K`` may
    differ by rank), ``a_scale`` ``[]`` or ``[..., W*s, ..., 1]``, ``b [K, N]`` fp8 and
    ``b_scale`` ``[]`` or ``[1, N]``::

        partial = _scaled_mm(a, b, a_scale, b_scale, out_dtype, use_fast_accum)  # out_dtype
        returns this rank's block of sum over ranks of partial, along scatter_dim
                                                         [..., s, ..., N]

    The partials cross the link in ``out_dtype`` and are summed in fp32 in rank order. Not
    differentiable (see the module docstring)."""
    op = "scaled_matmul_reduce_scatter"
    pg = resolve_group_or_note(group, op=op)
    dim = _check_operands(op, a, a_scale, [b], [b_scale], scatter_dim)
    world = pg.size()
    if a.shape[dim] % world:
        raise ValueError(
            f"{op}: a's dim {dim} has size {a.shape[dim]}, which {world} ranks do not divide"
        )
    rows, lead = flatten_rows(a, dim)
    scale = a_scale if a_scale.dim() == 0 else flatten_rows(a_scale, dim)[0]
    m = rows.shape[0] // world
    impl = scaled_backend(backend, pg, _RS, m, rows.shape[1], [b.shape[1]], out_dtype, a.device)
    out = reduce_scatter_scaled(
        impl,
        pg,
        rows.contiguous(),
        scale.contiguous(),
        b,
        b_scale,
        out_dtype=out_dtype,
        fast_accum=use_fast_accum,
        phase="forward",
    )
    return unflatten_rows(out, (lead[0] // world, *lead[1:]), dim)
