"""torchtitan 0.3's fused linears (``tp_gemm_backend="dist_gemm"``) running tp_kernels' ops.

Two parts. The three Functions alone (:mod:`tp_kernels.integrations._torchtitan_linear`) against
the collectives and matmuls written out, forward and backward, with and without bias, and under
spmd_types' type checker. Then torchtitan 0.3's Llama3 (tests/_titan03.py: its layer builder,
``parallelize_llama`` with TP + sequence parallel and FSDP, as its trainer steps it) with
``dist_gemm`` inside :func:`tp_kernels.integrations.torchtitan.patched`, against the unsharded
model and against torchtitan's stock unfused path (``tp_gemm_backend="default"``) on the same
layout: TP 2 and 4, FSDP dp 1 and 2, loss parallel on (torchtitan's vocab-parallel cross entropy)
and off (the logits gathered, plain cross entropy: 0.3 has no switch for it), full and selective
activation checkpointing, every backend. torchtitan's own dist_gemm Functions need CUDA symmetric
memory, so on CPU they cannot be the reference; its stock path is.

Tolerances, as in test_torchtitan.py: per quantity (the loss, each parameter's full gradient), the
norm-relative error against a float64 run of the unsharded model must stay within
``max(2 * err_ref, 2 * eps(float32))``, ``err_ref`` being the error of the float32 run compared
with (the unsharded model, or the stock path): sharding only reorders sums. (RoPE stays complex64
in the float64 run, torchtitan's choice; both float32 runs round it alike.)

Needs torch >= 2.15 and torchtitan 0.3.x (``pip install --no-deps torchtitan==0.3.0`` and
``spmd_types==0.2.3 torch_checkpointing`` with the deps its imports need); skipped otherwise.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _training import relative_error

import tp_kernels

spmd = pytest.importorskip("spmd_types", reason="torchtitan 0.3's dist_gemm path needs spmd_types")
torchtitan = pytest.importorskip("torchtitan", reason="needs torchtitan 0.3.x")

from tp_kernels.integrations import torchtitan as titan  # noqa: E402

if not titan._uses_dist_gemm(torchtitan):
    pytest.skip(
        f"needs torchtitan 0.3.x (dist_gemm); installed: {torchtitan.__version__}",
        allow_module_level=True,
    )

import _titan03 as t3  # noqa: E402

from tp_kernels.integrations import _torchtitan_linear as ours  # noqa: E402

FLOOR = 2 * torch.finfo(torch.float32).eps
BACKENDS = ["reference", "pipelined", "symm"]


# ---- the three Functions alone ------------------------------------------------------------------


def _gathered(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(group.size())]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def _functions_against_written_out(backend: str) -> list[str]:
    """Each Function's output and grads against all_gather / matmul / reduce_scatter written out
    (float64, so any difference is a wrong formula, not rounding); the problems found."""
    group = dist.group.WORLD
    world, rank = group.size(), group.rank()
    gen = torch.Generator().manual_seed(3)  # every rank draws the same full tensors
    m, k, n = 4 * world, 6 * world, 2 * world

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    problems = []

    def check(name, got, want):
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-12, atol=1e-12):
            problems.append(f"{backend} {name}: {got.shape} vs {want.shape}")

    rows = slice(rank * m // world, (rank + 1) * m // world)
    cols = slice(rank * k // world, (rank + 1) * k // world)
    for with_bias in (False, True):
        tag = "bias" if with_bias else "no bias"
        # gather side: x [M/R, K] rows of the full x; w [N/R, K], bias [N/R]
        x_full, w_full, b_full, dy_full = rand(m, k), rand(n, k), rand(n), rand(m, n)
        out_cols = slice(rank * n // world, (rank + 1) * n // world)
        x = x_full[rows].clone().requires_grad_()
        w = w_full[out_cols].clone().requires_grad_()
        b = b_full[out_cols].clone().requires_grad_() if with_bias else None
        with tp_kernels.use_backend(backend):
            y = ours.AllGatherLinear.apply(x, w, b, group, group.group_name)
            y.backward(dy_full[:, out_cols])
        ref_x = x_full[rows].clone().requires_grad_()
        ref_w = w_full[out_cols].clone().requires_grad_()
        ref_b = b_full[out_cols].clone().requires_grad_() if with_bias else None
        ref_y = _gathered(ref_x.detach(), group) @ ref_w.t()
        ref_y = ref_y + ref_b if with_bias else ref_y
        check(f"AllGatherLinear y ({tag})", y, ref_y)
        # dx = rows of sum over ranks of dy_r @ w_r: the reduce-scatter written out
        dx_all = dy_full[:, out_cols] @ w_full[out_cols]
        dist.all_reduce(dx_all, group=group)
        check(f"AllGatherLinear dx ({tag})", x.grad, dx_all[rows])
        check(f"AllGatherLinear dw ({tag})", w.grad, dy_full[:, out_cols].t() @ x_full)
        if with_bias:
            check(f"AllGatherLinear dbias ({tag})", b.grad, dy_full[:, out_cols].sum(0))

        # scatter side: x [M, K/R] columns of the full x; w [N, K/R], bias [N] replicated
        x = x_full[:, cols].clone().requires_grad_()
        w2_full = rand(n, k)
        w = w2_full[:, cols].clone().requires_grad_()
        b = b_full.clone().requires_grad_() if with_bias else None
        dy_rows = dy_full[rows]
        with tp_kernels.use_backend(backend):
            y = ours.LinearReduceScatter.apply(x, w, b, group, group.group_name)
            y.backward(dy_rows)
        want = (x_full @ w2_full.t())[rows]
        check(f"LinearReduceScatter y ({tag})", y, want + b_full if with_bias else want)
        check(f"LinearReduceScatter dx ({tag})", x.grad, dy_full @ w2_full[:, cols])
        check(f"LinearReduceScatter dw ({tag})", w.grad, dy_full.t() @ x_full[:, cols])
        if with_bias:
            check(f"LinearReduceScatter dbias ({tag})", b.grad, dy_full.sum(0))

    # frozen weight (input grad only) and an input without grad (weight grad only)
    x_full, w_full, w2_full, dy_full = rand(m, k), rand(n, k), rand(n, k), rand(m, n)
    out_cols = slice(rank * n // world, (rank + 1) * n // world)
    dx_all = dy_full[:, out_cols] @ w_full[out_cols]
    dist.all_reduce(dx_all, group=group)
    for x_grad, w_grad in ((True, False), (False, True)):
        tag = "frozen w" if x_grad else "x without grad"
        x = x_full[rows].clone().requires_grad_(x_grad)
        w = w_full[out_cols].clone().requires_grad_(w_grad)
        xr = x_full[:, cols].clone().requires_grad_(x_grad)
        wr = w2_full[:, cols].clone().requires_grad_(w_grad)
        with tp_kernels.use_backend(backend):
            ours.AllGatherLinear.apply(x, w, None, group, group.group_name).backward(
                dy_full[:, out_cols]
            )
            ours.LinearReduceScatter.apply(xr, wr, None, group, group.group_name).backward(
                dy_full[rows]
            )
        if x_grad:
            check(f"AllGatherLinear dx ({tag})", x.grad, dx_all[rows])
            check(f"LinearReduceScatter dx ({tag})", xr.grad, dy_full @ w2_full[:, cols])
        else:
            check(f"AllGatherLinear dw ({tag})", w.grad, dy_full[:, out_cols].t() @ x_full)
            check(f"LinearReduceScatter dw ({tag})", wr.grad, dy_full.t() @ x_full[:, cols])
        if (x.grad is None) == x_grad or (w.grad is None) == w_grad:
            problems.append(f"{backend} AllGatherLinear ({tag}): a grad not asked for, or missing")

    # two right-hand matrices, one gather
    x_full, wa_full, wb_full = rand(m, k), rand(n, k), rand(2 * n, k)
    dya_full, dyb_full = rand(m, n), rand(m, 2 * n)
    a_cols = slice(rank * n // world, (rank + 1) * n // world)
    b_cols = slice(rank * 2 * n // world, (rank + 1) * 2 * n // world)
    x = x_full[rows].clone().requires_grad_()
    wa = wa_full[a_cols].clone().requires_grad_()
    wb = wb_full[b_cols].clone().requires_grad_()
    with tp_kernels.use_backend(backend):
        ya, yb = ours.AllGatherLinearMulti.apply(x, wa, wb, group, group.group_name)
        torch.autograd.backward([ya, yb], [dya_full[:, a_cols], dyb_full[:, b_cols]])
    check("AllGatherLinearMulti ya", ya, x_full @ wa_full[a_cols].t())
    check("AllGatherLinearMulti yb", yb, x_full @ wb_full[b_cols].t())
    dx_all = dya_full[:, a_cols] @ wa_full[a_cols] + dyb_full[:, b_cols] @ wb_full[b_cols]
    dist.all_reduce(dx_all, group=group)
    check("AllGatherLinearMulti dx", x.grad, dx_all[rows])
    check("AllGatherLinearMulti dwa", wa.grad, dya_full[:, a_cols].t() @ x_full)
    check("AllGatherLinearMulti dwb", wb.grad, dyb_full[:, b_cols].t() @ x_full)
    return problems


@pytest.mark.parametrize("world", [2, 4])
def test_functions_match_collectives_written_out(worlds, world):
    backends = BACKENDS if world == 2 else ["symm"]
    for backend in backends:
        for problems in worlds(world).run(_functions_against_written_out, backend):
            assert not problems, "\n".join(problems)


def _types_under_the_checker() -> dict:
    """Under spmd_types' checker: the output types of each Function, and the error when an
    input's type is wrong."""
    from spmd_types import R, S, V
    from spmd_types.checker import typecheck

    group = dist.group.WORLD
    world = group.size()
    out = {}
    with typecheck(local=False):
        x = spmd.assert_type(torch.randn(4, 8), {group: S(0)})
        w = spmd.assert_type(torch.randn(6, 8), {group: S(0)})
        y = ours.AllGatherLinear.apply(x, w, None, group, group.group_name)
        ya, yb = ours.AllGatherLinearMulti.apply(x, w, w, group, group.group_name)
        h = spmd.assert_type(torch.randn(4 * world, 6), {group: S(1)})
        w2 = spmd.assert_type(torch.randn(8, 6), {group: S(1)})
        bias = spmd.assert_type(torch.randn(8), {group: R})
        z = ours.LinearReduceScatter.apply(h, w2, bias, group, group.group_name)
        for name, t in {"y": y, "ya": ya, "yb": yb, "z": z}.items():
            spec = spmd.get_partition_spec(t)
            sharded = [d for d, entry in enumerate(spec or ()) if entry is not None]
            out[name] = (list(spmd.get_local_type(t).values()) == [V], sharded)
        wrong = spmd.assert_type(torch.randn(4, 8), {group: R})
        try:
            ours.AllGatherLinear.apply(wrong, w, None, group, group.group_name)
            out["wrong"] = None
        except spmd.SpmdTypeError as e:
            out["wrong"] = str(e)
    return out


