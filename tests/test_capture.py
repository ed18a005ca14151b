"""Fused calls under CUDA graph capture, on a machine without a GPU.

torchtitan 0.3 captures every training step: a first eager call (the warmup), then the same step
captured and replayed. Here CPU tensors on gloo ranks stand in for CUDA ones: the capture probe
(``tp_kernels.backends.base.capturing``, and ``torch.cuda.is_current_stream_capturing`` under it)
answers True, and whatever a captured call must not do raises and is recorded: host
synchronization (``torch.cuda.synchronize``, ``item``/``tolist``/``cpu``/``numpy``/``bool`` of a
tensor), host-side exchange (the agreement, object exchange, the deadline's roll call, any
all-reduce or barrier), planning and ``auto``'s timing. The transfers themselves run on gloo
(NCCL's, which capture, on a GPU). A backend is one entry of :data:`BACKENDS`, with the fakes it
needs on a CPU in :data:`_SETUP`.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from test_torch_symm_mem import _fake_torch_ops

import tp_kernels as tpk
from tp_kernels import deadline
from tp_kernels.backends import base, choice
from tp_kernels.backends.choice import get_backend
from tp_kernels.ops import planning

BACKENDS = ["reference", "pipelined", "torch_symm_mem"]
# What a backend needs to run on gloo CPU ranks: torch's ops and workspace, faked.
_SETUP: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "torch_symm_mem": _fake_torch_ops,
}


class Forbidden(AssertionError):
    """Something a captured call must not do."""


@contextlib.contextmanager
def _patched(patches: list[tuple[object, str, object]]) -> Iterator[None]:
    saved = [(obj, attr, vars(obj).get(attr, _ABSENT)) for obj, attr, _ in patches]
    for obj, attr, new in patches:
        setattr(obj, attr, new)
    try:
        yield
    finally:
        for obj, attr, old in reversed(saved):
            if old is _ABSENT:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)


_ABSENT = object()


@contextlib.contextmanager
def _forbidding(*, device_max_all_reduce: bool = False) -> Iterator[list[str]]:
    """Every forbidden function raises :class:`Forbidden`; the names called are yielded.
    ``device_max_all_reduce``: an all-reduce MAX of a tensor is allowed (the fp8 path's amax
    reduction: on NCCL a stream-ordered collective of device tensors, which a graph captures;
    every host-side exchange has its own entry below)."""
    seen: list[str] = []

    def forbid(what: str) -> Callable:
        def refuse(*args, **kwargs):
            seen.append(what)
            raise Forbidden(f"{what} under CUDA graph capture")

        return refuse

    targets = [
        (torch.cuda, "synchronize"),
        *((torch.Tensor, name) for name in ("item", "tolist", "cpu", "numpy", "__bool__")),
        *((dist, name) for name in ("all_gather_object", "broadcast_object_list", "all_reduce")),
        (dist, "barrier"),
        (deadline, "gather_objects"),
        (deadline, "_roll_call"),
        (planning, "all_gather_single"),  # the agreement's exchange
        (planning, "agree_across_ranks"),
        (planning, "_new_plan"),  # checks, choice and agreement of a new plan
        (choice, "settle"),
        (choice, "_time_and_choose"),
        (choice, "_agreed_max"),
    ]
    patches = [
        (obj, name, forbid(f"{getattr(obj, '__name__', obj)}.{name}")) for obj, name in targets
    ]
    if device_max_all_reduce:
        refuse, all_reduce = patches[targets.index((dist, "all_reduce"))][2], dist.all_reduce

        def max_only(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
            if op != dist.ReduceOp.MAX or not isinstance(tensor, torch.Tensor):
                return refuse(tensor, op, *args, **kwargs)
            return all_reduce(tensor, op, *args, **kwargs)

        patches[targets.index((dist, "all_reduce"))] = (dist, "all_reduce", max_only)
    with _patched(patches):
        yield seen


@contextlib.contextmanager
def _capturing() -> Iterator[list[int]]:
    """The capture probe says yes for every tensor (CPU ones stand for CUDA ones); yields how
    often torch's probe was asked."""
    asked = [0]

    def probe() -> bool:
        asked[0] += 1
        return True

    with _patched(
        [
            (torch.cuda, "is_current_stream_capturing", probe),
            (base, "capturing", lambda device: torch.cuda.is_current_stream_capturing()),
        ]
    ):
        yield asked


