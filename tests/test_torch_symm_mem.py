"""The ``torch_symm_mem`` backend on CPU: why it cannot run here, and its glue around torch's ops.

PyTorch's ``torch.ops.symm_mem`` fused ops have CUDA kernels only. The glue (argument order, return
values, the addend, autograd through the ops layer) is tested by registering CPU kernels for the two
ops under their real schemas, inside the rank processes: gloo implementations of the documented
semantics (all-gather then matmul; matmul then reduce-scatter) that also record how they were
called, with the backend's availability forced. Results are compared with the ``reference``
backend and a float64 truth.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory  # noqa: F401  (defines torch.ops.symm_mem.*)
from torch.distributed.distributed_c10d import _resolve_process_group

import tp_kernels as tpk
from tp_kernels import symmetric_memory
from tp_kernels._compat import all_gather_single, reduce_scatter_single
from tp_kernels.backends import base, choice, torch_symm_mem
from tp_kernels.testing.fused_cases import AGCase, RSCase, run_case
from tp_kernels.testing.numerics import assert_no_failures, check_close

NAME = "torch_symm_mem"

# ---------------------------------------------------------------- availability, no group needed


def test_unavailable_on_cpu_says_why():
    avail = tpk.available_backends()
    assert avail[NAME] != "ok"
    assert "CUDA" in avail[NAME] and "cpu" in avail[NAME], avail[NAME]
    on_cuda = tpk.available_backends("cuda")[NAME]
    if not torch.cuda.is_available():
        assert "torch.cuda.is_available() is False" in on_cuda, on_cuda


def test_registered_as_a_backend():
    assert NAME in choice.BACKEND_NAMES
    assert choice.get_backend(NAME) is torch_symm_mem.BACKEND


class _FakeGroup:
    group_name = "fake"

    def __init__(self, collectives: str = "nccl") -> None:
        self.collectives = collectives

    def size(self) -> int:
        return 2

    def _get_backend(self, device: torch.device) -> types.SimpleNamespace:
        return types.SimpleNamespace(name=lambda: self.collectives)


def _shape(device: str) -> choice.Shape:
    # 4096 x 1024 fp32 rows per rank: large enough to pipeline.
    device = torch.device(device)
    return choice.Shape("all_gather_matmul", 4096, 1024, (1024,), torch.float32, device)


@contextlib.contextmanager
def _reasons(**why: str | None) -> Iterator[None]:
    """Backends named here report ``why`` as their unavailability (``None``: available)."""
    objs = {name: choice.get_backend(name) for name in why}
    for name, obj in objs.items():
        obj.unavailable_reason = lambda group, device, _w=why[name]: _w
    try:
        yield
    finally:
        for obj in objs.values():
            del obj.unavailable_reason


def _candidates(device: str) -> choice.Candidates:
    group = _FakeGroup()
    return choice.candidates(_shape(device), group)


def test_auto_on_cuda_prefers_torch_symm_mem_then_symm():
    with _reasons(pipelined=None, torch_symm_mem=None, symm=None):
        assert _candidates("cuda").names == (NAME, "symm", "pipelined", "reference")
    with _reasons(pipelined=None, torch_symm_mem="no NVLink here", symm=None):
        found = _candidates("cuda")
        assert found.names[0] == "symm"
        assert found.ruled_out[NAME] == "unavailable: no NVLink here"
    with _reasons(pipelined=None, torch_symm_mem="no ops", symm="no heap"):
        found = _candidates("cuda")
        assert found.names == ("pipelined", "reference")
        assert found.ruled_out == {NAME: "unavailable: no ops", "symm": "unavailable: no heap"}


def test_auto_on_cpu_never_asks_torch_symm_mem():
    with _reasons(torch_symm_mem=None, symm=None):
        assert _candidates("cpu").names == ("symm", "pipelined", "reference")
    with _reasons(torch_symm_mem=None, symm="no heap"):
        assert _candidates("cpu").names == ("pipelined", "reference")


def test_enable_for_group_only_where_not_deprecated(monkeypatch):
    symm_mem = torch.distributed._symmetric_memory
    calls: list[str] = []

    def enable(name: str) -> None:
        calls.append(name)

    monkeypatch.setattr(torch_symm_mem, "_enabled_groups", set())
    monkeypatch.setattr(symm_mem, "enable_symm_mem_for_group", enable)
    torch_symm_mem._enable_for_group(_FakeGroup())
    torch_symm_mem._enable_for_group(_FakeGroup())
    assert calls == ["fake"]  # an older torch: called once per group

    enable.__deprecated__ = "no need to call this function anymore"
    monkeypatch.setattr(torch_symm_mem, "_enabled_groups", set())
    torch_symm_mem._enable_for_group(_FakeGroup())
    assert calls == ["fake"]  # a newer torch: never called


def test_return_a_keyword_detected_from_the_schema():
    # torch 2.13 has it; the result follows the schema of whatever torch is installed.
    schema = str(torch.ops.symm_mem.fused_all_gather_matmul.default._schema)
    assert torch_symm_mem._takes_return_a() == ("return_A" in schema)


# ---------------------------------------------------------------- availability on gloo ranks


def _group_reasons() -> dict[str, str | None]:
    group = dist.group.WORLD
    backend = torch_symm_mem.BACKEND
    saved = os.environ.get("LOCAL_WORLD_SIZE")

    def hosts_reason() -> str | None:
        # The question torch_symm_mem asks of its group; on the CPU no fabric can excuse it.
        return symmetric_memory.group_unavailable_reason(
            group, torch.device("cpu"), "torch's ops", unknown_hosts_are_a_reason=True
        )

    try:
        out = {
            "cpu": backend.unavailable_reason(group, torch.device("cpu")),
            "cuda": backend.unavailable_reason(group, torch.device("cuda")),
            "one_host": hosts_reason(),
        }
        os.environ["LOCAL_WORLD_SIZE"] = "1"  # one rank per host: the group spans every host
        out["one_rank_per_host"] = hosts_reason()
        del os.environ["LOCAL_WORLD_SIZE"]
        out["unset"] = hosts_reason()
    finally:
        if saved is not None:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    return out


def test_unavailable_reasons_for_a_group(worlds):
    for got in worlds(2).run(_group_reasons):
        assert "run on CUDA tensors, not cpu" in got["cpu"]
        assert got["cuda"] and got["cuda"] != "ok"
        assert got["one_host"] is None
        assert "2 ranks but only LOCAL_WORLD_SIZE=1 run on this host" in got["one_rank_per_host"]
        assert "LOCAL_WORLD_SIZE is ''" in got["unset"]


# ---------------------------------------------------------------- the glue, with gloo fakes

_calls: list[tuple] = []
SYMM_MEM = torch.distributed._symmetric_memory
_ALLOW = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"  # torch's variable for ranks sharing a GPU
# Whether the fake device reports multicast support (torch asks the device, not the workspace).
_device_multicast = [False]


def _fake_all_gather_matmul(A, Bs, gather_dim, group_name, *, return_A=True):
    """``A = all_gather(A_shard, dim=gather_dim)``; ``(A if return_A else None, [A @ B, ...])``.

    Also torch's choice of its multicast all-gather (``_should_use_multimem_all_gather_matmul``,
    torch 2.13 and 2.15) on a device that reports multicast, and its failure where rendezvous set
    no multicast up, as with ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``.
    """
    b_shapes = [tuple(b.shape) for b in Bs]
    _calls.append(
        ("ag", tuple(A.shape), b_shapes, gather_dim, group_name, return_A, A.is_contiguous())
    )
    group = _resolve_process_group(group_name)
    multimem = (
        _device_multicast[0]
        and not return_A
        and A.is_contiguous()
        and gather_dim == 0
        and A.shape[:-1].numel() * group.size() <= 2048
    )
    if multimem and os.environ.get(_ALLOW) == "1":
        raise RuntimeError("multimem_all_gather_out: output must have multicast support")
    # torch's workspace: the gathered A for its multicast path, else the shard
    SYMM_MEM.get_symm_mem_workspace(group_name, A.nbytes * (group.size() if multimem else 1))
    lead = A.movedim(gather_dim, 0).contiguous()
    full = lead.new_empty((group.size() * lead.shape[0], *lead.shape[1:]))
    all_gather_single(full, lead, group)
    full = full.movedim(0, gather_dim)
    return (full.clone() if return_A else None), [torch.matmul(full, b) for b in Bs]


def _fake_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name):
    """``reduce_scatter(A @ B, scatter_dim, reduce_op)`` with reduce_op "sum" or "avg"."""
    _calls.append(("rs", tuple(A.shape), tuple(B.shape), reduce_op, scatter_dim, group_name))
    group = _resolve_process_group(group_name)
    full = torch.matmul(A, B).movedim(scatter_dim, 0).contiguous()
    # torch's workspace: two [m, N] chunks of the stacked partials
    SYMM_MEM.get_symm_mem_workspace(group_name, 2 * full.nbytes // group.size())
    out = full.new_empty((full.shape[0] // group.size(), *full.shape[1:]))
    reduce_scatter_single(out, full, group)
    if reduce_op == "avg":
        out /= group.size()
    return out.movedim(0, scatter_dim).contiguous()


def _fake_get_symm_mem_workspace(group_name: str, min_size: int) -> None:
    """torch's ``get_symm_mem_workspace`` (2.13, 2.15) on the CPU: the same size bookkeeping in
    ``_group_name_to_workspace_tensor``, the same refusal to grow during capture (as the tests
    fake it for CPU tensors: ``base.capturing``); no handle."""
    tensor = SYMM_MEM._group_name_to_workspace_tensor.get(group_name)
    size = 0 if tensor is None else tensor.numel() * tensor.element_size()
    if size < min_size:
        if base.capturing(torch.device("cpu")):
            raise RuntimeError(f"get_symm_mem_workspace(): the requested size ({min_size} bytes)")
        _calls.append(("grow", group_name, min_size))
        SYMM_MEM._group_name_to_workspace_tensor[group_name] = torch.empty(
            max(size, min_size), dtype=torch.uint8
        )


@contextlib.contextmanager
def _fake_torch_ops() -> Iterator[None]:
    """CPU kernels for torch's two fused ops and its workspace, and the backend forced available,
    in this process."""
    lib = torch.library.Library("symm_mem", "IMPL")
    lib.impl("fused_all_gather_matmul", _fake_all_gather_matmul, "CPU")
    lib.impl("fused_matmul_reduce_scatter", _fake_matmul_reduce_scatter, "CPU")
    saved = SYMM_MEM.get_symm_mem_workspace, SYMM_MEM._group_name_to_workspace_tensor
    SYMM_MEM.get_symm_mem_workspace = _fake_get_symm_mem_workspace
    SYMM_MEM._group_name_to_workspace_tensor = {}
    torch_symm_mem.BACKEND.unavailable_reason = lambda group, device: None
    _calls.clear()
    try:
        yield
    finally:
        del torch_symm_mem.BACKEND.unavailable_reason
        SYMM_MEM.get_symm_mem_workspace, SYMM_MEM._group_name_to_workspace_tensor = saved
        lib._destroy()  # the rank processes serve the whole session: leave no CPU kernel behind


AG_CASES = [
    AGCase((3, 5), 0, (4,)),
    AGCase((3, 5), 0, (2, 3, 1), return_a=True),
    AGCase((2, 3, 6), 1, (4, 5)),
    AGCase((2, 3, 6), 1, (2,), return_a=True),
]
RS_CASES = [
    RSCase((3,), 0, 5, 4),
    RSCase((3,), 0, 4, 6, reduce_op="avg", bias=True),
    RSCase((2, 3), 1, 4, 5, bias=True),
    RSCase((2, 3), 1, 3, 2, reduce_op="avg"),
]

DTYPES = (torch.float64, torch.float32)


def _expected_calls(kind: str, case) -> list[tuple]:
    """The calls the backend should make of torch's ops for one forward and backward."""
    world, name = dist.get_world_size(), dist.group.WORLD.group_name
    if kind == "ag":
        lead = list(case.shard)
        lead.insert(0, lead.pop(case.dim))  # the gather dim moved to the front, then flattened
        m, k = int(torch.tensor(lead[:-1]).prod()), lead[-1]
        ns = sum(case.ns)
        return [
            ("ag", (m, k), [(k, n) for n in case.ns], 0, name, case.return_a, True),
            # backward: d a_shard = rs(cat(d out_j) @ cat(b_j)^T (+ d A))
            ("rs", (world * m, ns), (ns, k), "sum", 0, name),
        ]
    rows = list(case.rows)
    rows.insert(0, rows.pop(case.dim))
    m = int(torch.tensor(rows).prod())
    return [
        ("rs", (world * m, case.k), (case.k, case.n), "sum", 0, name),  # "avg" divides after
        # backward: d a = all_gather(d out) @ b^T, with the gathered grad kept for d b
        ("ag", (m, case.n), [(case.n, case.k)], 0, name, True, True),
    ]


