"""The public fused ops (torch custom ops with autograd): see :mod:`tp_kernels.ops.functional`."""

from tp_kernels.ops.functional import all_gather_matmul, matmul_reduce_scatter

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]
