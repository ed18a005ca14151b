"""The public fused ops: argument checks, dim handling and backend choice around the custom ops."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tp_kernels import deadline
from tp_kernels.backends import check_backend_name, choose, get_backend, pipelined
from tp_kernels.backends.auto import Candidates, Shape, time_and_choose
from tp_kernels.ops._checks import (
    GroupLike,
    agree_across_ranks,
    check_all_gather_matmul,
    check_matmul_reduce_scatter,
    resolve_group_or_note,
)
from tp_kernels.ops.library import (
    all_gather_matmul_2d,
    count_as_replaced_collectives,
    matmul_reduce_scatter_2d,
)

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]


@dataclass(frozen=True)
class Signature:
    """What every rank of the group must agree on for one fused call; its text is compared.

    Sizes that may differ per rank (a colwise weight's uneven N, a rowwise weight's uneven K) are
    left out; the per-rank settings that change the protocol are in: the backend and the
    pipelined block count (which ``auto`` may time even where it then picks another backend).
    """

    op: str
    a_shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    dim: int
    num_rhs: int
    backend: str
    options: tuple[tuple[str, object], ...]
    chunks: int | None

    def __str__(self) -> str:
        return (
            f"{self.op} a={self.a_shape} {self.dtype} {self.device} dim={self.dim} "
            f"rhs={self.num_rhs} backend={self.backend} {dict(self.options)} chunks={self.chunks}"
        )


@dataclass(frozen=True)
class _Prepared:
    """A call after :func:`_prepare`: checked arguments, the backend, and what ``auto`` wants
    timed (``None``: nothing)."""

    a: torch.Tensor
    rhs: list[torch.Tensor]
    dim: int
    backend: str
    shape: Shape | None
    pending: Candidates | None


def _prepare(
    op: str,
    group: dist.ProcessGroup,
    a: object,
    backend: str | None,
    local_check: Callable[[], tuple[torch.Tensor, list[torch.Tensor], int]],
    options: dict[str, object],
) -> _Prepared:
    """Check locally, choose the backend, agree across ranks, raise: in that order, on every rank.

    A rank whose check fails still takes part in the agreement (with its error as its signature),
    so every rank raises together and none is left waiting. When ``auto`` wants the shape class
    timed, the candidates come back and the caller times them after the agreement (every rank
    then knows the others make the same call). While torch.compile traces, the checks stay local
    and the choice of backend is left to the op at run time (``""`` or the name asked for, see
    ``library.py``): the registry's state (context, environment, availability probes) is not
    traceable.
    """
    if torch.compiler.is_compiling():
        name = check_backend_name(backend, argument="backend") if backend is not None else ""
        return _Prepared(*local_check(), name, None, None)
    count_as_replaced_collectives()
    with deadline.fused_call(group, op, "forward"):
        try:
            t, rhs, dim = local_check()
            if op == "all_gather_matmul":
                shape, agreed = Shape.of_all_gather_matmul(t, rhs), tuple(t.shape)
            else:
                shape = Shape.of_matmul_reduce_scatter(t, rhs[0], group.size())
                agreed = tuple(t.shape[:-1])  # K may differ by rank (an uneven rowwise split)
                options = {"n": rhs[0].shape[1], **options}
            name, pending = choose(backend, shape, group)
            chunks = pipelined.chunks_setting()
            signature = Signature(
                op,
                agreed,
                t.dtype,
                t.device.type,
                dim,
                len(rhs),
                name,
                tuple(options.items()),
                chunks,
            )
            error = None
        except (TypeError, ValueError, RuntimeError) as exc:
            signature, error = f"error: {exc}", exc
        agree_across_ranks(group, op, str(signature), _device_of(a))
        if error is not None:
            raise error
    return _Prepared(t, rhs, dim, name, shape, pending)


def _row_major(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` (the gathered or scattered dim first, as the backends lay rows out rank-major) with
    that dim moved back to ``dim``, row-major, as PyTorch's collectives and matmuls return it:
    callers ``.view()`` results (``logits.view(-1, vocab)``). For ``dim == 0`` nothing moves; for
    another dim this is one copy of the output, O(M*N) against the matmul's O(M*N*K), that rank-
    major rows cannot avoid."""
    return t if dim == 0 else t.movedim(0, dim).contiguous()


def _as_rhs_list(args: tuple[torch.Tensor, torch.Tensor, int]) -> tuple:
    a, b, dim = args
    return a, [b], dim


def _device_of(t: object) -> torch.device:
    return t.device if isinstance(t, torch.Tensor) else torch.device("cpu")


