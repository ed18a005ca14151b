"""The math of each fused op and of its backward on one backend, written once.

Both ways into a fused op run these functions: the eager ``autograd.Function``\\ s of
``ops/eager.py`` (the cheap host path) and the ``torch.library`` custom ops of ``ops/library.py``
(torch.compile and dispatch modes). Shapes as in ``backends/base.py``, on rank ``r`` of ``W``:

================================  =========================================================
all-gather-matmul forward         ``A = all_gather(a_shard) [W*m, K]``; ``C_j = A @ b_j``
  dgrad (``need_a``)              ``d a_shard = reduce_scatter(cat_j dC_j @ cat_j b_j^T + dA)``
  wgrad (``need_b[j]``)           ``d b_j = A^T @ dC_j`` (``A`` saved, or gathered again while
                                  the reduce-scatter runs)
matmul-reduce-scatter forward     ``C = reduce_scatter(a @ b) [m, N]`` (``/ W`` when avg)
                                  ``+ bias`` (added once)
  dgrad (``need_a``)              ``G = all_gather(dC) [W*m, N]`` fused with ``d a = G @ b^T``
  wgrad (``need_b``)              ``d b = a^T @ G``                  (both ``/ W`` when avg)
  bias (``need_bias``)            ``d bias = sum of G's rows``
================================  =========================================================

Backward computes only the gradients asked for: no reduce-scatter when ``a_shard`` needs no
grad, no re-gather of ``A`` (or of ``dC``) when no weight (or bias) needs one. Calls are counted
in :func:`tp_kernels.comm_stats` here, where they run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tp_kernels.backends.base import Backend
from tp_kernels.ops.stats import record


def all_gather_matmul(
    impl: Backend,
    a_shard: torch.Tensor,
    bs: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    keep_a: bool,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """``(A if keep_a else None, [A @ b for b in bs])``."""
    record("forward", "all_gather_matmul", impl.name)
    return impl.all_gather_matmul(a_shard.contiguous(), bs, group, return_a=keep_a)


@dataclass(frozen=True)
class ArrivedGrads:
    """What an all-gather-matmul's backward received and must compute: ``grad_a`` (``dA`` or
    None), ``used`` (the indices ``j`` whose ``dC_j`` arrived) with ``grad_outs`` (those
    ``dC_j``, contiguous) and ``need_b`` (whether each of them needs its weight grad), and
    ``need_a`` (the input grad, when it is wanted and some grad arrived)."""

    grad_a: torch.Tensor | None
    used: list[int]
    grad_outs: list[torch.Tensor]
    need_b: list[bool]
    need_a: bool

    @property
    def nothing_to_do(self) -> bool:
        return not self.need_a and not any(self.need_b)


def arrived_grads(
    grads: Sequence[torch.Tensor | None],
    a_out: bool,
    need_a: bool,
    need_b: Sequence[bool],
    flatten: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.contiguous,
) -> ArrivedGrads:
    """Sort a backward's incoming ``grads`` (``dA`` first when ``a_out``, then each ``dC_j``,
    None for an output nobody used) by what forward's ``need_a``/``need_b`` asked;
    ``flatten`` brings each to the 2-D rows the math takes."""
    grad_a = grads[0] if a_out else None
    grad_outs = grads[1:] if a_out else grads
    used = [j for j, g in enumerate(grad_outs) if g is not None]
    return ArrivedGrads(
        None if grad_a is None else flatten(grad_a),
        used,
        [flatten(grad_outs[j]) for j in used],
        [need_b[j] for j in used],
        need_a and (bool(used) or grad_a is not None),
    )


def all_gather_matmul_backward(
    impl: Backend,
    group: dist.ProcessGroup,
    a: torch.Tensor | None,
    a_is_gathered: bool,
    bs: Sequence[torch.Tensor],
    grad_outs: Sequence[torch.Tensor],
    grad_a: torch.Tensor | None,
    need_a: bool,
    need_b: Sequence[bool],
    as_weights: bool = False,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """``(d a_shard or None, [d b_j or None])`` for the ``grad_outs`` given (``dC_j``, each
    ``[W*m, N_j]``, with ``bs[j]`` and ``need_b[j]`` beside it; ``bs`` may be empty when
    ``need_a`` is false). ``a`` is the saved shard ``[m, K]`` or, with ``a_is_gathered``, the
    saved ``A``; it is read only for a weight grad. ``grad_a``: ``dA`` or None. With
    ``as_weights`` the weight grads are those of Linear weights ``w_j = b_j^T``: ``d w_j =
    dC_j^T @ A`` ``[N_j, K]``, row-major as autograd lays out a parameter's grad."""
    pending = None
    if any(need_b) and not a_is_gathered:
        # The gather of A for the weight grads runs while the fused matmul-reduce-scatter
        # computes the input grad.
        record("backward", "all_gather", impl.name)
        pending = impl.all_gather_async(a.contiguous(), group)
    grad_a_shard = None
    if need_a:
        if grad_outs:
            grad_cat = torch.cat(list(grad_outs), dim=1) if len(grad_outs) > 1 else grad_outs[0]
            b_cat = torch.cat(list(bs), dim=1) if len(bs) > 1 else bs[0]
        else:  # only the returned A was used: reduce-scatter dA alone
            grad_cat = grad_a.new_zeros((grad_a.shape[0], 0))
            b_cat = grad_a.new_zeros((grad_a.shape[1], 0))
        record("backward", "matmul_reduce_scatter", impl.name)
        grad_a_shard = impl.matmul_reduce_scatter(
            grad_cat.contiguous(), b_cat.t(), group, addend=grad_a
        )
    gathered = a if pending is None else pending.wait()
    grad_bs = [
        (g.t() @ gathered if as_weights else gathered.t() @ g) if need else None
        for g, need in zip(grad_outs, need_b)
    ]
    return grad_a_shard, grad_bs


def matmul_reduce_scatter(
    impl: Backend,
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup,
    avg: bool,
) -> torch.Tensor:
    """This rank's ``[m, N]`` slice of ``sum over ranks of a @ b`` (``/ W`` when ``avg``),
    ``+ bias``."""
    record("forward", "matmul_reduce_scatter", impl.name)
    out = impl.matmul_reduce_scatter(a.contiguous(), b, group)
    if avg:
        out.div_(group.size())
    return out if bias is None else out.add_(bias)


def matmul_reduce_scatter_backward(
    impl: Backend,
    group: dist.ProcessGroup,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    grad: torch.Tensor,
    avg: bool,
    need_a: bool,
    need_b: bool,
    need_bias: bool,
    as_weight: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(d a, d b, d bias)``, each None unless asked for; ``a`` is read only for ``d b`` and
    ``b`` only for ``d a``. With ``as_weight``, ``d w = G^T @ a`` ``[N, K]`` for the Linear
    weight ``w = b^T`` in place of ``d b``."""
    keep_gathered = need_b or need_bias
    grad_a = gathered = None
    if need_a:
        record("backward", "all_gather_matmul", impl.name)
        gathered, (grad_a,) = impl.all_gather_matmul(
            grad.contiguous(), [b.t()], group, return_a=keep_gathered
        )
    elif keep_gathered:
        record("backward", "all_gather", impl.name)
        gathered = impl.all_gather_async(grad.contiguous(), group).wait()
    grad_b = (gathered.t() @ a if as_weight else a.t() @ gathered) if need_b else None
    if avg:
        for g in (grad_a, grad_b):
            if g is not None:
                g.div_(group.size())
    grad_bias = gathered.sum(0) if need_bias else None
    return grad_a, grad_b, grad_bias
