"""The fused ops against an unsharded float64 truth, the reference backend, and bad input.

Layered cheapest first: argument checks with no process group, then gloo worlds of 1..4 ranks
running every backend over a table of shapes, dims and dtypes, forward and backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time

import pytest
import torch
import torch.distributed as dist

import tp_kernels as tpk
from tp_kernels import config
from tp_kernels.backends import choice, pipelined
from tp_kernels.backends.choice import current_backend
from tp_kernels.ops._checks import check_all_gather_matmul, check_matmul_reduce_scatter
from tp_kernels.testing.numerics import check_close

BACKENDS = ("reference", "pipelined", "symm")
DTYPES = (torch.float64, torch.float32, torch.bfloat16)


# ---------------------------------------------------------------- no process group needed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (((3, 4), [(4, 2)], 1), r"gather_dim=1 is the contracted \(last\) dim of a_shard"),
        (((3, 4), [(4, 2)], 2), r"gather_dim must be an int in \[-2, 1\].*got 2"),
        (((4,), [(4, 2)], 0), r"a_shard must have >= 2 dims"),
        (((0, 4), [(4, 2)], 0), r"a_shard has a zero-sized dim \(shape \(0, 4\)\)"),
        (((3, 4), [(5, 2)], 0), r"bs\[0\] has K=5 rows.*a_shard has K=4"),
        (((3, 4), [(4, 2), (4,)], 0), r"bs\[1\] must be 2-D \[K, N\], got shape \(4,\)"),
        (((3, 4), [(4, 0)], 0), r"bs\[0\] has a zero-sized dim"),
        (((3, 4), [], 0), r"bs must be a non-empty list"),
    ],
)
def test_all_gather_matmul_checks(args, message):
    a_shape, b_shapes, dim = args
    with pytest.raises((ValueError, TypeError), match=message):
        check_all_gather_matmul(torch.ones(a_shape), [torch.ones(s) for s in b_shapes], dim)


def test_dtype_and_device_mismatch_named():
    a = torch.ones(3, 4)
    with pytest.raises(
        ValueError,
        match=r"bs\[0\] has dtype torch.float64 but a_shard has "
        r"torch.float32",
    ):
        check_all_gather_matmul(a, [torch.ones(4, 2, dtype=torch.float64)], 0)
    with pytest.raises(ValueError, match=r"bs\[0\] is on meta but a_shard is on cpu"):
        check_all_gather_matmul(a, [torch.ones(4, 2, device="meta")], 0)


class _FakeGroup:
    def size(self) -> int:
        return 4


@pytest.mark.parametrize(
    ("a_shape", "dim", "op", "message"),
    [
        ((6, 4), 0, "sum", r"a.shape\[0\]=6 .* must be divisible by the group size 4"),
        ((8, 4), -1, "sum", r"scatter_dim=1 is the contracted"),
        ((8, 4), 0, "max", r"reduce_op must be 'sum' or 'avg', got 'max'"),
    ],
)
def test_matmul_reduce_scatter_checks(a_shape, dim, op, message):
    with pytest.raises(ValueError, match=message):
        check_matmul_reduce_scatter(torch.ones(a_shape), torch.ones(4, 2), dim, op, _FakeGroup())


def test_backend_selection_precedence(monkeypatch):
    # The environment is read once (tp_kernels.config); reset() makes the next use read it again.
    monkeypatch.delenv("TP_KERNELS_BACKEND", raising=False)
    config.BACKEND.reset()
    try:
        assert current_backend() == "auto"
        monkeypatch.setenv("TP_KERNELS_BACKEND", "pipelined")
        config.BACKEND.reset()
        assert current_backend() == "pipelined"
        tpk.set_backend("reference")
        assert current_backend() == "reference"
        with tpk.use_backend("pipelined"):
            assert current_backend() == "pipelined"
        assert current_backend() == "reference"
        with pytest.raises(ValueError, match=r"set_backend\(name\): unknown backend 'fast'"):
            tpk.set_backend("fast")
        config.BACKEND.reset()
        monkeypatch.setenv("TP_KERNELS_BACKEND", "nope")
        with pytest.raises(ValueError, match="TP_KERNELS_BACKEND: unknown backend 'nope'"):
            current_backend()
    finally:
        config.BACKEND.reset()


def test_available_backends_reports_every_backend():
    avail = tpk.available_backends()
    assert set(avail) == {"reference", "pipelined", "symm", "torch_symm_mem"}
    assert avail["reference"] == "ok" and avail["pipelined"] == "ok"
    assert isinstance(avail["symm"], str) and avail["symm"]


# ---------------------------------------------------------------- numerics on gloo worlds


@dataclasses.dataclass(frozen=True)
class AGCase:
    shard: tuple[int, ...]  # a_shard shape on every rank
    dim: int
    ns: tuple[int, ...]  # N_j of each b
    noncontig: bool = False
    chunks: int | None = None  # pipelined row blocks per peer (None: chosen from the shape)
    dtypes: tuple[torch.dtype, ...] = DTYPES


AG_CASES = [
    AGCase((1, 1), 0, (1,)),
    AGCase((3, 5), 0, (7,)),
    AGCase((3, 5), -2, (2, 3, 1), noncontig=True),
    AGCase((2, 3, 6), 0, (4, 5, 1)),
    AGCase((2, 3, 6), 1, (4,), noncontig=True),
    AGCase((7, 4), 0, (3, 2), chunks=3),
    AGCase((2, 5, 3, 4), 2, (5,)),
    # 2 MiB per shard: the pipelined backend splits each peer transfer into 2 blocks by itself.
    AGCase((512, 1024), 0, (8,), dtypes=(torch.float32,)),
]


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a transposed-storage layout."""
    out = torch.empty(tuple(reversed(t.shape)), dtype=t.dtype).permute(*reversed(range(t.ndim)))
    return out.copy_(t)


