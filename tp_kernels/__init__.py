"""tp_kernels: PyTorch's tensor-parallel styles, with fused and overlapped sequence-parallel
boundaries.

Import the styles from here instead of ``torch.distributed.tensor.parallel``; the plan, the model
and the results stay the same. See README.md.
"""

from tp_kernels._compat import check_torch_version, import_before_any_group

check_torch_version()
import_before_any_group()

from torch.distributed.tensor.parallel import loss_parallel  # noqa: E402

from tp_kernels.api import parallelize_module  # noqa: E402
from tp_kernels.backends.base import CaptureUnreadyError  # noqa: E402
from tp_kernels.backends.choice import (  # noqa: E402
    available_backends,  # noqa: E402
    set_backend,
    use_backend,
)
from tp_kernels.deadline import PeerTimeoutError, get_timeout, set_timeout  # noqa: E402
from tp_kernels.ops import (  # noqa: E402
    all_gather_matmul,
    all_gather_scaled_matmul,
    matmul_reduce_scatter,
    scaled_matmul_reduce_scatter,
)
from tp_kernels.ops.capture import reserve  # noqa: E402
from tp_kernels.ops.comm_stats import comm_stats, reset_comm_stats  # noqa: E402
from tp_kernels.styles import (  # noqa: E402
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__version__ = "0.1.0"

__all__ = [
    "CaptureUnreadyError",
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PeerTimeoutError",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "all_gather_matmul",
    "all_gather_scaled_matmul",
    "available_backends",
    "comm_stats",
    "get_timeout",
    "loss_parallel",
    "matmul_reduce_scatter",
    "parallelize_module",
    "reserve",
    "reset_comm_stats",
    "scaled_matmul_reduce_scatter",
    "set_backend",
    "set_timeout",
    "use_backend",
]
