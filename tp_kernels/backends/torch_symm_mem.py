"""The ``torch_symm_mem`` backend: PyTorch's own fused ops over CUDA symmetric memory.

It hands both patterns to ``torch.ops.symm_mem`` (defined by importing
``torch.distributed._symmetric_memory``), so a GPU user gets a fused path that PyTorch maintains.
On rank ``r`` of ``W`` ranks, shapes as in ``backends/base.py``::

    all_gather_matmul:      fused_all_gather_matmul(a_shard [m, K], bs, gather_dim=0, group_name,
                                                    return_A=return_a)
                            -> (A [W*m, K] or None, [A @ b_j  [W*m, N_j]])
    matmul_reduce_scatter:  fused_matmul_reduce_scatter(a [W*m, K], b [K, N], "sum",
                                                        scatter_dim=0, group_name)
                            -> (sum over s of (a @ b)(rank s))[r*m:(r+1)*m]   [m, N]

The ops layer has already moved the gather/scatter dim to the front and made the input
contiguous, which is the layout torch's ops take without a copy; ``"avg"`` and the bias are
applied by the ops layer after the sum, so torch's op always sums.

``addend`` (the backward's gradient of a returned ``A``) has no place in torch's op. Since
``rs(a @ b + addend) = rs(a @ b) + rs(addend)``, the addend's reduce-scatter is started as an
ordinary collective before the fused op and added afterwards: it runs on the communicator's
stream while the fused op computes. It cannot deadlock: every rank enqueues the collective, then
the fused op; the collective depends only on the peers' collectives, the fused op's
symmetric-memory barriers only on the peers' fused ops.

Requirements (checked by :meth:`TorchSymmMemBackend.unavailable_reason` without communication):
CUDA tensors; a torch build whose ``torch.distributed._symmetric_memory`` imports and defines both
ops; torch's ``CUDA`` symmetric-memory backend (the ops barrier on the handle's signal pads and copy
from peers' buffers, which the NVSHMEM and NCCL backends do not provide that way; what torch's
symmetric memory offers on the device is asked as the ``symm`` backend asks it,
:func:`tp_kernels.symmetric_memory.torch_symm_mem_unavailable_reason`); every rank of
the group on this host (from ``LOCAL_WORLD_SIZE``) or, across hosts, in one multi-node NVLink
domain (the question ``symm`` asks too,
:func:`tp_kernels.symmetric_memory.group_unavailable_reason`); and, when this process sees fewer
GPUs than the group has ranks here, ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` (torch's
rendezvous refuses two ranks with the same device index on one host without it). Any group with a
store will do for the rendezvous (NCCL on GPU nodes; gloo where ranks share one GPU).
Torch 2.7 .. 2.15 differ in two ways, both feature-detected: before ``return_A`` existed, the
gathered ``A`` is always returned (and dropped here when not asked for); before
``enable_symm_mem_for_group`` was deprecated, it is called once per group.

What each call guards against, from torch's ``_symmetric_memory/__init__.py`` (2.13 and 2.15):

* The device: torch allocates its workspace on, and takes its side stream from, the *current*
  CUDA device, so each call runs with the tensors' device made current.
* The multicast all-gather: with ``return_A=False``, a contiguous shard, ``gather_dim == 0`` and
  ``W*m <= 2048`` torch takes ``multimem_all_gather_out``, chosen because the *device* supports
  multicast; its workspace has multicast only where rendezvous set it up, which it never does
  while ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` (the op then fails: the output "must have
  multicast support"). With that variable set, ``return_A=True`` is asked for, which keeps torch
  on its pipelined all-gather; the copy of ``A`` it makes is dropped.
* CUDA graph capture: torch's ops capture once their group's workspace
  (``get_symm_mem_workspace(group_name, min_size)``, one ``uint8`` tensor per group, re-allocated
  and re-rendezvoused, a collective, whenever a call asks for more) holds the call; growing it
  during capture raises mid-capture. So a captured call first compares what torch will ask for
  with the size torch keeps (``_group_name_to_workspace_tensor``) and is refused, before anything
  is launched, where the workspace would grow: an eager warmup call of the shape, or
  :meth:`TorchSymmMemBackend.reserve` (``tp_kernels.reserve``), grows it beforehand. torch asks
  for the shard's bytes (its pipelined all-gather; under capture ``return_A`` is always asked for,
  which keeps torch off its multicast all-gather and the ``W`` times larger buffer that one takes)
  and for two ``[m, N]`` chunks (its reduce-scatter: ``2 * W*m*N*itemsize / W``). The addend's
  reduce-scatter is a collective of the group: NCCL's capture, gloo's (ranks sharing a GPU) do
  not, so there a captured call with an addend is refused too.

Scaled (fp8) calls go to torch's ``fused_all_gather_scaled_matmul`` and
``fused_scaled_matmul_reduce_scatter`` with the same scales (a packed row-wise shard is unpacked
into its fp8 rows and their ``[m, 1]`` scales, which torch gathers as its "row-wise-sharded"
``A_scale``). Where their semantics differ from :func:`tp_kernels.backends.scaled.scaled_mm`
(torchao's rule): a row-wise product without fast accumulation is scaled inside torch's GEMM
(one rounding) where torchao scales a bf16 product afterwards (two), and an fp16/fp32 row-wise
output is asked of torch's GEMM as bf16 and cast here. torch's scaled ops take no addend, so an
addend is reduce-scattered beside them, as above.

Numerics (what the rule of tp_kernels/testing/numerics.py allows for): torch rounds each rank's
partial product to the input dtype before reducing (2.13: ``torch.sum`` over the partials, which on
CUDA accumulates fp16/bf16 in fp32 and rounds once; 2.15: a Triton kernel that does the same), as
``symm`` does; but the addend is reduce-scattered by the group's collective in the dtype (``W - 1``
running sums rounded) and added with one more rounding, where ``symm`` folds it into its partials:
hence the wider floors of ``TORCH_SYMM_MEM_FLOOR`` (tp_kernels/testing/numerics.py) for this
backend.

What was not run where this was written (a CPU machine, no GPU): torch's CUDA kernels behind the
two ops, the overlap of the addend's reduce-scatter with them, and the availability checks on a
CUDA machine. The CPU tests replace the two ops by gloo implementations of their documented
semantics, registered under the real schemas, and check the glue: argument order, return values,
the addend, autograd through the ops layer.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tp_kernels import symmetric_memory
from tp_kernels._compat import reduce_scatter_single
from tp_kernels.backends import base
from tp_kernels.backends.base import Backend, CaptureNeed, CaptureUnreadyError
from tp_kernels.backends.scaled import BlockScaling, Scaled, unpack_rows

_OPS = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")

# torch's CUDA rendezvous accepts ranks with the same (host, device index) only when this is "1"
# (c10::utils::check_env), and then never sets multicast up.
_ALLOW_OVERLAPPING = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"

_enabled_groups: set[str] = set()


def _symm_mem_module() -> tuple[Any, str | None]:
    """``(torch.distributed._symmetric_memory, None)``, or ``(None, why it does not import)``."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except (ImportError, RuntimeError) as exc:
        return None, f"torch.distributed._symmetric_memory does not import ({exc})"
    return symm_mem, None


