"""torchao's float8 tensor-parallel styles on tp_kernels' fused path.

``Float8ColwiseParallel``, ``Float8RowwiseParallel`` and ``PrepareFloat8ModuleInput`` take the
names and arguments of ``torchao.float8.float8_tensor_parallel``'s classes (swap the import; the
colwise and rowwise ones also take tp_kernels' ``backend``). torchao's cast a Float8Linear's input
to fp8 with one tensor-wise scale (and, in backward, its output gradient) before DTensor
redistributes it, so that the all-gather moves fp8 bytes; the scale is computed on the DTensor,
so its amax spans the ranks and is all-reduced.

On a sequence-parallel boundary tp_kernels' own styles already do that for a Float8Linear, inside
the fused op (:mod:`tp_kernels.float8`: the spanning amax all-reduced, fp8 bytes gathered, the
same scales), so these classes are those styles with torchao's behaviour everywhere else:

- at apply time, torchao's checks (a Float8Linear with dynamic scaling; e4m3 for the input);
- on a call that does not fuse (a replicated input no group gathered, a compiled call, an uneven
  shard: each counted as a fallback where tp_kernels would fuse), torchao's hooks: the input cast
  to fp8 before its redistribution, the output gradient cast in backward.

Both are reached through the method resolution order: tp_kernels' class comes first and, where
a call does not fuse, hands it to the next class's hook, which here is torchao's instead of
PyTorch's. ``PrepareFloat8ModuleInput`` puts torchao's class first, so its apply finds the
children's ``linear_mm_config`` before tp_kernels' grouping installs the fused gather.
"""

from __future__ import annotations

import torch.nn as nn
from torchao.float8 import float8_tensor_parallel as _torchao_tp

from tp_kernels import styles

__all__ = ["Float8ColwiseParallel", "Float8RowwiseParallel", "PrepareFloat8ModuleInput"]


class _LocalOutputOnly:
    """torchao's output hook wraps a DTensor output in a cast of its gradient to fp8, which the
    fused backward makes itself: so a style that hands on a DTensor (``use_local_output=False``,
    or a colwise output laid out other than ``Shard(-1)``) never fuses; its calls take torchao's
    path, counted."""

    def _unfusable_reason(self, module: nn.Module) -> str | None:
        if not self._hands_on_local(module):
            return (
                f"{type(self).__name__} hands on a DTensor output, whose gradient torchao's "
                f"output hook casts to fp8 (the fused backward casts it itself)"
            )
        return super()._unfusable_reason(module)


class Float8ColwiseParallel(
    _LocalOutputOnly, styles.ColwiseParallel, _torchao_tp.Float8ColwiseParallel
):
    """torchao's ``Float8ColwiseParallel`` (a Float8Linear with tensor-wise scaling, its input
    gathered in fp8), fused as :class:`tp_kernels.ColwiseParallel` fuses a Float8Linear; plus
    ``backend``."""


class Float8RowwiseParallel(
    _LocalOutputOnly, styles.RowwiseParallel, _torchao_tp.Float8RowwiseParallel
):
    """torchao's ``Float8RowwiseParallel`` (its output gradient gathered in fp8 in backward), fused
    as :class:`tp_kernels.RowwiseParallel` fuses a Float8Linear; plus ``backend``."""


class PrepareFloat8ModuleInput(_torchao_tp.PrepareFloat8ModuleInput, styles.PrepareModuleInput):
    """torchao's ``PrepareFloat8ModuleInput`` (``float8_dtype``, ``fwd_config_submodule_fqn``),
    whose ``Shard -> Replicate`` input is gathered once in fp8, fused with the matmuls of the
    module's Float8Linear children as :class:`tp_kernels.PrepareModuleInput` groups them."""
