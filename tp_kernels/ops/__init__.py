"""The public fused ops, one module each (``ag_matmul.py``, ``matmul_rs.py``); ``planning.py``
plans every call (checks, backend, agreement) and counts it."""

from tp_kernels.ops.ag_matmul import all_gather_matmul
from tp_kernels.ops.matmul_rs import matmul_reduce_scatter

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]