def test_functions_are_typechecked_by_spmd_types(worlds):
    result = worlds(2).run(_types_under_the_checker)[0]
    # varying on the TP axis, sharded along the dim torchtitan's Functions declare: S(1) out of
    # the gather side, S(0) out of the scatter side
    assert result["y"] == result["ya"] == result["yb"] == (True, [1]), result
    assert result["z"] == (True, [0]), result
    assert result["wrong"] is not None, "a replicated x was accepted where S(0) is required"
    assert "tensor has PerMeshAxisLocalSpmdType.R, expected" in result["wrong"], result["wrong"]


# ---- torchtitan 0.3's Llama3 ---------------------------------------------------------------------


def _run_cases(
    tp: int, dp: int, backends: list[str], ac: str = "none", loss_parallel=(False, True)
) -> dict:
    """Per (backend, loss_parallel): errors of tp_kernels and of its references, fused counts.

    Returns ``{(backend, lp): {"errors": {quantity: (err_tpk, err_unsharded, err_stock)},
    "forward": ..., "step": ..., "backward": ..., "fallback": n}}``.
    """
    t3.use_cpu()
    base = t3.build("default")
    state = t3.copy_state(base)
    truth = t3.unsharded_loss_and_grads(copy.deepcopy(base).double())
    unsharded = t3.unsharded_loss_and_grads(copy.deepcopy(base))
    dims = t3.parallel_dims(tp, dp)
    out = {}
    for lp in loss_parallel:
        stock_model = t3.parallelize(t3.build("default", tp, dp, state), dims, tp=tp, dp=dp, ac=ac)
        stock_loss = t3.step(stock_model, dims, loss_parallel=lp, patched=False)
        stock = (stock_loss, t3.full_grads(stock_model))
        for backend in backends:
            model = t3.build("dist_gemm", tp, dp, state)
            model = t3.parallelize(model, dims, tp=tp, dp=dp, ac=ac)
            loss, grads, counts = t3.counted_step(model, dims, backend, loss_parallel=lp)
            assert grads.keys() == truth[1].keys()
            errors = {}
            for key, (got, ref64, ref, stock_ref) in {
                "loss": (loss, truth[0], unsharded[0], stock[0]),
                **{n: (grads[n], truth[1][n], unsharded[1][n], stock[1][n]) for n in truth[1]},
            }.items():
                assert got.shape == ref.shape and got.dtype == ref.dtype, key
                errors[key] = (
                    relative_error(got, ref64),
                    relative_error(ref, ref64),
                    relative_error(stock_ref, ref64),
                )
            out[(backend, lp)] = {"errors": errors, **counts}
    return out


