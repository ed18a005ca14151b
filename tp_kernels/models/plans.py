"""The tensor-parallel plan of :class:`tp_kernels.models.Llama` (torchtitan's layout).

With sequence parallelism on a mesh of ``W`` ranks, activations between blocks are sharded on the
sequence dim (``Shard(1)``, local ``[B, S/W, D]``); each block gathers them before attention and the
feed-forward and reduce-scatters after ``wo`` and ``w2``::

    tok_embeddings  RowwiseParallel   tokens Replicate -> h Shard(1)   (vocab-sharded table)
    attention_norm  SequenceParallel  Shard(1) -> Shard(1)
    attention       PrepareModuleInput Shard(1) -> Replicate            (all-gather)
      wq, wk, wv    ColwiseParallel   Replicate -> heads sharded
      wo            RowwiseParallel   heads sharded -> Shard(1)        (matmul -> reduce-scatter)
    ffn_norm        SequenceParallel
    feed_forward    PrepareModuleInput Shard(1) -> Replicate
      w1, w3        ColwiseParallel
      w2            RowwiseParallel   -> Shard(1)
    norm            SequenceParallel
    output          ColwiseParallel   Shard(1) -> logits Replicate     (all-gather -> matmul)
                                      or Shard(-1) kept as a DTensor with loss_parallel

Without sequence parallelism the same Linears are sharded but activations stay replicated: the
row-wise outputs are all-reduced and the norms run replicated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import torch.distributed.tensor.parallel as torch_tp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from tp_kernels import styles as tpk_styles
from tp_kernels.models.llama import Llama, LlamaConfig

__all__ = ["check_tp_compatible", "llama_tp_plan"]


def check_tp_compatible(config: LlamaConfig, tp_size: int, *, seq_len: int | None = None) -> None:
    """Raise ValueError unless ``config`` can be sharded evenly on ``tp_size`` ranks.

    Needs ``tp_size`` to divide ``n_heads`` and ``n_kv_heads`` (whole heads per rank, in the same
    grouping), ``ffn_hidden_dim`` (``w1/w3/w2``) and ``vocab_size`` (``tok_embeddings``,
    ``output``); and, when ``seq_len`` is given, the sequence length (sequence-parallel shards).
    """
    sizes = {
        "n_heads": config.n_heads,
        "n_kv_heads": config.n_kv_heads,
        "ffn_hidden_dim": config.ffn_hidden_dim,
        "vocab_size": config.vocab_size,
    }
    require_divisible("Llama", sizes, tp_size, seq_len=seq_len)


def require_divisible(
    model: str, sizes: dict[str, int], tp_size: int, *, seq_len: int | None = None
) -> None:
    """Raise ValueError unless ``tp_size`` is a positive int dividing every one of ``sizes``
    (``{name: size}``) and ``seq_len`` when given, naming ``model`` and each size that does not."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"check_tp_compatible: tp_size must be a positive int, got {tp_size!r}")
    if seq_len is not None:
        sizes = {**sizes, "seq_len": seq_len}
    bad = {name: size for name, size in sizes.items() if size % tp_size}
    if bad:
        seen = ", ".join(f"{name}={size}" for name, size in bad.items())
        raise ValueError(
            f"{model} cannot be split over a tensor-parallel mesh of {tp_size} ranks: {seen} "
            f"{'is' if len(bad) == 1 else 'are'} not divisible by {tp_size}"
        )


class CheckCompatible(torch_tp.ParallelStyle):
    """A plan entry for the root module that only validates ``check(module.config, tp_size)``
    (which raises on sizes the mesh cannot split): it runs before any weight is sharded."""

    def __init__(self, check: Callable[[Any, int], None]) -> None:
        self.check = check

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.check(module.config, device_mesh.size())
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def style_classes(
    styles: str, backend: str | None, *, caller: str
) -> tuple[
    Callable[..., torch_tp.ParallelStyle], Callable[..., torch_tp.ParallelStyle], type, type
]:
    """``(colwise, rowwise, SequenceParallel, PrepareModuleInput)`` of ``styles`` (``"tp_kernels"``,
    its Colwise/Rowwise bound to ``backend``, or ``"torch"``); errors name ``caller``, the plan
    function that was asked."""
    if styles == "tp_kernels":
        return (
            functools.partial(tpk_styles.ColwiseParallel, backend=backend),
            functools.partial(tpk_styles.RowwiseParallel, backend=backend),
            tpk_styles.SequenceParallel,
            tpk_styles.PrepareModuleInput,
        )
    if styles == "torch":
        if backend is not None:
            raise ValueError(
                f"{caller}: backend={backend!r} needs styles='tp_kernels'; PyTorch's styles "
                f"have no backend"
            )
        return (
            torch_tp.ColwiseParallel,
            torch_tp.RowwiseParallel,
            torch_tp.SequenceParallel,
            torch_tp.PrepareModuleInput,
        )
    raise ValueError(f"{caller}: styles must be 'tp_kernels' or 'torch', got {styles!r}")


def llama_tp_plan(
    model: Llama,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    backend: str | None = None,
    styles: Literal["tp_kernels", "torch"] = "tp_kernels",
) -> dict[str, torch_tp.ParallelStyle]:
    """The plan for ``parallelize_module(model, mesh, plan)``, keyed by module path.

    Per-block keys use a wildcard over the layer index (``"layers.*.attention.wq"``). The first
    entry (key ``""``, the model itself) checks :func:`check_tp_compatible` against the mesh size
    before anything is sharded.

    Args:
        model: the :class:`~tp_kernels.models.Llama` to parallelize (read for its config only).
        sequence_parallel: shard the activations between blocks on the sequence dim (``Shard(1)``);
            the input sequence length must then be divisible by the mesh size.
        loss_parallel: keep the logits a ``Shard(-1)`` DTensor (vocab-sharded) for a cross entropy
            under :func:`tp_kernels.loss_parallel`; otherwise they are gathered to a plain
            ``[B, S, V]`` tensor.
        backend: passed to every ``ColwiseParallel`` and ``RowwiseParallel`` (``None``: the
            process-wide default).
        styles: ``"tp_kernels"``, or ``"torch"`` for the same plan from
            ``torch.distributed.tensor.parallel``'s classes (then ``backend`` must be ``None``).
    """
    if not isinstance(model, Llama):
        raise TypeError(
            f"llama_tp_plan: model must be a tp_kernels Llama, got {type(model).__name__}"
        )
    colwise, rowwise, sequence, prepare_input = style_classes(
        styles, backend, caller="llama_tp_plan"
    )
    act = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, torch_tp.ParallelStyle] = {
        "": CheckCompatible(check_tp_compatible),
        "tok_embeddings": rowwise(input_layouts=Replicate(), output_layouts=act),
    }
    if sequence_parallel:
        plan["norm"] = sequence()
    plan["output"] = colwise(
        input_layouts=act,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )
    block = "layers.*."
    if sequence_parallel:
        for name in ("attention_norm", "ffn_norm"):
            plan[block + name] = sequence()
        for name in ("attention", "feed_forward"):
            plan[block + name] = prepare_input(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
    for name in (
        "attention.wq",
        "attention.wk",
        "attention.wv",
        "feed_forward.w1",
        "feed_forward.w3",
    ):
        plan[block + name] = colwise()
    for name in ("attention.wo", "feed_forward.w2"):
        plan[block + name] = rowwise(output_layouts=act)
    return plan
