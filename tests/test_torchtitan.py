"""torchtitan 0.2.x's Llama3, parallelized by torchtitan's own ``apply_tp`` under ``patched()``.

Three copies of one tiny model (torchtitan's Llama3 debug model shrunk: dim 64, 2 layers, 4 heads,
2 KV heads at 2 ranks and 4 at 4 ranks, since ``apply_tp`` shards whole KV heads) run the same
batch of 2 sequences of 16 tokens: unsharded, parallelized with PyTorch's styles (``apply_tp`` as
shipped) and with tp_kernels' (``apply_tp`` inside ``patched()``). Every backend, loss parallel on
and off, and activation checkpointing.

Tolerances: as in test_llama.py, per quantity (the loss, each parameter's full gradient), the
norm-relative error against a float64 run of the same unsharded model must stay within
``max(2 * err_ref, 2 * eps(float32))``, ``err_ref`` being the error of the float32 run it is
compared with (the unsharded model, or PyTorch's styles): sharding only reorders sums. (The
float64 run is float64 except RoPE, which torchtitan computes in complex64 whatever the dtype;
both float32 runs round it the same way, so it only adds to ``err_ref``.)

Fused path, per forward of the 2-layer model: one grouped all-gather-matmul per attention and per
feed-forward input plus one for ``output`` (5), one matmul-reduce-scatter per ``wo`` and ``w2``
(4); the backward runs the transposed ops; nothing falls back. Needs torchtitan 0.2.x
(``pip install torchtitan==0.2.2 --no-deps`` and the deps its imports need: tyro, torchdata,
tensorboard, datasets, einops, tomli); skipped without it.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from _training import next_token_loss_and_grads, relative_error
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import parallel as torch_tp

import tp_kernels

pytest.importorskip(
    "torchtitan.models.llama3.infra.parallelize",
    reason="needs torchtitan 0.2.x (apply_tp); 0.3 is tested by test_torchtitan_dist_gemm.py",
)
from torchtitan.config.job_config import ActivationCheckpoint  # noqa: E402
from torchtitan.distributed.activation_checkpoint import apply_ac  # noqa: E402
from torchtitan.models.llama3 import Transformer, TransformerModelArgs  # noqa: E402
from torchtitan.models.llama3.infra import parallelize as llama3_parallelize  # noqa: E402

from tp_kernels.integrations import torchtitan as titan  # noqa: E402

BATCH, SEQ, VOCAB, LAYERS = 2, 16, 128, 2
FLOOR = 2 * torch.finfo(torch.float32).eps
BACKENDS = ["reference", "pipelined", "symm", "auto"]
# Per forward of the 2-layer model, and per backward (see the module docstring).
FORWARD = {"all_gather_matmul": 2 * LAYERS + 1, "matmul_reduce_scatter": 2 * LAYERS}
BACKWARD = {
    "matmul_reduce_scatter": 2 * LAYERS + 1,  # input grads of each gathered input
    "all_gather": 2 * LAYERS + 1,  # the saved shard, gathered again for the weight grads
    "all_gather_matmul": 2 * LAYERS,  # output grads of wo and w2, fused with their input grads
}


def _model_args(world: int) -> TransformerModelArgs:
    return TransformerModelArgs(
        dim=64,
        n_layers=LAYERS,
        n_heads=4,
        n_kv_heads=2 if world == 2 else 4,
        vocab_size=VOCAB,
        multiple_of=64,  # ffn hidden 192: divisible by 2 and 4
        rope_theta=500000,
        max_seq_len=SEQ,
    )


def _base_model(world: int) -> Transformer:
    torch.manual_seed(0)  # every rank builds the same weights
    model = Transformer(_model_args(world))
    with torch.no_grad():  # as torchtitan's trainer calls it
        model.init_weights()
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return tokens[:, :-1], tokens[:, 1:]


def _loss_and_grads(
    model: torch.nn.Module, loss_parallel: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return next_token_loss_and_grads(model, *_batch(), loss_parallel=loss_parallel)


def _parallel(base: Transformer, *, styles: str, loss_parallel: bool, ac: str = "none"):
    """A copy of ``base`` through torchtitan's ``apply_tp`` (and ``apply_ac`` unless "none")."""
    model = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with titan.patched() if styles == "tp_kernels" else contextlib.nullcontext():
        llama3_parallelize.apply_tp(
            model, mesh, loss_parallel=loss_parallel, enable_float8_tensorwise_tp=False
        )
    wq = model.layers["0"].attention.wq
    assert hasattr(wq, "_tpk_fused") == (styles == "tp_kernels"), styles
    if ac != "none":
        apply_ac(model, ActivationCheckpoint(mode=ac, selective_ac_option="op"))
    return model