def _failures(result: dict) -> list[str]:
    failures = []
    for (backend, lp), case in result.items():
        where = f"backend={backend} loss_parallel={lp}"
        for name, (err, err_unsharded, err_stock) in case["errors"].items():
            for ref_name, ref in (("unsharded", err_unsharded), ("stock path", err_stock)):
                if err > max(2 * ref, FLOOR):
                    failures.append(
                        f"{where} {name}: err {err:.3e} > max(2 * {ref:.3e} ({ref_name}), "
                        f"{FLOOR:.1e})"
                    )
        if case["fallback"]:
            failures.append(f"{where}: {case['fallback']} calls fell back")
    return failures


def _check(result: dict, recomputed: int = 0) -> None:
    assert not _failures(result), "\n".join(_failures(result))
    for case in result.values():
        assert len(case["errors"]) == 1 + N_PARAMS, case["errors"].keys()
        assert case["forward"] == t3.FORWARD
        assert case["step"] == {k: (1 + recomputed) * n for k, n in t3.FORWARD.items()}
        assert case["backward"] == t3.BACKWARD


# tok_embeddings, norm, lm_head; per layer wqkv, wo, w1, w2, w3 and two norms
N_PARAMS = 3 + 7 * t3.LAYERS


def _backends() -> list:
    symm = tp_kernels.available_backends()["symm"]
    skip = pytest.mark.skipif(symm != "ok", reason=f"symm: {symm}")
    return [pytest.param(b, marks=skip) if b == "symm" else b for b in BACKENDS]


