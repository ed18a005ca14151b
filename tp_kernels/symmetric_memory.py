"""Symmetric memory: a buffer on every rank of a group, mapped into every rank, with signal pads.

:func:`get_workspace` gives a :class:`SymmWorkspace`: each of the ``world_size`` ranks of ``group``
owns a data region of ``nbytes`` bytes and a signal pad of int32 words, and every rank can read and
write every rank's region and pad directly, through :meth:`SymmWorkspace.buffer` (zero-copy tensor
views) or through raw addresses (:meth:`SymmWorkspace.buffer_ptrs`,
:meth:`SymmWorkspace.signal_pad_ptrs`, for kernels).

Two implementations sit behind the one interface:

- CUDA: ``torch.distributed._symmetric_memory`` (``empty`` + ``rendezvous``) with torch's ``CUDA``
  backend, on a group of any backend (gloo or NCCL) whose ranks all run on this host or in one
  multi-node NVLink domain (:func:`nvlink_domain_reason`). Signal
  operations are kernels queued on the current stream; a wait past its timeout traps on the device
  (a CUDA error from torch), it cannot raise :class:`~tp_kernels.deadline.PeerTimeoutError`.
- CPU: the POSIX shared-memory heap of the native extension ``tp_kernels._C``: one segment per rank,
  mapped by every rank of the group, which must all run on this host. Each segment's name is
  unlinked as soon as every rank has mapped it, so a crash leaves nothing in ``/dev/shm``. Waits
  spin, then yield, then sleep, and stop at their deadline with the heap's own error, which
  :class:`_ShmWorkspace` turns into :class:`~tp_kernels.deadline.PeerTimeoutError` naming the
  group, this rank, the peer, the channel and the time waited.

Signal convention (the one of CUDA symmetric memory, so the same kernel indexing serves both): the
signals that ``src`` sends to ``dst`` on channel ``c`` live in word ``c * world_size + src`` of
``dst``'s pad. A word is 0 when idle; :meth:`~SymmWorkspace.put_signal` waits until it is 0 and sets
it to 1 (release), :meth:`~SymmWorkspace.wait_signal` waits until it is 1 and sets it back to 0
(acquire). So a signal is never lost or counted twice, and pads are all zero between rounds.

Collective rules: :func:`get_workspace` allocates collectively (the first time for a
``(group, tag, device)``, and again, to at least twice the size, whenever ``nbytes`` exceeds the
current size). Every rank of the group must make the same sequence of calls with the same
``nbytes`` and ``tag``. A size mismatch at an allocation is detected and raises on every rank; a
mismatch that makes some ranks allocate and others not cannot be detected without a collective
per call, and ends at the process group's timeout.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import ctypes
import dataclasses
import functools
import importlib
import math
import os
import socket
import sys
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from tp_kernels.config import check_seconds
from tp_kernels.deadline import (
    DEFAULT_TIMEOUT_S,
    PeerTimeoutError,
    gather_objects,
    get_timeout,
    set_timeout,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "SHM_NAME_PREFIX",
    "SymmWorkspace",
    "get_timeout",
    "get_workspace",
    "set_timeout",
    "symm_unavailable_reason",
    "torch_symm_mem_unavailable_reason",
]

# Every segment of the CPU heap is named "/" + SHM_NAME_PREFIX + <allocation id> + "_" + <rank>.
SHM_NAME_PREFIX = "tp_kernels_"
# The CPU heap's signal pad has the default size of CUDA symmetric memory's (32 blocks x 72 ranks x
# 4 bytes), so both give the same number of channels for a world size.
_CPU_SIGNAL_PAD_BYTES = 32 * 72 * 4
_SIGNAL_WORD_BYTES = 4


def _resolve_timeout(timeout_s: float | None) -> float:
    return get_timeout() if timeout_s is None else check_seconds(timeout_s, "timeout_s")


# --- availability ---------------------------------------------------------------------------------

_native_module: ModuleType | None = None
_native_error: str | None = None


def _native() -> ModuleType | None:
    """``tp_kernels._C``, imported on first use; ``None`` (and :data:`_native_error`) if missing."""
    global _native_module, _native_error
    if _native_module is None and _native_error is None:
        try:
            from tp_kernels import _C
        except ImportError as exc:
            _native_error = str(exc)
        else:
            _native_module = _C
    return _native_module


def _as_device(device: torch.device | str | int, argument: str = "device") -> torch.device:
    """``device`` as a :class:`torch.device`; a CUDA device without an index gets the current one.

    A given index is kept as it is: the workspace lives on the tensors' own device, which need not
    be the current one.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{argument}: not a device: {device!r} ({exc})") from None
    if dev.type == "cpu":
        return torch.device("cpu")  # "cpu:0" is the same memory, and the same cache entry
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def _env_int(name: str) -> int | None:
    """A non-negative integer environment variable (as torchrun sets them), else ``None``."""
    raw = os.environ.get(name, "")
    return int(raw) if raw.isdigit() else None


