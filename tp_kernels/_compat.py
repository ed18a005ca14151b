"""What differs between the torch versions tp_kernels supports, in one place: the version floor
(checked once at import), the collectives' names, and an import that must come before any
process group exists."""

from __future__ import annotations

import re

import torch

MIN_TORCH = (2, 7)


def _parse(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ImportError(f"tp_kernels cannot read the torch version {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch_version(version: str = torch.__version__) -> None:
    """Raise ImportError unless ``version`` is at least :data:`MIN_TORCH`."""
    if _parse(version) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ImportError(
            f"tp_kernels needs torch>={need} (for DTensor's public API and the src_data_rank "
            f"argument of the tensor-parallel styles); found torch {version}. "
            f"Install a newer torch first, e.g. `pip install torch==2.13.0`."
        )


def import_before_any_group() -> None:
    """Import ``torch.distributed.nn.functional`` now, at ``import tp_kernels``, which in the usual
    order (imports, then ``init_process_group``) runs before any process group exists.

    That module's collectives take ``group=group.WORLD`` as a default argument, evaluated at its
    first import. torch imports it lazily (``torch._dynamo`` does, on the first call of any custom
    op, the fused ops' first call among them); imported while a group is initialized, it binds
    the default group in those defaults, a reference nothing releases. ``destroy_process_group()``
    then leaves the group alive, and with it gloo's worker threads and the store's, until the
    interpreter tears its modules down at exit, where a gloo thread that still holds a finished
    Work's tensors needs the GIL of an interpreter that is going away: the process aborts after
    its last line (``terminate called without an active exception``), now and then. Imported
    here, the defaults hold ``None`` (the default group at call time, the same meaning).
    """
    import torch.distributed as dist

    if dist.is_available():
        import torch.distributed.nn.functional  # noqa: F401


def _collective(new_name: str, old_name: str):
    import torch.distributed as dist

    # torch 2.13 renamed the tensor collectives (`*_single`); older releases have the old names.
    return getattr(dist, new_name, None) or getattr(dist, old_name)


def all_gather_single(output, input, group, async_op: bool = False):
    """``output = cat([input of every rank of group], dim=0)``."""
    return _collective("all_gather_single", "all_gather_into_tensor")(
        output, input, group=group, async_op=async_op
    )


def reduce_scatter_single(output, input, group, async_op: bool = False):
    """``output = sum over ranks of input``, rows ``[rank*m:(rank+1)*m]``."""
    return _collective("reduce_scatter_single", "reduce_scatter_tensor")(
        output, input, group=group, async_op=async_op
    )