@pytest.mark.parametrize("backend", _backends())
def test_dist_gemm_tp2_matches_unsharded_and_stock(worlds, backend):
    per_rank = worlds(2).run(_run_cases, 2, 1, [backend])
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree on the full tensors"
    _check(per_rank[0])


# At 4 ranks (slow to run on 2 cores), AC and dp 2: torchtitan's default, loss parallel on; the
# 2-rank backend tests cover it off.
def test_dist_gemm_tp4(worlds):
    _check(worlds(4).run(_run_cases, 4, 1, ["symm"], loss_parallel=(True,))[0])


def test_dist_gemm_tp2_with_fsdp_dp2(worlds):
    # 4 ranks: dp_shard 2 x tp 2; the TP group is a subgroup of the world
    _check(worlds(4).run(_run_cases, 2, 2, ["pipelined"], loss_parallel=(True,))[0])


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_dist_gemm_with_activation_checkpointing(worlds, mode):
    # Each block's forward runs again in backward, its fused ops included (torchtitan's
    # selective policy saves aten ops' outputs, not tp_kernels' ops, so those are recomputed).
    result = worlds(2).run(_run_cases, 2, 1, ["pipelined"], mode, loss_parallel=(True,))[0]
    _check(result, recomputed=1)


# ---- CUDA graphs: torchtitan 0.3 captures every step ---------------------------------------------