def all_gather_matmul(
    a_shard: torch.Tensor,
    bs: Sequence[torch.Tensor],
    gather_dim: int,
    group: GroupLike,
    *,
    backend: str | None = None,
    return_a: bool = False,
    save_gathered_a: bool = False,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """All-gather ``a_shard`` along ``gather_dim`` and multiply the result by each of ``bs``.

    On each of the ``W`` ranks of ``group``, with ``a_shard`` of shape ``[..., s, ..., K]``
    (``s`` at ``gather_dim``, any dim but the last) and ``bs[j]`` of shape ``[K, N_j]``::

        a = cat([a_shard of rank 0, ..., rank W-1], dim=gather_dim)     [..., W*s, ..., K]
        returns (a if return_a else None, [a @ b for b in bs])          [..., W*s, ..., N_j]

    Differentiable in ``a_shard`` and every ``b``. Backward: ``d a_shard`` is one fused
    matmul-reduce-scatter of ``cat(d out_j) @ cat(bs)^T`` (plus ``d a`` when ``a`` was returned
    and used); ``d b_j = a^T @ d out_j``. ``save_gathered_a=False`` (default) keeps only the shard
    for backward and gathers it again there, overlapped with the reduce-scatter: ``W`` times less
    saved memory than keeping ``a``; ``True`` saves ``a`` and skips that gather.

    ``group``: a ProcessGroup, a 1-D DeviceMesh, a group name or None (the default group).
    ``backend``: ``"reference"``, ``"pipelined"``, ``"symm"``, ``"auto"`` or ``None`` (the current
    default, see :func:`tp_kernels.set_backend`). Mirrors
    ``torch.ops.symm_mem.fused_all_gather_matmul``.
    """
    op = "all_gather_matmul"
    pg = resolve_group_or_note(group, op=op)
    call = _prepare(
        op,
        pg,
        a_shard,
        backend,
        lambda: check_all_gather_matmul(a_shard, bs, gather_dim),
        {"return_a": return_a, "save": save_gathered_a},
    )
    a, bs, dim, name = call.a, call.rhs, call.dim, call.backend
    world = pg.size()
    lead = a.movedim(dim, 0)
    rows_shape = lead.shape[:-1]
    a_2d = lead.reshape(-1, a.shape[-1])
    if call.pending is not None:
        keep_a = return_a or save_gathered_a
        name = time_and_choose(
            call.shape,
            pg,
            call.pending,
            lambda n: get_backend(n).all_gather_matmul(a_2d.contiguous(), bs, pg, return_a=keep_a),
        )
    results = all_gather_matmul_2d(a_2d, list(bs), pg.group_name, name, return_a, save_gathered_a)

    def unflatten(t: torch.Tensor) -> torch.Tensor:
        return _row_major(t.view(world * rows_shape[0], *rows_shape[1:], t.shape[-1]), dim)

    outs = [unflatten(t) for t in results[-len(bs) :]]
    return (unflatten(results[0]) if return_a else None), outs


def matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    scatter_dim: int,
    group: GroupLike,
    *,
    reduce_op: str = "sum",
    backend: str | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multiply ``a`` by ``b`` and reduce-scatter the product along ``scatter_dim``.

    On each of the ``W`` ranks of ``group``, with ``a`` of shape ``[..., M, ..., K]`` (``M`` at
    ``scatter_dim``, any dim but the last, divisible by ``W``) and ``b`` of shape ``[K, N]``::

        c = sum over ranks of (a @ b)   (mean when reduce_op="avg")      [..., M, ..., N]
        returns this rank's slice of c along scatter_dim (+ bias)        [..., M/W, ..., N]

    ``bias`` (optional, ``[N]``, the same on every rank) is added once, after the reduction: the
    replicated bias of a rowwise-parallel Linear. Differentiable in ``a``, ``b`` and ``bias``.
    Backward: ``g = all_gather(d out)`` fused with ``d a = g @ b^T`` (one all-gather-matmul),
    ``d b = a^T @ g`` and ``d bias = g`` summed over its rows (no extra communication).
    Mirrors ``torch.ops.symm_mem.fused_matmul_reduce_scatter``.
    """
    op = "matmul_reduce_scatter"
    pg = resolve_group_or_note(group, op=op)
    call = _prepare(
        op,
        pg,
        a,
        backend,
        lambda: _as_rhs_list(check_matmul_reduce_scatter(a, b, scatter_dim, reduce_op, pg, bias)),
        {"reduce_op": reduce_op, "bias": bias is not None},
    )
    a, (b,), dim, name = call.a, call.rhs, call.dim, call.backend
    lead = a.movedim(dim, 0)
    rows_shape = lead.shape[:-1]
    a_2d = lead.reshape(-1, a.shape[-1])
    if call.pending is not None:
        name = time_and_choose(
            call.shape,
            pg,
            call.pending,
            lambda n: get_backend(n).matmul_reduce_scatter(a_2d.contiguous(), b, pg),
        )
    out = matmul_reduce_scatter_2d(a_2d, b, bias, pg.group_name, name, reduce_op == "avg")
    return _row_major(out.view(rows_shape[0] // pg.size(), *rows_shape[1:], b.shape[1]), dim)