def _step(backend: str | None, rows: int = 4) -> list[torch.Tensor]:
    """One forward and backward of each op: a colwise boundary (two weights) and a rowwise one."""
    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    a_shard = torch.randn(rows, 8, generator=gen).requires_grad_()
    bs = [torch.randn(8, n, generator=torch.Generator().manual_seed(n)) for n in (6, 2)]
    bs = [b.requires_grad_() for b in bs]
    _, outs = tpk.all_gather_matmul(a_shard, bs, 0, group, backend=backend)
    a = torch.randn(world * rows, 8, generator=gen).requires_grad_()
    w = torch.randn(8, 6, generator=torch.Generator().manual_seed(3)).requires_grad_()
    out = tpk.matmul_reduce_scatter(a, w, 0, group, backend=backend)
    (sum(o.sum() for o in outs) + out.sum()).backward()
    return [o.detach() for o in outs] + [out.detach(), a_shard.grad, *(b.grad for b in bs)]


def _hygiene(backend: str, custom_ops: bool = False) -> dict:
    """With ``custom_ops``, under a dispatch mode (CommDebugMode), which sends the calls through
    the custom ops of ``ops/ag_matmul.py`` and ``ops/matmul_rs.py`` (torch.compile's and
    torchtitan 0.3's backward's way)."""
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode if custom_ops else contextlib.nullcontext
    with _SETUP.get(backend, contextlib.nullcontext)():
        with mode():
            warm = _step(backend)
        tpk.reset_comm_stats()
        with _forbidding() as seen, _capturing() as asked, mode():
            try:
                captured = _step(backend)
            except Forbidden:
                captured = []
    return {
        "forbidden": seen,
        "probes": asked[0],
        "same": len(captured) == len(warm) and all(map(torch.equal, captured, warm)),
        "on": tpk.comm_stats().total(backend=backend),
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reused_plans_captured_call_does_nothing_forbidden(worlds, backend):
    """After one eager step, the same step captured: no host synchronization, exchange, planning
    or timing; the same results, on the same backend."""
    for got in worlds(2).run(_hygiene, backend):
        assert got["forbidden"] == [], got
        assert got["probes"] >= 2, got  # the probe was asked: the capture was seen
        assert got["same"], got
        assert got["on"] >= 2, got


def test_the_custom_ops_captured_call_does_nothing_forbidden(worlds):
    for got in worlds(2).run(_hygiene, "reference", True):
        assert got["forbidden"] == [] and got["same"] and got["on"] >= 2, got


def _new_shape_under_capture(backend: str) -> str:
    with _SETUP.get(backend, contextlib.nullcontext)():
        _step(backend)
        with _forbidding() as seen, _capturing():
            try:
                _step(backend, rows=5)  # a shape class the warmup did not see
            except base.CaptureUnreadyError as exc:
                assert seen == [], seen
                return str(exc)
    return "not refused"


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_a_new_shape_class_is_refused_before_any_communication(worlds, backend):
    for got in worlds(2).run(_new_shape_under_capture, backend):
        assert got.startswith("all_gather_matmul: a call of a new shape class (m=5, K=8"), got
        assert "has no plan yet" in got and "nothing was launched" in got, got
        assert "eager step" in got, got


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _auto_falls_back(all_unready: bool) -> dict:
    """``auto`` times pipelined and reference in the warmup; under capture its winner (and, with
    ``all_unready``, every candidate) says it cannot be captured."""
    found = choice.Candidates(("pipelined", "reference"), {}, {})
    records = _Records()
    logger = logging.getLogger("tp_kernels")
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    out: dict = {}
    try:
        fresh = [
            (choice, "candidates", lambda shape, group, block_scaled=False: found),
            (choice, "_ranked", {}),  # shape classes timed by earlier tests
            (choice, "_logged", set()),
            (planning, "_plans", weakref.WeakKeyDictionary()),
        ]
        with _patched(fresh):
            _step("auto")
            shape = choice.Shape.of_all_gather_matmul(torch.empty(4, 8), [torch.empty(8, 6)] * 2)
            out["ranking"] = choice._ranked[shape.key(dist.group.WORLD)]
            unready = out["ranking"] if all_unready else out["ranking"][:1]
            tpk.reset_comm_stats()
            records.messages.clear()
            stubs = [
                (get_backend(n), "capture_unready_reason", lambda g, d, need, n=n: f"{n} not ready")
                for n in unready
            ]
            with _patched(stubs), _forbidding() as seen, _capturing():
                try:
                    _step("auto")
                    _step("auto")  # logged once, not per call
                except base.CaptureUnreadyError as exc:
                    out["error"] = str(exc)
            out["forbidden"] = seen
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    stats = tpk.comm_stats()
    out["on"] = {n: stats.total(backend=n) for n in out["ranking"]}
    out["logged"] = [m for m in records.messages if "under CUDA graph capture" in m]
    return out


def test_auto_reuses_its_warmup_and_falls_to_the_next_capturable(worlds):
    """The captured call neither plans nor times again (before, a timed shape class was planned
    and agreed once more on its second call); where the warmup's winner cannot be captured, every
    rank takes the next of the warmup's ranking, and says so once at INFO."""
    results = worlds(2).run(_auto_falls_back, False)
    assert results[0]["ranking"] == results[1]["ranking"]
    assert sorted(results[0]["ranking"]) == ["pipelined", "reference"]
    for got in results:
        first, second = got["ranking"]
        assert got["forbidden"] == [] and "error" not in got, got
        assert got["on"][first] == 0 and got["on"][second] >= 4, got
        # once per op's shape class that fell back: the all-gather's (its winner was stubbed),
        # and the reduce-scatter's where the same backend won it
        gathers = [m for m in got["logged"] if m.startswith("auto backend for all_gather_matmul")]
        assert len(gathers) == 1 and len(got["logged"]) <= 2, got["logged"]
        assert f"{second}, because under CUDA graph capture {first}" in gathers[0]
        assert f"{first} not ready" in gathers[0]


def test_auto_with_nothing_capturable_refuses_naming_each(worlds):
    for got in worlds(2).run(_auto_falls_back, True):
        assert got["forbidden"] == [], got
        error = got["error"]
        assert error.startswith("all_gather_matmul: backend "), error
        assert got["ranking"] == ("pipelined", "reference") or got["ranking"] == (
            "reference",
            "pipelined",
        )
        assert "pipelined: pipelined not ready" in error, error
        assert "reference: reference not ready" in error and "nothing was launched" in error


def _spied_capture(
    backend: str,
    step: Callable[[], list[torch.Tensor]],
    need_of: Callable[[base.CaptureNeed], object],
    *,
    device_max_all_reduce: bool = False,
    then: Callable[[], object] | None = None,
) -> dict:
    """An eager ``step``, then the same step captured while ``backend``'s capture probe is spied
    on: what it did that is forbidden, how often torch's probe was asked, whether its values are
    the eager step's, the needs it asked the backend about (``need_of`` each) and the fused calls
    it ran on ``backend``; ``then`` runs after it, still under capture (its result: "then")."""
    needs: list[object] = []
    impl = get_backend(backend)
    ask = impl.capture_unready_reason

    def spy(group, device, need):
        needs.append(need_of(need))
        return ask(group, device, need)

    warm = step()
    tpk.reset_comm_stats()
    with _forbidding(device_max_all_reduce=device_max_all_reduce) as seen, _capturing() as asked:
        with _patched([(impl, "capture_unready_reason", spy)]):
            try:
                captured = step()
            except Forbidden:
                captured = []
        fused = tpk.comm_stats().total(backend=backend)
        after = None if then is None else then()
    return {
        "forbidden": seen,
        "probes": asked[0],
        "same": len(captured) == len(warm) and all(map(torch.equal, captured, warm)),
        "fused": fused,
        "needs": needs,
        "then": after,
    }


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 12)
        self.down = torch.nn.Linear(12, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _styles_hygiene(backend: str) -> dict:
    """A sequence-parallel MLP on tp_kernels' styles (torchtitan 0.2's layout): an eager step,
    then the same step captured."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _MLP()
    tpk.parallelize_module(
        model,
        mesh,
        {
            "up": tpk.ColwiseParallel(input_layouts=Shard(1), backend=backend),
            "down": tpk.RowwiseParallel(output_layouts=Shard(1), backend=backend),
        },
    )
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(dist.get_rank()))

    def step() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        out = model(x)
        out.sum().backward()
        return [out.detach()] + [p.grad.to_local() for p in model.parameters()]

    with _SETUP.get(backend, contextlib.nullcontext)():
        return _spied_capture(backend, step, lambda need: need.op)


@pytest.mark.parametrize("backend", ["reference", "torch_symm_mem"])
def test_styles_captured_step_does_nothing_forbidden(worlds, backend):
    """The styles' fused Linears (``colwise_linears``, ``rowwise_linear``) plan as the ops do: a
    captured step after an eager one reuses every plan, and the backward's needs come from the
    DTensor parameters."""
    for got in worlds(2).run(_styles_hygiene, backend):
        assert got["forbidden"] == [], got
        assert got["probes"] >= 2 and got["same"], got
        assert got["fused"] >= 4, got  # two forward calls, two backward ones at least
        # up: its gather, then the weight grads' re-gather (the input needs no grad); down: its
        # reduce-scatter, then the input grad's gather fused with its matmul
        assert got["needs"] == [
            "all_gather_matmul",
            "all_gather",
            "matmul_reduce_scatter",
            "all_gather_matmul",
        ], got


def _backward_by_name() -> dict:
    """torchtitan 0.3's Functions' way: the forward through the op with ``backend="auto"``, the
    backward through the custom op, passed ``"auto"`` by name; under capture ``auto``'s timed
    choice says it cannot be captured."""
    found = choice.Candidates(("pipelined", "reference"), {}, {})
    fresh = [
        (choice, "candidates", lambda shape, group, block_scaled=False: found),
        (choice, "_ranked", {}),
        (choice, "_logged", set()),
        (planning, "_plans", weakref.WeakKeyDictionary()),
    ]
    group = dist.group.WORLD

    def step() -> None:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
        w = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
        _, (y,) = tpk.all_gather_matmul(x, [w], 0, group, backend="auto")
        torch.ops.tp_kernels.all_gather_matmul_backward(
            x, [w], [torch.ones_like(y)], None, False, group.group_name, "auto", [True]
        )

    with _patched(fresh):
        step()
        shape = choice.Shape.of_all_gather_matmul(torch.empty(4, 8), [torch.empty(8, 6)])
        first, second = choice._ranked[shape.key(group)]
        stub = [(get_backend(first), "capture_unready_reason", lambda g, d, need: "not ready")]
        tpk.reset_comm_stats()
        with _patched(stub), _forbidding() as seen, _capturing():
            step()
    stats = tpk.comm_stats()
    return {
        "forbidden": seen,
        "backward on": {n: stats.total(phase="backward", backend=n) for n in (first, second)},
        "order": (first, second),
    }


def test_a_backward_resolved_by_name_falls_back_as_its_forward(worlds):
    """Before, the backward op resolved ``auto`` to its timed choice and ran it under capture
    without asking whether it could be captured."""
    for got in worlds(2).run(_backward_by_name):
        first, second = got["order"]
        assert got["forbidden"] == [], got
        assert got["backward on"] == {first: 0, second: 2}, got  # the reduce-scatter, re-gather


# Each backend with the part of a call that runs the group's own collectives: reference and
# pipelined all of it; torch_symm_mem the backward's re-gather (its fused ops are torch's).
_COLLECTIVE_PARTS = {
    "reference": "all_gather_matmul",
    "pipelined": "all_gather_matmul",
    "torch_symm_mem": "all_gather",
}


def _gloo_reasons() -> dict[str, str | None]:
    group = dist.group.WORLD
    return {
        f"{name} {kind}": get_backend(name).capture_unready_reason(
            group, torch.device(kind), base.CaptureNeed(op, 64, torch.float32)
        )
        for name, op in _COLLECTIVE_PARTS.items()
        for kind in ("cpu", "cuda")
    }


def test_a_gloo_group_of_cuda_tensors_is_not_capturable(worlds):
    """gloo's collectives run on the host (a CUDA tensor through a host copy and a
    synchronization): a graph cannot hold them, so a backend says so on CUDA for the part of a
    call that runs them (where ``auto`` then takes another backend); CPU tensors stand for CUDA
    ones elsewhere in this file, so the CPU answer stays None. Before: None for every one (on
    one H200, torch_symm_mem's captured step then failed: the capture was invalidated)."""
    for got in worlds(2).run(_gloo_reasons):
        for name in _COLLECTIVE_PARTS:
            assert got[f"{name} cpu"] is None, got
            why = got[f"{name} cuda"]
            assert why is not None and "'gloo'" in why and "NCCL" in why, got


def _float8_hygiene(backend: str) -> dict:
    """torchao's rowwise Float8Linear SwiGLU block on tp_kernels' styles (tests/test_fp8.py's):
    an eager step, the same step captured, then one with a longer sequence captured."""
    import test_fp8

    ours, _, x, _ = test_fp8._block_pair("rowwise", torch.bfloat16)

    def step(x: torch.Tensor) -> list[torch.Tensor]:
        ours.zero_grad(set_to_none=True)
        return list(test_fp8._step(ours, x))

    def longer() -> str:
        try:
            step(torch.cat([x, x], dim=1))  # a sequence twice as long: a new shape class
            return "not refused"
        except base.CaptureUnreadyError as exc:
            return str(exc)

    with tpk.use_backend(backend):
        got = _spied_capture(backend, lambda: step(x), _op_and_bytes, device_max_all_reduce=True,
                             then=longer)  # fmt: skip
    return {**got, "refused": got["then"], "tokens": x.shape[0] * x.shape[1]}


def _op_and_bytes(need: base.CaptureNeed) -> tuple[str, int]:
    return need.op, need.nbytes


def test_a_captured_float8_step_does_nothing_forbidden(worlds):
    """The fused fp8 path (tp_kernels/float8.py) under capture: its backend is the eager step's,
    asked for the forward's and the backward's buffers (the gather of the fp8 rows, each with its
    scale: ``K + 16`` bytes a row; the reduce-scatters of bf16 partials; the fp8 re-gathers), no
    host synchronization or exchange (its amax all-reduces are device collectives on NCCL); a new
    shape class is refused before anything runs. Before, a captured fp8 call asked nothing: a
    new shape class planned on the host and a backend that could not capture ran anyway."""
    from test_fp8 import H

    for got in worlds(2).run(_float8_hygiene, "reference"):
        assert got["forbidden"] == [] and got["probes"] >= 2 and got["same"], got
        assert got["fused"] >= 4, got
        m = got["tokens"]  # this rank's rows
        assert got["needs"] == [
            ("all_gather_matmul", m * (H + 16)),  # w1/w3's gather of x
            ("matmul_reduce_scatter", 2 * m * H * 2),  # its dgrad: [W*m, H] bf16 partials
            ("all_gather", m * H),  # x's fp8 bytes for the weight grads
            ("matmul_reduce_scatter", 2 * m * H * 2),  # w2: [W*m, H] bf16 partials
            ("all_gather_matmul", m * (H + 16)),  # its dgrad's gather of dY
            ("all_gather", m * H),  # dY's fp8 bytes for its weight grad
        ], got["needs"]
        assert "new shape class" in got["refused"] and "nothing was launched" in got["refused"]


def _mxfp8_hygiene(backend: str) -> dict:
    """test_mxfp8's SwiGLU block of MXFP8Linears on tp_kernels' styles: an eager step, then the
    same step captured."""
    import test_fp8
    import test_mxfp8 as mx

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    block = mx._convert(test_fp8.SwiGLU(64, 64 * world).to(torch.bfloat16), "MXFP8Linear")
    ours = tpk.parallelize_module(block, mx._mesh(), test_fp8._plan(tpk))
    x = torch.randn(mx.B, mx.TOKENS * world, 64).to(torch.bfloat16).chunk(world, dim=1)[rank]

    def step() -> list[torch.Tensor]:
        ours.zero_grad(set_to_none=True)
        return mx._block_step(ours, x)

    with tpk.use_backend(backend):
        got = _spied_capture(backend, step, _op_and_bytes)
    return {**got, "tokens": x.shape[0] * x.shape[1]}


def test_a_captured_mxfp8_step_does_nothing_forbidden(worlds):
    """The fused MXFP8 path (tp_kernels/mxfp8.py) under capture: the eager step's backend, asked
    for every buffer the step and its backward need (packed e4m3 rows with their e8m0 scales,
    ``K + K/32`` bytes padded to 16; the partials; the weight grads' operands gathered along the
    tokens), no host synchronization or exchange, the eager step's values."""
    from tp_kernels.tiling import mx_row_bytes

    for got in worlds(2).run(_mxfp8_hygiene, "reference"):
        assert got["forbidden"] == [] and got["probes"] >= 2 and got["same"], got
        m, h = got["tokens"], 64
        assert got["needs"] == [
            ("all_gather_matmul", m * mx_row_bytes(h)),  # w1/w3's gather of x
            ("matmul_reduce_scatter", 2 * m * h * 2),  # its dgrad: [W*m, H] bf16 partials
            ("all_gather", h * mx_row_bytes(m)),  # x along the tokens, for the weight grads
            ("matmul_reduce_scatter", 2 * m * h * 2),  # w2: [W*m, H] bf16 partials
            ("all_gather_matmul", m * mx_row_bytes(h)),  # its dgrad's gather of dY
            ("all_gather", h * mx_row_bytes(m)),  # dY along the tokens, for its weight grad
        ], got["needs"]