def _warmup_then_captured(backend: str) -> dict:
    """The order of torchtitan 0.3's CUDA graph wrapper on the three Functions: one eager step
    (its warmup), then the same step captured, the capture faked as in tests/test_capture.py
    (CPU tensors standing in for CUDA ones; whatever a captured call must not do raises)."""
    from test_capture import Forbidden, _capturing, _forbidding

    group = dist.group.WORLD
    world, rank = group.size(), group.rank()

    def step() -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(4, 6 * world, generator=gen).requires_grad_()
        w, wa, wb = (torch.randn(n, 6 * world, generator=gen).requires_grad_() for n in (4, 2, 6))
        w2 = torch.randn(8, 4, generator=gen).requires_grad_()
        with tp_kernels.use_backend(backend):
            y = ours.AllGatherLinear.apply(x, w, None, group, group.group_name)
            ya, yb = ours.AllGatherLinearMulti.apply(x, wa, wb, group, group.group_name)
            z = ours.LinearReduceScatter.apply(y, w2, None, group, group.group_name)
            (z.sum() + ya.sum() + yb.sum()).backward()
        return [z.detach(), ya.detach(), yb.detach(), x.grad, w.grad, wa.grad, wb.grad, w2.grad]

    warm = step()
    with _forbidding() as seen, _capturing() as asked:
        try:
            captured = step()
        except Forbidden:
            captured = []
    same = len(captured) == len(warm) and all(map(torch.equal, captured, warm))
    return {"forbidden": seen, "probes": asked[0], "same": same}


@pytest.mark.parametrize("backend", ["reference", "pipelined", "auto"])
def test_captured_step_reuses_the_warmups_plans(worlds, backend):
    """The captured step plans, agrees and times nothing (forward through the ops, backward
    through the custom ops), and gives the warmup's results."""
    for got in worlds(2).run(_warmup_then_captured, backend):
        assert got["forbidden"] == [], got
        assert got["probes"] >= 3 and got["same"], got


# ---- patching ------------------------------------------------------------------------------------


def test_patched_rebinds_dist_gemm_and_restores():
    from torchtitan.distributed import linear as titan_linear
    from torchtitan.models.common import dist_gemm

    names = titan.DIST_GEMM_FUNCTIONS
    before = {name: getattr(dist_gemm, name) for name in names}
    assert all(before[name] is getattr(titan_linear, name) for name in names)
    forward_before = {
        name: getattr(dist_gemm, name).__dict__["forward"] for name in titan.DIST_GEMM_OWNERS
    }
    with titan.patched() as modules:
        assert modules == [titan.DIST_GEMM_MODULE]
        with titan.patched():
            pass  # nested: the inner exit must not restore
        for name in names:
            assert getattr(dist_gemm, name).function is getattr(ours, name), name
        for name in titan.DIST_GEMM_OWNERS:  # wrapped, so the calls can find fp8 children
            cls = getattr(dist_gemm, name)
            assert cls.forward.tp_kernels_wraps is forward_before[name], name
    for name in names:
        assert getattr(dist_gemm, name) is before[name], name
    for name in titan.DIST_GEMM_OWNERS:
        assert getattr(dist_gemm, name).__dict__["forward"] is forward_before[name], name
    with pytest.raises(RuntimeError, match="without a patch"):
        titan.unpatch()


