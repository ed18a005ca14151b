"""Hugging Face transformers decoders (Llama, Mistral, Qwen2, Qwen3) with tp_kernels' fused
sequence-parallel plan.

Two ways in, one plan (:func:`sequence_parallel_plan`), keyed by module path of the
``*ForCausalLM`` model (``"model.layers.*.self_attn"``):

* on a model you hold (random init, or loaded whole on every rank)::

      mesh = init_device_mesh("cuda", (tp,))
      tp_kernels.parallelize_module(model, mesh, sequence_parallel_plan(model.config))

* through transformers' own loader, each rank reading only its shards of the checkpoint::

      tp_kernels.integrations.hf.register()
      plan = sequence_parallel_tp_plan(AutoConfig.from_pretrained(path))
      model = AutoModelForCausalLM.from_pretrained(
          path, distributed_config=DistributedConfig(tp_size=tp, tp_plan=plan)
      )

  :func:`register` adds the plan's styles to ``ALL_PARALLEL_STYLES`` under names starting with
  ``tpk_`` (transformers' own names are left alone); :func:`sequence_parallel_tp_plan` is the same
  plan with those names. ``DistributedConfig`` merges a plan into the model's default plan key by
  key, so this plan names every key the default names (and more). transformers' loader creates
  the process group and mesh itself (``torchrun``'s environment, or an initialized group).

The layout on a mesh of ``W`` ranks (``B`` batch, ``S`` sequence, ``D`` hidden)::

    model.embed_tokens          RowwiseParallel    ids Replicate -> h Shard(1) (vocab-sharded)
    layers.*.input_layernorm    SequenceParallel   Shard(1) -> Shard(1)
    layers.*.self_attn          PrepareModuleInput hidden_states= Shard(1) -> Replicate (all-gather)
      q_proj, k_proj, v_proj    ColwiseParallel    -> local heads [B, S, heads/W * head_dim]
      q_norm, k_norm (Qwen3)    HeadNormParallel   per-head norm of the local heads
      o_proj                    RowwiseParallel    -> Shard(1)            (matmul -> reduce-scatter)
    layers.*.post_attention_layernorm, layers.*.mlp (gate/up colwise, down rowwise): the same
    model.norm                  SequenceParallel
    lm_head                     ColwiseParallel    Shard(1) -> logits Replicate [B, S, V], or
                                                   Shard(-1) kept a DTensor for loss_parallel

With tp_kernels' styles the two gathers of each layer run as one fused all-gather-matmul each
(``q/k/v`` together, ``gate/up`` together) and ``o_proj``/``down_proj`` as fused
matmul-reduce-scatters; ``lm_head`` gathers its input fused with its matmul.

Between layers the activations stay **DTensors** of the global shape ``[B, S, D]`` (sharded
``Shard(1)``, local ``[B, S/W, D]``): the embedding and the row-wise outputs keep
``use_local_output=False``. That is what lets the model's own code run unchanged: it reads the
sequence length from the embedding output (``position_ids``, the causal or padding mask, the
rotary tables), so every rank builds them for the full sequence, and attention, which runs on the
gathered input, gets masks and rotary tables of its size. Inside attention and the MLP the tensors
are plain local ones (the gathered input, the local heads), so ``view(*input_shape, -1,
head_dim)`` counts the local heads (``num_key_value_groups`` is the same ratio locally).

What the caller passes: ``input_ids`` ``[B, S]`` (identical on every rank, ``S`` divisible by
``W``), optionally ``attention_mask`` ``[B, S]``, ``position_ids`` ``[B or 1, S]`` and ``labels``
``[B, S]`` exactly as for the unsharded model (full sequence, never a shard). The outputs:
``logits`` ``[B, S, V]`` (every rank the same), or with ``loss_parallel=True`` a ``Shard(-1)``
DTensor: then run the forward with ``labels`` (transformers' loss) or your own cross entropy, and
the backward, under ``tp_kernels.loss_parallel()``. Not supported: ``tie_word_embeddings=True``
(the plan shards ``embed_tokens`` and ``lm_head`` separately, which unties them), a KV cache
(``use_cache=True``, generation), and ``inputs_embeds`` (they must be a ``Shard(1)`` DTensor).

Qwen3's ``q_norm``/``k_norm`` normalize each head over ``head_dim`` with one weight shared by all
heads, while each rank holds only its heads: :class:`HeadNormParallel` keeps the weight replicated
and returns its gradient as a ``Partial`` sum over the ranks (what each rank's heads contribute),
so ``weight.grad.full_tensor()`` is the unsharded model's gradient and optimizers reduce it as they
do the other norms' gradients.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import torch.distributed.tensor.parallel as torch_tp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer

from tp_kernels.api import parallelize_module
from tp_kernels.models.plans import CheckCompatible, require_divisible, style_classes

__all__ = [
    "FAMILIES",
    "HeadNormParallel",
    "check_tp_compatible",
    "register",
    "sequence_parallel_plan",
    "sequence_parallel_tp_plan",
]

# ``config.model_type`` of the families whose decoder layer this plan describes.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class HeadNormParallel(torch_tp.ParallelStyle):
    """A norm over the last dim applied to this rank's heads only (Qwen3's ``q_norm``/``k_norm``,
    input ``[B, S, heads/W, head_dim]`` local): its parameters become ``Replicate()`` DTensors and
    its forward runs on their local values, whose gradients come back as ``Partial()`` sums.

    Each rank's gradient covers its own heads; the unsharded gradient is their sum over ranks.
    The swap is done by forward hooks, not by replacing ``module.forward``: transformers 5.25
    kernelizes the model after its loader applied the plan, and kernels resets the instance
    ``forward`` of every hub-kernel layer (RMSNorm among them) to its class's.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = distribute_tensor(
                param.detach(), device_mesh, [Replicate()], src_data_rank=self.src_data_rank
            )
            module.register_parameter(
                name, nn.Parameter(replicated, requires_grad=param.requires_grad)
            )
        swap = _LocalParameters()
        module.register_forward_pre_hook(swap.enter)
        # always_call: the DTensor parameters come back even when the forward raises.
        module.register_forward_hook(swap.exit, always_call=True)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _LocalParameters:
    """Swaps a module's DTensor parameters for their local values (grads ``Partial``) while its
    forward runs, and back after: the forward is the model's own code, written for plain
    tensors."""

    def __init__(self) -> None:
        self.saved: dict[str, nn.Parameter | None] = {}

    def enter(self, module: nn.Module, args: Any) -> None:
        self.saved = dict(module._parameters)
        for name, param in self.saved.items():
            if param is not None:
                # Not register_parameter: a to_local() view is not a leaf, so not a Parameter.
                module._parameters[name] = param.to_local(grad_placements=(Partial(),))

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        module._parameters.update(self.saved)
        self.saved = {}


