"""The small Llama, its tensor-parallel plan and the training example, end to end.

Tolerances (parallel vs unsharded). Every check compares the parallel run's relative error
``||x_tp - x_64|| / ||x_64||`` against a float64 run of the same unsharded model with the same
(dtype-rounded) weights, and allows ``max(2 * err_ref, 2 * eps(dtype))``, where ``err_ref`` is the
unsharded model's own error in the same dtype measured the same way:

=========  ========================  =============================================================
dtype      floor ``2 * eps(dtype)``  why
=========  ========================  =============================================================
float32    2.4e-7                    Sharding only reorders sums (a split matmul, a reduce-scatter,
bfloat16   1.6e-2                    an all-reduce): that moves rounding errors around without
                                     growing them; measured ratios ``err_tp / err_ref`` are 1.0-1.3.
                                     The floor (four half-ulp roundings) covers quantities that the
                                     reference happens to round almost exactly: the scalar loss is a
                                     mean whose errors can cancel.
=========  ========================  =============================================================

Every backend is held to these tolerances. The fused path is checked to fire: per forward each
block runs exactly two fused all-gathers (attention and feed-forward inputs, each grouped with
its colwise children) and two fused reduce-scatters (``wo``, ``w2``), plus one all-gather for
``output``, and the backward runs the matching transposed ops; nothing falls back.
"""

from __future__ import annotations

import copy
import math
import re
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _training import next_token_loss_and_grads, relative_error
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import parallel as torch_tp

import tp_kernels
from tp_kernels.examples import train_llama
from tp_kernels.models import Llama, LlamaConfig
from tp_kernels.models.plans import check_tp_compatible, llama_tp_plan
from tp_kernels.ops.comm_stats import record

# Divisible by 2 and 4 everywhere it must be (heads, kv heads, ffn, vocab, sequence).
CONFIG = LlamaConfig(
    vocab_size=128, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden_dim=128, max_seq_len=32
)
BATCH, SEQ = 2, 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (sequence_parallel, loss_parallel)
LAYOUTS = [(True, False), (True, True), (False, False), (False, True)]