def _run_cases(backends: list[str], ac: str = "none") -> dict:
    """Per (backend, loss_parallel): errors of tp_kernels and of its references, fused counts.

    Returns ``{(backend, lp): {"errors": {quantity: (err_tpk, err_unsharded, err_torch)},
    "forward": {kind: n}, "backward": {kind: n}, "fallback": n}}``.
    """
    base = _base_model(dist.get_world_size())
    truth = _loss_and_grads(copy.deepcopy(base).double(), loss_parallel=False)
    unsharded = _loss_and_grads(copy.deepcopy(base), loss_parallel=False)
    out = {}
    for lp in (False, True):
        theirs = _loss_and_grads(
            _parallel(base, styles="torch", loss_parallel=lp, ac=ac), loss_parallel=lp
        )
        for backend in backends:
            model = _parallel(base, styles="tp_kernels", loss_parallel=lp, ac=ac)
            with tp_kernels.use_backend(backend):
                tp_kernels.reset_comm_stats()
                # Forward counts come from a forward of its own (no backward, nothing recomputed)
                inputs, _ = _batch()
                with torch.no_grad():
                    model(inputs)
                forward = tp_kernels.comm_stats()
                tp_kernels.reset_comm_stats()
                ours = _loss_and_grads(model, loss_parallel=lp)
                both = tp_kernels.comm_stats()
            errors = {}
            for key, (got, ref64, ref, torch_ref) in {
                "loss": (ours[0], truth[0], unsharded[0], theirs[0]),
                **{n: (ours[1][n], truth[1][n], unsharded[1][n], theirs[1][n]) for n in truth[1]},
            }.items():
                assert got.shape == ref.shape and got.dtype == ref.dtype, key
                errors[key] = (
                    relative_error(got, ref64),
                    relative_error(ref, ref64),
                    relative_error(torch_ref, ref64),
                )
            assert ours[1].keys() == truth[1].keys()
            out[(backend, lp)] = {
                "errors": errors,
                "forward": {k: forward.total("forward", k) for k in FORWARD},
                # forward-kind calls of the training step: its forward, and any recompute
                "step": {k: both.total("forward", k) for k in FORWARD},
                "backward": {k: both.total("backward", k) for k in BACKWARD},
                "fallback": forward.total(kind="fallback") + both.total(kind="fallback"),
            }
    return out


def _failures(result: dict) -> list[str]:
    failures = []
    for (backend, lp), case in result.items():
        where = f"backend={backend} loss_parallel={lp}"
        for name, (err, err_unsharded, err_torch) in case["errors"].items():
            for ref_name, ref in (("unsharded", err_unsharded), ("PyTorch's styles", err_torch)):
                if err > max(2 * ref, FLOOR):
                    failures.append(
                        f"{where} {name}: err {err:.3e} > max(2 * {ref:.3e} ({ref_name}), "
                        f"{FLOOR:.1e})"
                    )
        if case["fallback"]:
            failures.append(f"{where}: {case['fallback']} calls fell back to PyTorch's path")
    return failures


def _backends() -> list:
    symm = tp_kernels.available_backends()["symm"]
    skip = pytest.mark.skipif(symm != "ok", reason=f"symm: {symm}")
    return [pytest.param(b, marks=skip) if b == "symm" else b for b in BACKENDS]


@pytest.mark.parametrize("backend", _backends())
def test_apply_tp_matches_unsharded_and_torch_styles_at_2_ranks(worlds, backend):
    per_rank = worlds(2).run(_run_cases, [backend])
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree on the full tensors"
    result = per_rank[0]
    assert not _failures(result), "\n".join(_failures(result))
    for case in result.values():
        assert len(case["errors"]) == 1 + len(list(_base_model(2).parameters()))
        assert case["forward"] == case["step"] == FORWARD
        assert case["backward"] == BACKWARD