# ---- FP8: torchtitan 0.3's float8 converter on the dist_gemm modules -----------------------------
#
# torchtitan's float8 converter rewrites every Linear.Config, RowParallelLinear's (attention's
# ``wo``) included, before the trainer sets the sharding: ``wo`` becomes a plain Float8Linear, so
# torchtitan declares the stock attention contract (the block's input gathered) while the QKV is
# still AllGatherFusedQKVLinear, which gathers it again. Those runs fail, patched or not; a
# working conversion keeps ``wo`` out (``filter_fqns``). The tests also keep ``lm_head`` out: it
# is not a dist_gemm module, and under torchtitan's own path its fp8 casts take local amaxes.
FLOAT8_FILTER = ("attention.wo", "lm_head")
# The children of the dist_gemm modules that the converters make low-precision Linears.
CONVERTED = ("attention.qkv_linear.wqkv", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def _assert_every_converted_child_fused(converted: list[str], counts: dict) -> None:
    """Every layer's :data:`CONVERTED` children were converted (``converted``: the names of the
    low-precision Linears) and every step of theirs ran fused (``counts``: ``comm_stats``), zero
    fallbacks, ``wo`` the bf16 fused op."""
    layers = [f"layers.{i}." for i in range(t3.LAYERS)]
    assert converted == sorted(f"{layer}{name}" for layer in layers for name in CONVERTED)
    assert not [k for k in counts if k[1] == "fallback"], counts
    fused = {(phase, kind): n for (phase, kind, _), n in counts.items() if "matmul" in kind}
    assert fused == {
        ("forward", "scaled_all_gather_matmul"): 2 * t3.LAYERS,  # wqkv, w1+w3
        ("forward", "scaled_matmul_reduce_scatter"): t3.LAYERS,  # w2
        ("forward", "matmul_reduce_scatter"): t3.LAYERS,  # wo: bf16
        ("backward", "scaled_matmul_reduce_scatter"): 2 * t3.LAYERS,
        ("backward", "scaled_all_gather_matmul"): t3.LAYERS,
        ("backward", "all_gather_matmul"): t3.LAYERS,
    }, counts


def _float8_cases(recipe: str) -> dict:
    """The converted model with dist_gemm under patched() (``reference``) against the same
    conversion unsharded and on torchtitan's stock path: norm-relative errors per quantity,
    counts; then what the unfiltered conversion raises, and the counts of an emulated one."""
    from torchao.float8.float8_linear import Float8Linear

    t3.use_cpu()
    base = t3.build("default", float8=recipe, float8_filter=FLOAT8_FILTER)
    state = t3.copy_state(base)
    unsharded = t3.unsharded_loss_and_grads(copy.deepcopy(base))
    dims = t3.parallel_dims(2, 1)
    stock = t3.parallelize(
        t3.build("default", 2, 1, state, float8=recipe, float8_filter=FLOAT8_FILTER),
        dims, tp=2, dp=1,
    )  # fmt: skip
    stock_loss = t3.step(stock, dims, loss_parallel=True, patched=False)
    model = t3.build("dist_gemm", 2, 1, state, float8=recipe, float8_filter=FLOAT8_FILTER)
    fp8 = sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))
    model = t3.parallelize(model, dims, tp=2, dp=1)
    tp_kernels.reset_comm_stats()
    with tp_kernels.use_backend("reference"):
        loss = t3.step(model, dims, loss_parallel=True, patched=True)
    counts = dict(tp_kernels.comm_stats())
    grads, stock_grads = t3.full_grads(model), t3.full_grads(stock)
    out = {
        "fp8": fp8,
        "counts": counts,
        "vs unsharded": {
            "loss": relative_error(loss, unsharded[0]),
            **{n: relative_error(g, unsharded[1][n]) for n, g in grads.items()},
        },
        "vs stock": {
            "loss": relative_error(loss, stock_loss),
            **{n: relative_error(g, stock_grads[n]) for n, g in grads.items()},
        },
    }
    if recipe != "rowwise":
        return out
    # every Linear converted (torchtitan's default filter): wo's contract is lost
    whole = t3.parallelize(t3.build("dist_gemm", 2, 1, state, float8=recipe), dims, tp=2, dp=1)
    try:
        t3.step(whole, dims, loss_parallel=True, patched=True)
        out["unfiltered"] = None
    except RuntimeError as e:
        out["unfiltered"] = str(e)
    # an emulated Float8Linear (not fusable): multiplied in high precision, counted
    from torchao.float8 import Float8LinearConfig

    emulated = t3.parallelize(
        t3.build("dist_gemm", 2, 1, state, float8=recipe, float8_filter=FLOAT8_FILTER),
        dims, tp=2, dp=1,
    )  # fmt: skip
    for m in emulated.modules():
        if isinstance(m, Float8Linear):
            m.config = Float8LinearConfig(emulate=True)
    tp_kernels.reset_comm_stats()
    with tp_kernels.use_backend("reference"):
        t3.step(emulated, dims, loss_parallel=True, patched=True)
    out["emulated counts"] = dict(tp_kernels.comm_stats())
    return out


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_dist_gemm_runs_torchtitan_s_float8_linears_fused(worlds, recipe):
    """torchtitan's float8 converter (``wo`` and ``lm_head`` filtered, see above) with
    dist_gemm under patched(): every Float8Linear child of a fused module (wqkv, w1, w3, w2)
    runs tp_kernels' fused fp8 ops, zero fallbacks, ``wo`` the bf16 fused op.

    Tolerances. The fused path casts each shard with the amax of the whole tensor (all-reduced
    where it spans the shards: tp_kernels/float8.py), so it makes torchao's unsharded casts;
    what remains is sharding's fp32 sum order (tests/test_fp8.py at 2 ranks: 2^-20) through two
    layers, measured <= 2^-18.5, bound 2^-16. A cast landing on the other side of an fp8 rounding
    edge would move an element by 2^-3 of itself and fail that bound (inputs are fixed: it does
    not here). Tensorwise is held to the unsharded model: torchtitan's stock path (Float8Linear
    on the local shards under spmd_types) takes tensor-wise amaxes of the local shard, its
    gradients ~2^-3.5 away. Rowwise is held to the stock path: both sharded runs agree within
    2^-18 and differ alike from the unsharded model (4e-3 in one weight's grad, measured: not
    from the fused path, which both do not share)."""
    pytest.importorskip("torchao.float8")
    result = worlds(2).run(_float8_cases, recipe)[0]
    _assert_every_converted_child_fused(result["fp8"], result["counts"])
    errors = result["vs unsharded" if recipe == "tensorwise" else "vs stock"]
    assert len(errors) == 1 + N_PARAMS
    assert max(errors.values()) <= 2**-16, errors
    if recipe == "rowwise":
        assert "is invalid for input of size" in result["unfiltered"], result["unfiltered"]
        emulated = result["emulated counts"]
        # every fp8 child ignored, counted: wqkv, w1+w3 (one call), w2 per layer
        assert emulated[("forward", "fallback", "torch")] == 3 * t3.LAYERS, emulated
        assert not [k for k in emulated if "scaled" in k[1]], emulated