def _run_glue(kind: str) -> list[str]:
    cases = AG_CASES if kind == "ag" else RS_CASES
    failures = []
    for i, case in enumerate(cases):
        tag = f"case {i} {case}"
        for dtype in DTYPES:
            with _fake_torch_ops():
                found = run_case(
                    case,
                    dtype=dtype,
                    device=torch.device("cpu"),
                    group=dist.group.WORLD,
                    seed=100 * i,
                    backend=NAME,
                )
                calls = [call for call in _calls if call[0] != "grow"]
            if calls != _expected_calls(kind, case):
                failures.append(f"{tag} {dtype}: calls {calls} != {_expected_calls(kind, case)}")
            for name, g, t, r, m in zip(
                found.names, found.got, found.truth, found.reference, found.magnitude, strict=True
            ):
                msg = check_close(name, g, t, r, m)
                if msg:
                    failures.append(f"{tag} {dtype}: {msg}")
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_matmul_through_torch_ops(worlds, world_size):
    assert_no_failures(worlds(world_size).run(_run_glue, "ag"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_matmul_reduce_scatter_through_torch_ops(worlds, world_size):
    assert_no_failures(worlds(world_size).run(_run_glue, "rs"))


def _without_return_a_keyword() -> tuple:
    """An older torch, whose op has no ``return_A``: A comes back anyway and is dropped."""
    saved = torch_symm_mem._takes_return_a
    torch_symm_mem._takes_return_a = lambda: False
    try:
        with _fake_torch_ops():
            a, outs = tpk.all_gather_matmul(
                torch.ones(2, 3), [torch.ones(3, 4)], 0, dist.group.WORLD, backend=NAME
            )
            calls = list(_calls)
    finally:
        torch_symm_mem._takes_return_a = saved
    return a, outs[0].shape, calls[0][5]


def test_older_torch_without_return_a_keyword(worlds):
    for a, shape, return_a in worlds(2).run(_without_return_a_keyword):
        assert a is None and shape == (4, 4)
        assert return_a is True  # the schema's default when the keyword is not passed


def _fakes_removed() -> bool:
    with _fake_torch_ops():
        pass
    try:
        torch.ops.symm_mem.fused_matmul_reduce_scatter(
            torch.ones(2, 2), torch.ones(2, 2), "sum", 0, dist.group.WORLD.group_name
        )
    except NotImplementedError:
        return True
    return False


def test_fakes_leave_no_cpu_kernel_behind(worlds):
    assert all(worlds(2).run(_fakes_removed))


# ---------------------------------------------------------------- first contact with a GPU


def _shared_gpu_multicast_board() -> tuple:
    """Ranks sharing a GPU (overlapping devices allowed) on a device that reports multicast: a
    small gather without ``return_a`` is where torch would take its multicast path."""
    saved = os.environ.get(_ALLOW)
    os.environ[_ALLOW] = "1"
    _device_multicast[0] = True
    try:
        with _fake_torch_ops():
            shard = torch.full((2, 3), float(dist.get_rank() + 1))
            a, outs = tpk.all_gather_matmul(
                shard, [torch.ones(3, 4)], 0, dist.group.WORLD, backend=NAME
            )
            calls = list(_calls)
    finally:
        _device_multicast[0] = False
        if saved is None:
            del os.environ[_ALLOW]
        else:
            os.environ[_ALLOW] = saved
    return a, outs[0][:, 0].tolist(), calls[0][5]


def test_shared_gpu_keeps_torch_off_its_multicast_all_gather(worlds):
    """(a) torch picks multimem_all_gather_out by the device's report, but rendezvous sets no
    multicast up while overlapping devices are allowed: the backend asks for A there."""
    for a, col, return_a in worlds(2).run(_shared_gpu_multicast_board):
        assert a is None  # A was asked of torch, not returned to the caller
        assert col == [3.0, 3.0, 6.0, 6.0]  # rank 0's rows (1 * 3), then rank 1's (2 * 3)
        assert return_a is True


def _guarded_calls() -> list[tuple]:
    """Every fake op call, with the device guards entered and left around it."""
    saved = symmetric_memory._on_device

    @contextlib.contextmanager
    def recorder(device):
        _calls.append(("guard", str(device)))
        yield
        _calls.append(("unguard",))

    symmetric_memory._on_device = recorder
    try:
        with _fake_torch_ops():
            group = dist.group.WORLD
            backend = torch_symm_mem.BACKEND
            backend.all_gather_matmul(torch.ones(2, 3), [torch.ones(3, 4)], group, return_a=False)
            backend.matmul_reduce_scatter(
                torch.ones(4, 3), torch.ones(3, 5), group, addend=torch.ones(4, 5)
            )
            return [
                call[:1] if call[0] in ("ag", "rs") else call
                for call in _calls
                if call[0] != "grow"
            ]
    finally:
        symmetric_memory._on_device = saved


def test_torch_ops_run_on_the_tensors_device(worlds):
    """(b) torch allocates its workspace and picks its streams on the current device: each op
    (and the addend's collective) runs with the tensors' device made current."""
    for calls in worlds(2).run(_guarded_calls):
        assert calls == [
            ("guard", "cpu"),
            ("ag",),
            ("unguard",),
            ("guard", "cpu"),
            ("rs",),
            ("unguard",),
        ], calls


def _reasons_on_a_cuda_host(backend_name: str, gpus: int, allow: str | None) -> str | None:
    """``unavailable_reason`` for ``cuda:0`` as a host with ``gpus`` GPUs and torch's
    symmetric-memory backend ``backend_name`` would give it."""
    saved = (torch.cuda.is_available, torch.cuda.device_count, symmetric_memory._symm_mem_backend)
    env = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", _ALLOW)}
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: gpus
    symmetric_memory._symm_mem_backend = lambda symm_mem, device: backend_name
    os.environ["LOCAL_WORLD_SIZE"] = str(dist.get_world_size())
    if allow is None:
        os.environ.pop(_ALLOW, None)
    else:
        os.environ[_ALLOW] = allow
    try:
        return torch_symm_mem.BACKEND.unavailable_reason(dist.group.WORLD, torch.device("cuda", 0))
    finally:
        torch.cuda.is_available, torch.cuda.device_count = saved[:2]
        symmetric_memory._symm_mem_backend = saved[2]
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _cuda_host_reasons() -> dict[str, str | None]:
    return {
        "cuda, a GPU per rank": _reasons_on_a_cuda_host("CUDA", 2, None),
        "nvshmem": _reasons_on_a_cuda_host("NVSHMEM", 2, None),
        "no backend": _reasons_on_a_cuda_host(None, 2, None),
        "shared gpu": _reasons_on_a_cuda_host("CUDA", 1, None),
        "shared gpu, allowed": _reasons_on_a_cuda_host("CUDA", 1, "1"),
    }


def test_unavailable_where_torch_would_fail(worlds):
    """(c) ``auto`` rules torch_symm_mem out, instead of crashing in torch, for a symmetric-memory
    backend other than CUDA and for ranks that share a GPU without the overlapping variable."""
    for got in worlds(2).run(_cuda_host_reasons):
        assert got["cuda, a GPU per rank"] is None
        assert "backend for cuda:0 is 'NVSHMEM'" in got["nvshmem"]
        assert "set_backend('CUDA')" in got["nvshmem"]
        assert "has no symmetric-memory backend for cuda:0" in got["no backend"]
        assert "2 ranks on this host share 1 GPU(s)" in got["shared gpu"]
        assert "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1" in got["shared gpu"]
        assert got["shared gpu, allowed"] is None


def test_graph_capture_refused_only_where_the_workspace_would_grow(monkeypatch):
    """(d) torch raises mid-capture when its workspace must grow: a captured call is refused up
    front exactly then, naming the bytes and the way to reserve them; on CUDA only (asking a CPU
    build whether it captures raises). Before, every captured call was refused."""
    backend, group, cuda = torch_symm_mem.BACKEND, _FakeGroup(), torch.device("cuda", 0)
    workspaces = {"fake": torch.empty(1000, dtype=torch.uint8)}
    monkeypatch.setattr(SYMM_MEM, "_group_name_to_workspace_tensor", workspaces)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    f32 = torch.float32
    for op, fits, grows in (
        ("all_gather_matmul", 1000, 1001),  # torch asks for the shard
        ("matmul_reduce_scatter", 1000, 1002),  # two [m, N] chunks of the [W*m, N] product: 2/W
    ):
        need = base.CaptureNeed(op, fits, f32)
        assert backend.capture_unready_reason(group, cuda, need) is None
        assert torch_symm_mem._check_call(op, group, cuda, fits, f32) is True
        why = backend.capture_unready_reason(group, cuda, base.CaptureNeed(op, grows, f32))
        assert f"has 1000 bytes and this {op}" in why and f"asks for {grows}" in why, why
        assert f"tp_kernels.reserve(group, {grows})" in why, why
        refused = rf"torch_symm_mem {op}: .*asks for {grows}.*nothing was launched"
        with pytest.raises(base.CaptureUnreadyError, match=refused):
            torch_symm_mem._check_call(op, group, cuda, grows, f32)
        assert torch_symm_mem._check_call(op, group, torch.device("cpu"), grows, f32) is False
    # the backward's plain re-gather is a collective of the group: no workspace, captured where
    # the group's collectives are NCCL's; gloo's run on the host
    regather = base.CaptureNeed("all_gather", 10**9, f32)
    assert backend.capture_unready_reason(group, cuda, regather) is None
    why = backend.capture_unready_reason(_FakeGroup("gloo"), cuda, regather)
    assert why is not None and "'gloo'" in why, why
    workspaces.clear()  # no workspace yet: 0 bytes
    why = backend.capture_unready_reason(group, cuda, base.CaptureNeed("all_gather_matmul", 8, f32))
    assert "has 0 bytes" in why, why
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert torch_symm_mem._check_call("all_gather_matmul", group, cuda, 10**9, f32) is False

    # Each op checks before it registers the group, enqueues the addend or calls torch.
    checked: list[str] = []

    def refuse(op: str, *args) -> bool:
        checked.append(op)
        raise RuntimeError("refused")

    def touched(*args, **kwargs):
        raise AssertionError("something ran before the check")

    monkeypatch.setattr(torch_symm_mem, "_check_call", refuse)
    monkeypatch.setattr(torch_symm_mem, "_enable_for_group", touched)
    monkeypatch.setattr(torch_symm_mem, "reduce_scatter_single", touched)
    with pytest.raises(RuntimeError, match="refused"):
        backend.all_gather_matmul(torch.ones(2, 3), [torch.ones(3, 4)], group, return_a=True)
    with pytest.raises(RuntimeError, match="refused"):
        backend.matmul_reduce_scatter(
            torch.ones(4, 3), torch.ones(3, 5), group, addend=torch.ones(4, 5)
        )
    assert checked == ["all_gather_matmul", "matmul_reduce_scatter"]


def test_reserve_grows_torchs_workspace(monkeypatch):
    """``reserve`` asks torch's workspace for the largest of what calls of up to ``nbytes`` ask
    (the all-gather's shard), on the tensors' device, after registering the group; nothing on
    the CPU or for a group of one."""
    asked: list[tuple] = []
    monkeypatch.setattr(
        SYMM_MEM, "get_symm_mem_workspace", lambda name, min_size: asked.append((name, min_size))
    )
    monkeypatch.setattr(torch_symm_mem, "_enable_for_group", lambda g: asked.append("enabled"))

    @contextlib.contextmanager
    def on_device(device):
        asked.append(("on", str(device)))
        yield

    monkeypatch.setattr(symmetric_memory, "_on_device", on_device)
    backend = torch_symm_mem.BACKEND
    backend.reserve(_FakeGroup(), torch.device("cuda", 1), 4096)
    assert asked == ["enabled", ("on", "cuda:1"), ("fake", 4096)]
    asked.clear()
    backend.reserve(_FakeGroup(), torch.device("cpu"), 4096)

    class One(_FakeGroup):
        def size(self) -> int:
            return 1

    backend.reserve(One(), torch.device("cuda", 0), 4096)
    assert asked == []


def _captured_calls() -> dict:
    """After an eager warmup call of each op, the same calls captured (CPU tensors standing in
    for CUDA ones): what torch's ops were asked, and the refusals."""
    group, rank = dist.group.WORLD, dist.get_rank()
    backend = torch_symm_mem.BACKEND
    shard = torch.full((2, 3), float(rank + 1))
    out: dict = {}
    saved = torch.cuda.is_current_stream_capturing, base.capturing
    _device_multicast[0] = True  # where torch would take its multicast all-gather eagerly
    with _fake_torch_ops():
        backend.all_gather_matmul(shard, [torch.ones(3, 4)], group, return_a=False)
        backend.matmul_reduce_scatter(torch.ones(4, 3), torch.ones(3, 5), group)
        warm = dict(SYMM_MEM._group_name_to_workspace_tensor)
        _calls.clear()
        torch.cuda.is_current_stream_capturing = lambda: True
        base.capturing = lambda device: True
        try:
            a, outs = backend.all_gather_matmul(shard, [torch.ones(3, 4)], group, return_a=False)
            out["ag"] = (a, outs[0][:, 0].tolist())
            out["rs"] = backend.matmul_reduce_scatter(torch.ones(4, 3), torch.ones(3, 5), group)
            try:
                backend.matmul_reduce_scatter(
                    torch.ones(4, 3), torch.ones(3, 5), group, addend=torch.ones(4, 5)
                )
            except base.CaptureUnreadyError as exc:
                out["addend"] = str(exc)
            try:
                backend.all_gather_matmul(
                    torch.ones(8, 3), [torch.ones(3, 4)], group, return_a=True
                )
            except base.CaptureUnreadyError as exc:
                out["larger"] = str(exc)
            out["calls"] = list(_calls)
        finally:
            torch.cuda.is_current_stream_capturing, base.capturing = saved
            _device_multicast[0] = False
        out["same workspace"] = SYMM_MEM._group_name_to_workspace_tensor == warm
    return out


def test_captured_calls_reuse_the_warmups_workspace(worlds):
    """(e) Under capture the calls a warmup sized run without growing torch's workspace, ask for
    A (keeping torch off its multicast all-gather, whose buffer is W times the shard's), and
    refuse, before calling torch, a larger call and an addend on a gloo group."""
    for got in worlds(2).run(_captured_calls):
        assert got["ag"] == (None, [3.0, 3.0, 6.0, 6.0])
        assert got["rs"].shape == (2, 5)
        assert "backend 'gloo' cannot be captured" in got["addend"], got["addend"]
        assert "has 80 bytes and this all_gather_matmul" in got["larger"]
        assert "asks for 96" in got["larger"] and "nothing was launched" in got["larger"]
        kinds = [(call[0], call[5]) if call[0] == "ag" else call[:1] for call in got["calls"]]
        assert kinds == [("ag", True), ("rs",)], got["calls"]
        assert got["same workspace"]


def _reserved(names: list[str] | None, nbytes: object) -> object:
    """What ``tp_kernels.reserve`` asked of each backend (recorded by a spy), or its error."""
    from tp_kernels.backends.choice import BACKEND_NAMES, get_backend

    asked: list[tuple] = []
    # Every backend class's own reserve (symm has one) and the base's, spied on.
    classes = {base.Backend} | {type(get_backend(n)) for n in BACKEND_NAMES if n != "auto"}
    saved = {cls: cls.__dict__.get("reserve") for cls in classes}
    for cls in classes:
        cls.reserve = lambda self, group, device, n: asked.append((self.name, str(device), n))
    try:
        tpk.reserve(dist.group.WORLD, nbytes, device="cpu", backends=names)
    except (TypeError, ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        for cls, original in saved.items():
            if original is None:
                del cls.reserve
            else:
                cls.reserve = original
    return asked


def test_public_reserve_asks_each_backend(worlds):
    available = [n for n, why in tpk.available_backends("cpu").items() if why == "ok"]
    for got in worlds(2).run(_reserved, None, 4096):
        assert got == [(n, "cpu", 4096) for n in available], got
        assert ("reference", "cpu", 4096) in got
    for got in worlds(2).run(_reserved, ["pipelined"], 0):
        assert got == [("pipelined", "cpu", 0)]
    for got in worlds(2).run(_reserved, [NAME], 8):
        assert got.startswith("RuntimeError: reserve: backend 'torch_symm_mem' cannot run here")
    for got in worlds(2).run(_reserved, ["nope"], 8):
        assert got.startswith("ValueError: backend: 'nope' is not a concrete backend"), got
    for got in worlds(2).run(_reserved, None, -1):
        assert got == "ValueError: reserve: nbytes must be an int >= 0, got -1"