def test_apply_tp_at_4_ranks(worlds):
    # One backend that moves bytes through shared memory and one that chooses: 4 ranks on 2
    # cores are slow to start, and the 2-rank tests cover every backend.
    backends = [b for b in ("symm", "auto") if tp_kernels.available_backends().get(b, "ok") == "ok"]
    result = worlds(4).run(_run_cases, backends)[0]
    assert not _failures(result), "\n".join(_failures(result))
    for case in result.values():
        assert case["forward"] == case["step"] == FORWARD and case["backward"] == BACKWARD


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_apply_tp_with_activation_checkpointing(worlds, mode):
    # torchtitan wraps each block; its backward runs the block's forward again, fused ops
    # included: one more forward's worth of the blocks' calls (not the output's).
    # (torchtitan's selective "op" policy saves PyTorch's reduce-scatter outputs, not tp_kernels'
    # ops, so those are recomputed too.)
    result = worlds(2).run(_run_cases, ["pipelined"], ac=mode)[0]
    assert not _failures(result), "\n".join(_failures(result))
    recomputed = {"all_gather_matmul": 2 * LAYERS, "matmul_reduce_scatter": 2 * LAYERS}
    for case in result.values():
        assert case["forward"] == FORWARD
        assert case["step"] == {k: FORWARD[k] + recomputed[k] for k in FORWARD}
        assert case["backward"] == BACKWARD


def _patch_and_restore() -> list[str]:
    """Check on a rank (where torchtitan is imported) that every patched name comes back."""
    import torchao.float8.float8_tensor_parallel as torchao_float8_tp

    import tp_kernels.float8_tensor_parallel as tpk_float8_tp

    problems = []
    modules, _ = titan._style_modules()
    modules.append(torchao_float8_tp)
    float8_names = tpk_float8_tp.__all__
    before = {m.__name__: dict(vars(m)) for m in modules}
    llama3 = llama3_parallelize
    with titan.patched() as names:
        with titan.patched():  # nested: the inner exit must not restore
            pass
        if llama3.__name__ not in names:
            problems.append(f"{llama3.__name__} not in {names}")
        imported = ("ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput")
        for name in imported:
            if getattr(llama3, name) is not getattr(tp_kernels, name):
                problems.append(f"inside: llama3's {name} is {getattr(llama3, name)}")
        if llama3.parallelize_module is not torch_tp.parallelize_module:
            problems.append("parallelize_module was rebound")
        for name in float8_names:  # imported by apply_tp from torchao's module when it runs
            if getattr(torchao_float8_tp, name) is not getattr(tpk_float8_tp, name):
                problems.append(f"inside: torchao's {name} is {getattr(torchao_float8_tp, name)}")
    try:
        with titan.patched():
            raise KeyError("inside")
    except KeyError:
        pass
    titan.patch()
    titan.unpatch()
    for module in modules:
        for key, value in before[module.__name__].items():
            if vars(module).get(key) is not value:
                problems.append(f"after: {module.__name__}.{key} is {vars(module).get(key)}")
    try:
        titan.unpatch()
        problems.append("unpatch() without patch() did not raise")
    except RuntimeError:
        pass
    return problems


def test_patched_restores_every_name(worlds):
    for problems in worlds(2).run(_patch_and_restore):
        assert not problems, "\n".join(problems)


def test_patched_names_the_version_when_nothing_imports_the_styles(monkeypatch):
    import torchtitan

    monkeypatch.setattr(titan, "_style_modules", lambda: ([], {}))
    monkeypatch.setattr(torchtitan, "__version__", "0.2.9")
    with pytest.raises(RuntimeError, match=r"torchtitan 0\.2\.9 .*nothing to patch.*0\.2\.x"):
        with titan.patched():
            pass
    # the failed entry left nothing open
    with pytest.raises(RuntimeError, match="without a patch"):
        titan.unpatch()


def test_patched_takes_the_dist_gemm_path_by_version(monkeypatch):
    # A release numbered 0.3 without dist_gemm (this 0.2 install, relabelled): a clear error
    # naming the version and the module, and nothing left patched.
    import torchtitan

    monkeypatch.setattr(torchtitan, "__version__", "0.3.0")
    assert titan._uses_dist_gemm(torchtitan)
    with pytest.raises(RuntimeError, match=r"torchtitan 0\.3\.0: cannot import .*dist_gemm"):
        titan.patch()
    with pytest.raises(RuntimeError, match="without a patch"):
        titan.unpatch()
    # a checkout without a release number goes by what it has: 0.2.x has no dist_gemm
    monkeypatch.setattr(torchtitan, "__version__", "0.0.0+unknown")
    assert not titan._uses_dist_gemm(torchtitan)
    monkeypatch.setattr(torchtitan, "__version__", "0.2.2")
    assert not titan._uses_dist_gemm(torchtitan)