def _spans_hosts_reason(group: dist.ProcessGroup | None, what: str) -> str | None:
    """Why ``group`` is known to span more than one host, from local facts only; else ``None``.

    Symmetric memory maps every peer's memory into this process, which both implementations can do
    only for ranks on this host (POSIX shared memory; CUDA IPC handles passed over Unix sockets).
    torchrun sets ``LOCAL_WORLD_SIZE`` (ranks on this host) and numbers the ranks host by host, so
    when every host runs ``LOCAL_WORLD_SIZE`` ranks, global rank ``g`` runs on host
    ``g // LOCAL_WORLD_SIZE``. That layout is trusted only where what torchrun says of this
    process (``LOCAL_RANK``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, when set) fits it; otherwise the
    one certain fact is that a group larger than ``LOCAL_WORLD_SIZE`` cannot fit on one host.
    Without ``LOCAL_WORLD_SIZE`` nothing is known here, and :func:`get_workspace` compares
    hostnames when it allocates.
    """
    local = _env_int("LOCAL_WORLD_SIZE")
    if group is None or not local:
        return None
    if group.size() > local:
        return (
            f"the group has {group.size()} ranks but only LOCAL_WORLD_SIZE={local} run on this "
            f"host; {what} needs every rank of the group on one host"
        )
    try:
        ranks = list(dist.get_process_group_ranks(group))
        rank, world = dist.get_rank(), dist.get_world_size()
    except (KeyError, RuntimeError, ValueError):
        return None  # not a group of the default world: nothing more is known locally
    hosts = _env_int("GROUP_WORLD_SIZE")  # torchrun: the number of hosts (agents)
    local_rank, host = _env_int("LOCAL_RANK"), _env_int("GROUP_RANK")
    uniform = (
        world % local == 0
        and (hosts is None or hosts * local == world)
        and (local_rank is None or rank % local == local_rank)
        and (host is None or rank // local == host)
    )
    if not uniform:
        return None
    by_host = sorted({g // local for g in ranks})
    if len(by_host) == 1:
        return None
    return (
        f"the group's ranks (global ranks {ranks}) run on hosts {by_host}: with "
        f"LOCAL_WORLD_SIZE={local} ranks on every host, global rank g runs on host g // {local}; "
        f"{what} needs every rank of the group on one host"
    )


# --- NVLink domains: hosts whose GPUs map each other's memory -------------------------------------

# On a multi-node NVLink system (GB200/GB300 NVL72: 4 GPUs per compute tray, 18 trays on one
# NVLink fabric) torch's CUDA symmetric memory maps peers on other hosts by exporting fabric
# handles (CU_MEM_HANDLE_TYPE_FABRIC) through the group's store, where it would pass POSIX file
# descriptors over Unix sockets between the processes of one host. It chooses fabric handles per
# process, when NVML reports the GPU in a fabric and a trial allocation, export and import of a
# fabric handle works (c10/cuda PeerToPeerAccess.cpp, get_fabric_access), and its rendezvous
# refuses ranks whose NVML clique ids differ. What decides here is read from the same driver
# facts, per GPU, by read_fabric_facts.

# NVML's fabric states (nvml.h, NVML_GPU_FABRIC_STATE_*): the fabric manager has registered the GPU,
# and so given it its cluster and clique, once the state is "completed".
_FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
_FABRIC_STATE_COMPLETED = 3
# CUdevice_attribute CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED (cuda.h, CUDA 12.3 on).
_CU_FABRIC_HANDLES_SUPPORTED = 128
# Where the driver's IMEX channels are: a process that can open none can neither create nor import
# a fabric handle (cuda.h, cuMemCreate and cuMemImportFromShareableHandle).
_IMEX_CHANNELS = "/dev/nvidia-caps-imex-channels"
# The first torch release whose CUDA symmetric memory exchanges fabric handles (pytorch#159319,
# July 2025, before 2.9's branch cut); earlier ones pass file descriptors only, one host's worth.
_TORCH_FABRIC_HANDLES = (2, 9)


class _NvmlFabricInfoV2(ctypes.Structure):
    """NVML's ``nvmlGpuFabricInfo_v2_t`` (nvml.h), which ``nvmlDeviceGetGpuFabricInfoV`` fills
    (drivers 550 on)."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("cluster_uuid", ctypes.c_ubyte * 16),
        ("status", ctypes.c_int),
        ("clique_id", ctypes.c_uint),
        ("state", ctypes.c_ubyte),
        ("health_mask", ctypes.c_uint),
    ]


@dataclasses.dataclass(frozen=True)
class FabricFacts:
    """What the driver reports of one GPU's place in a multi-node NVLink fabric.

    ``state``, ``status``, ``cluster_uuid`` and ``clique_id``: NVML's
    ``nvmlDeviceGetGpuFabricInfoV`` (two GPUs share memory over the fabric when both are
    registered with the same cluster UUID and clique id; a clique id alone is not unique across
    clusters). ``handles``: CUDA's ``CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED`` (``None``:
    libcuda could not be asked). ``imex_channel``: whether this process can open an IMEX channel.
    """

    state: int
    status: int
    cluster_uuid: str
    clique_id: int
    handles: bool | None
    imex_channel: bool

    @property
    def domain(self) -> str:
        """The NVLink domain, in words: GPUs with the same one share memory over the fabric."""
        return f"clique {self.clique_id} of cluster {self.cluster_uuid}"

    def unjoinable_reason(self) -> str | None:
        """Why this GPU cannot map memory of GPUs on other hosts; ``None`` if it can."""
        if self.state != _FABRIC_STATE_COMPLETED:
            state = _FABRIC_STATES.get(self.state, f"unknown ({self.state})")
            return f"NVML reports its NVLink fabric state {state!r}, not 'completed'"
        if self.status != 0:
            return f"NVML reports its fabric registration failed (status {self.status})"
        if uuid.UUID(self.cluster_uuid).int == 0:
            return "NVML reports no fabric cluster for it (a zero cluster UUID)"
        if self.handles is None:
            return "whether CUDA supports fabric handles on it cannot be asked (no libcuda)"
        if not self.handles:
            return "CUDA reports no fabric handle support on it"
        if not self.imex_channel:
            return (
                f"this process can open no IMEX channel in {_IMEX_CHANNELS}, and CUDA creates "
                "and imports fabric handles only through one"
            )
        return None


def _cuda_fabric_handles(index: int) -> bool | None:
    """CUDA's ``CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED`` for device ``index`` (the
    driver's ordinal, which is torch's), or ``None`` where libcuda cannot be asked."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device, value = ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), index):
        return None
    if cuda.cuDeviceGetAttribute(ctypes.byref(value), _CU_FABRIC_HANDLES_SUPPORTED, device):
        return None
    return bool(value.value)


def _imex_channel() -> bool:
    try:
        names = os.listdir(_IMEX_CHANNELS)
    except OSError:
        return False
    return any(
        os.access(os.path.join(_IMEX_CHANNELS, name), os.R_OK | os.W_OK)
        for name in names
        if name.startswith("channel")
    )


@functools.cache
def read_fabric_facts(index: int) -> FabricFacts | str:
    """The :class:`FabricFacts` of CUDA device ``index`` of this process, or why they cannot be
    read (no NVML, a driver before 550, ...). Read once per process: a GPU's registration with
    the fabric is done before jobs start. The one place tp_kernels asks the driver about fabrics
    (the tests replace it with fakes).

    torch's Python exposes nothing of it (2.13: neither device properties nor
    ``torch.distributed._symmetric_memory``), so NVML and libcuda are asked through ``ctypes``,
    as ``torch.cuda`` asks NVML for device counts; the device is found by its UUID.
    """
    try:
        gpu = f"GPU-{torch.cuda.get_device_properties(index).uuid}"
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except Exception as exc:  # a fact that cannot be read is reported, not raised
        return f"NVML cannot be asked about cuda:{index} ({type(exc).__name__}: {exc})"
    get_info = getattr(nvml, "nvmlDeviceGetGpuFabricInfoV", None)
    if get_info is None:
        return "this driver's NVML has no nvmlDeviceGetGpuFabricInfoV (drivers 550 on have it)"
    handle, info = ctypes.c_void_p(), _NvmlFabricInfoV2()
    info.version = ctypes.sizeof(info) | 2 << 24  # NVML_STRUCT_VERSION(GpuFabricInfo, 2)
    if nvml.nvmlInit_v2():
        return "NVML's nvmlInit_v2 failed"
    if nvml.nvmlDeviceGetHandleByUUID(gpu.encode(), ctypes.byref(handle)):
        return f"NVML finds no {gpu}"
    if get_info(handle, ctypes.byref(info)):
        return "NVML's nvmlDeviceGetGpuFabricInfoV failed"
    return FabricFacts(
        state=info.state,
        status=info.status,
        cluster_uuid=str(uuid.UUID(bytes=bytes(info.cluster_uuid))),
        clique_id=info.clique_id,
        handles=_cuda_fabric_handles(index),
        imex_channel=_imex_channel(),
    )


def _local_fabric(device: torch.device) -> FabricFacts | str:
    """This process's :class:`FabricFacts` for ``device``, or why it cannot span hosts over
    them (a torch that exchanges no fabric handles, facts that cannot be read)."""
    if torch.__version__ < _TORCH_FABRIC_HANDLES:
        return (
            f"torch {torch.__version__}'s CUDA symmetric memory passes file descriptors between "
            "the processes of one host; it exchanges fabric handles from torch 2.9 on"
        )
    return read_fabric_facts(torch.cuda.current_device() if device.index is None else device.index)


def _unjoinable_reason(fabric: FabricFacts | str) -> str | None:
    return fabric if isinstance(fabric, str) else fabric.unjoinable_reason()


def nvlink_domain_reason(
    hosts: Sequence[str], fabrics: Sequence[FabricFacts | str], what: str
) -> str | None:
    """The rule, over what every rank of a group reported (rank ``r`` runs on ``hosts[r]`` with
    ``fabrics[r]``: :class:`FabricFacts`, or why it has none): why the ranks cannot map each
    other's memory, naming what differs or is unknown; ``None`` when they can.

    They can when all run on one host (CUDA IPC between its processes), or when every GPU is
    registered with the NVLink fabric (state completed, no error, fabric handles and an IMEX
    channel usable) and all report the same cluster UUID and clique id. ``what`` names who needs
    it.
    """
    if len(set(hosts)) <= 1:
        return None
    head = (
        f"{what} needs every rank on one host, or every rank in one multi-node NVLink domain, "
        f"but the ranks run on {list(hosts)}"
    )
    cannot = {r: why for r, f in enumerate(fabrics) if (why := _unjoinable_reason(f)) is not None}
    if cannot:
        details = "; ".join(f"rank {r} ({hosts[r]}): {why}" for r, why in cannot.items())
        return f"{head}, and not every GPU can join one: {details}"
    domains: dict[str, list[int]] = {}
    for r, fabric in enumerate(fabrics):
        if isinstance(fabric, FabricFacts):  # every rank's, as none was a reason above
            domains.setdefault(fabric.domain, []).append(r)
    if len(domains) > 1:
        details = "; ".join(f"ranks {ranks} in {domain}" for domain, ranks in domains.items())
        return f"{head}, in different NVLink domains: {details}"
    return None


def group_unavailable_reason(
    group: dist.ProcessGroup | None,
    device: torch.device,
    what: str,
    *,
    unknown_hosts_are_a_reason: bool = False,
) -> str | None:
    """Why ``group``'s ranks are known not to map each other's memory on ``device``, from local
    facts only; ``None`` otherwise. The question both ``symm`` and ``torch_symm_mem`` ask.

    A group that ``LOCAL_WORLD_SIZE`` shows to span hosts (:func:`_spans_hosts_reason`; with
    ``unknown_hosts_are_a_reason``, one for which it is not set either) is refused unless
    ``device`` is a GPU that can join a multi-node NVLink domain: then whether every peer is in
    the same one is decided by an exchange, :func:`get_workspace`'s for ``symm``, torch's
    rendezvous for its own ops. The CPU heap maps POSIX shared memory: one host only.
    """
    spans = _spans_hosts_reason(group, what)
    local = _env_int("LOCAL_WORLD_SIZE")
    if spans is None and unknown_hosts_are_a_reason and group is not None and not local:
        spans = (
            f"LOCAL_WORLD_SIZE is {os.environ.get('LOCAL_WORLD_SIZE', '')!r}, so whether every "
            "rank of the group runs on this host cannot be told without communication (torchrun "
            "sets it)"
        )
    if spans is None or device.type != "cuda":
        return spans
    why = _unjoinable_reason(_local_fabric(device))
    if why is None:
        return None
    return f"{spans}; nor can {device} join a multi-node NVLink domain: {why}"


def _cpu_unavailable_reason(group: dist.ProcessGroup | None) -> str | None:
    if not sys.platform.startswith("linux"):
        return f"the CPU heap needs Linux (POSIX shared memory in /dev/shm); this is {sys.platform}"
    if _native() is None:
        return (
            f"the native extension tp_kernels._C is not available ({_native_error}); reinstall "
            "with `TP_KERNELS_BUILD_EXT=1 pip install -e .` to build it or see why it cannot be"
        )
    if not os.path.isdir("/dev/shm"):
        return "/dev/shm does not exist, so POSIX shared memory is unavailable"
    return _spans_hosts_reason(group, "the CPU heap (POSIX shared memory)")


def _symm_mem() -> ModuleType:
    """``torch.distributed._symmetric_memory`` (looked up in ``sys.modules`` first, like any
    import)."""
    return importlib.import_module("torch.distributed._symmetric_memory")


# What tp_kernels uses of torch's symmetric memory: the module's allocation and rendezvous, and on
# the rendezvous handle the peers' addresses, the pad size and the signal operations. All exist
# from torch 2.7 on. ``signal_pad_size`` is a property of each handle up to torch 2.9 and a static
# property of the handle class (readable through a handle) since 2.10, which also added the
# module-level get_signal_pad_size(); only the handle's attribute exists in every supported
# version.
_MODULE_API = ("empty", "rendezvous")
_HANDLE_API = (
    "buffer_ptrs",
    "signal_pad_ptrs",
    "signal_pad_size",
    "get_buffer",
    "get_signal_pad",
    "put_signal",
    "wait_signal",
    "barrier",
)

# The symmetric-memory backend that tp_kernels' kernels can use. They need every peer's buffer and
# signal pad mapped into this process (``handle.buffer_ptrs`` / ``signal_pad_ptrs``) and the
# handle's put_signal / wait_signal / barrier working on those pad words. torch's "CUDA" backend
# provides all of it. What the others lack, as of torch's sources:
_SUPPORTED_BACKEND = "CUDA"
_BACKEND_GAPS = {
    "NVSHMEM": (
        "its handles' put_signal, wait_signal and barrier do nothing (not implemented in torch), "
        "and a peer on another node has no address here"
    ),
    "NCCL": (
        "its handles give peer addresses only with NCCL's device API (NCCL >= 2.28), signal "
        "through NCCL's own signals instead of the signal pad's words, and have no barrier"
    ),
}


def _symm_mem_backend(symm_mem: ModuleType, device: torch.device) -> str | None:
    """The name of torch's symmetric-memory backend for ``device`` (``None``: none registered).

    torch >= 2.9 says it (``get_backend``, chosen by ``set_backend`` or ``TORCH_SYMMMEM``); torch
    2.8 chooses it once from ``TORCH_SYMMMEM`` (default ``CUDA``) and cannot be asked; torch 2.7
    (no NVSHMEM, no ``is_nvshmem_available``) has only the ``CUDA`` backend.
    """
    if hasattr(symm_mem, "get_backend"):
        return symm_mem.get_backend(device)
    if hasattr(symm_mem, "is_nvshmem_available"):
        return os.environ.get("TORCH_SYMMMEM", _SUPPORTED_BACKEND)
    return _SUPPORTED_BACKEND


def _backend_reason(symm_mem: ModuleType, device: torch.device, user: str) -> str | None:
    backend = _symm_mem_backend(symm_mem, device)
    if backend == _SUPPORTED_BACKEND:
        return None
    if hasattr(symm_mem, "set_backend"):
        how = (
            f"call torch.distributed._symmetric_memory.set_backend({_SUPPORTED_BACKEND!r}) before "
            f"this process's first symmetric allocation, or start it with "
            f"TORCH_SYMMMEM={_SUPPORTED_BACKEND}"
        )
    else:
        how = f"start the process with TORCH_SYMMMEM={_SUPPORTED_BACKEND}"
    if backend is None:
        return (
            f"torch {torch.__version__} has no symmetric-memory backend for {device}; {user} "
            f"needs the {_SUPPORTED_BACKEND!r} backend (if this build has it: {how})"
        )
    gap = _BACKEND_GAPS.get(backend, "tp_kernels' kernels were not written for it")
    return (
        f"torch's symmetric-memory backend for {device} is {backend!r}, and {gap}; {user} "
        f"needs the {_SUPPORTED_BACKEND!r} backend, whose handles map every peer's buffer and "
        f"signal pad into this process: {how}"
    )


def torch_symm_mem_unavailable_reason(device: torch.device, *, user: str) -> str | None:
    """Why torch's CUDA symmetric memory cannot serve ``device`` for ``user`` (who needs it, named
    in the reason), or ``None`` if it can: CUDA and the device exist, this torch's
    ``torch.distributed._symmetric_memory`` imports, and its symmetric-memory backend for the
    device is ``CUDA``, the one whose handles map every peer's buffer and signal pad into this
    process (tp_kernels' kernels and torch's own fused ops both use them so). Local facts only."""
    if not torch.cuda.is_available():
        return f"torch.cuda.is_available() is False (torch {torch.__version__})"
    if device.index is not None and device.index >= torch.cuda.device_count():
        return f"{device} does not exist: this process sees {torch.cuda.device_count()} GPUs"
    try:
        symm_mem = _symm_mem()
    except (ImportError, RuntimeError) as exc:
        return f"torch.distributed._symmetric_memory cannot be imported ({exc})"
    return _backend_reason(symm_mem, device, user)


def _cuda_unavailable_reason(device: torch.device, group: dist.ProcessGroup | None) -> str | None:
    why = torch_symm_mem_unavailable_reason(device, user="tp_kernels' symm backend")
    if why is not None:
        return why
    symm_mem = _symm_mem()
    handle_class = getattr(symm_mem, "_SymmetricMemory", None)
    missing = [name for name in _MODULE_API if not hasattr(symm_mem, name)]
    missing += [f"handle.{name}" for name in _HANDLE_API if not hasattr(handle_class, name)]
    if missing:
        return (
            f"torch {torch.__version__}'s symmetric memory lacks {', '.join(missing)}, which "
            "tp_kernels uses (present from torch 2.7 on)"
        )
    # No check of the group's backend: the CUDA backend's rendezvous exchanges what it needs
    # through the group's store (any group: gloo or NCCL), and passes CUDA IPC handles (file
    # descriptors) over Unix sockets between the processes of one host, or fabric handles
    # through the store across the hosts of one NVLink domain.
    return group_unavailable_reason(group, device, "CUDA symmetric memory")


def symm_unavailable_reason(
    device: torch.device | str, *, group: dist.ProcessGroup | None = None
) -> str | None:
    """Why symmetric memory cannot be used on ``device`` (and ``group``); ``None`` if it can.

    Only local facts are checked (no communication). That every rank of the group runs on this
    host (or, on CUDA, in this GPU's NVLink domain) is checked here from torchrun's
    ``LOCAL_WORLD_SIZE`` when it is set and the GPU's fabric facts (see
    :func:`group_unavailable_reason`), and for certain (an exchange of hostnames and fabric
    facts, :func:`nvlink_domain_reason`) by :func:`get_workspace`.
    On CUDA, the group may have any backend (gloo or NCCL); torch's symmetric memory must use its
    ``CUDA`` backend.
    """
    dev = _as_device(device)
    if dev.type == "cpu":
        return _cpu_unavailable_reason(group)
    if dev.type == "cuda":
        return _cuda_unavailable_reason(dev, group)
    return f"symmetric memory supports cpu and cuda devices, not {dev.type!r}"


# --- workspaces -----------------------------------------------------------------------------------


def _group_label(group: dist.ProcessGroup) -> str:
    return f"'{group.group_name}'"


class SymmWorkspace(abc.ABC):
    """One symmetric allocation: ``nbytes`` bytes and a signal pad on each rank of ``group``.

    Made by :func:`get_workspace` (one subclass per device type).

    Attributes:
        rank, world_size: this process's rank in ``group`` and the group's size.
        nbytes: size of each rank's data region (at least what was asked for).
        num_signals: number of signal channels; a pad holds ``num_signals * world_size`` words.
        device: where the regions live.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        nbytes: int,
        num_signals: int,
        device: torch.device,
        buffer_ptrs: list[int],
        signal_pad_ptrs: list[int],
    ) -> None:
        self._group_ref = weakref.ref(group)
        self._group_label = _group_label(group)
        self.rank = group.rank()
        self.world_size = group.size()
        self.nbytes = nbytes
        self.num_signals = num_signals
        self.device = device
        self._buffer_ptrs = torch.tensor(buffer_ptrs, dtype=torch.int64, device=device)
        self._signal_pad_ptrs = torch.tensor(signal_pad_ptrs, dtype=torch.int64, device=device)

    @property
    def group(self) -> dist.ProcessGroup:
        group = self._group_ref()
        if group is None:
            raise RuntimeError(f"the process group {self._group_label} of this workspace is gone")
        return group

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(group={self._group_label}, rank={self.rank}, "
            f"world_size={self.world_size}, nbytes={self.nbytes}, num_signals={self.num_signals}, "
            f"device={self.device})"
        )

    def _check_rank(self, rank: int, argument: str) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"{argument}: expected a rank in [0, {self.world_size}), got {rank!r}")

    def _check_channel(self, channel: int) -> None:
        if (
            isinstance(channel, bool)
            or not isinstance(channel, int)
            or not 0 <= channel < self.num_signals
        ):
            raise ValueError(
                f"channel: expected a channel in [0, {self.num_signals}), got {channel!r}"
            )

    def buffer(
        self, rank: int, shape: Sequence[int] | int, dtype: torch.dtype, *, offset: int = 0
    ) -> torch.Tensor:
        """A zero-copy, contiguous view of ``shape`` and ``dtype`` into ``rank``'s data region.

        ``rank`` may be this rank or any peer; the view starts ``offset`` bytes into the region,
        which must be a multiple of ``dtype``'s size. Writes through it are visible to every rank.
        """
        self._check_rank(rank, "rank")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: expected a torch.dtype, got {dtype!r}")
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise ValueError(f"shape: expected non-negative ints, got {shape!r}")
        itemsize = dtype.itemsize
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset: expected a non-negative number of bytes, got {offset!r}")
        if offset % itemsize:
            raise ValueError(
                f"offset: {offset} bytes is not a multiple of the {itemsize}-byte size of {dtype}"
            )
        size = math.prod(dims) * itemsize
        if offset + size > self.nbytes:
            raise ValueError(
                f"shape {list(dims)} of {dtype} at offset {offset} needs {offset + size} bytes, "
                f"but the workspace holds {self.nbytes}; ask get_workspace for more"
            )
        return self._view(rank, dims, dtype, offset)

    @abc.abstractmethod
    def _view(
        self, rank: int, shape: tuple[int, ...], dtype: torch.dtype, offset: int
    ) -> torch.Tensor:
        """The view of :meth:`buffer`, whose arguments are already checked."""

    def buffer_ptrs(self) -> torch.Tensor:
        """int64 ``[world_size]`` on :attr:`device`: every rank's data region, as addresses in this
        process (do not modify)."""
        return self._buffer_ptrs

    def signal_pad_ptrs(self) -> torch.Tensor:
        """int64 ``[world_size]`` on :attr:`device`: every rank's signal pad (int32 words), as
        addresses in this process (do not modify)."""
        return self._signal_pad_ptrs

    @abc.abstractmethod
    def signal_pad(self, rank: int) -> torch.Tensor:
        """int32 ``[num_signals * world_size]`` on :attr:`device`: a view of ``rank``'s signal
        pad (this rank's or a peer's), for writers that raise its words from the host side (the
        ``symm`` backend's pusher); valid while this workspace lives."""

    @abc.abstractmethod
    def put_signal(
        self, dst_rank: int, channel: int = 0, *, timeout_s: float | None = None
    ) -> None:
        """Release: wait until word ``channel * world_size + rank`` of ``dst_rank``'s pad is 0, then
        set it to 1. Writes made before it are visible to ``dst_rank`` once its wait returns."""

    @abc.abstractmethod
    def wait_signal(
        self, src_rank: int, channel: int = 0, *, timeout_s: float | None = None
    ) -> None:
        """Acquire: wait until word ``channel * world_size + src_rank`` of this rank's pad is 1,
        then reset it to 0. ``timeout_s`` defaults to :func:`get_timeout`."""

    @abc.abstractmethod
    def barrier(self, channel: int = 0, *, timeout_s: float | None = None) -> None:
        """Signal every peer on ``channel`` and wait for every peer's signal (within ``timeout_s``
        in total). Writes made before it by any rank are visible to all ranks after it."""


class _ShmWorkspace(SymmWorkspace):
    """CPU implementation over the native shared-memory heap ``tp_kernels._C.Heap``."""

    def __init__(self, group: dist.ProcessGroup, heap: Any, native: ModuleType) -> None:
        ranks = range(group.size())
        super().__init__(
            group,
            nbytes=heap.data_bytes,
            num_signals=heap.signal_words // group.size(),
            device=torch.device("cpu"),
            buffer_ptrs=[heap.data_ptr(r) for r in ranks],
            signal_pad_ptrs=[heap.signal_pad_ptr(r) for r in ranks],
        )
        self._heap = heap
        self._timeout_error = native.SignalTimeoutError
        #: Name prefix of this allocation's segments in /dev/shm (unlinked once set up).
        self.shm_name_prefix: str = heap.name_prefix.lstrip("/")
        # Each view holds a reference to its region, and so to the mapping: a tensor stays valid
        # after its workspace is dropped or replaced by a larger one.
        self._bytes = [torch.frombuffer(heap.data_region(r), dtype=torch.uint8) for r in ranks]

    def _view(
        self, rank: int, shape: tuple[int, ...], dtype: torch.dtype, offset: int
    ) -> torch.Tensor:
        size = math.prod(shape) * dtype.itemsize
        return self._bytes[rank][offset : offset + size].view(dtype).view(shape)

    def signal_pad(self, rank: int) -> torch.Tensor:
        self._check_rank(rank, "rank")
        words = self.num_signals * self.world_size
        # The heap exposes the pad by address only; the ctypes array is the view's buffer, and
        # the workspace (which holds the heap, and so the mapping) must outlive the view.
        pad = (ctypes.c_int32 * words).from_address(self._heap.signal_pad_ptr(rank))
        return torch.frombuffer(pad, dtype=torch.int32)

    @contextlib.contextmanager
    def _timed(self, timeout_s: float, peer: int | None = None) -> Iterator[None]:
        """Around a wait of the heap, which gives up at ``timeout_s`` with its own error (its
        message names this rank, the group, the peer waited for, the wait and its channel):
        that becomes the :class:`PeerTimeoutError` of every deadline."""
        try:
            yield
        except self._timeout_error as exc:
            raise PeerTimeoutError(
                str(exc),
                phase="signal wait",
                group=self.group.group_name,
                peers=None if peer is None else [peer],
                waited_s=timeout_s,
            ) from None

    def _signal(
        self,
        op: Callable[[int, int, float, str], None],
        peer: int,
        word: int,
        timeout_s: float | None,
        what: str,
    ) -> None:
        timeout = _resolve_timeout(timeout_s)
        with self._timed(timeout, peer):
            op(peer, word, timeout, what)

    def put_signal(
        self, dst_rank: int, channel: int = 0, *, timeout_s: float | None = None
    ) -> None:
        self._check_rank(dst_rank, "dst_rank")
        self._check_channel(channel)
        word = channel * self.world_size + self.rank
        what = f"put_signal on channel {channel} (the peer has not consumed the previous signal)"
        self._signal(self._heap.put_signal, dst_rank, word, timeout_s, what)

    def wait_signal(
        self, src_rank: int, channel: int = 0, *, timeout_s: float | None = None
    ) -> None:
        self._check_rank(src_rank, "src_rank")
        self._check_channel(channel)
        word = channel * self.world_size + src_rank
        what = f"wait_signal on channel {channel} (no signal arrived)"
        self._signal(self._heap.wait_signal, src_rank, word, timeout_s, what)

    def barrier(self, channel: int = 0, *, timeout_s: float | None = None) -> None:
        self._check_channel(channel)
        timeout = _resolve_timeout(timeout_s)
        with self._timed(timeout):
            self._heap.barrier(channel, timeout, f"barrier on channel {channel}")


def _check_handle_offset(group: dist.ProcessGroup, handle: Any) -> None:
    """Raise on every rank unless every rank's tensor starts its symmetric allocation.

    A handle's ``buffer_ptrs`` and ``signal_pad_ptrs`` are those of the whole allocation, and its
    ``offset`` (bytes) says where the tensor lies in it: non-zero when torch's memory pool
    (``symm_mem.empty`` since torch 2.11) places a tensor inside a larger block, whose one signal
    pad every tensor in the block then shares; ``get_buffer`` counts from the block's start too.
    The kernels address peers' buffers from ``buffer_ptrs`` and own the pad's words, so they need
    offset 0. Handles without the attribute (older torch) have none.
    """
    offsets = gather_objects(group, int(getattr(handle, "offset", 0)), "symmetric memory setup")
    if any(offsets):
        raise RuntimeError(
            f"symmetric memory setup on group {_group_label(group)}: torch placed the workspace "
            f"inside a larger symmetric allocation (handle.offset by rank: {offsets} bytes), "
            "whose buffer addresses and signal pad are the allocation's, not the workspace's; "
            "tp_kernels needs offset 0: start the processes with TORCH_SYMMMEM_IMPLICIT_POOL=0 "
            "so that symm_mem.empty allocates each tensor on its own"
        )


class _CudaWorkspace(SymmWorkspace):
    """CUDA implementation: a thin layer over ``torch.distributed._symmetric_memory``."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device) -> None:
        symm_mem = _symm_mem()
        # On ``device``, not the current device: since torch 2.11 symm_mem.empty allocates from a
        # memory pool that it activates for the current device only.
        with torch.cuda.device(device):
            tensor = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
            handle = symm_mem.rendezvous(tensor, group)
        _check_handle_offset(group, handle)
        # The pad size this allocation got, read once: the handle's attribute exists in every
        # supported torch (symm_mem.get_signal_pad_size only since 2.10), and from 2.10 on it
        # reports the process-wide setting, which a later set_signal_pad_size could change.
        pad_bytes = int(handle.signal_pad_size)
        super().__init__(
            group,
            nbytes=nbytes,
            num_signals=pad_bytes // (_SIGNAL_WORD_BYTES * group.size()),
            device=device,
            buffer_ptrs=list(handle.buffer_ptrs),
            signal_pad_ptrs=list(handle.signal_pad_ptrs),
        )
        # The handle's memory is the tensor's: keep it alive as long as the workspace.
        self._tensor = tensor
        self._handle = handle

    def _view(
        self, rank: int, shape: tuple[int, ...], dtype: torch.dtype, offset: int
    ) -> torch.Tensor:
        return self._handle.get_buffer(rank, list(shape), dtype, offset // dtype.itemsize)

    def signal_pad(self, rank: int) -> torch.Tensor:
        self._check_rank(rank, "rank")
        words = self.num_signals * self.world_size
        return self._handle.get_signal_pad(rank, [words], torch.int32)

    @staticmethod
    def _ms(timeout_s: float | None) -> int:
        return max(1, math.ceil(_resolve_timeout(timeout_s) * 1000))

    def put_signal(
        self, dst_rank: int, channel: int = 0, *, timeout_s: float | None = None
    ) -> None:
        self._check_rank(dst_rank, "dst_rank")
        self._check_channel(channel)
        self._handle.put_signal(dst_rank, channel, self._ms(timeout_s))

    def wait_signal(
        self, src_rank: int, channel: int = 0, *, timeout_s: float | None = None
    ) -> None:
        self._check_rank(src_rank, "src_rank")
        self._check_channel(channel)
        self._handle.wait_signal(src_rank, channel, self._ms(timeout_s))

    def barrier(self, channel: int = 0, *, timeout_s: float | None = None) -> None:
        self._check_channel(channel)
        self._handle.barrier(channel, self._ms(timeout_s))


# --- allocation -----------------------------------------------------------------------------------

# group -> {(tag, device): workspace}. Weak in the group, so that a destroyed group's workspaces
# (and, once no tensor views them, their mappings) go with it.
_workspaces: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[str, str], SymmWorkspace]]
_workspaces = weakref.WeakKeyDictionary()
atexit.register(_workspaces.clear)

# group -> the CUDA workspaces that a larger one replaced, kept until the group goes. A rank's
# host runs ahead of its GPU: when the ranks agree to grow, a peer's kernels of an earlier call
# may still be reading this rank's old buffer, writing into it, or signalling on its pad. Since
# torch 2.11, symm_mem.empty allocates from a memory pool, so a freed buffer can be handed to the
# next symmetric tensor while those kernels still run: a use-after-free on the GPU that no error
# reports. (Before, the free waits for this rank's own device only, not for the peers'.) Knowing
# that every peer's kernels are done would take a synchronization of every rank's device. Growth
# at least doubles (see get_workspace), so what is kept is smaller than the newest workspace. On
# the CPU nothing is kept: every wait and copy there is done when the call returns, and
# get_workspace's exchange cannot complete before every peer has entered it.
_replaced: weakref.WeakKeyDictionary[dist.ProcessGroup, list[SymmWorkspace]]
_replaced = weakref.WeakKeyDictionary()
atexit.register(_replaced.clear)


# torch's CUDA rendezvous refuses ranks whose (host, device index) coincide unless this is "1".
_ALLOW_SHARED_GPU = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"


def _agree(group: dist.ProcessGroup, nbytes: int, device: torch.device, tag: str) -> str:
    """Check on every rank, together, that allocating is possible and that all ranks ask the same;
    raise the same error on every rank if not. Returns rank 0's allocation id."""
    label = _group_label(group)
    mine = {
        "reason": symm_unavailable_reason(device, group=group),
        "nbytes": nbytes,
        "tag": tag,
        "device": device.type,
        "index": device.index,
        "host": socket.gethostname(),
        # Read only where torch could map a peer on another host, and only once the local checks
        # passed (the reader asks the driver of a device that exists).
        "fabric": None,
        "uid": uuid.uuid4().hex,
    }
    if device.type == "cuda" and mine["reason"] is None:
        mine["fabric"] = _local_fabric(device)
    infos = gather_objects(group, mine, "symmetric memory setup")
    where = f"get_workspace(tag={tag!r}) on group {label}"
    bad = {r: i["reason"] for r, i in enumerate(infos) if i["reason"] is not None}
    if bad:
        details = "; ".join(f"rank {r}: {why}" for r, why in bad.items())
        raise RuntimeError(f"{where}: symmetric memory is unavailable: {details}")
    for key in ("tag", "device", "nbytes"):
        values = [i[key] for i in infos]
        if len(set(values)) > 1:
            raise ValueError(
                f"{where}: {key} differs across ranks (by rank: {values}); every rank of the "
                "group must ask for the same workspace"
            )
    hosts = [i["host"] for i in infos]
    if device.type == "cpu" and len(set(hosts)) > 1:
        raise RuntimeError(
            f"{where}: symmetric memory needs every rank on one host, but the ranks run on {hosts}"
        )
    if device.type == "cuda":
        why = nvlink_domain_reason(hosts, [i["fabric"] for i in infos], "CUDA symmetric memory")
        if why is not None:
            raise RuntimeError(f"{where}: {why}")
    if device.type == "cuda" and os.environ.get(_ALLOW_SHARED_GPU) != "1":
        # torch's rendezvous refuses two ranks on one GPU unless told otherwise; say how here.
        # A GPU is a (host, index) pair, as torch's rendezvous counts them: the hosts of one NVLink
        # domain number their GPUs alike.
        gpus = [(i["host"], i["index"]) for i in infos]
        shared = {g: [r for r, x in enumerate(gpus) if x == g] for g in set(gpus)}
        shared = {g: ranks for g, ranks in shared.items() if len(ranks) > 1}
        if shared:
            details = "; ".join(
                f"ranks {ranks} use cuda:{index} of {host}"
                for (host, index), ranks in shared.items()
            )
            raise RuntimeError(
                f"{where}: {details}, and CUDA symmetric memory refuses ranks that share a GPU "
                f"unless {_ALLOW_SHARED_GPU}=1 is set in every rank (as for several ranks on one "
                "GPU, or ranks that each see a different GPU under the same index)"
            )
    return infos[0]["uid"]


def _on_every_rank(group: dist.ProcessGroup, step: Callable[[], None], what: str) -> None:
    """Run ``step`` here and tell every rank whether it worked everywhere (a barrier); raise the
    same error on every rank if it failed on any."""
    try:
        step()
        error = None
    except (OSError, RuntimeError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    errors = gather_objects(group, error, "symmetric memory setup")
    failed = {r: e for r, e in enumerate(errors) if e is not None}
    if failed:
        details = "; ".join(f"rank {r}: {e}" for r, e in failed.items())
        raise RuntimeError(
            f"symmetric memory setup on group {_group_label(group)}: could not {what}: {details}"
        )


def _allocate_shm(group: dist.ProcessGroup, nbytes: int, uid: str) -> _ShmWorkspace:
    native = _native()
    world_size = group.size()
    channels = _CPU_SIGNAL_PAD_BYTES // (_SIGNAL_WORD_BYTES * world_size)
    prefix = f"/{SHM_NAME_PREFIX}{uid}_"
    heap = native.Heap(
        group.group_name, group.rank(), world_size, prefix, nbytes, channels * world_size
    )
    try:
        _on_every_rank(group, heap.create, "create its shared-memory segment")
        _on_every_rank(group, heap.map_peers, "map the segments of its peers")
    except BaseException:
        # A peer may have died between creating its segment and unlinking it: every rank knows
        # every segment's name, so the survivors remove them all (the heap's destructor unmaps
        # and unlinks this rank's own).
        _unlink_segments(prefix, world_size)
        raise
    # Every rank has passed the exchange above, so every segment is mapped.
    heap.unlink()
    workspace = _ShmWorkspace(group, heap, native)
    # Once get_workspace returns on any rank, no segment of this allocation has a name left.
    workspace.barrier()
    return workspace


def _unlink_segments(prefix: str, world_size: int) -> None:
    """Remove the names of every rank's segment of one allocation, those that exist."""
    from _posixshmem import shm_unlink  # the POSIX call, as multiprocessing.shared_memory uses it

    for rank in range(world_size):
        with contextlib.suppress(FileNotFoundError):
            shm_unlink(f"{prefix}{rank}")


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``device`` made the current CUDA device, where it exists; else nothing changes.

    The agreement's object collective (on an NCCL group) and torch's symmetric allocation work on
    the current device, and the workspace belongs on ``device``, which need not be the current one.
    A device that does not exist is left to the agreement, which reports it on every rank.
    """
    if (
        device.type == "cuda"
        and device.index is not None
        and torch.cuda.is_available()
        and device.index < torch.cuda.device_count()
    ):
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def cached_workspace(
    group: dist.ProcessGroup, device: torch.device | str, tag: str
) -> SymmWorkspace | None:
    """The workspace :func:`get_workspace` holds for ``(group, tag, device)``, or None; never
    communicates (what a call under CUDA graph capture may ask)."""
    return _workspaces.get(group, {}).get((tag, str(_as_device(device))))


def get_workspace(
    group: dist.ProcessGroup,
    nbytes: int,
    device: torch.device | str,
    *,
    tag: str = "default",
) -> SymmWorkspace:
    """The symmetric workspace of ``(group, tag, device)`` with room for at least ``nbytes`` bytes.

    Collective when it allocates: the first call for a ``(group, tag, device)``, and every call
    whose ``nbytes`` exceeds the current workspace's. Growth is to at least twice the current
    size, so a slowly growing shape reallocates only O(log) times. The new workspace replaces the
    old one in the cache: tensors viewing the old one stay valid but are no longer shared; on CUDA
    the old one is kept until the group goes, since peers' kernels may still use it (see
    :data:`_replaced`). Calls that fit return the cached workspace without communicating. Every
    rank must ask the same ``nbytes``. Its tensors are never inference tensors.
    """
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed.ProcessGroup, got {group!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes: expected a positive number of bytes, got {nbytes!r}")
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"tag: expected a non-empty string, got {tag!r}")
    dev = _as_device(device)
    per_group = _workspaces.setdefault(group, {})
    key = (tag, str(dev))
    current = per_group.get(key)
    if current is not None and current.nbytes >= nbytes:
        return current
    # The ranks agree on what was asked; the size follows from it and from the current size,
    # which every rank has the same.
    size = nbytes if current is None else max(nbytes, 2 * current.nbytes)
    # Not inference tensors, whatever mode the first call ran in: later calls write them.
    with _on_device(dev), torch.inference_mode(False):
        uid = _agree(group, nbytes, dev, tag)  # raises on every rank if any rank cannot allocate
        if dev.type == "cpu":
            workspace: SymmWorkspace = _allocate_shm(group, size, uid)
        else:
            workspace = _CudaWorkspace(group, size, dev)
    if dev.type == "cuda" and current is not None:
        _replaced.setdefault(group, []).append(current)
    per_group[key] = workspace
    return workspace