def check_tp_compatible(config: Any, tp_size: int, *, seq_len: int | None = None) -> None:
    """Raise ValueError unless :func:`sequence_parallel_plan` can shard ``config``'s model on
    ``tp_size`` ranks: a family of :data:`FAMILIES`, untied embeddings, and ``tp_size`` dividing
    the attention and key/value heads, ``intermediate_size``, ``vocab_size`` and, when given, the
    sequence length."""
    model_type = getattr(config, "model_type", type(config).__name__)
    if model_type not in FAMILIES:
        raise ValueError(
            f"sequence_parallel_plan: no plan for model_type {model_type!r}; "
            f"supported: {', '.join(FAMILIES)}"
        )
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError(
            "sequence_parallel_plan: tie_word_embeddings=True is not supported: the plan shards "
            "embed_tokens and lm_head separately, which would untie them"
        )
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    require_divisible(model_type, sizes, tp_size, seq_len=seq_len)


# One table drives both forms of the plan: module path -> style name, and style name -> a
# factory of the style from (Colwise, Rowwise, Sequence, PrepareModuleInput) classes.
_LAYER = "model.layers.*."
_PLAN: dict[str, str] = {
    "model.embed_tokens": "tpk_embedding",
    _LAYER + "input_layernorm": "tpk_sequence_parallel",
    _LAYER + "self_attn": "tpk_gather_attention",
    _LAYER + "self_attn.q_proj": "tpk_colwise",
    _LAYER + "self_attn.k_proj": "tpk_colwise",
    _LAYER + "self_attn.v_proj": "tpk_colwise",
    _LAYER + "self_attn.o_proj": "tpk_rowwise_sequence",
    _LAYER + "post_attention_layernorm": "tpk_sequence_parallel",
    _LAYER + "mlp": "tpk_gather_mlp",
    _LAYER + "mlp.gate_proj": "tpk_colwise",
    _LAYER + "mlp.up_proj": "tpk_colwise",
    _LAYER + "mlp.down_proj": "tpk_rowwise_sequence",
    "model.norm": "tpk_sequence_parallel",
}
_QWEN3_HEAD_NORMS = {
    _LAYER + "self_attn.q_norm": "tpk_head_norm",
    _LAYER + "self_attn.k_norm": "tpk_head_norm",
}
_LM_HEAD = {False: "tpk_lm_head", True: "tpk_lm_head_loss_parallel"}


