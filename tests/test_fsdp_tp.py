"""FSDP2 on a ``dp`` mesh dimension times tensor parallel on ``tp``: 4 ranks as a 2 x 2 mesh.

Three layouts, each built twice, once through tp_kernels and once the way PyTorch (or torchtitan)
ships it, then trained side by side and checkpointed across:

* ``titan02``: torchtitan 0.2.x's Llama3 through its own ``apply_tp`` (inside
  :func:`tp_kernels.integrations.torchtitan.patched`, or with PyTorch's styles) and its
  ``apply_fsdp`` on ``dp``;
* ``titan03``: torchtitan 0.3.x's Llama3 through ``parallelize_llama`` (TP + sequence parallel and
  FSDP), ``tp_gemm_backend="dist_gemm"`` under ``patched()``, against its stock unfused path;
* ``titan02-fp8``: ``titan02`` with torchtitan's float8 converter (torchao's rowwise
  Float8Linear) before ``apply_tp``;
* ``hf``: a transformers Llama on :func:`tp_kernels.integrations.hf.sequence_parallel_plan`
  (tp_kernels' styles, or the same plan from PyTorch's) with ``fully_shard`` per decoder layer and
  at the root.

Each variant takes ``STEPS`` SGD steps on one batch (each dp rank its own half); the losses
and the final parameters of the two must agree, and tp_kernels' steps count no fallback. Then a
``torch.distributed.checkpoint`` save of each trained model is loaded into a freshly built model
of the other variant (other weights): the loaded parameters must equal the saved ones exactly,
and one more step on each gives the same loss.

Tolerance: ``REL_TOL = 8 * eps(float32)`` (~1e-6) on the relative difference, per quantity (each
loss, each parameter's full tensor). A step's gradients agree to a few eps relative (sharding and
the fused ops only reorder sums: test_torchtitan*.py, test_hf.py hold them to 2x the unsharded
model's own rounding error); SGD turns that into a parameter difference ``lr * |dg|``, far below
one rounding of the parameter itself at ``lr = LR``, so after a few steps the parameters differ
by a few ulps at most and the next loss by as little. Measured on torch 2.13 and 2.15: the
losses equal to the bit, the largest parameter difference 5.6e-8 (hf), 2.2e-8 (titan02), 1.5e-8
(titan03); loaded parameters equal to the bit.

gloo has neither AVG nor PREMUL_SUM, so every FSDP module here reduces with
``set_force_sum_reduction_for_comms(True)`` (FSDP then divides by itself where it would average).
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from _training import full, relative_error
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import tp_kernels

STEPS, LR = 3, 0.1
REL_TOL = 8 * torch.finfo(torch.float32).eps
BACKEND = "pipelined"  # W - 1 point-to-point steps on the 2-rank tp subgroups of a 4-rank world
VARIANTS = ("tp_kernels", "reference")
VOCAB, SEQ, BATCH = 128, 16, 4  # BATCH global: 2 rows per dp rank


def _tokens() -> torch.Tensor:
    """The global batch of token ids [BATCH, SEQ + 1], the same every step (so the loss must
    fall)."""
    gen = torch.Generator().manual_seed(100)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's rows of the batch: inputs and next-token labels [2, SEQ]."""
    tokens = _tokens()
    rows = BATCH // 2
    start = (dist.get_rank() // 2) * rows  # mesh (dp, tp): ranks 0, 1 are dp 0
    tokens = tokens[start : start + rows]
    return tokens[:, :-1], tokens[:, 1:]


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _sum_on_gloo(model: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # gloo: no AVG, no PREMUL_SUM
    return model


def _mean_over_dp(loss: torch.Tensor, mesh) -> torch.Tensor:
    """Each dp rank's mean over the same number of tokens: their mean is the global mean."""
    loss = full(loss).detach().clone()
    dist.all_reduce(loss, group=mesh["dp"].get_group())
    return loss / 2


# ---- the three layouts: make(variant, seed) -> model, step(model, variant) -> global loss ----


class _Layout:
    """How a layout's model is checkpointed: PyTorch's distributed state-dict API by default."""

    def save(self, model, path: str) -> None:
        dcp.save(get_model_state_dict(model), checkpoint_id=path)

    def load(self, model, path: str) -> None:
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state)


class Titan02(_Layout):
    # torchao's recipe its Linears are converted with (torchtitan's float8 converter), or None
    float8_recipe: str | None = None

    def __init__(self) -> None:
        self.mesh = _mesh()

    def make(self, variant: str, seed: int):
        from torchtitan.models.llama3 import Transformer, TransformerModelArgs
        from torchtitan.models.llama3.infra import parallelize as llama3

        from tp_kernels.integrations import torchtitan as titan

        torch.manual_seed(seed)
        args = TransformerModelArgs(
            dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, multiple_of=64,
            rope_theta=500000, max_seq_len=SEQ,
        )  # fmt: skip
        model = Transformer(args)
        with torch.no_grad():
            model.init_weights()
        if self.float8_recipe is not None:
            from test_torchtitan import convert_with_torchtitan_s_float8_converter

            convert_with_torchtitan_s_float8_converter(model, self.float8_recipe)
        with titan.patched() if variant == "tp_kernels" else contextlib.nullcontext():
            llama3.apply_tp(
                model, self.mesh["tp"], loss_parallel=False, enable_float8_tensorwise_tp=False
            )
        llama3.apply_fsdp(model, self.mesh["dp"], torch.float32, torch.float32, pp_enabled=False)
        return _sum_on_gloo(model)

    def step(self, model, variant: str) -> torch.Tensor:
        inputs, labels = _batch()
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        return _mean_over_dp(loss, self.mesh)


class Titan03(_Layout):
    def __init__(self) -> None:
        import _titan03 as t3

        t3.use_cpu()
        self.t3 = t3
        self.dims = t3.parallel_dims(2, 2)

    def make(self, variant: str, seed: int):
        gemm = "dist_gemm" if variant == "tp_kernels" else "default"
        model = self.t3.build(gemm, tp=2, dp=2, seed=seed)
        return self.t3.parallelize(model, self.dims, tp=2, dp=2)

    def step(self, model, variant: str) -> torch.Tensor:
        tokens = _tokens()  # t3.step takes this dp rank's rows
        patched = variant == "tp_kernels"
        return self.t3.step(model, self.dims, loss_parallel=True, patched=patched, tokens=tokens)

    # torchtitan 0.3's checkpointer: the model's own state_dict through its ModelWrapper, whose
    # hooks save the fused wqkv as the stock wq/wk/wv (PyTorch's get_model_state_dict cannot
    # follow those keys)
    def save(self, model, path: str) -> None:
        from torchtitan.components.checkpointer.base import ModelWrapper

        dcp.save(ModelWrapper(model).state_dict(), checkpoint_id=path)

    def load(self, model, path: str) -> None:
        from torchtitan.components.checkpointer.base import ModelWrapper

        wrapper = ModelWrapper(model)
        state = wrapper.state_dict()
        dcp.load(state, checkpoint_id=path)
        wrapper.load_state_dict(state)


class HF(_Layout):
    def __init__(self) -> None:
        self.mesh = _mesh()

    def make(self, variant: str, seed: int):
        import transformers

        from tp_kernels.integrations import hf

        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=64,
            tie_word_embeddings=False, attn_implementation="sdpa",
        )  # fmt: skip
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).float()
        styles = "tp_kernels" if variant == "tp_kernels" else "torch"
        tp_kernels.parallelize_module(
            model, self.mesh["tp"], hf.sequence_parallel_plan(config, styles=styles)
        )
        for layer in model.model.layers:
            fully_shard(layer, mesh=self.mesh["dp"])
        fully_shard(model, mesh=self.mesh["dp"])
        return _sum_on_gloo(model)

    def step(self, model, variant: str) -> torch.Tensor:
        inputs, labels = _batch()
        # transformers shifts the labels itself: pass the inputs as labels, its mean over tokens
        loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        return _mean_over_dp(loss, self.mesh)


