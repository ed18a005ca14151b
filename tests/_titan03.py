"""torchtitan 0.3's Llama3 on CPU gloo ranks, as torchtitan's trainer builds and steps it.

What tests/test_torchtitan_dist_gemm.py and tests/test_fsdp_tp.py share: a tiny Llama3 (torchtitan's
own layer builder: dim 64, 2 layers, 4 heads, 4 KV heads, ffn 192, vocab 128, sequence 16, fused
QKV) built unsharded, or parallelized by ``parallelize_llama`` (spmd_types backend, TP with
sequence parallel, FSDP on ``dp_shard``, optional activation checkpointing) with
``tp_gemm_backend`` ``"default"`` (torchtitan's stock, unfused path) or ``"dist_gemm"`` (its fused
linears), and one training step's loss and full gradients.

CPU workarounds, all here and none in tp_kernels (:func:`use_cpu`):

* torchtitan picks ``device_type`` once at import, ``"cuda"`` when no accelerator is found, and
  builds its meshes on it: set to ``"cpu"``.
* Its Llama3 offers only flex and varlen attention; flex refuses backward on CPU and varlen needs
  CUDA. The attention (a causal ``BlockMask``, one document per row) is computed as the dense
  math it stands for, ``scaled_dot_product_attention`` with the block mask materialized, the same
  in every model compared.
* FSDP2 on gloo: gloo has neither AVG nor PREMUL_SUM, so every FSDP module sums
  (``set_force_sum_reduction_for_comms(True)``); torchtitan already turns FSDP's division off and
  divides the loss by the global token count, so the gradients are those of the global mean loss.
"""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _training import full
from torch.distributed.fsdp import FSDPModule

import tp_kernels
from tp_kernels.integrations import torchtitan as titan

VOCAB, SEQ, DIM, HEADS, KV_HEADS, LAYERS, FFN = 128, 16, 64, 4, 4, 2, 192
BATCH = 4  # global: split over dp
# Per forward of the 2-layer model through dist_gemm: one all-gather-matmul per QKV and per
# w1/w3 pair, one matmul-reduce-scatter per wo and w2; the lm_head is not a dist_gemm module
# (torchtitan's root norm gathers the sequence before it). Backward: the transposed ops, and the
# re-gather of each gathered input's shard for the weight grads.
FORWARD = {"all_gather_matmul": 2 * LAYERS, "matmul_reduce_scatter": 2 * LAYERS}
BACKWARD = {
    "matmul_reduce_scatter": 2 * LAYERS,
    "all_gather": 2 * LAYERS,
    "all_gather_matmul": 2 * LAYERS,
}


def _dense_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, **_):
    """What ``flex_attention(q, k, v, block_mask=...)`` computes, as eager dense math (CPU
    backward); ``q, k, v`` [B, H, L, D]."""
    from torch.nn.attention.flex_attention import create_mask

    assert score_mod is None and not return_aux.lse, "the test model uses neither"
    mask = create_mask(block_mask.mask_mod, q.shape[0], None, q.shape[2], k.shape[2], q.device)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )
    return out, None