def _ag_problem(case: AGCase, world: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    full = list(case.shard)
    dim = case.dim % len(full)
    full[dim] *= world
    a_full = torch.randn(full, generator=g, dtype=torch.float64).to(dtype)
    b_all = [
        [
            torch.randn(case.shard[-1], n, generator=g, dtype=torch.float64).to(dtype)
            for n in case.ns
        ]
        for _ in range(world)
    ]  # b_all[r][j]: rank r's b_j
    grad_out = [
        [torch.randn(*full[:-1], n, generator=g, dtype=torch.float64).to(dtype) for n in case.ns]
        for _ in range(world)
    ]
    grad_a = [torch.randn(full, generator=g, dtype=torch.float64).to(dtype) for _ in range(world)]
    return dim, a_full, b_all, grad_out, grad_a


def _ag_unsharded(
    dim, a_full, b_all, grad_out, grad_a, rank, world, compute_dtype, use_a, magnitude=False
):
    """Single-process truth: outputs and grads of rank ``rank``'s inputs.

    ``magnitude=True`` runs it on absolute values: the sizes of the terms each result sums.
    """
    val = (lambda t: t.abs()) if magnitude else (lambda t: t)
    a = val(a_full).to(compute_dtype, copy=True).requires_grad_()
    bs = [[val(b).to(compute_dtype, copy=True).requires_grad_() for b in row] for row in b_all]
    loss = 0
    for r in range(world):
        for b, g in zip(bs[r], grad_out[r]):
            loss = loss + ((a @ b) * val(g).to(compute_dtype)).sum()
        if use_a:
            loss = loss + (a * val(grad_a[r]).to(compute_dtype)).sum()
    loss.backward()
    outs = [(a @ b).detach() for b in bs[rank]]
    return outs, a.grad.chunk(world, dim)[rank], [b.grad for b in bs[rank]]


def _run_ag_cases(cases: list[AGCase], group_kind: str) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = {
        "pg": dist.group.WORLD,
        "name": dist.group.WORLD.group_name,
        "mesh": dist.device_mesh.init_device_mesh("cpu", (world,)),
    }[group_kind]
    failures = []
    for i, case in enumerate(cases):
        pipelined.set_chunks(case.chunks)
        for dtype in case.dtypes:
            dim, a_full, b_all, grad_out, grad_a = _ag_problem(case, world, dtype, seed=i)
            for return_a in (False, True):
                truth = _ag_unsharded(
                    dim, a_full, b_all, grad_out, grad_a, rank, world, torch.float64, return_a
                )
                same = _ag_unsharded(
                    dim, a_full, b_all, grad_out, grad_a, rank, world, dtype, return_a
                )
                mag = _ag_unsharded(
                    dim,
                    a_full,
                    b_all,
                    grad_out,
                    grad_a,
                    rank,
                    world,
                    torch.float64,
                    return_a,
                    magnitude=True,
                )
                results = {}
                for backend in BACKENDS:
                    for save in (False, True):
                        a_shard = a_full.chunk(world, dim)[rank].clone()
                        if case.noncontig:
                            a_shard = _noncontiguous(a_shard)
                        a_shard.requires_grad_()
                        bs = [
                            (_noncontiguous(b) if case.noncontig else b.clone()).requires_grad_()
                            for b in b_all[rank]
                        ]
                        a, outs = tpk.all_gather_matmul(
                            a_shard,
                            bs,
                            case.dim,
                            group,
                            backend=backend,
                            return_a=return_a,
                            save_gathered_a=save,
                        )
                        loss = sum((o * g).sum() for o, g in zip(outs, grad_out[rank]))
                        if return_a:
                            ok = torch.equal(a, a_full)
                            if not ok:
                                failures.append(
                                    f"case {i} {case} {dtype} {backend}: returned a "
                                    f"!= the gathered tensor"
                                )
                            loss = loss + (a * grad_a[rank]).sum()
                        loss.backward()
                        results[backend, save] = (outs, a_shard.grad, [b.grad for b in bs])
                for (backend, save), (outs, ga, gbs) in results.items():
                    tag = f"case {i} {case} {dtype} {backend} save={save} return_a={return_a}"
                    refs = [same] + ([results["reference", save]] if backend != "reference" else [])
                    for ref in refs:
                        pairs = [("out", *x) for x in zip(outs, truth[0], ref[0], mag[0])]
                        pairs.append(("grad a_shard", ga, truth[1], ref[1], mag[1]))
                        pairs += [("grad b", *x) for x in zip(gbs, truth[2], ref[2], mag[2])]
                        for name, actual, t, r, mg in pairs:
                            msg = check_close(name, actual, t, r, mg)
                            if msg:
                                failures.append(f"{tag}: {msg}")
    pipelined.set_chunks(None)
    return failures


@dataclasses.dataclass(frozen=True)
class RSCase:
    rows: tuple[int, ...]  # a's shape without K, with s in place of M (M = W * s)
    dim: int
    k: int  # local K (K sharded across ranks, as in a rowwise Linear)
    n: int
    reduce_op: str = "sum"
    noncontig: bool = False
    chunks: int | None = None
    dtypes: tuple[torch.dtype, ...] = DTYPES
    bias: bool = False


RS_CASES = [
    RSCase((1,), 0, 1, 1),
    RSCase((3,), 0, 5, 7),
    RSCase((3,), 0, 4, 6, reduce_op="avg", noncontig=True),
    RSCase((3,), 0, 4, 6, bias=True),
    RSCase((2, 3), 1, 4, 5, reduce_op="avg", bias=True),
    RSCase((2, 3), 0, 4, 5),
    RSCase((2, 3), 1, 3, 2, noncontig=True),
    RSCase((5, 2), -3, 4, 3, chunks=2),
    RSCase((7,), 0, 6, 5, chunks=3),
    # 1 MiB per destination: pipelined picks its own block count.
    RSCase((256,), 0, 16, 1024, dtypes=(torch.float32,)),
]


def _rs_unsharded(a_full, b_full, bias, grad_full, scale, dim, compute_dtype, magnitude=False):
    """Single-process truth for this rank: its output slice and the grads of its shards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    val = (lambda t: t.abs()) if magnitude else (lambda t: t)
    a = val(a_full).to(compute_dtype, copy=True).requires_grad_()
    b = val(b_full).to(compute_dtype, copy=True).requires_grad_()
    c = (a @ b) * scale
    if bias is not None:
        bias = val(bias).to(compute_dtype, copy=True).requires_grad_()
        c = c + bias
    (c * val(grad_full).to(compute_dtype)).sum().backward()
    grads = (
        c.detach().chunk(world, dim)[rank],
        a.grad.chunk(world, -1)[rank],
        b.grad.chunk(world, 0)[rank],
    )
    return grads + ((bias.grad,) if bias is not None else ())


def _run_rs_cases(cases: list[RSCase]) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    for i, case in enumerate(cases):
        pipelined.set_chunks(case.chunks)
        ndim = len(case.rows) + 1
        dim = case.dim % ndim
        for dtype in case.dtypes:
            g = torch.Generator().manual_seed(100 + i)
            shape = list(case.rows)
            shape[dim] *= world
            a_full = torch.randn(*shape, world * case.k, generator=g, dtype=torch.float64)
            b_full = torch.randn(world * case.k, case.n, generator=g, dtype=torch.float64)
            grad_full = torch.randn(*shape, case.n, generator=g, dtype=torch.float64)
            bias = torch.randn(case.n, generator=g, dtype=torch.float64) if case.bias else None
            a_full, b_full, grad_full = (t.to(dtype) for t in (a_full, b_full, grad_full))
            bias = bias.to(dtype) if case.bias else None
            scale = 1 / world if case.reduce_op == "avg" else 1
            problem = (a_full, b_full, bias, grad_full, scale, dim)
            truth = _rs_unsharded(*problem, torch.float64)
            same = _rs_unsharded(*problem, dtype)
            mag = _rs_unsharded(*problem, torch.float64, magnitude=True)
            results = {}
            for backend in BACKENDS:
                a = a_full.chunk(world, -1)[rank].clone()
                b = b_full.chunk(world, 0)[rank].clone()
                if case.noncontig:
                    a, b = _noncontiguous(a), _noncontiguous(b)
                a.requires_grad_()
                b.requires_grad_()
                bias_r = bias.clone().requires_grad_() if case.bias else None
                out = tpk.matmul_reduce_scatter(
                    a,
                    b,
                    case.dim,
                    dist.group.WORLD,
                    reduce_op=case.reduce_op,
                    backend=backend,
                    bias=bias_r,
                )
                (out * grad_full.chunk(world, dim)[rank]).sum().backward()
                results[backend] = (out, a.grad, b.grad) + ((bias_r.grad,) if case.bias else ())
            for backend, got in results.items():
                refs = [same] + ([results["reference"]] if backend != "reference" else [])
                for ref in refs:
                    names = ("out", "grad a", "grad b", "grad bias")
                    for name, *x in zip(names, got, truth, ref, mag):
                        msg = check_close(name, *x)
                        if msg:
                            failures.append(f"case {i} {case} {dtype} {backend}: {msg}")
    pipelined.set_chunks(None)
    return failures


def _assert_no_failures(per_rank: list[list[str]]) -> None:
    lines = [f"rank {r}: {f}" for r, fails in enumerate(per_rank) for f in fails]
    assert not lines, f"{len(lines)} mismatches:\n" + "\n".join(lines[:40])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_gather_matmul_numerics(worlds, world_size):
    _assert_no_failures(worlds(world_size).run(_run_ag_cases, AG_CASES, "pg"))


@pytest.mark.parametrize("group_kind", ["name", "mesh"])
def test_all_gather_matmul_group_forms(worlds, group_kind):
    _assert_no_failures(worlds(2).run(_run_ag_cases, AG_CASES[2:4], group_kind))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_matmul_reduce_scatter_numerics(worlds, world_size):
    _assert_no_failures(worlds(world_size).run(_run_rs_cases, RS_CASES))


# ---------------------------------------------------------------- bad input across ranks


@contextlib.contextmanager
def _symm_disabled():
    """Make the symm backend report itself unavailable, as on a machine without the heap."""
    symm = choice.get_backend("symm")
    symm.unavailable_reason = lambda group, device: "disabled by the test"
    try:
        yield
    finally:
        del symm.unavailable_reason


def _bad_call(kind: str) -> str:
    rank = dist.get_rank()
    group = dist.group.WORLD
    a, b = torch.ones(4, 3), [torch.ones(3, 2)]
    try:
        if kind == "shape_mismatch":
            tpk.all_gather_matmul(torch.ones(4 + rank, 3), b, 0, group)
        elif kind == "one_rank_bad_dim":
            tpk.all_gather_matmul(a, b, 1 if rank == 1 else 0, group)
        elif kind == "rs_one_rank_bad_k":
            tpk.matmul_reduce_scatter(a, torch.ones(3 + rank, 2), 0, group)
        elif kind == "rs_n_mismatch":
            tpk.matmul_reduce_scatter(a, torch.ones(3, 2 + rank), 0, group)
        elif kind == "unknown_backend":
            tpk.all_gather_matmul(a, b, 0, group, backend="nccl_magic")
        elif kind == "unavailable_backend":
            with _symm_disabled():
                tpk.matmul_reduce_scatter(a, b[0], 0, group, backend="symm")
        elif kind == "not_member":
            sub = dist.new_group([0])
            if rank == 0:  # a member: joins the outsider's check that the world still works
                dist.all_reduce(torch.ones(1))
                return "member"
            tpk.all_gather_matmul(a, b, 0, sub)
        elif kind == "bad_group_type":
            tpk.all_gather_matmul(a, b, 0, 42)
        elif kind == "bad_group_name":
            tpk.all_gather_matmul(a, b, 0, "no-such-group")
        elif kind == "int_dtype":
            # pipelined summed int64 in float32 (67108864 for 67108867); symm raised late.
            big = torch.full((4, 3), 2**24 + 1, dtype=torch.int64)
            tpk.matmul_reduce_scatter(big, torch.ones(3, 2, dtype=torch.int64), 0, group)
        elif kind == "bool_dtype":
            tpk.all_gather_matmul(a.bool(), [b[0].bool()], 0, group, backend="pipelined")
        elif kind in ("chunks_differ", "chunks_not_a_number"):
            value = str(2 + rank) if kind == "chunks_differ" else ("abc" if rank else "2")
            os.environ["TP_KERNELS_PIPELINE_CHUNKS"] = value
            config.PIPELINE_CHUNKS.reset()  # read the environment again
            try:
                tpk.all_gather_matmul(a, b, 0, group, backend="pipelined")
            finally:
                del os.environ["TP_KERNELS_PIPELINE_CHUNKS"]
                config.PIPELINE_CHUNKS.reset()
        elif kind == "default_group":
            _, (out,) = tpk.all_gather_matmul(a, b, 0, None)
            return f"ok {tuple(out.shape)}"
        elif kind == "dtensor_input":
            mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
            dt = dist.tensor.distribute_tensor(torch.ones(4, 3), mesh, [dist.tensor.Shard(0)])
            tpk.all_gather_matmul(dt, b, 0, group)
    except (ValueError, TypeError, RuntimeError) as exc:
        # The group still works afterwards: nobody is stuck in a collective.
        t = torch.ones(1)
        dist.all_reduce(t)
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize(
    ("kind", "pattern"),
    [
        (
            "shape_mismatch",
            r"ValueError: all_gather_matmul: the ranks of group .* called with "
            r"different arguments.*rank 0: .*a=\(4, 3\).*rank 1: .*a=\(5, 3\)",
        ),
        (
            "one_rank_bad_dim",
            r"ValueError: all_gather_matmul: .*different arguments.*rank 1: "
            r"error: .*gather_dim=1 is the contracted",
        ),
        (
            "rs_one_rank_bad_k",
            r"ValueError: matmul_reduce_scatter: .*different arguments.*"
            r"rank 1: error: .*b has K=4 rows",
        ),
        (
            "rs_n_mismatch",
            r"ValueError: matmul_reduce_scatter: .*different arguments.*"
            r"rank 0: .*'n': 2.*rank 1: .*'n': 3",
        ),
        ("unknown_backend", r"ValueError: backend: unknown backend 'nccl_magic'"),
        (
            "unavailable_backend",
            r"RuntimeError: backend='symm' cannot run matmul_reduce_scatter here: disabled by "
            r"the test",
        ),
        (
            "bad_group_type",
            r"TypeError: all_gather_matmul: group must be a ProcessGroup, a 1-D "
            r"DeviceMesh, a group name or None \(the default group\), got int",
        ),
        (
            "int_dtype",
            r"TypeError: matmul_reduce_scatter: a has dtype torch.int64; the fused ops take "
            r"floating tensors only",
        ),
        (
            "bool_dtype",
            r"TypeError: all_gather_matmul: a_shard has dtype torch.bool; the fused ops take "
            r"floating tensors only",
        ),
        ("default_group", r"ok \(8, 2\)"),
        (
            "chunks_differ",
            r"ValueError: all_gather_matmul: the ranks .* called with different arguments.*"
            r"rank 0: .*chunks=2.*rank 1: .*chunks=3",
        ),
        (
            "chunks_not_a_number",
            r"ValueError: all_gather_matmul: .*different arguments.*rank 1: error: "
            r"TP_KERNELS_PIPELINE_CHUNKS: got 'abc', expected a positive integer",
        ),
        (
            "bad_group_name",
            r"ValueError: all_gather_matmul: group 'no-such-group' is not a "
            r"registered process group name",
        ),
        (
            "dtensor_input",
            r"TypeError: all_gather_matmul: a_shard must be a local tensor, got a "
            r"DTensor",
        ),
    ],
)
def test_bad_input_raises_on_every_rank(worlds, kind, pattern):
    for rank, message in enumerate(worlds(2).run(_bad_call, kind)):
        assert __import__("re").search(pattern, message, flags=2 | 16), (rank, message)


def test_rank_outside_group_is_named(worlds):
    member, outsider = worlds(2).run(_bad_call, "not_member")
    assert member == "member"
    assert "this rank (global rank 1) is not a member" in outsider


def _counted_calls(save: bool) -> dict:
    tpk.reset_comm_stats()
    a = torch.ones(4, 3, requires_grad=True)
    b1, b2 = torch.ones(3, 2, requires_grad=True), torch.ones(3, 5, requires_grad=True)
    _, outs = tpk.all_gather_matmul(
        a, [b1, b2], 0, dist.group.WORLD, backend="pipelined", save_gathered_a=save
    )
    y = tpk.matmul_reduce_scatter(
        torch.cat(outs, 1), torch.ones(7, 3), 0, dist.group.WORLD, backend="reference"
    )
    forward = dict(tpk.comm_stats())
    y.sum().backward()
    return {"forward": forward, "all": dict(tpk.comm_stats())}


@pytest.mark.parametrize("save", [False, True])
def test_comm_stats_count_each_fused_call(worlds, save):
    stats = worlds(2).run(_counted_calls, save)[0]
    assert stats["forward"] == {
        ("forward", "all_gather_matmul", "pipelined"): 1,
        ("forward", "matmul_reduce_scatter", "reference"): 1,
    }
    backward = {k: v for k, v in stats["all"].items() if k[0] == "backward"}
    expected = {
        # one reduce-scatter for both bs' input grads; the shard gathered again unless saved
        ("backward", "matmul_reduce_scatter", "pipelined"): 1,
        ("backward", "all_gather_matmul", "reference"): 1,
    }
    if not save:
        expected["backward", "all_gather", "pipelined"] = 1
    assert backward == expected


# ---------------------------------------------------------------- auto and torch.compile


def _auto_choices() -> tuple[bool, list[str], list[str]]:
    """Two rounds of auto calls at a small and a big shape, with symm and then (other shape
    classes, so nothing cached is reused) without it; the log and the backends that ran. On a
    group of its own: auto's choices are kept per group, and earlier tests used the world's."""
    group = dist.new_group(list(range(dist.get_world_size())))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    log = logging.getLogger("tp_kernels")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    symm_ok = tpk.available_backends()["symm"] == "ok"
    ran: list[str] = []
    try:
        for disable, (small, big) in (
            (False, ((4, 8), (1024, 512))),
            (True, ((4, 20), (1024, 1100))),
        ):
            with _symm_disabled() if disable else contextlib.nullcontext():
                for _ in range(2):  # the second round must neither log nor time again
                    for rows, k in (small, big):
                        tpk.reset_comm_stats()
                        a = torch.ones(rows, k)
                        tpk.all_gather_matmul(a, [torch.ones(k, 2)], 0, group)
                        ran += [backend for (_, _, backend) in tpk.comm_stats()]
    finally:
        log.removeHandler(handler)
        dist.destroy_process_group(group)
    return symm_ok, records, ran


def test_auto_rules_out_times_the_rest_and_logs_once(worlds):
    (symm_ok, records, ran), (_, records1, ran1) = worlds(2).run(_auto_choices)
    # All ranks took the same backend in every call (the timing's verdict is agreed).
    assert ran == ran1 and records[-1].split(": ")[1] == records1[-1].split(": ")[1]
    # One line per shape class, none in the second round.
    assert len(records) == 4, records
    small, big, small_off, big_off = records
    if symm_ok:
        # pipelined is ruled out at the small block by its size; the big block's line says
        # whether the model ruled out all but one or which were timed, the model beside each.
        assert "m=4 K=8" in small and "too small to pipeline" in small
        assert "timed fastest on the slowest rank" in big or "the model predicts" in big, big
        assert "model" in big
    assert "m=4 K=20" in small_off and "reference, because" in small_off
    assert "symm: unavailable: disabled by the test" in small_off
    assert "too small to pipeline" in small_off
    # Without symm, the big block has two candidates, timed: each measured beside the model.
    assert "timed fastest on the slowest rank: pipelined" in big_off
    assert "reference " in big_off and big_off.count("(model ") == 2
    # Each round ran (small, big); the second round of each kept the first one's choices.
    assert len(ran) == 8 and ran[2:4] == ran[0:2] and ran[6:8] == ran[4:6], ran


def _auto_timing_agrees_on_the_slowest_rank() -> tuple[str, int]:
    """pipelined is made slow on rank 1 only: its own median would win on rank 0, but the
    slowest rank's does not, so both ranks must settle on another backend."""
    impl = choice.get_backend("pipelined")
    calls = 0

    def slow_on_rank_1(*args, **kwargs):
        nonlocal calls
        calls += 1
        if dist.get_rank() == 1:
            time.sleep(0.2)
        return type(impl).all_gather_matmul(impl, *args, **kwargs)

    impl.all_gather_matmul = slow_on_rank_1
    try:
        with _symm_disabled():
            a = torch.ones(3000, 700)  # a shape class no other test uses
            for _ in range(3):
                tpk.all_gather_matmul(a, [torch.ones(700, 2)], 0, dist.group.WORLD)
            [backend] = [v[0] for k, v in choice._ranked.items() if k[-1] == (12, 10)]
    finally:
        del impl.all_gather_matmul
    return backend, calls


def test_auto_timing_takes_the_slowest_rank_and_times_once(worlds):
    for backend, calls in worlds(2).run(_auto_timing_agrees_on_the_slowest_rank):
        assert backend == "reference"
        assert calls == choice.WARMUP + choice.ROUNDS  # timed once, then never run again


def _auto_with_uneven_columns() -> list[str]:
    """A colwise weight whose N differs by rank (3 and 4 columns, then 2 and 3): the ranks must
    agree on which calls start a new shape class, or one would time while the other runs on."""
    rank = dist.get_rank()
    a = torch.ones(40, 24)
    chosen = []
    for n in (3 + rank, 2 + rank):
        tpk.reset_comm_stats()
        _, (out,) = tpk.all_gather_matmul(a, [torch.ones(24, n)], 0, dist.group.WORLD)
        assert out.shape == (80, n) and bool((out == 24).all())
        chosen += [backend for (_, _, backend) in tpk.comm_stats()]
    return chosen


def test_auto_shape_classes_ignore_sizes_that_differ_by_rank(worlds):
    chosen = worlds(2).run(_auto_with_uneven_columns)
    assert chosen[0] == chosen[1] and len(chosen[0]) == 2


def _compiled_matches_eager(backend: str) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD

    def block(x, w1, w2):
        _, (h,) = tpk.all_gather_matmul(x, [w1], 0, group, backend=backend)
        return tpk.matmul_reduce_scatter(torch.relu(h), w2, 0, group, backend=backend)

    g = torch.Generator().manual_seed(rank)
    inputs = [
        torch.randn(4, 6, generator=g),
        torch.randn(6, 5, generator=g),
        torch.randn(5, 6, generator=g),
    ]
    eager_in = [t.clone().requires_grad_() for t in inputs]
    comp_in = [t.clone().requires_grad_() for t in inputs]
    eager = block(*eager_in)
    eager.square().sum().backward()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(*comp_in)
    compiled.square().sum().backward()
    errs = [(compiled - eager).abs().max()]
    errs += [(c.grad - e.grad).abs().max() for c, e in zip(comp_in, eager_in)]
    assert compiled.shape == (4 * world // world, 6)
    return max(e.item() for e in errs)


@pytest.mark.parametrize("backend", ["pipelined", None])
def test_torch_compile_fullgraph_matches_eager(worlds, backend):
    # The same kernels and reduction order run in both: only fp32 reassociation by the compiler
    # around the ops could differ, so a tight bound.
    for err in worlds(2).run(_compiled_matches_eager, backend):
        assert err <= 1e-5