def _missing_ops_reason() -> str | None:
    """Why this torch build cannot run the two fused ops (``None`` when it can)."""
    _, why = _symm_mem_module()  # importing it is what defines torch.ops.symm_mem.*
    if why is not None:
        return why
    missing = [name for name in _OPS if not hasattr(torch.ops.symm_mem, name)]
    if missing:
        names = ", ".join(f"torch.ops.symm_mem.{name}" for name in missing)
        return f"torch {torch.__version__} has no {names}"
    return None


def _overlapping_devices_allowed() -> bool:
    return os.environ.get(_ALLOW_OVERLAPPING) == "1"


def _shared_gpu_reason(group: dist.ProcessGroup) -> str | None:
    """Why torch's rendezvous will refuse the group's ranks for sharing a device index.

    Called once the group's ranks are known not to span hosts beyond one NVLink domain. The ranks
    on this host are the group's, or at most ``LOCAL_WORLD_SIZE`` where the group spans the hosts
    of a domain (torch tells GPUs apart by host and index): when this process sees fewer GPUs than
    that, two of them use the same index (as every rank sees the same GPUs), which torch refuses
    unless :data:`_ALLOW_OVERLAPPING` is ``"1"``.
    """
    gpus, world = torch.cuda.device_count(), group.size()
    here = min(world, symmetric_memory._env_int("LOCAL_WORLD_SIZE") or world)
    if here <= gpus or _overlapping_devices_allowed():
        return None
    return (
        f"the group's {here} ranks on this host share {gpus} GPU(s), and torch's CUDA "
        f"symmetric memory refuses ranks on the same device unless {_ALLOW_OVERLAPPING}=1 is set "
        "in every rank"
    )