class Titan02Float8(Titan02):
    float8_recipe = "rowwise"


LAYOUTS = {"titan02": Titan02, "titan02-fp8": Titan02Float8, "titan03": Titan03, "hf": HF}


def _full_params(model) -> dict[str, torch.Tensor]:
    return {n: full(p.detach()).clone() for n, p in model.named_parameters()}


def _train_and_cross_load(layout: str, checkpoint_dir: str) -> dict:
    """On every rank: both variants trained ``STEPS`` steps, and the checkpoint of each loaded into
    the other. Returns ``{"losses": {variant: [...]}, "param_errors": {name: rel diff},
    "cross": {"src->dst": (max |loaded - saved|, rel diff of the next losses)}}``."""
    setup = LAYOUTS[layout]()
    trained, losses, calls = {}, {}, {}
    with tp_kernels.use_backend(BACKEND):
        for variant in VARIANTS:
            model = setup.make(variant, seed=0)
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            losses[variant] = []
            tp_kernels.reset_comm_stats()
            for _ in range(STEPS):
                optimizer.zero_grad(set_to_none=True)
                losses[variant].append(setup.step(model, variant))
                optimizer.step()
            trained[variant] = model
            calls[variant] = {kind: n for (_, kind, _), n in tp_kernels.comm_stats().items()}
        params = {variant: _full_params(model) for variant, model in trained.items()}
        ours, theirs = params["tp_kernels"], params["reference"]
        assert ours.keys() == theirs.keys()
        out = {
            "losses": {v: [float(x) for x in ls] for v, ls in losses.items()},
            "loss_errors": [relative_error(a, b) for a, b in zip(*losses.values())],
            "param_errors": {n: relative_error(ours[n], theirs[n]) for n in ours},
            "calls": calls["tp_kernels"],  # the fused calls and fallbacks of its training steps
            "cross": {},
        }
        for src, dst in (VARIANTS, VARIANTS[::-1]):
            path = f"{checkpoint_dir}/{layout}-{src}"
            setup.save(trained[src], path)
            fresh = setup.make(dst, seed=1)  # other weights, so the load must overwrite them
            setup.load(fresh, path)
            loaded = _full_params(fresh)
            worst = max((loaded[n] - params[src][n]).abs().max().item() for n in loaded)
            next_src = setup.step(trained[src], src)
            next_dst = setup.step(fresh, dst)
            out["cross"][f"{src}->{dst}"] = (worst, relative_error(next_dst, next_src))
    return out


