"""The public fused ops, one module each (``ag_matmul.py``, ``matmul_rs.py``; their scaled fp8
forms in ``scaled.py``); ``planning.py`` plans every call (checks, backend, agreement),
``comm_stats.py`` counts it."""

from tp_kernels.ops.ag_matmul import all_gather_matmul
from tp_kernels.ops.matmul_rs import matmul_reduce_scatter
from tp_kernels.ops.scaled import all_gather_scaled_matmul, scaled_matmul_reduce_scatter

__all__ = [
    "all_gather_matmul",
    "all_gather_scaled_matmul",
    "matmul_reduce_scatter",
    "scaled_matmul_reduce_scatter",
]
