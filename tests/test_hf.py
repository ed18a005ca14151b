"""Hugging Face transformers models on the sequence-parallel plan of tp_kernels.integrations.hf.

Each family (Llama, Mistral, Qwen2, Qwen3) is built from a tiny random config, its real model code
run unchanged: the loss of ``model(input_ids, attention_mask, labels=...)`` (transformers' own
cross entropy, right-padded second row) and every parameter gradient of the parallel model are
compared with the unsharded model's.

Tolerances, as in test_llama.py: the relative error ``||x_tp - x_64|| / ||x_64||`` against a
float64 run of the unsharded model (same fp32-rounded weights) may be at most
``max(2 * err_ref, 2 * eps(float32))``, where ``err_ref`` is the unsharded fp32 model's own error
measured the same way. Sharding only reorders sums (split matmuls, reduce-scatters, the ``Partial``
sums of the norms' weight gradients), which moves rounding errors around without growing them; the
floor (four half-ulp roundings) covers quantities the reference happens to round almost exactly
(the loss: transformers computes it from ``logits.float()``, so even the float64 run's loss is
an fp32 cross entropy, and the loss errors sit at the floor).
PyTorch's own styles on the same plan are held to the same rule, and must shard every parameter
the same way.

The fused path must fire at every boundary: per forward, per decoder layer, one all-gather-matmul
for ``q/k/v`` (``self_attn`` is called with ``hidden_states=`` by keyword), one for ``gate/up``,
and one matmul-reduce-scatter each for ``o_proj`` and ``down_proj``, plus the ``lm_head`` gather;
the backward runs the transposed ops; nothing falls back.

World size 4 (four ranks on two cores: the slow part of this file) runs one family, Qwen3, whose
attention has the most parts (per-head norms on the local heads), with the two backends whose
schedules depend on the number of ranks (``pipelined``: W - 1 point-to-point steps; ``symm``: W
peer buffers); ``reference`` is one collective, and ``auto`` picks among these.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel as torch_tp
import transformers
from _training import full, relative_error
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

import tp_kernels
from tp_kernels.examples import train_hf
from tp_kernels.integrations import hf

# Every sharded size divisible by 2 and 4: heads, kv heads (GQA 2:1), intermediate, vocab, seq.
SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
# The attention implementation decides how the mask is made: sdpa skips it for a causal unpadded
# batch and builds it here (padding), eager always adds a materialized [B, 1, S, S] mask.
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, "sdpa"),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, "eager"),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, "sdpa"),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, "eager"),
}
BATCH, SEQ, PAD = 2, 16, 3
BACKENDS = ("reference", "pipelined", "symm", "auto")
FLOOR = 2 * torch.finfo(torch.float32).eps


def _config(family: str) -> transformers.PretrainedConfig:
    config_cls, _, attn = FAMILIES[family]
    return config_cls(**SIZES, attn_implementation=attn)


def _model(family: str, seed: int = 0) -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return FAMILIES[family][1](_config(family)).float()


def _batch() -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and labels ``[B, S]``; the second row's last PAD tokens padded."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[1, -PAD:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _loss_and_grads(
    model: torch.nn.Module, *, loss_parallel: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict, dict]:
    """transformers' loss, ``backward()``; the full loss and gradients, and the fused-call counts
    of the forward and of the backward."""
    tp_kernels.reset_comm_stats()
    with tp_kernels.loss_parallel() if loss_parallel else contextlib.nullcontext():
        loss = model(**_batch()).loss
        forward = tp_kernels.comm_stats()
        loss.backward()
    backward = tp_kernels.comm_stats() - forward
    grads = {name: full(p.grad) for name, p in model.named_parameters()}
    return full(loss).detach(), grads, dict(forward), dict(backward)


def _placements(model: torch.nn.Module) -> dict[str, tuple]:
    return {n: getattr(p, "placements", None) for n, p in model.named_parameters()}


def _runs(family: str, backends: tuple[str, ...]) -> dict:
    """On every rank: per (styles or backend, loss_parallel), ``{"errors": {"loss" or param:
    (err_tp, err_ref)}, "forward"/"backward": fused-call counts, "placements": per param}``."""
    base = _model(family)
    loss64, grads64, _, _ = _loss_and_grads(copy.deepcopy(base).double())
    loss_ref, grads_ref, _, _ = _loss_and_grads(copy.deepcopy(base))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for label in ("torch", *backends):
        for lp in (False, True):
            kwargs = {"styles": "torch"} if label == "torch" else {"backend": label}
            model = copy.deepcopy(base)
            plan = hf.sequence_parallel_plan(model.config, loss_parallel=lp, **kwargs)
            tp_kernels.parallelize_module(model, mesh, plan)
            loss, grads, forward, backward = _loss_and_grads(model, loss_parallel=lp)
            errors = {"loss": (relative_error(loss, loss64), relative_error(loss_ref, loss64))}
            for name, g in grads.items():
                assert g.dtype == torch.float32 and g.shape == grads_ref[name].shape, name
                errors[name] = (
                    relative_error(g, grads64[name]),
                    relative_error(grads_ref[name], grads64[name]),
                )
            out[(label, lp)] = {
                "errors": errors,
                "forward": forward,
                "backward": backward,
                "placements": _placements(model),
            }
    return out


def _by_kind(counts: dict) -> dict[str, int]:
    totals: dict[str, int] = {}
    for (_, kind, _), n in counts.items():
        totals[kind] = totals.get(kind, 0) + n
    return totals


def _check(per_rank: list[dict], family: str) -> list[str]:
    """Every failure of the rules of the module docstring, one line each."""
    results = per_rank[0]
    assert all(r == results for r in per_rank), "ranks disagree on the full tensors or counts"
    layers = SIZES["num_hidden_layers"]
    want_forward = {"all_gather_matmul": 2 * layers + 1, "matmul_reduce_scatter": 2 * layers}
    want_backward = {
        # input grads of every gathered input: one reduce-scatter per group of colwise Linears
        "matmul_reduce_scatter": 2 * layers + 1,
        # the gathered inputs are not kept for backward: gathered again for the weight grads
        "all_gather": 2 * layers + 1,
        # the output grads of o_proj / down_proj, gathered with the input-grad matmul
        "all_gather_matmul": 2 * layers,
    }
    n_params = len(list(_model(family).parameters()))
    failures = []
    for (label, lp), run in results.items():
        where = f"{family} {label} loss_parallel={lp}"
        assert len(run["errors"]) == 1 + n_params
        for name, (err_tp, err_ref) in run["errors"].items():
            if err_tp > max(2 * err_ref, FLOOR):
                failures.append(
                    f"{where} {name}: err {err_tp:.3e} > max(2 * {err_ref:.3e}, {FLOOR:.1e})"
                )
        if run["placements"] != results[("torch", lp)]["placements"]:
            failures.append(f"{where}: parameters sharded unlike PyTorch's styles")
        if label == "torch":
            continue
        for phase, want in (("forward", want_forward), ("backward", want_backward)):
            got = run[phase]
            if _by_kind(got) != want:
                failures.append(f"{where} {phase}: fused calls {got}, want per kind {want}")
            used = {backend for (_, _, backend) in got}
            if (label != "auto" and used != {label}) or "torch" in used:
                failures.append(f"{where} {phase}: ran on backends {used}")
    return failures


@pytest.mark.parametrize("family", list(FAMILIES))
def test_matches_unsharded_model_on_the_fused_path(worlds, family):
    failures = _check(worlds(2).run(_runs, family, BACKENDS), family)
    assert not failures, "\n".join(failures)


def test_qwen3_on_four_ranks(worlds):
    failures = _check(worlds(4).run(_runs, "qwen3", ("pipelined", "symm")), "qwen3")
    assert not failures, "\n".join(failures)


def _head_norm_grads(kernelized: bool = False) -> tuple[dict[str, tuple], dict[str, float]]:
    """Qwen3's q_norm/k_norm: placements of weight and grad, and the grad's max abs difference
    from the unsharded model's. ``kernelized``: then reset every module's instance ``forward``
    to its class's, as transformers 5.25's kernelize (kernels 0.19) does after the loader."""
    base = _model("qwen3")
    _, want, _, _ = _loss_and_grads(copy.deepcopy(base))
    model = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tp_kernels.parallelize_module(model, mesh, hf.sequence_parallel_plan(model.config))
    if kernelized:
        for module in model.modules():
            if isinstance(module, transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm):
                module.__dict__.pop("forward", None)
    _loss_and_grads(model)
    placements, diffs = {}, {}
    for name, p in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            placements[name] = (p.placements, p.grad.placements)
            diffs[name] = (p.grad.full_tensor() - want[name]).abs().max().item()
    return placements, diffs


@pytest.mark.parametrize("kernelized", [False, True])
def test_qwen3_head_norm_grads_are_summed_over_ranks(worlds, kernelized):
    placements, diffs = worlds(2).run(_head_norm_grads, kernelized)[0]
    assert len(diffs) == 2 * SIZES["num_hidden_layers"]
    assert set(placements.values()) == {((Replicate(),), (Partial(),))}
    # Each rank's own grad is about half the total: unreduced, it would miss by ~50%.
    assert max(diffs.values()) < 1e-5, diffs


def _load_sharded(path: str) -> dict:
    """Save a tiny Qwen3 (rank 0), then load it whole in float64 and through transformers'
    tensor-parallel loader with the tp_kernels plan; compare loss and gradients."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    transformers.utils.logging.disable_progress_bar()
    if dist.get_rank() == 0:
        _model("qwen3", seed=3).save_pretrained(path)
    dist.barrier()
    hf.register()
    truth = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    config = DistributedConfig(
        tp_size=dist.get_world_size(), tp_plan=hf.sequence_parallel_tp_plan(truth.config)
    )
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, distributed_config=config
    )
    loss64, grads64, _, _ = _loss_and_grads(truth)
    loss, grads, forward, backward = _loss_and_grads(model)
    errors = {"loss": relative_error(loss, loss64)} | {
        n: relative_error(g, grads64[n]) for n, g in grads.items()
    }
    reference = copy.deepcopy(truth).float()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tp_kernels.parallelize_module(reference, mesh, hf.sequence_parallel_plan(reference.config))
    return {
        "styles": set(model.tp_plan.values()),
        "errors": errors,
        "forward": _by_kind(forward),
        "backward": _by_kind(backward),
        "same_sharding": _placements(model) == _placements(reference),
        "same_weights": all(
            torch.equal(full(p), full(q))
            for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        ),
    }