def _workspace_bytes(group_name: str) -> int | None:
    """The size of torch's workspace for ``group_name`` in bytes (0 before its first use), or
    None where this torch does not keep it where 2.7 .. 2.15 do."""
    symm_mem, _ = _symm_mem_module()
    tensors = getattr(symm_mem, "_group_name_to_workspace_tensor", None)
    if not isinstance(tensors, dict):
        return None
    tensor = tensors.get(group_name)
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _torch_min_size(need: CaptureNeed, world: int) -> int:
    """The ``min_size`` torch's op asks its workspace for, for a call needing ``need`` (see the
    module docstring): two ``[m, N]`` chunks for a reduce-scatter, the shard for an all-gather.
    The backward's plain re-gather (``"all_gather"``) is a collective of the group: none."""
    if need.op == "matmul_reduce_scatter":
        return 2 * (need.nbytes // world)
    return need.nbytes if need.op == "all_gather_matmul" else 0


def _workspace_short_reason(group: dist.ProcessGroup, need: CaptureNeed) -> str | None:
    """Why torch's workspace cannot hold a call needing ``need`` without growing (None if it
    can)."""
    min_size = _torch_min_size(need, group.size())
    if min_size == 0:
        return None
    have = _workspace_bytes(group.group_name)
    if have is None:
        return (
            f"torch {torch.__version__} keeps no _group_name_to_workspace_tensor, so whether its "
            f"workspace holds the {min_size} bytes this {need.op} asks for cannot be told"
        )
    if have >= min_size:
        return None
    return (
        f"torch's symmetric-memory workspace of group {group.group_name!r} has {have} bytes and "
        f"this {need.op} ({need.dtype}) asks for {min_size}; it cannot grow during capture. Run "
        f"one eager step first, or call tp_kernels.reserve(group, {need.nbytes}) before capturing"
    )


def _check_call(
    op: str, group: dist.ProcessGroup, device: torch.device, nbytes: int, dtype: torch.dtype
) -> bool:
    """Refuse, before anything is launched, a captured call that torch's op would fail at midway
    (its workspace would grow); whether the call is being captured."""
    if not base.capturing(device):
        return False
    why = _workspace_short_reason(group, CaptureNeed(op, nbytes, dtype))
    if why is not None:
        raise CaptureUnreadyError(f"torch_symm_mem {op}: {why}; nothing was launched")
    return True


def _check_addend(group: dist.ProcessGroup) -> None:
    """Refuse a captured addend's collective on a group whose collectives do not capture."""
    backend = str(dist.get_backend(group))
    if "nccl" not in backend:
        raise CaptureUnreadyError(
            f"torch_symm_mem matmul_reduce_scatter: the addend (the gradient of a returned A) is "
            f"reduce-scattered by a collective of group {group.group_name!r}, whose backend "
            f"{backend!r} cannot be captured in a CUDA graph (NCCL's can); nothing was launched"
        )


def _enable_for_group(group: dist.ProcessGroup) -> None:
    """Register ``group`` with torch's symmetric memory, on the torch versions that need it.

    Older releases need ``enable_symm_mem_for_group`` before the first fused op on a group (some
    call it themselves; calling it again is a no-op); newer ones mark it deprecated (a
    FutureWarning on every call) and need nothing.
    """
    name = group.group_name
    if name in _enabled_groups:
        return
    symm_mem, _ = _symm_mem_module()
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None and getattr(enable, "__deprecated__", None) is None:
        enable(name)
    _enabled_groups.add(name)


@functools.cache
def _takes_return_a() -> bool:
    """Whether this torch's ``fused_all_gather_matmul`` has the ``return_A`` keyword."""
    schema = torch.ops.symm_mem.fused_all_gather_matmul.default._schema
    return any(arg.name == "return_A" for arg in schema.arguments)


def first_contact_facts(device: torch.device) -> list[tuple[str, str]]:
    """``(what, value)`` for what a first run of torch's fused ops on ``device`` depends on: each
    op's schema, whether the device reports multicast (which picks torch's multicast all-gather),
    what the driver reports of its NVLink fabric (which decides groups across hosts), the
    symmetric-memory backend selected, and :data:`_ALLOW_OVERLAPPING` in this process. A fact
    that cannot be read says why instead. Asking for multicast support marks torch's allocator
    backend as used, after which ``set_backend`` cannot change it: ask in a process that does not
    choose one (gpu_check's parent process, whose ranks are processes of their own)."""

    def read(what: Any) -> str:
        try:
            return str(what())
        except Exception as exc:  # a fact that cannot be read is reported, not raised
            return f"unreadable ({type(exc).__name__}: {exc})"

    def schema(name: str) -> Any:
        return _missing_ops_reason() or getattr(torch.ops.symm_mem, name).default._schema

    def multicast() -> Any:
        if device.type != "cuda":
            return f"n/a ({device.type})"
        from torch._C._autograd import DeviceType

        symm_mem, why = _symm_mem_module()
        index = torch.cuda.current_device() if device.index is None else device.index
        return why or symm_mem._SymmetricMemory.has_multicast_support(DeviceType.CUDA, index)

    def backend() -> Any:
        symm_mem, why = _symm_mem_module()
        return why or repr(symmetric_memory._symm_mem_backend(symm_mem, device))

    def fabric() -> Any:
        if device.type != "cuda":
            return f"n/a ({device.type})"
        index = torch.cuda.current_device() if device.index is None else device.index
        return symmetric_memory.read_fabric_facts(index)

    facts = [(f"torch.ops.symm_mem.{name}", read(lambda n=name: schema(n))) for name in _OPS]
    facts.append((f"has_multicast_support({device})", read(multicast)))
    facts.append((f"NVLink fabric of {device}", read(fabric)))
    facts.append((f"symmetric-memory backend for {device}", read(backend)))
    facts.append((_ALLOW_OVERLAPPING, os.environ.get(_ALLOW_OVERLAPPING, "unset")))
    return facts


class TorchSymmMemBackend(Backend):
    name = "torch_symm_mem"
    block_scales_reason = (
        "PyTorch's fused scaled ops take row-wise or tensor-wise fp32 scales, not MX blocks of "
        "e8m0 scales"
    )

    def unavailable_reason(
        self, group: dist.ProcessGroup | None, device: torch.device
    ) -> str | None:
        if device.type != "cuda":
            return f"torch's fused symmetric-memory ops run on CUDA tensors, not {device.type}"
        why = (
            symmetric_memory.torch_symm_mem_unavailable_reason(
                device, user="torch's fused symmetric-memory ops"
            )
            or _missing_ops_reason()
        )
        if why is not None or group is None:
            return why
        # Any group with a store: torch's rendezvous exchanges handles through it (NCCL for real
        # GPU nodes; gloo where several ranks share one GPU, which NCCL refuses). Unlike our
        # workspaces, torch's ops have no exchange of ours behind them, so a group whose hosts
        # are unknown (no LOCAL_WORLD_SIZE) is refused too, unless this GPU can join a
        # multi-node NVLink domain: then torch's rendezvous compares the ranks' cliques.
        why = symmetric_memory.group_unavailable_reason(
            group, device, "torch's fused symmetric-memory ops", unknown_hosts_are_a_reason=True
        )
        return why or _shared_gpu_reason(group)

    def capture_unready_reason(
        self, group: dist.ProcessGroup, device: torch.device, need: CaptureNeed
    ) -> str | None:
        if group.size() == 1:
            return None
        if need.op == "all_gather":
            # The backward's re-gather is the group's own collective, not torch's fused op:
            # capturable where the group's collectives are (NCCL), not on a gloo group of CUDA
            # tensors (on one H200 such a capture was invalidated mid-backward).
            return super().capture_unready_reason(group, device, need)
        return _workspace_short_reason(group, need)

    def _refuse_block_scales(self, scaling: Scaled | None) -> None:
        # The ops layer never hands one here (ops/scaled.py's scaled_backend): a caller of the
        # backend itself learns why.
        if isinstance(scaling, BlockScaling):
            raise ValueError(f"torch_symm_mem cannot run this call: {self.block_scales_reason}")

    def reserve(self, group: dist.ProcessGroup, device: torch.device, nbytes: int) -> None:
        """Grow torch's workspace of ``group`` to what calls of up to ``nbytes`` ask for: the
        all-gather's shard (``nbytes``) is the larger of the two (a reduce-scatter asks for
        ``2 * nbytes / W``). Collective (torch's re-rendezvous), as a growth in a call is."""
        if group.size() == 1 or device.type != "cuda":
            return
        _enable_for_group(group)
        symm_mem, _ = _symm_mem_module()
        with symmetric_memory._on_device(device):
            symm_mem.get_symm_mem_workspace(group.group_name, min_size=nbytes)

    def all_gather_matmul(
        self,
        a_shard: torch.Tensor,
        bs: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        *,
        return_a: bool,
        scaling: Scaled | None = None,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        self._refuse_block_scales(scaling)
        if scaling is not None:
            return self._all_gather_scaled_matmul(a_shard, bs, group, scaling)
        if group.size() == 1:
            return (a_shard.clone() if return_a else None), [a_shard @ b for b in bs]
        nbytes = a_shard.nbytes
        captured = _check_call("all_gather_matmul", group, a_shard.device, nbytes, a_shard.dtype)
        _enable_for_group(group)
        op = torch.ops.symm_mem.fused_all_gather_matmul
        # Asking for A keeps torch off its multicast path (see the module docstring).
        ask_a = return_a or captured or _overlapping_devices_allowed()
        kwargs = {"return_A": ask_a} if _takes_return_a() else {}
        with symmetric_memory._on_device(a_shard.device):
            a, outs = op(a_shard, list(bs), 0, group.group_name, **kwargs)
        return (a if return_a else None), list(outs)

    def matmul_reduce_scatter(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        addend: torch.Tensor | None = None,
        scaling: Scaled | None = None,
    ) -> torch.Tensor:
        self._refuse_block_scales(scaling)
        world = group.size()
        if world == 1 and scaling is not None:
            out = scaling.block(a, 0, b)
            return out if addend is None else out.add_(addend)
        if world == 1:
            return a @ b if addend is None else torch.addmm(addend, a, b)
        out_dtype = a.dtype if scaling is None else scaling.out_dtype
        nbytes = a.shape[0] * b.shape[1] * out_dtype.itemsize
        if _check_call("matmul_reduce_scatter", group, a.device, nbytes, out_dtype) and (
            addend is not None
        ):
            _check_addend(group)
        _enable_for_group(group)
        with symmetric_memory._on_device(a.device):
            pending = None
            if addend is not None:
                # Started first, so that it overlaps the fused op (see the module docstring).
                rs_addend = addend.new_empty((addend.shape[0] // world, addend.shape[1]))
                pending = reduce_scatter_single(
                    rs_addend, addend.contiguous(), group, async_op=True
                )
            if scaling is None:
                out = torch.ops.symm_mem.fused_matmul_reduce_scatter(
                    a, b, "sum", 0, group.group_name
                )
            else:
                out = _torch_dtype_out(scaling, lambda mm_dtype: (
                    torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
                        a, b, scaling.a_scale, scaling.b_scales[0], "sum", 0, 0,
                        group.group_name, [a.shape[0] // world, b.shape[1]],
                        out_dtype=mm_dtype, use_fast_accum=scaling.fast_accum,
                    )
                ))  # fmt: skip
            if pending is not None:
                pending.wait()
                out = out.add_(rs_addend)
        return out

    def _all_gather_scaled_matmul(
        self,
        a_shard: torch.Tensor,
        bs: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        scaling: Scaled,
    ) -> tuple[None, list[torch.Tensor]]:
        if group.size() == 1:
            return None, [scaling.block(a_shard, j, b) for j, b in enumerate(bs)]
        k = bs[0].shape[0]
        if scaling.packed:
            data, a_scale = (t.contiguous() for t in unpack_rows(a_shard, k, scaling.a_dtype))
        else:
            data, a_scale = a_shard.view(scaling.a_dtype), scaling.a_scale
        _check_call("all_gather_matmul", group, a_shard.device, a_shard.nbytes, a_shard.dtype)
        _enable_for_group(group)
        n = len(bs)
        with symmetric_memory._on_device(a_shard.device):
            a, outs = _torch_dtype_out(scaling, lambda mm_dtype: (
                torch.ops.symm_mem.fused_all_gather_scaled_matmul(
                    data, list(bs), a_scale, list(scaling.b_scales), 0, group.group_name,
                    [None] * n, [None] * n, [mm_dtype] * n, [scaling.fast_accum] * n,
                )
            ))  # fmt: skip
        # A scaled call never asks for A (see Backend.all_gather_matmul): torch's A would be
        # the fp8 rows without their scales.
        return None, list(outs)


def _torch_dtype_out(scaling: Scaled, call: Any) -> Any:
    """``call(mm_dtype)`` with the dtype torch's row-wise scaled GEMM can produce (bf16 for an
    fp16/fp32 ``out_dtype``), its products cast to ``out_dtype`` afterwards."""
    rowwise = scaling.packed or (scaling.a_scale is not None and scaling.a_scale.dim() == 2)
    if not rowwise or scaling.out_dtype == torch.bfloat16:
        return call(scaling.out_dtype)
    result = call(torch.bfloat16)
    if isinstance(result, torch.Tensor):
        return result.to(scaling.out_dtype)
    a, outs = result
    return a, [out.to(scaling.out_dtype) for out in outs]


BACKEND = TorchSymmMemBackend()