def _tokens(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _loss_and_grads(
    model: torch.nn.Module, *, loss_parallel: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return next_token_loss_and_grads(model, *_tokens(), loss_parallel=loss_parallel)


def _parallel_copy(base: Llama, **plan_kwargs: object) -> Llama:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = copy.deepcopy(base)
    return tp_kernels.parallelize_module(model, mesh, llama_tp_plan(model, **plan_kwargs))


def _check_sharded(model: Llama, sequence_parallel: bool) -> None:
    """Fail unless the plan reached the modules it names (a key that matches nothing only warns)."""
    world = dist.get_world_size()
    block = model.layers["1"]
    expect = {
        block.attention.wq.weight: (Shard(0), CONFIG.n_heads * CONFIG.head_dim // world),
        block.attention.wk.weight: (Shard(0), CONFIG.n_kv_heads * CONFIG.head_dim // world),
        block.attention.wo.weight: (Shard(1), CONFIG.dim),
        block.feed_forward.w1.weight: (Shard(0), CONFIG.ffn_hidden_dim // world),
        block.feed_forward.w2.weight: (Shard(1), CONFIG.dim),
        model.tok_embeddings.weight: (Shard(0), CONFIG.vocab_size // world),
        model.output.weight: (Shard(0), CONFIG.vocab_size // world),
    }
    for param, (placement, rows) in expect.items():
        assert isinstance(param, DTensor) and param.placements == (placement,), param
        assert param.to_local().shape[0] == rows
    norm_is_dtensor = isinstance(block.ffn_norm.weight, DTensor)
    assert norm_is_dtensor == sequence_parallel


def _errors_vs_unsharded(
    backend: str,
) -> dict[tuple[str, bool, bool], dict[str, tuple[float, float]]]:
    """Per (dtype, sequence_parallel, loss_parallel): ``{"loss" or param: (err_tp, err_ref)}``."""
    out = {}
    for dtype_name, dtype in DTYPES.items():
        base = Llama(CONFIG, seed=3).to(dtype)
        loss64, grads64 = _loss_and_grads(copy.deepcopy(base).double())
        loss_ref, grads_ref = _loss_and_grads(copy.deepcopy(base))
        for sp, lp in LAYOUTS:
            model = _parallel_copy(base, sequence_parallel=sp, loss_parallel=lp, backend=backend)
            _check_sharded(model, sp)
            loss, grads = _loss_and_grads(model, loss_parallel=lp)
            errs = {"loss": (relative_error(loss, loss64), relative_error(loss_ref, loss64))}
            for name, g in grads.items():
                assert g.dtype == dtype and g.shape == grads_ref[name].shape, name
                errs[name] = (
                    relative_error(g, grads64[name]),
                    relative_error(grads_ref[name], grads64[name]),
                )
            out[(dtype_name, sp, lp)] = errs
    return out


def _backends() -> list:
    symm = tp_kernels.available_backends()["symm"]
    return [
        "reference",
        "pipelined",
        pytest.param("symm", marks=pytest.mark.skipif(symm != "ok", reason=f"symm: {symm}")),
    ]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("world_size", [2, 4])
def test_matches_unsharded_model(worlds, world_size, backend):
    per_rank = worlds(world_size).run(_errors_vs_unsharded, backend)
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree on the full tensors"
    failures = []
    for (dtype_name, sp, lp), errs in per_rank[0].items():
        assert len(errs) == 1 + len(list(Llama(CONFIG).parameters()))
        floor = 2 * torch.finfo(DTYPES[dtype_name]).eps
        for name, (err_tp, err_ref) in errs.items():
            if err_tp > max(2 * err_ref, floor):
                failures.append(
                    f"{dtype_name} sequence_parallel={sp} loss_parallel={lp} {name}: "
                    f"err {err_tp:.3e} > max(2 * {err_ref:.3e}, {floor:.1e})"
                )
    assert not failures, "\n".join(failures)


def _comm_counts(backend: str) -> tuple[dict, dict]:
    model = _parallel_copy(Llama(CONFIG, seed=5), backend=backend)
    inputs, targets = _tokens()
    tp_kernels.reset_comm_stats()
    logits = model(inputs)
    forward = tp_kernels.comm_stats()
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    return dict(forward), dict(tp_kernels.comm_stats() - forward)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("world_size", [2, 4])
def test_fused_path_fires_once_per_boundary(worlds, world_size, backend):
    forward, backward = worlds(world_size).run(_comm_counts, backend)[0]
    blocks = CONFIG.n_layers
    assert forward == {
        ("forward", "all_gather_matmul", backend): 2 * blocks + 1,  # + output
        ("forward", "matmul_reduce_scatter", backend): 2 * blocks,
    }
    assert backward == {
        # input grads of every gathered input: one reduce-scatter per group of colwise Linears
        ("backward", "matmul_reduce_scatter", backend): 2 * blocks + 1,
        # the gathered inputs are not kept for backward: gathered again for the weight grads
        ("backward", "all_gather", backend): 2 * blocks + 1,
        # the output grads of wo / w2, gathered with the input-grad matmul
        ("backward", "all_gather_matmul", backend): 2 * blocks,
    }


def _compiled_matches_eager() -> tuple[float, float]:
    config = LlamaConfig(**{**CONFIG.__dict__, "n_layers": 1})
    base = Llama(config, seed=9)
    inputs, targets = _tokens()
    results = []
    for compiled in (False, True):
        model = _parallel_copy(base, backend="pipelined")
        run = torch.compile(model, backend="aot_eager") if compiled else model
        loss = F.cross_entropy(run(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        results.append((loss.detach(), grads))
    (eager_loss, eager), (comp_loss, comp) = results
    return (comp_loss - eager_loss).abs().item(), max(
        (comp[n] - eager[n]).abs().max().item() for n in eager
    )


def test_torch_compile_of_parallelized_model_matches_eager(worlds):
    # The same ops run in the same order; only the compiler's fusion of the pointwise ops around
    # them may reassociate fp32 arithmetic: a few ulps of the O(1) loss and grads.
    for loss_err, grad_err in worlds(2).run(_compiled_matches_eager):
        assert loss_err <= 1e-5 and grad_err <= 1e-5


def _apply_to_incompatible() -> tuple[str, bool]:
    cfg = LlamaConfig(vocab_size=128, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128)
    model = Llama(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    try:
        tp_kernels.parallelize_module(model, mesh, llama_tp_plan(model))
    except ValueError as e:
        return str(e), any(isinstance(p, DTensor) for p in model.parameters())
    return "no error", False


def test_incompatible_mesh_is_rejected_before_sharding(worlds):
    for message, sharded in worlds(4).run(_apply_to_incompatible):
        assert "mesh of 4 ranks: n_kv_heads=2 is not divisible by 4" in message
        assert not sharded


def test_check_tp_compatible():
    check_tp_compatible(CONFIG, 4, seq_len=SEQ)
    with pytest.raises(ValueError, match=r"2 ranks: seq_len=7 is not divisible by 2"):
        check_tp_compatible(CONFIG, 2, seq_len=7)
    with pytest.raises(ValueError, match=r"n_kv_heads=4, ffn_hidden_dim=128, vocab_size=128 are"):
        check_tp_compatible(CONFIG, 3)
    with pytest.raises(ValueError, match="tp_size must be a positive int, got 0"):
        check_tp_compatible(CONFIG, 0)


def test_plan_layout():
    model = Llama(CONFIG)
    plan = llama_tp_plan(model, backend="reference")
    assert plan["layers.*.attention.wq"].backend == "reference"
    fusable = [
        s
        for s in plan.values()
        if isinstance(s, torch_tp.ColwiseParallel | torch_tp.RowwiseParallel)
    ]
    assert len(fusable) == 9 and all(s.backend == "reference" for s in fusable)
    assert all(
        isinstance(s, tp_kernels.ColwiseParallel | tp_kernels.RowwiseParallel) for s in fusable
    )
    assert isinstance(plan["layers.*.attention.wo"], tp_kernels.RowwiseParallel)
    assert plan["layers.*.attention.wo"].output_layouts == (Shard(1),)
    assert plan["layers.*.feed_forward"].desired_input_layouts == (Replicate(),)
    assert plan["output"].use_local_output
    lp = llama_tp_plan(model, loss_parallel=True)["output"]
    assert lp.output_layouts == (Shard(-1),) and not lp.use_local_output
    no_sp = llama_tp_plan(model, sequence_parallel=False)
    assert not any(
        isinstance(s, torch_tp.SequenceParallel | torch_tp.PrepareModuleInput)
        for s in no_sp.values()
    )
    assert no_sp["layers.*.feed_forward.w2"].output_layouts == (Replicate(),)
    theirs = llama_tp_plan(model, styles="torch")
    assert theirs.keys() == plan.keys()
    assert type(theirs["output"]) is torch_tp.ColwiseParallel
    with pytest.raises(ValueError, match="backend='reference' needs styles='tp_kernels'"):
        llama_tp_plan(model, styles="torch", backend="reference")
    with pytest.raises(ValueError, match="styles must be 'tp_kernels' or 'torch', got 'dtensor'"):
        llama_tp_plan(model, styles="dtensor")
    with pytest.raises(TypeError, match="model must be a tp_kernels Llama, got Linear"):
        llama_tp_plan(torch.nn.Linear(2, 2))


def test_config_errors():
    with pytest.raises(ValueError, match=r"dim \(60\) must be a multiple of n_heads \(8\)"):
        LlamaConfig(dim=60, n_heads=8)
    with pytest.raises(ValueError, match=r"n_heads \(6\) must be a multiple of n_kv_heads \(4\)"):
        LlamaConfig(dim=48, n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="head dim dim/n_heads = 3 must be even"):
        LlamaConfig(dim=12, n_heads=4, n_kv_heads=2)
    with pytest.raises(ValueError, match="n_layers must be a positive int, got 0"):
        LlamaConfig(n_layers=0)
    with pytest.raises(ValueError, match=r"tokens must be \[batch, seq\] int64, got \[4\]"):
        Llama(CONFIG)(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="sequence length 33 exceeds max_seq_len 32"):
        Llama(CONFIG)(torch.zeros(1, 33, dtype=torch.int64))


def test_init_is_deterministic():
    rng = torch.get_rng_state()
    a, b, c = Llama(CONFIG, seed=1), Llama(CONFIG, seed=1), Llama(CONFIG, seed=2)
    assert torch.equal(torch.get_rng_state(), rng), "init must not draw from the global RNG"
    assert "rope_cos" not in a.state_dict() and "rope_cos" in dict(a.named_buffers())
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
        assert name.endswith("norm.weight") == torch.equal(pa, pc), name
    half = Llama(CONFIG, seed=1, dtype=torch.bfloat16)
    for name, p in half.state_dict().items():
        assert torch.equal(p, a.state_dict()[name].bfloat16()), name
    a.init_weights(2)
    for x, y in zip(a.state_dict().values(), c.state_dict().values(), strict=True):
        assert torch.equal(x, y)


def _attention_by_formula(model: Llama, x: torch.Tensor) -> torch.Tensor:
    """The first block's attention written out head by head, in float64."""
    att, d = model.layers["0"].attention, CONFIG.head_dim
    seq = x.shape[1]
    pos = torch.arange(seq, dtype=torch.float64)[:, None]
    angle = pos * CONFIG.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)

    def rope(t: torch.Tensor) -> torch.Tensor:  # t [B, S, d]
        t1, t2 = t[..., : d // 2], t[..., d // 2 :]
        return torch.cat(
            [t1 * angle.cos() - t2 * angle.sin(), t1 * angle.sin() + t2 * angle.cos()], -1
        )

    group = CONFIG.n_heads // CONFIG.n_kv_heads
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    heads = []
    for h in range(CONFIG.n_heads):
        kv = h // group
        q = rope(x @ att.wq.weight[h * d : (h + 1) * d].T)
        k = rope(x @ att.wk.weight[kv * d : (kv + 1) * d].T)
        v = x @ att.wv.weight[kv * d : (kv + 1) * d].T
        scores = (q @ k.transpose(1, 2) / d**0.5).masked_fill(~mask, float("-inf"))
        heads.append(scores.softmax(-1) @ v)
    return torch.cat(heads, -1) @ att.wo.weight.T


def test_model_computes_its_formula():
    # Built in float64 so that the RoPE tables are too (a .double() copy would keep fp32 tables).
    model = Llama(CONFIG, seed=4, dtype=torch.float64)
    x = torch.randn(BATCH, SEQ, CONFIG.dim, dtype=torch.float64)
    rope = (model.rope_cos[:SEQ], model.rope_sin[:SEQ])
    got = model.layers["0"].attention(x, rope=rope)
    torch.testing.assert_close(got, _attention_by_formula(model, x), rtol=1e-12, atol=1e-12)
    inputs, _ = _tokens()
    logits = model(inputs)
    assert logits.shape == (BATCH, SEQ, CONFIG.vocab_size) and logits.dtype == torch.float64
    changed = inputs.clone()
    changed[:, -1] = (changed[:, -1] + 1) % CONFIG.vocab_size
    later = model(changed)
    assert torch.equal(later[:, :-1], logits[:, :-1]), "a future token changed an earlier logit"
    assert not torch.equal(later[:, -1], logits[:, -1])


def test_example_main_trains_and_matches(worlds, capsys):
    # The default data and model at 5 steps: deterministic, the loss drops from ~5.3 to ~4.2.
    assert train_llama.main(["--world-size", "2", "--steps", "5"], world=worlds(2)) == 0
    out = capsys.readouterr().out  # the parent's report (the ranks print the steps)
    assert out.count("loss curves ") == 3
    first, last = map(float, re.search(r"^loss ([\d.]+) -> ([\d.]+);.*: OK$", out, re.M).groups())
    assert last < first - 0.5
    with pytest.raises(ValueError, match="--world-size is 4 but the given world has 2 ranks"):
        train_llama.main(["--world-size", "4"], world=worlds(2))


def _train_fifty_steps() -> tuple[dict[str, list[float]], dict]:
    opts = train_llama.parse_args(["--steps", "50"])
    curves = train_llama.train_rank(opts)  # resets the counters before the parallel run
    return curves, dict(tp_kernels.comm_stats())


def test_fifty_training_steps_follow_the_unsharded_curve_on_the_fused_path(worlds):
    curves, stats = worlds(2).run(_train_fifty_steps)[0]
    ok, deviation, tolerance = train_llama.check_curves(curves, "float32")
    assert ok, f"parallel loss curve off float64 by {deviation:.3e} > {tolerance:.3e}"
    assert curves["tp"][-1] < curves["tp"][0] - 2.0
    layers = train_llama.parse_args([]).layers
    fused = {kind: n for (phase, kind, _), n in stats.items() if phase == "forward"}
    # Every forward step: 2 grouped gathers per block and one for the output; 2 reduce-scatters
    # per block; nothing took PyTorch's path.
    assert fused == {
        "all_gather_matmul": 50 * (2 * layers + 1),
        "matmul_reduce_scatter": 50 * 2 * layers,
    }, stats


def test_example_progress_lines(capsys):
    opts = train_llama.parse_args(["--steps", "2", "--batch", "2", "--seq-len", "8"])
    base = Llama(opts.model_config(), seed=opts.seed)
    stand_in = copy.deepcopy(base)  # for the parallel model: one counted fallback per forward
    stand_in.register_forward_pre_hook(lambda *_: record("forward", "fallback", "torch"))
    curves = train_llama.train_curves(base, stand_in, opts, torch.device("cpu"), log=True)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[-1].startswith("fused path: ")
    for step, line in enumerate(lines[:2], 1):
        losses = [f"{curves[name][step - 1]:.4f}" for name in ("tp", "unsharded", "float64")]
        pattern = (rf"step +{step}/2 +loss tp {losses[0]} +unsharded {losses[1]} +float64 "
                   rf"{losses[2]} +fallbacks {step} +tokens/s +\d+ +ms/step +[\d.]+")  # fmt: skip
        assert re.fullmatch(pattern, line), line
    tokens = train_llama.synthetic_tokens(3, 4, 8, seed=0)
    assert torch.equal(tokens, train_llama.synthetic_tokens(3, 4, 8, seed=0))
    stride = (tokens[:, 1:] - tokens[:, :-1]) % train_llama.VOCAB
    assert ((stride == stride[:, :1]) & (stride >= 1) & (stride <= 3)).all()


def _train_with_recipe(argv: list[str]) -> tuple[dict[str, list[float]], dict]:
    curves = train_llama.train_rank(train_llama.parse_args(argv))
    return curves, dict(tp_kernels.comm_stats())


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8-rowwise"])
def test_example_trains_a_low_precision_recipe_on_the_fused_path(worlds, recipe):
    # Every Linear but output converted (torchao's MXFP8Linear emulated on the CPU, or
    # Float8Linear), mxfp8 at its default sizes, which fuse at W=2: each block's two gathers
    # and two reduce-scatters are the scaled fused ops, nothing falls back, and the losses follow
    # the unsharded model of the same recipe within the reduce-scatter's bf16 roundings (2^-8
    # of a partial, measured 1e-4 of the loss), and float64 within the example's own tolerance.
    steps, layers = 2, train_llama.parse_args([]).layers
    argv = ["--recipe", recipe, "--steps", str(steps)]
    curves, stats = worlds(2).run(_train_with_recipe, argv)[0]
    assert not [key for key in stats if key[1] == "fallback"], stats
    fused = {kind: n for (phase, kind, _), n in stats.items() if phase == "forward"}
    assert fused["scaled_all_gather_matmul"] == steps * 2 * layers, stats
    assert fused["scaled_matmul_reduce_scatter"] == steps * 2 * layers, stats
    assert fused["all_gather_matmul"] == steps  # output, kept in high precision
    assert all(math.isfinite(loss) for curve in curves.values() for loss in curve)
    for tp, unsharded in zip(curves["tp"], curves["unsharded"], strict=True):
        assert abs(tp - unsharded) <= 1e-3 * unsharded
    assert curves["unsharded"] != curves["float64"]  # the recipe ran on the unsharded model too
    ok, deviation, tolerance = train_llama.check_curves(curves, "float32")
    assert ok, f"parallel loss curve off float64 by {deviation:.3e} > {tolerance:.3e}"


def test_example_recipe_flag(monkeypatch, capsys):
    mx = train_llama.parse_args(["--recipe", "mxfp8"])
    assert (mx.recipe, mx.dim, mx.seq_len) == ("mxfp8", 128, 64)  # sizes that fuse at W=2
    assert train_llama.parse_args(["--recipe", "mxfp8", "--dim", "256"]).dim == 256
    plain = train_llama.parse_args([])
    assert (plain.recipe, plain.dim, plain.seq_len) == ("none", 64, 32)
    with pytest.raises(SystemExit):
        train_llama.parse_args(["--recipe", "fp4"])
    cpu = torch.device("cpu")
    assert train_llama.mxfp8_kernel_preference(cpu).name == "EMULATED"
    assert "KernelPreference.EMULATED (no sm_100 GPU" in train_llama.describe_recipe("mxfp8", cpu)
    for capability, kernels in (((10, 0), "AUTO"), ((9, 0), "EMULATED")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _, c=capability: c)
        assert train_llama.mxfp8_kernel_preference(torch.device("cuda", 0)).name == kernels
    model = train_llama.convert(Llama(CONFIG), "fp8-tensorwise", cpu)
    converted = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    linears = {n for n, m in Llama(CONFIG).named_modules() if isinstance(m, torch.nn.Linear)}
    assert converted == linears - {"output"}
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails: a message, no picture
    curves = {"tp": [2.0, 1.0], "unsharded": [2.0, 1.0], "float64": [2.0, 1.0]}
    assert train_llama.report(curves, "float32", plot="loss.png")
    assert "--plot loss.png: matplotlib is not installed" in capsys.readouterr().out


def test_example_flags_divergence():
    curves = {"float64": [5.0, 4.0, 3.0], "unsharded": [5.0, 4.0, 3.001], "tp": [5.0, 4.0, 3.0]}
    assert train_llama.check_curves(curves, "float32") == (True, 0.0, pytest.approx(0.002))
    curves["tp"] = [5.0, 4.01, 3.0]
    ok, dev, tol = train_llama.check_curves(curves, "float32")
    assert not ok and dev == pytest.approx(0.01)
    curves["unsharded"] = curves["float64"]
    assert train_llama.curve_tolerance(curves, "bfloat16") == pytest.approx(2 * 2**-7 * 5.0)
    with pytest.raises(SystemExit):
        train_llama.parse_args(["--heads", "6"])