def test_transformers_loader_shards_the_checkpoint_onto_the_fused_path(worlds, tmp_path):
    got = worlds(2).run(_load_sharded, str(tmp_path / "qwen3"))[0]
    assert got["styles"] and all(s.startswith("tpk_") for s in got["styles"]), got["styles"]
    assert got["same_sharding"] and got["same_weights"]
    # fp32 against the float64 truth: a few ulps relative, through two layers and the loss.
    assert max(got["errors"].values()) < 1e-5, got["errors"]
    layers = SIZES["num_hidden_layers"]
    assert got["forward"] == {
        "all_gather_matmul": 2 * layers + 1,
        "matmul_reduce_scatter": 2 * layers,
    }
    assert got["backward"] == {
        "matmul_reduce_scatter": 2 * layers + 1,
        "all_gather": 2 * layers + 1,
        "all_gather_matmul": 2 * layers,
    }


def test_example_main_trains_and_matches(worlds, capsys):
    argv = ["--model", "qwen3", "--world-size", "2", "--steps", "5"]
    assert train_hf.main(argv, world=worlds(2)) == 0
    out = capsys.readouterr().out
    assert out.count("loss curves ") == 3
    first, last = map(float, re.search(r"^loss ([\d.]+) -> ([\d.]+);.*: OK$", out, re.M).groups())
    assert last < first