def _check(result: dict) -> None:
    losses = result["losses"]
    assert "fallback" not in result["calls"], result["calls"]
    assert all(len(ls) == STEPS for ls in losses.values()), losses
    assert losses["tp_kernels"][-1] < losses["tp_kernels"][0], f"not training: {losses}"
    bad = [e for e in result["loss_errors"] if e > REL_TOL]
    assert not bad, f"losses differ by {result['loss_errors']} (> {REL_TOL:.1e}): {losses}"
    bad = {n: e for n, e in result["param_errors"].items() if e > REL_TOL}
    assert not bad, f"parameters differ after {STEPS} steps (> {REL_TOL:.1e}): {bad}"
    assert set(result["cross"]) == {"tp_kernels->reference", "reference->tp_kernels"}
    for direction, (worst, next_loss_error) in result["cross"].items():
        assert worst == 0.0, f"{direction}: loaded parameters differ from the saved by {worst}"
        assert next_loss_error <= REL_TOL, f"{direction}: next losses differ by {next_loss_error}"


def _needs(module: str, why: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=why)


def _titan_generation() -> str | None:
    if importlib.util.find_spec("torchtitan") is None:
        return None
    import torchtitan

    from tp_kernels.integrations import torchtitan as titan

    return "0.3" if titan._uses_dist_gemm(torchtitan) else "0.2"


@pytest.mark.skipif(_titan_generation() != "0.2", reason="needs torchtitan 0.2.x (apply_tp)")
def test_torchtitan_02_apply_tp_with_fsdp(worlds, tmp_path):
    per_rank = worlds(4).run(_train_and_cross_load, "titan02", str(tmp_path))
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree"
    _check(per_rank[0])


@pytest.mark.skipif(_titan_generation() != "0.2", reason="needs torchtitan 0.2.x (apply_tp)")
def test_torchtitan_02_float8_apply_tp_with_fsdp(worlds, tmp_path):
    """The titan02 layout with torchtitan's float8 converter (rowwise) before ``apply_tp``: every
    Linear fused in fp8 (none falls back), the same tolerance. At 2 TP ranks on ``pipelined`` the
    fp8 path's outputs and input grads are torchao's bit for bit (tests/test_fp8.py), so its
    weight grads differ by fp32 accumulation order only, as the bf16 layouts' do."""
    pytest.importorskip("torchao.float8")
    per_rank = worlds(4).run(_train_and_cross_load, "titan02-fp8", str(tmp_path))
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree"
    _check(per_rank[0])
    calls = per_rank[0]["calls"]
    assert calls.get("scaled_all_gather_matmul") and calls.get("scaled_matmul_reduce_scatter")


@pytest.mark.skipif(_titan_generation() != "0.3", reason="needs torchtitan 0.3.x (dist_gemm)")
def test_torchtitan_03_dist_gemm_with_fsdp(worlds, tmp_path):
    per_rank = worlds(4).run(_train_and_cross_load, "titan03", str(tmp_path))
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree"
    _check(per_rank[0])


@_needs("transformers", "needs transformers (the hf extra)")
def test_hf_plan_with_fully_shard(worlds, tmp_path):
    per_rank = worlds(4).run(_train_and_cross_load, "hf", str(tmp_path))
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree"
    _check(per_rank[0])