def _styles(colwise, rowwise, sequence, prepare_input) -> dict[str, torch_tp.ParallelStyle]:
    seq, rep = Shard(1), Replicate()
    return {
        # use_local_output=False on the outputs that leave a layer: see the module docstring.
        "tpk_embedding": rowwise(input_layouts=rep, output_layouts=seq, use_local_output=False),
        "tpk_sequence_parallel": sequence(),
        # HF's decoder layers call self_attn(hidden_states=...) by keyword, mlp(x) positionally.
        "tpk_gather_attention": prepare_input(
            input_kwarg_layouts={"hidden_states": seq},
            desired_input_kwarg_layouts={"hidden_states": rep},
            use_local_output=True,
        ),
        "tpk_gather_mlp": prepare_input(
            input_layouts=(seq,), desired_input_layouts=(rep,), use_local_output=True
        ),
        "tpk_colwise": colwise(),
        "tpk_rowwise_sequence": rowwise(output_layouts=seq, use_local_output=False),
        "tpk_head_norm": HeadNormParallel(),
        "tpk_lm_head": colwise(input_layouts=seq, output_layouts=rep),
        "tpk_lm_head_loss_parallel": colwise(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        ),
    }


def sequence_parallel_tp_plan(config: Any, *, loss_parallel: bool = False) -> dict[str, str]:
    """The plan as style names, for ``DistributedConfig(tp_plan=...)`` after :func:`register`.

    Same keys and layout as :func:`sequence_parallel_plan` (the process-wide backend:
    ``tp_kernels.set_backend`` or ``TP_KERNELS_BACKEND``).
    """
    check_tp_compatible(config, 1)
    plan = dict(_PLAN)
    if config.model_type == "qwen3":
        plan |= _QWEN3_HEAD_NORMS
    plan["lm_head"] = _LM_HEAD[loss_parallel]
    return plan


def sequence_parallel_plan(
    config: Any,
    *,
    loss_parallel: bool = False,
    backend: str | None = None,
    styles: Literal["tp_kernels", "torch"] = "tp_kernels",
) -> dict[str, torch_tp.ParallelStyle]:
    """The sequence-parallel plan for ``parallelize_module(model, mesh, plan)`` of a
    ``*ForCausalLM`` of ``config`` (a ``transformers`` config of one of :data:`FAMILIES`).

    Args:
        config: the model's config (``model.config``); read for its family only, the sizes are
            checked against the mesh when the plan is applied (its ``""`` entry runs first).
        loss_parallel: keep the logits a vocab-sharded ``Shard(-1)`` DTensor for a loss under
            ``tp_kernels.loss_parallel()``; otherwise they are gathered to ``[B, S, V]``.
        backend: the tp_kernels backend of every Colwise/Rowwise style (``None``: the
            process-wide default).
        styles: ``"tp_kernels"``, or ``"torch"`` for the same plan from PyTorch's classes (then
            ``backend`` must be ``None``); both use :class:`HeadNormParallel` for Qwen3's norms.
    """
    by_name = _styles(*style_classes(styles, backend, caller="sequence_parallel_plan"))
    plan: dict[str, torch_tp.ParallelStyle] = {"": CheckCompatible(check_tp_compatible)}
    for key, name in sequence_parallel_tp_plan(config, loss_parallel=loss_parallel).items():
        plan[key] = copy.copy(by_name[name])  # parallelize_module sets attributes on a style
    return plan


class _LoaderStyle(TensorParallelLayer):
    """A tp_kernels style in transformers' loader: ``apply_tensor_parallelism`` calls
    ``shard_param`` for each of a module's parameters, then ``install_forward`` once, on the
    meta-device model before any weight is read; it then reads each rank's shard of every
    DTensor parameter by that parameter's placements.

    transformers 5.25 passes ``config=`` and ``mesh_manager=`` to both methods (the model's text
    config, its meshes), 5.23 neither; the plan needs neither, the mesh is the TP mesh in both."""

    def __init__(self, style: torch_tp.ParallelStyle) -> None:
        self.style = style

    def shard_param(
        self,
        module: nn.Module,
        param: str,
        mesh: DeviceMesh,
        *,
        config: Any = None,
        mesh_manager: Any = None,
    ) -> None:
        # install_forward distributes all of the module's parameters at once, as the style does.
        pass

    def install_forward(
        self, module: nn.Module, mesh: DeviceMesh, *, config: Any = None, mesh_manager: Any = None
    ) -> nn.Module:
        # Meta tensors: no source rank to scatter from; each rank loads its own shard later.
        return parallelize_module(module, mesh, copy.copy(self.style), src_data_rank=None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.style!r})"


def register() -> None:
    """Make the ``tpk_*`` styles of :func:`sequence_parallel_tp_plan` known to transformers'
    tensor-parallel loader (``ALL_PARALLEL_STYLES``). Idempotent; call it on every rank before
    ``from_pretrained``. Their Colwise/Rowwise styles use the process-wide backend."""
    for name, style in _styles(*style_classes("tp_kernels", None, caller="register")).items():
        ALL_PARALLEL_STYLES.register(name, _LoaderStyle(style))