@pytest.mark.parametrize("family", list(FAMILIES))
def test_plan_covers_transformers_default_plan(family):
    config = _config(family)
    names = hf.sequence_parallel_tp_plan(config)
    default = {f"model.{key}" for key in config.base_model_tp_plan}
    # DistributedConfig merges a plan into the default key by key: every default key is replaced.
    assert default <= names.keys()
    assert all(name.startswith("tpk_") for name in names.values())
    assert (names.get("model.layers.*.self_attn.q_norm") == "tpk_head_norm") == (family == "qwen3")
    plan = hf.sequence_parallel_plan(config, backend="pipelined")
    assert plan.keys() == {""} | names.keys()
    attention = plan["model.layers.*.self_attn"]
    assert isinstance(attention, tp_kernels.PrepareModuleInput)
    assert attention.input_kwarg_layouts == {"hidden_states": Shard(1)}
    assert plan["model.layers.*.mlp.down_proj"].backend == "pipelined"
    assert plan["lm_head"].output_layouts == (Replicate(),)
    lp = hf.sequence_parallel_plan(config, loss_parallel=True)["lm_head"]
    assert lp.output_layouts == (Shard(-1),) and not lp.use_local_output
    theirs = hf.sequence_parallel_plan(config, styles="torch")
    assert type(theirs["lm_head"]) is torch_tp.ColwiseParallel


def test_plan_errors():
    with pytest.raises(ValueError, match="backend='symm' needs styles='tp_kernels'"):
        hf.sequence_parallel_plan(_config("llama"), styles="torch", backend="symm")
    with pytest.raises(ValueError, match="no plan for model_type 'gpt2'"):
        hf.sequence_parallel_plan(transformers.GPT2Config())
    with pytest.raises(ValueError, match="tie_word_embeddings=True is not supported"):
        hf.sequence_parallel_plan(transformers.LlamaConfig(tie_word_embeddings=True))
    small = transformers.Qwen2Config(**{**SIZES, "num_key_value_heads": 2})
    with pytest.raises(ValueError, match=r"4 ranks: num_key_value_heads=2, seq_len=6 are not"):
        hf.check_tp_compatible(small, 4, seq_len=6)
    hf.check_tp_compatible(_config("qwen3"), 4, seq_len=SEQ)


@pytest.mark.parametrize("method", ["shard_param", "install_forward"])
def test_loader_style_takes_every_argument_the_installed_transformers_passes(method):
    # transformers' loader calls these on every style by the base class's signature: 5.25 added
    # config= and mesh_manager= keywords, which a narrower override rejects with a TypeError.
    from transformers.distributed.tensor_parallel import TensorParallelLayer

    theirs = inspect.signature(getattr(TensorParallelLayer, method)).parameters
    ours = inspect.signature(getattr(hf._LoaderStyle, method)).parameters
    assert len(theirs) >= 3, theirs  # self, module, and a parameter name or the mesh
    missing = [name for name in theirs if name not in ours]
    assert not missing, (
        f"_LoaderStyle.{method} lacks {missing} (transformers {transformers.__version__})"
    )
    for name, param in theirs.items():
        assert ours[name].kind == param.kind, (name, ours[name].kind, param.kind)