def use_cpu() -> None:
    """Apply the CPU workarounds of the module docstring in this (rank) process."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.models.common.attention import FlexAttention

    parallel_dims.device_type = "cpu"
    FlexAttention._compiled_flex_attn = staticmethod(_dense_attention)


def _parallelism(tp: int, dp: int):
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(
        tensor_parallel_degree=tp,
        data_parallel_shard_degree=dp,
        enable_sequence_parallel=True,
        spmd_backend="spmd_types",
    )


def float8_converter(recipe: str, filter_fqns: tuple[str, ...] = ()):
    """torchtitan 0.3's own float8 converter for torchao's ``recipe``. The converter refuses
    without an sm_89 GPU unless asked to emulate, and an emulated Float8Linear is not what a
    training run uses (its GEMMs are not ``_scaled_mm``); ``torch._scaled_mm`` runs on the CPU
    here, so its hardware check is answered yes. ``"tensorwise"`` is outside the converter's
    declared recipes (``"rowwise"``, ``"rowwise_with_gw_hp"``) but torchao's recipe lookup takes
    it, and nothing else in the converter depends on the name."""
    from unittest import mock

    from torchtitan.components.quantization import float8 as titan_float8

    config = titan_float8.Float8LinearConverter.Config(
        recipe_name=recipe, filter_fqns=list(filter_fqns)
    )
    with mock.patch.object(titan_float8, "has_cuda_capability", return_value=True):
        return config.build()


def mxfp8_converter(fqns: tuple[str, ...]):
    """torchtitan 0.3's own MXFP8 converter of the Linears whose names contain one of ``fqns``.
    It refuses without an sm_100 GPU (B200): its check is answered yes here, and the
    MXFP8Linears it builds, which ask for torchao's kernels (``KernelPreference.AUTO``, sm_100
    only), are set to emulate them after the build (:func:`build`)."""
    from unittest import mock

    from torchtitan.components.quantization import mx as titan_mx

    config = titan_mx.MXFP8LinearConverter.Config(fqns=list(fqns))
    with mock.patch.object(titan_mx, "has_cuda_capability", return_value=True):
        return config.build()


def build(
    tp_gemm_backend: str,
    tp: int = 1,
    dp: int = 1,
    state: dict | None = None,
    seed: int = 0,
    float8: str | None = None,
    float8_filter: tuple[str, ...] = (),
    mxfp8: tuple[str, ...] = (),
):
    """The Llama3 model (on CPU, fp32), weights from ``state`` or drawn from ``seed``; its
    sharding config set for ``tp`` x ``dp``. ``float8``: a torchao recipe, the model config
    converted by torchtitan's float8 converter (:func:`float8_converter`) first, where its
    ``model_registry`` converts it: before the trainer sets the sharding configs. ``mxfp8``:
    the names converted by torchtitan's MXFP8 converter (:func:`mxfp8_converter`) the same way,
    its MXFP8Linears emulated (``KernelPreference.EMULATED``: the CPU has no MXFP8 kernels)."""
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    config = llama3.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)
        ),
        # torchtitan's own builder, so the layers are those of its flavors
        layers=llama3._build_llama3_layers(
            n_layers=LAYERS,
            dim=DIM,
            n_heads=HEADS,
            n_kv_heads=KV_HEADS,
            hidden_dim=FFN,
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000),
            attn_backend="flex",
            tp_gemm_backend=tp_gemm_backend,
        ),
    )
    if float8 is not None:
        config = float8_converter(float8, float8_filter).convert(config)
    if mxfp8:
        config = mxfp8_converter(mxfp8).convert(config)
    config.update_from_config(config=SimpleNamespace(parallelism=_parallelism(tp, dp)))
    torch.manual_seed(seed)
    model = config.build()
    if mxfp8:
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        for module in model.modules():
            if isinstance(module, MXFP8Linear):
                module.kernel_preference = KernelPreference.EMULATED
    with torch.no_grad():
        model.init_weights()
        if state is not None:
            model.load_state_dict(state)
    return model


_DIMS: dict = {}


def parallel_dims(tp: int, dp: int):
    """torchtitan's ParallelDims for ``dp_shard`` x ``tp``, its meshes built; one per process and
    layout, since torchtitan keeps the first meshes it sees (a second set of mesh objects for
    the same layout fails FSDP's same-mesh check)."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_spmd_backend("spmd_types")
    if (tp, dp) not in _DIMS:
        dims = ParallelDims(
            dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, world_size=tp * dp
        )
        dims.build_mesh()
        _DIMS[(tp, dp)] = dims
    return _DIMS[(tp, dp)]


def parallelize(model, dims, *, tp: int, dp: int, ac: str = "none"):
    """``parallelize_llama`` as the trainer calls it (fp32 params and reductions), FSDP summing."""
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.llama3 import parallelize_llama

    ac_config = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[ac]
    model = parallelize_llama(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=_parallelism(tp, dp),
        compile_config=CompileConfig(),
        ac_config=ac_config,
        dump_folder="",
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # gloo: no AVG, no PREMUL_SUM
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: inputs and next-token labels [BATCH, SEQ]."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _local_batch(dims, tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's dp slice of the global batch (all of it without dp): inputs and labels of
    ``tokens`` [BATCH, SEQ + 1], by default :func:`batch`'s."""
    inputs, labels = batch() if tokens is None else (tokens[:, :-1], tokens[:, 1:])
    if dims.dp_shard == 1:
        return inputs, labels
    rows = BATCH // dims.dp_shard
    start = dims.get_mesh("dp_shard").get_local_rank() * rows
    return inputs[start : start + rows], labels[start : start + rows]


def _positions(inputs: torch.Tensor) -> torch.Tensor:
    return torch.arange(inputs.shape[1]).expand_as(inputs)  # one document per row: causal mask


def unsharded_loss_and_grads(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean next-token cross entropy over the global batch, ``backward()``; loss and grads."""
    inputs, labels = batch()
    positions = _positions(inputs)
    pred = model(inputs, positions, model.get_attention_masks(positions))
    loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    loss = loss / labels.numel()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


class _GatherVocab(torch.autograd.Function):
    """``[..., V/R]`` logits -> ``[..., V]`` on every TP rank (loss parallel off); backward keeps
    this rank's columns of the grad (every rank computes the same loss from the same logits)."""

    @staticmethod
    def forward(ctx, logits, group):
        ctx.group = group
        parts = [torch.empty_like(logits) for _ in range(group.size())]
        dist.all_gather(parts, logits.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        rank, world = ctx.group.rank(), ctx.group.size()
        return grad.chunk(world, dim=-1)[rank].contiguous(), None


def step(model, dims, *, loss_parallel: bool, patched: bool, tokens: torch.Tensor | None = None):
    """One forward and backward as torchtitan's trainer runs it (its spmd context, input types,
    loss over the global token count), on this rank's dp slice of the batch. Returns the global
    loss (the grads are left on the parameters, see :func:`full_grads`); with ``patched`` the
    forward and backward run inside :func:`tp_kernels.integrations.torchtitan.patched`.
    ``tokens``: the global batch [BATCH, SEQ + 1] (default: :func:`batch`'s)."""
    import spmd_types as spmd
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types, current_spmd_mesh

    inputs, labels = _local_batch(dims, tokens)
    # patched() holds the backward too: under activation checkpointing the backward runs each
    # block's forward again, and dist_gemm's modules look the Functions up then
    with (
        dist_utils.get_spmd_context(parallel_dims=dims)(),
        titan.patched() if patched else contextlib.nullcontext(),
    ):
        inputs, labels, extra = annotate_input_spmd_types(
            dims, inputs, labels, {"positions": _positions(inputs)}
        )
        masks = model.get_attention_masks(extra["positions"])
        pred = model(inputs, extra["positions"], masks)
        if loss_parallel:
            loss = cross_entropy_loss(pred, labels, global_vocab_size=VOCAB)
        else:
            logits = _GatherVocab.apply(pred, current_spmd_mesh().get_group("tp"))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        loss = loss / BATCH / SEQ
        with spmd.no_typecheck():  # as the trainer: types are checked in forward only
            loss.backward()
    whole = loss.detach().clone()
    if dims.dp_shard > 1:
        dist.all_reduce(whole, group=dims.get_mesh("dp_shard").get_group())
    return whole


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient, by name (activation checkpointing's wrapper prefix
    removed, so names match the unwrapped model's)."""
    return {
        n.replace("_checkpoint_wrapped_module.", ""): full(p.grad)
        for n, p in model.named_parameters()
    }


def counted_step(model, dims, backend: str, *, loss_parallel: bool):
    """:func:`step` through tp_kernels (``patched``) on ``backend``; also the fused calls it ran:
    ``(loss, grads, {"forward": ..., "step": ..., "backward": ..., "fallback": n})`` with the
    forward kinds of a forward of its own and of the training step (recompute included)."""
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types

    with tp_kernels.use_backend(backend):
        tp_kernels.reset_comm_stats()
        inputs, labels = _local_batch(dims)
        with torch.no_grad(), dist_utils.get_spmd_context(parallel_dims=dims)(), titan.patched():
            inputs, _, extra = annotate_input_spmd_types(
                dims, inputs, labels, {"positions": _positions(inputs)}
            )
            model(inputs, extra["positions"], model.get_attention_masks(extra["positions"]))
        forward = tp_kernels.comm_stats()
        tp_kernels.reset_comm_stats()
        loss = step(model, dims, loss_parallel=loss_parallel, patched=True)
        both = tp_kernels.comm_stats()
    counts = {
        "forward": {k: forward.total("forward", k) for k in FORWARD},
        "step": {k: both.total("forward", k) for k in FORWARD},
        "backward": {k: both.total("backward", k) for k in BACKWARD},
        "fallback": forward.total(kind="fallback") + both.total(kind="fallback"),
    }
    return loss, full_grads(model), counts


def copy_state(model) -> dict[str, torch.Tensor]:
    return copy.deepcopy(model.state_dict())