# ---- MXFP8: torchtitan 0.3's MXFP8 converter on the dist_gemm modules ----------------------------
#
# The converter takes the names to convert (``fqns``), not a filter: :data:`CONVERTED`, ``wo``
# kept out for the reason FLOAT8_FILTER gives. At TP 2 each rank's rows (4 x 8 tokens) are one
# whole MX block and every GEMM dim per rank (64, 96) a multiple of 32.


def _mxfp8_cases() -> dict:
    """The converted model with dist_gemm under patched() (``reference``) against the same
    conversion unsharded: norm-relative errors per quantity, counts; then the counts of a batch
    whose shards are not whole MX blocks."""
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

    t3.use_cpu()
    base = t3.build("default", mxfp8=CONVERTED)
    state = t3.copy_state(base)
    unsharded = t3.unsharded_loss_and_grads(copy.deepcopy(base))
    dims = t3.parallel_dims(2, 1)
    model = t3.build("dist_gemm", 2, 1, state, mxfp8=CONVERTED)
    mx = sorted(n for n, m in model.named_modules() if isinstance(m, MXFP8Linear))
    model = t3.parallelize(model, dims, tp=2, dp=1)
    tp_kernels.reset_comm_stats()
    with tp_kernels.use_backend("reference"):
        loss = t3.step(model, dims, loss_parallel=True, patched=True)
    out = {
        "mx": mx,
        "counts": dict(tp_kernels.comm_stats()),
        "vs unsharded": {
            "loss": relative_error(loss, unsharded[0]),
            **{n: relative_error(g, unsharded[1][n]) for n, g in t3.full_grads(model).items()},
        },
    }
    # 2 sequences: 2 x 8 tokens a rank, half an MX block: every MXFP8 call falls back, counted
    tokens = torch.randint(0, t3.VOCAB, (2, t3.SEQ + 1), generator=torch.Generator().manual_seed(3))
    tp_kernels.reset_comm_stats()
    with tp_kernels.use_backend("reference"):
        t3.step(model, dims, loss_parallel=True, patched=True, tokens=tokens)
    out["half-block counts"] = dict(tp_kernels.comm_stats())
    return out


