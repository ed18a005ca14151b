"""The public fused ops: argument checks, dim handling and backend choice around the fused calls.

A call of a shape class already seen (same argument types, shapes, dtypes, devices, dims,
options, backend asked for, settings and ``use_backend`` context, on the same group) reuses its
:class:`_Plan`: the checks it passed, the backend chosen and the signature agreed are what they
were, so the host does only the agreement (one tiny collective, when consistency checks are on)
and the call. Anything else goes through :func:`_new_plan` (check, choose, agree, raise, in that
order, on every rank). Under CUDA graph capture a call reuses its plan without the agreement,
or is refused (``ops/capture.py``). The call then runs through the eager ``autograd.Function`` of
``ops/eager.py`` when no dispatch mode is active and every tensor is a plain one, else through
the custom op of ``ops/library.py`` (what ``torch.compile`` traces and modes see).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tp_kernels import config, deadline
from tp_kernels.backends import (
    base,
    check_backend_name,
    choose,
    context_backend,
    current_backend,
    get_backend,
    pipelined,
)
from tp_kernels.backends.auto import Candidates, Shape, time_and_choose
from tp_kernels.backends.base import Backend, CaptureNeed
from tp_kernels.ops import capture, eager
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
class _Plan:
    """One shape class of calls, resolved: the normalized ``dim``, the backend (``impl`` None
    while torch.compile traces: the op resolves it when the graph runs), ``auto``'s shape, the
    agreed ``signature`` and its ``text``, and whether ``auto`` chose the backend."""

    dim: int
    backend: str
    impl: Backend | None
    shape: Shape | None
    signature: Signature | None
    text: str
    auto: bool


# group -> {call key -> plan}; weak, so a destroyed group's plans go with it. Bounded: a model
# whose shapes never repeat would otherwise grow it without end.
_plans: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, _Plan]]
_plans = weakref.WeakKeyDictionary()
_MAX_PLANS_PER_GROUP = 1024
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _tensor_key(t: object) -> tuple:
    return (type(t), t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else (type(t),)


def _call_key(a: object, rhs: object, *rest: object) -> tuple | None:
    """What decides a call's checks, backend and signature; None when it cannot be keyed (the
    call then takes the full path, whose checks say what is wrong; and while torch.compile
    traces, which keeps no state)."""
    if torch.compiler.is_compiling() or not isinstance(rhs, (list, tuple)):
        return None
    return (
        _tensor_key(a),
        tuple(_tensor_key(b) for b in rhs),
        *rest,
        config.generation(),
        context_backend(),
    )


def _new_plan(
    op: str,
    group: dist.ProcessGroup,
    a: object,
    backend: str | None,
    local_check: Callable[[], tuple[torch.Tensor, list[torch.Tensor], int]],
    options: dict[str, object],
) -> tuple[_Plan, Candidates | None]:
    """Check locally, choose the backend, agree across ranks, raise: in that order, on every rank.

    A rank whose check fails still takes part in the agreement (with its error as its signature),
    so every rank raises together and none is left waiting. When ``auto`` wants the shape class
    timed, the candidates come back beside the plan and the caller times them after the
    agreement (every rank then knows the others make the same call). While torch.compile traces,
    the checks stay local and the choice of backend is left to the op at run time (``""`` or the
    name asked for, see ``library.py``): the registry's state (context, environment,
    availability probes) is not traceable.
    """
    if torch.compiler.is_compiling():
        name = check_backend_name(backend, argument="backend") if backend is not None else ""
        return _Plan(local_check()[2], name, None, None, None, "", False), None
    with deadline.fused_call(group, op, "forward"):
        try:
            t, rhs, dim = local_check()
            if op == "all_gather_matmul":
                shape, agreed = Shape.of_all_gather_matmul(t, rhs), tuple(t.shape)
            else:
                shape = Shape.of_matmul_reduce_scatter(t, rhs[0], group.size())
                agreed = tuple(t.shape[:-1])  # K may differ by rank (an uneven rowwise split)
                options = {"n": rhs[0].shape[1], **options}
            asked = backend if backend is not None else current_backend()
            name, pending = choose(backend, shape, group)
            chunks = pipelined.chunks_setting()
            options_items = tuple(options.items())
            signature = Signature(
                op, agreed, t.dtype, t.device.type, dim, len(rhs), name, options_items, chunks
            )
            text, error = str(signature), None
        except (TypeError, ValueError, RuntimeError) as exc:
            text, error = f"error: {exc}", exc
        agree_across_ranks(group, op, text, _device_of(a))
        if error is not None:
            raise error
    auto = asked == "auto"
    return _Plan(dim, name, get_backend(name), shape, signature, text, auto), pending


def _plan(
    op: str,
    group: dist.ProcessGroup,
    key: tuple | None,
    a: object,
    backend: str | None,
    local_check: Callable[[], tuple[torch.Tensor, list[torch.Tensor], int]],
    options: dict[str, object],
    timed_run: Callable[[_Plan, str], object],
    capture_needs: Callable[[], list[CaptureNeed]],
) -> tuple[_Plan, bool]:
    """The plan of this call and whether it still needs the agreement (a cached plan does; a new
    one was agreed while it was made; a captured call never agrees, see ``ops/capture.py``).
    ``timed_run(plan, name)`` runs the call on backend ``name`` for ``auto``'s timing;
    ``capture_needs()`` is what the call and its backward need of a backend under capture."""
    if not torch.compiler.is_compiling():
        count_as_replaced_collectives()
    cached = _plans.get(group)
    plan = None if cached is None or key is None else cached.get(key)
    device = _device_of(a)
    if base.capturing(device):
        if plan is None:
            local_check()  # what the arguments get wrong, said locally, before the refusal
            capture.refuse_new_plan(op, group, f"a call of a new shape class ({_described(a)})")
        name, impl = capture.capture_backend(
            op, group, device, capture_needs(), plan.backend, plan.impl, plan.shape, plan.auto
        )
        return dataclasses.replace(plan, backend=name, impl=impl), False
    if plan is not None:
        return plan, True
    plan, pending = _new_plan(op, group, a, backend, local_check, options)
    if pending is not None:
        name = time_and_choose(plan.shape, group, pending, lambda n: timed_run(plan, n))
        # Kept as a plan like any other: a later call of the shape class (the captured one of a
        # CUDA graph's warmup and capture among them) must not plan, agree or time again.
        signature = dataclasses.replace(plan.signature, backend=name)
        plan = dataclasses.replace(
            plan, backend=name, impl=get_backend(name), signature=signature, text=str(signature)
        )
    if key is not None and plan.impl is not None:
        cached = _plans.setdefault(group, {})
        if len(cached) >= _MAX_PLANS_PER_GROUP:
            cached.clear()
        cached[key] = plan
    return plan, False


def _grads_wanted(grads: tuple[object, Sequence[object]]) -> tuple[bool, bool]:
    """Whether autograd will want the grad of the input, and of any of the parameters."""
    return capture.requires_grad([grads[0]]), capture.requires_grad(grads[1])


def _described(a: object) -> str:
    return f"{tuple(a.shape)} {a.dtype}" if isinstance(a, torch.Tensor) else type(a).__name__


def eager_path(tensors: Sequence[torch.Tensor | None]) -> bool:
    """Whether the call may take ``ops/eager.py``: no dispatch mode is active (CommDebugMode,
    fake tensors, a user's mode see the custom op) and every tensor is a plain one."""
    return not torch._C._len_torch_dispatch_stack() and all(
        t is None or type(t) in _PLAIN for t in tensors
    )


def plan_all_gather_matmul(
    a_shard: object,
    bs: object,
    gather_dim: object,
    group: GroupLike,
    backend: str | None,
    return_a: bool,
    save_gathered_a: bool,
    grads: tuple[object, Sequence[object]] | None = None,
) -> tuple[dist.ProcessGroup, _Plan, bool]:
    """The group, the plan of an :func:`all_gather_matmul` call and whether it still needs the
    agreement (see :func:`_plan`); raises on every rank what the arguments get wrong. ``grads``:
    the input and weights as autograd sees them (DTensors) where ``a_shard`` and ``bs`` are
    their local tensors."""
    op = "all_gather_matmul"
    pg = resolve_group_or_note(group, op=op)
    keep_a = return_a or save_gathered_a
    plan, agree = _plan(
        op,
        pg,
        _call_key(a_shard, bs, gather_dim, backend, return_a, save_gathered_a),
        a_shard,
        backend,
        lambda: check_all_gather_matmul(a_shard, bs, gather_dim),
        {"return_a": return_a, "save": save_gathered_a},
        lambda plan, n: get_backend(n).all_gather_matmul(
            flatten_rows(a_shard, plan.dim)[0].contiguous(), bs, pg, return_a=keep_a
        ),
        lambda: capture.all_gather_matmul_needs(
            a_shard, save_gathered_a, pg.size(), *_grads_wanted(grads or (a_shard, bs))
        ),
    )
    return pg, plan, agree


def plan_matmul_reduce_scatter(
    a: object,
    b: object,
    scatter_dim: object,
    group: GroupLike,
    reduce_op: object,
    backend: str | None,
    bias: object,
    grads: tuple[object, Sequence[object]] | None = None,
) -> tuple[dist.ProcessGroup, _Plan, bool]:
    """:func:`plan_all_gather_matmul` for a :func:`matmul_reduce_scatter` call (``grads``: the
    input, then the weight and bias, as autograd sees them)."""
    op = "matmul_reduce_scatter"
    pg = resolve_group_or_note(group, op=op)
    bias_key = None if bias is None else _tensor_key(bias)
    plan, agree = _plan(
        op,
        pg,
        _call_key(a, (b,), scatter_dim, reduce_op, bias_key, backend),
        a,
        backend,
        lambda: _as_rhs_list(check_matmul_reduce_scatter(a, b, scatter_dim, reduce_op, pg, bias)),
        {"reduce_op": reduce_op, "bias": bias is not None},
        lambda plan, n: get_backend(n).matmul_reduce_scatter(
            flatten_rows(a, plan.dim)[0].contiguous(), b, pg
        ),
        lambda: capture.matmul_reduce_scatter_needs(
            a, b.shape[1], pg.size(), *_grads_wanted(grads or (a, (b, bias)))
        ),
    )
    return pg, plan, agree


def agree_if_needed(
    group: dist.ProcessGroup, op: str, plan: _Plan, agree: bool, device: torch.device
) -> None:
    """The agreement a cached plan still owes (inside the call's ``fused_call``)."""
    if agree:
        agree_across_ranks(group, op, plan.text, device)


def restore_dim(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` (the gathered or scattered dim first, as the backends lay rows out rank-major) with
    that dim moved back to ``dim``, row-major, as PyTorch's collectives and matmuls return it:
    callers ``.view()`` results (``logits.view(-1, vocab)``). For ``dim == 0`` nothing moves; for
    another dim this is one copy of the output, O(M*N) against the matmul's O(M*N*K), that rank-
    major rows cannot avoid."""
    return t if dim == 0 else t.movedim(0, dim).contiguous()


def flatten_rows(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``t`` with ``dim`` moved first and flattened to 2-D rows ``[rows, K]``, and the leading
    shape those rows came from."""
    lead = t if dim == 0 else t.movedim(dim, 0)
    return (lead if lead.ndim == 2 else lead.reshape(-1, t.shape[-1])), lead.shape[:-1]


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
    pg, plan, agree = plan_all_gather_matmul(
        a_shard, bs, gather_dim, group, backend, return_a, save_gathered_a
    )
    dim = plan.dim
    a_2d, rows_shape = flatten_rows(a_shard, dim)
    if plan.impl is not None and eager_path((a_shard, *bs)):
        with deadline.fused_call(pg, op, "forward"):
            agree_if_needed(pg, op, plan, agree, a_shard.device)
            results = eager.AllGatherMatmul.apply(
                plan.impl, pg, return_a, save_gathered_a, a_2d, *bs
            )
    else:
        if agree:  # never while torch.compile traces: a traced call's plan is new
            with deadline.fused_call(pg, op, "forward"):
                agree_across_ranks(pg, op, plan.text, a_shard.device)
        results = all_gather_matmul_2d(
            a_2d, list(bs), pg.group_name, plan.backend, return_a, save_gathered_a
        )
    rows = pg.size() * rows_shape[0]

    def unflatten(t: torch.Tensor) -> torch.Tensor:
        return restore_dim(t.view(rows, *rows_shape[1:], t.shape[-1]), dim)

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
    avg = reduce_op == "avg"
    pg, plan, agree = plan_matmul_reduce_scatter(a, b, scatter_dim, group, reduce_op, backend, bias)
    dim = plan.dim
    a_2d, rows_shape = flatten_rows(a, dim)
    if plan.impl is not None and eager_path((a, b, bias)):
        with deadline.fused_call(pg, op, "forward"):
            agree_if_needed(pg, op, plan, agree, a.device)
            out = eager.MatmulReduceScatter.apply(plan.impl, pg, avg, a_2d, b, bias)
    else:
        if agree:  # never while torch.compile traces: a traced call's plan is new
            with deadline.fused_call(pg, op, "forward"):
                agree_across_ranks(pg, op, plan.text, a.device)
        out = matmul_reduce_scatter_2d(a_2d, b, bias, pg.group_name, plan.backend, avg)
    return restore_dim(out.view(rows_shape[0] // pg.size(), *rows_shape[1:], b.shape[1]), dim)