# --- FP8: torchtitan's float8 converter (torchao's Float8Linear) ----------------------------------


def _float8_model(world: int, recipe: str) -> Transformer:
    """The tiny model converted by torchtitan's float8 converter with ``recipe``."""
    model = _base_model(world)
    convert_with_torchtitan_s_float8_converter(model, recipe)
    return model


def convert_with_torchtitan_s_float8_converter(model: torch.nn.Module, recipe: str) -> None:
    """Convert ``model`` with torchtitan 0.2.2's own float8 converter and ``recipe``
    (``tensorwise``: no recipe name, the converter's default config). The converter refuses
    without an sm_89 GPU unless asked to emulate, and an emulated Float8Linear never fuses (its
    GEMMs are not ``_scaled_mm``); ``torch._scaled_mm`` runs on the CPU here, so its hardware
    check is answered yes."""
    from unittest import mock

    from torchtitan.components.quantization import float8 as titan_float8
    from torchtitan.config.job_config import JobConfig

    job = JobConfig()
    job.model.converters = ["quantize.linear.float8"]
    job.quantize.linear.float8.recipe_name = None if recipe == "tensorwise" else recipe
    parallel_dims = mock.Mock(dp_shard_enabled=False)
    with mock.patch.object(titan_float8, "has_cuda_capability", return_value=True):
        converter = titan_float8.Float8LinearConverter(job, parallel_dims)
    converter.convert(model)


def _float8_step(recipe: str, backend: str) -> dict:
    """One training step of the float8-converted model through ``apply_tp`` under ``patched()``
    (tensorwise with ``enable_float8_tensorwise_tp``, as torchtitan's parallelize_llama sets it)
    and as shipped without the flag (PyTorch's styles: torchao's float8 styles cannot run on
    gloo, which refuses to all-gather a float8 tensor): each quantity's norm-relative error,
    the counters."""
    from torchao.float8.float8_linear import Float8Linear

    world = dist.get_world_size()
    base = _float8_model(world, recipe)
    fp8 = [name for name, m in base.named_modules() if isinstance(m, Float8Linear)]
    mesh = init_device_mesh("cpu", (world,))
    theirs = copy.deepcopy(base)
    llama3_parallelize.apply_tp(theirs, mesh, loss_parallel=True, enable_float8_tensorwise_tp=False)
    ours = copy.deepcopy(base)
    with titan.patched():
        llama3_parallelize.apply_tp(
            ours, mesh, loss_parallel=True, enable_float8_tensorwise_tp=recipe == "tensorwise"
        )
    want = _loss_and_grads(theirs, loss_parallel=True)
    tp_kernels.reset_comm_stats()
    with tp_kernels.use_backend(backend):
        got = _loss_and_grads(ours, loss_parallel=True)
    counts = tp_kernels.comm_stats()
    return {
        "fp8 linears": fp8,
        "fused": [name for name in fp8 if hasattr(ours.get_submodule(name), "_tpk_fused")],
        "loss equal": torch.equal(got[0], want[0]),
        "errors": {name: relative_error(got[1][name], want[1][name]) for name in want[1]},
        "counts": dict(counts),
    }


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "rowwise_with_gw_hp"])
def test_apply_tp_runs_torchtitan_s_float8_linears_fused(worlds, recipe):
    """Every Linear torchtitan's converter makes fp8 (all 15: the filter passes dims that are
    multiples of 16) fused by ``apply_tp`` under ``patched()``, the tensorwise recipe through its
    float8 TP styles: zero fallbacks, the fp8 fused ops counted as the bf16 ones are (FORWARD,
    BACKWARD), the loss equal to PyTorch's styles' and each gradient within 2^-20 of it
    (tests/test_fp8.py's reasoning at 2 ranks on ``reference``: the same casts and ``_scaled_mm``
    rows; fp32 master weights, whose weight grads reduce the rows in another order)."""
    pytest.importorskip("torchao.float8")
    result = worlds(2).run(_float8_step, recipe, "reference")[0]
    assert len(result["fp8 linears"]) == 7 * LAYERS + 1 and result["fused"] == result["fp8 linears"]
    assert result["loss equal"]
    assert max(result["errors"].values()) <= 2**-20, result["errors"]
    counts = result["counts"]
    assert not [key for key in counts if key[1] == "fallback"], counts
    fused = {(phase, kind): n for (phase, kind, _), n in counts.items() if "scaled" in kind}
    assert fused == {
        ("forward", "scaled_all_gather_matmul"): FORWARD["all_gather_matmul"],
        ("forward", "scaled_matmul_reduce_scatter"): FORWARD["matmul_reduce_scatter"],
        ("backward", "scaled_all_gather_matmul"): BACKWARD["all_gather_matmul"],
        ("backward", "scaled_matmul_reduce_scatter"): BACKWARD["matmul_reduce_scatter"],
    }