def test_dist_gemm_runs_torchtitan_s_mxfp8_linears_fused(worlds):
    """torchtitan's MXFP8 converter (wqkv, w1, w2, w3; emulated on the CPU) with dist_gemm under
    patched(): every MXFP8Linear child of a fused module runs tp_kernels' fused MXFP8 ops, zero
    fallbacks, ``wo`` the bf16 fused op.

    Tolerances. Every forward and input-grad cast runs along a row's K or N, whole on each rank
    or split at block boundaries, so it is torchao's unsharded cast; what remains is sharding's
    fp32 sum order, bound 2^-18 (measured: the loss exact, every other quantity within 2^-21.3;
    an e4m3 rounding flipped by the sum order would move one element of a block by 2^-4 of
    itself, far below that bound norm-relative). The converted Linears' weight grads cast along
    the tokens in blocks of 32 consecutive rows of torchtitan's sequence-major flattening
    (``x.transpose(0, 1)``: 8 positions x 4 sequences here), where the unsharded model's blocks
    run along each sequence: other blocks, whose e8m0 scales may differ, so those four grads per
    layer are held to MX's own error (e4m3's 2^-4 relative rounding: norm-relative bound 2^-3;
    measured within 2^-21.3: this data's blocks happen to share their scales)."""
    pytest.importorskip("torchao.prototype.moe_training")
    result = worlds(2).run(_mxfp8_cases)[0]
    _assert_every_converted_child_fused(result["mx"], result["counts"])
    errors = result["vs unsharded"]
    assert len(errors) == 1 + N_PARAMS
    token_blocked = {f"{name}.weight" for name in result["mx"]}
    assert max(e for n, e in errors.items() if n not in token_blocked) <= 2**-18, errors
    assert max(errors[n] for n in token_blocked) <= 2**-3, errors
    half = result["half-block counts"]
    # every MXFP8 child's call counted: wqkv, w1+w3 (one call), w2 per layer
    assert half[("forward", "fallback", "torch")] == 3 * t3.LAYERS, half
    assert not [k for k in half if "scaled" in k[1]], half


def _routed_quantize_weights() -> dict:
    """A dist_gemm-like owner of two Linears whose weights ``quantize_`` wrapped for MXFP8
    (emulated), calling the routed ``AllGatherLinearMulti`` on this rank's 32 rows: whether its
    outputs are each Linear's own (torchao's override) on the gathered rows, and the counts."""
    import torch.nn as nn
    from torchao.quantization import quantize_

    class Owner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w3 = nn.Linear(64, 96, bias=False), nn.Linear(64, 96, bias=False)

        @ours.owned_forward
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            group = dist.group.WORLD
            routed = ours.Routed(ours.AllGatherLinearMulti)
            return routed.apply(x, self.w1.weight, self.w3.weight, group, group.group_name)

    torch.manual_seed(0)  # the same weights on every rank
    owner = Owner()
    quantize_(owner, _mx_emulated_config(), filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
    world = dist.get_world_size()
    gathered = torch.randn(32 * world, 64, generator=torch.Generator().manual_seed(1))
    tp_kernels.reset_comm_stats()
    with tp_kernels.use_backend("reference"):
        ya, yb = owner(gathered.chunk(world)[dist.get_rank()])
    counts = dict(tp_kernels.comm_stats())
    return {
        "equal": [torch.equal(ya, owner.w1(gathered)), torch.equal(yb, owner.w3(gathered))],
        "counts": counts,
    }


def _mx_emulated_config():
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe

    return MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)


def test_routed_gather_runs_quantize_s_mxfp8_weights_fused(worlds):
    """``quantize_``'s MXFP8 weights on a dist_gemm module's children take the fused MXFP8
    gather: one ``scaled_all_gather_matmul``, no fallback, each output torchao's unsharded
    Linear's bit for bit (torchao's casts of the same rows, its GEMM: tests/test_mxfp8.py).
    torchtitan 0.3's own flow does not keep such weights (its parallelize re-registers each
    parameter as a plain tensor, and ``quantize_`` after it fails in FSDP's lazy init): its MXFP8
    converter is the way there (docs/torchtitan.md)."""
    pytest.importorskip("torchao.prototype.moe_training")
    for result in worlds(2).run(_routed_quantize_weights):
        assert result["equal"] == [True, True]
        assert result["counts"] == {("forward", "scaled_all_gather_matmul", "reference"): 1}