# --- MXFP8: torchao's MXFP8Linear under apply_tp ------------------------------------------------
#
# torchtitan 0.2.2's MX converter cannot build with torchao 0.18 (it imports torchao's former
# MXLinearConfig) and asserts an sm_100 GPU, so a 0.2.x run converts the model itself: here every
# Linear but ``output`` made an emulated MXFP8Linear, as ``train_llama --recipe mxfp8`` does.
# Sizes that fuse at 2 ranks: each rank's run of a sequence is one 32-token MX block and every
# GEMM dim per rank a multiple of 32 (wk, wv: 4 KV heads x 16 / 2).
MX_SEQ = 64


def _mxfp8_step() -> dict:
    """One training step of the MXFP8 model through ``apply_tp`` under ``patched()`` on
    ``reference`` against the same model unsharded: each quantity's norm-relative error, the
    counters."""
    from tp_kernels.examples import train_llama

    args = _model_args(4)  # 4 KV heads
    args.max_seq_len = MX_SEQ
    torch.manual_seed(0)
    base = Transformer(args)
    with torch.no_grad():
        base.init_weights()
    train_llama.convert(base, "mxfp8", torch.device("cpu"))
    tokens = torch.randint(
        0, VOCAB, (BATCH, MX_SEQ + 1), generator=torch.Generator().manual_seed(7)
    )
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    want = next_token_loss_and_grads(copy.deepcopy(base), inputs, targets, loss_parallel=False)
    ours = copy.deepcopy(base)
    with titan.patched():
        llama3_parallelize.apply_tp(
            ours,
            init_device_mesh("cpu", (2,)),
            loss_parallel=True,
            enable_float8_tensorwise_tp=False,
        )
    tp_kernels.reset_comm_stats()
    with tp_kernels.use_backend("reference"):
        got = next_token_loss_and_grads(ours, inputs, targets, loss_parallel=True)
    return {
        "mx linears": sum(type(m).__name__ == "MXFP8Linear" for m in base.modules()),
        "errors": {
            "loss": relative_error(got[0], want[0]),
            **{name: relative_error(got[1][name], want[1][name]) for name in want[1]},
        },
        "counts": dict(tp_kernels.comm_stats()),
    }


def test_apply_tp_runs_mxfp8_linears_fused(worlds):
    """Every MXFP8Linear fused by ``apply_tp`` under ``patched()``: zero fallbacks, each block's
    gathers and reduce-scatters the MXFP8 fused ops (``output`` the bf16 one), and the loss and
    every gradient those of the unsharded model: tests/test_mxfp8.py's reasoning (torchao's casts
    of the same rows, the weight grads' along the tokens in torchao's order), less what the
    reduce-scatter's fp32 sums in rank order move, bound 2^-20 as for fp8 (measured: the loss
    and the MXFP8Linears' grads exact, the norms' and embeddings' within 2^-22.3)."""
    pytest.importorskip("torchao.prototype.moe_training")
    result = worlds(2).run(_mxfp8_step)[0]
    assert result["mx linears"] == 7 * LAYERS
    counts = result["counts"]
    assert not [key for key in counts if key[1] == "fallback"], counts
    fused = {(phase, kind): n for (phase, kind, _), n in counts.items() if "matmul" in kind}
    assert fused == {
        ("forward", "scaled_all_gather_matmul"): 2 * LAYERS,
        ("forward", "all_gather_matmul"): 1,  # output
        ("forward", "scaled_matmul_reduce_scatter"): 2 * LAYERS,
        ("backward", "scaled_all_gather_matmul"): 2 * LAYERS,
        ("backward", "scaled_matmul_reduce_scatter"): 2 * LAYERS,
        ("backward", "matmul_reduce_scatter"): 1,  # output
    }, counts
    assert max(result["errors"].values()) <= 2**-20, result["errors"]
