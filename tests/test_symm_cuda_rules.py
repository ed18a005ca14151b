"""The CUDA rules of ``tp_kernels.symmetric_memory``, exercised on a machine without a GPU.

``symm``'s view of the world is replaced, for one test at a time, by fakes: its ``torch`` (a proxy
whose ``torch.cuda`` claims two GPUs and records the current device, and whose ``torch.tensor``
leaves tensors on the CPU), its ``torch.distributed`` (groups with chosen global ranks, backend,
hosts and devices; an object all-gather that answers for the peers) and
``torch.distributed._symmetric_memory`` (shaped like a chosen torch release: which functions the
module has and how the rendezvous handle reports its signal pad). What each fake release has was
read from that release's ``torch/distributed/_symmetric_memory/__init__.py`` and
``torch/_C/_distributed_c10d.pyi``.
"""

from __future__ import annotations

import contextlib
import gc
import re
import sys
import types
import uuid as uuid_module
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tp_kernels import symmetric_memory

SYMM_MEM = "torch.distributed._symmetric_memory"
PAD_BYTES = 9216  # torch's default signal pad size from 2.7 on


# --- fakes ----------------------------------------------------------------------------------------


class FakeGroup:
    """A process group as symm sees it: rank, size, name, and what the fake dist reports."""

    def __init__(
        self,
        rank: int,
        size: int,
        *,
        backend: str = "nccl",
        global_ranks: list[int] | None = None,
        hosts: list[str] | None = None,
        devices: list[int] | None = None,
        fabrics: list[Any] | None = None,
        name: str = "fake",
    ) -> None:
        self._rank, self._size = rank, size
        self.backend = backend
        self.global_ranks = list(range(size)) if global_ranks is None else global_ranks
        self.hosts = hosts
        self.devices = devices
        self.fabrics = fabrics
        self.group_name = name

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class FakeDist:
    """symm's ``torch.distributed``: the real module, except for what the fake groups answer."""

    ProcessGroup = FakeGroup

    def __init__(self, *, rank: int, world_size: int) -> None:
        self._rank, self._world_size = rank, world_size

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def get_rank(self) -> int:
        return self._rank

    def get_world_size(self) -> int:
        return self._world_size

    def get_process_group_ranks(self, group: FakeGroup) -> list[int]:
        return group.global_ranks

    def get_backend(self, group: FakeGroup) -> str:
        return group.backend

    def all_gather_object(self, out: list[Any], obj: Any, group: FakeGroup) -> None:
        """Every peer sends what this rank sends, but from its own host and device (this rank's
        own entry is what it sent); what is not a setup record comes back as sent."""
        for r in range(group.size()):
            if not isinstance(obj, dict):
                out[r] = obj
                continue
            info = dict(obj, uid=f"uid{r}")
            if group.hosts is not None:
                info["host"] = group.hosts[r]
            if group.devices is not None:
                info["index"] = group.devices[r]
            if group.fabrics is not None:
                info["fabric"] = group.fabrics[r]
            out[r] = obj if r == group.rank() else info


class FakeCuda:
    """``torch.cuda`` with two GPUs; ``device(d)`` sets the current device for its block."""

    def __init__(self) -> None:
        self.current = 0

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 2

    def current_device(self) -> int:
        return self.current

    @contextlib.contextmanager
    def device(self, device: torch.device | int) -> Iterator[None]:
        index = device.index if isinstance(device, torch.device) else int(device)
        previous, self.current = self.current, index
        try:
            yield
        finally:
            self.current = previous


class FakeTorch:
    """symm's ``torch``: the real one, with :class:`FakeCuda` and pointer tables on the CPU."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def tensor(data: Any, *, dtype: torch.dtype | None = None, device: Any = None) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype)


class StaticPadHandle:
    """A rendezvous handle of torch >= 2.10: ``signal_pad_size`` is the class's, as there."""

    signal_pad_size = PAD_BYTES

    def __init__(self, tensor: torch.Tensor, group: FakeGroup) -> None:
        self.tensor = tensor
        self.calls: list[tuple] = []
        # Addresses that are never dereferenced: distinct per rank, the pads after the buffers.
        self._buffers = [tensor.data_ptr() + (r << 32) for r in range(group.size())]

    # Properties, as on torch's handle class, so that symm can check for them without a handle.
    buffer_ptrs = property(lambda self: list(self._buffers))
    signal_pad_ptrs = property(lambda self: [p + (1 << 31) for p in self._buffers])

    def get_buffer(self, rank: int, shape: list[int], dtype: torch.dtype, offset: int) -> Any:
        return self.tensor.view(dtype)[offset : offset + int(torch.Size(shape).numel())]

    def get_signal_pad(self, rank: int, shape: list[int], dtype: torch.dtype) -> Any:
        self.calls.append(("get_signal_pad", rank, list(shape), dtype))
        return torch.zeros(shape, dtype=dtype)

    def put_signal(self, *args: int) -> None:
        self.calls.append(("put_signal", *args))

    def wait_signal(self, *args: int) -> None:
        self.calls.append(("wait_signal", *args))

    def barrier(self, *args: int) -> None:
        self.calls.append(("barrier", *args))


class InstancePadHandle(StaticPadHandle):
    """A rendezvous handle of torch 2.7 .. 2.9: ``signal_pad_size`` is a property of each handle
    (the pad of that allocation)."""

    signal_pad_size = property(lambda self: self.pad_bytes)  # type: ignore[assignment]
    pad_bytes = PAD_BYTES


class FakeSymmMem(types.ModuleType):
    """``torch.distributed._symmetric_memory`` of one torch release; records every call with the
    current device it ran on."""

    def __init__(
        self,
        version: str,
        cuda: FakeCuda,
        *,
        backend: str | None = "CUDA",
        offset: int | None = None,
    ) -> None:
        super().__init__(SYMM_MEM)
        self._offset = offset  # the handles' ``offset`` attribute (None: they have none)
        minor = int(version.split(".")[1])
        self.cuda = cuda
        self.calls: list[tuple] = []
        self._SymmetricMemory = StaticPadHandle if minor >= 10 else InstancePadHandle
        if minor >= 8:
            self.is_nvshmem_available = lambda: False
        if minor >= 9:
            self.set_backend = lambda name: None
            self.get_backend = self._get_backend
        if minor >= 10:
            self.get_signal_pad_size = lambda: PAD_BYTES
        self._backend = backend

    def _get_backend(self, device: torch.device) -> str | None:
        self.calls.append(("get_backend", device))
        return self._backend

    def empty(self, nbytes: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.calls.append(("empty", device, self.cuda.current))
        return torch.zeros(nbytes, dtype=dtype)

    def rendezvous(self, tensor: torch.Tensor, group: FakeGroup) -> StaticPadHandle:
        self.calls.append(("rendezvous", group.group_name, self.cuda.current))
        handle = self._SymmetricMemory(tensor, group)
        if self._offset is not None:
            handle.offset = self._offset
        return handle


class World:
    """One test's fakes, installed into ``symm`` (and ``sys.modules``) by :func:`fake_world`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch
        self.cuda = FakeCuda()
        self.symm_mem: FakeSymmMem | None = None
        self.dist(rank=0, world_size=2)
        monkeypatch.setattr(symmetric_memory, "torch", FakeTorch(self.cuda))
        # No NVML here, whatever the machine running the tests has (section 5 gives fabrics).
        self.fabric("no NVML in the fake world")

    def fabric(self, facts: symmetric_memory.FabricFacts | str) -> None:
        """What the driver reports of this rank's GPU's NVLink fabric, whatever the device."""
        self._monkeypatch.setattr(symmetric_memory, "read_fabric_facts", lambda index: facts)

    def dist(self, *, rank: int, world_size: int) -> None:
        """This process's global rank and the default world's size; the setup's object exchange
        (tp_kernels.deadline.gather_objects) through the fake's all_gather_object."""
        fake = FakeDist(rank=rank, world_size=world_size)
        self._monkeypatch.setattr(symmetric_memory, "dist", fake)

        def gather_objects(group: FakeGroup, obj: Any, what: str) -> list[Any]:
            out: list[Any] = [None] * group.size()
            fake.all_gather_object(out, obj, group)
            return out

        self._monkeypatch.setattr(symmetric_memory, "gather_objects", gather_objects)

    def torch_release(self, version: str, **kwargs: Any) -> FakeSymmMem:
        """Make ``torch.distributed._symmetric_memory`` look like ``version``'s."""
        self.symm_mem = FakeSymmMem(version, self.cuda, **kwargs)
        self._monkeypatch.setitem(sys.modules, SYMM_MEM, self.symm_mem)
        # `import a.b.c as m` takes the attribute of the parent package where it exists.
        self._monkeypatch.setattr(dist, "_symmetric_memory", self.symm_mem, raising=False)
        return self.symm_mem


@pytest.fixture
def fake_world(monkeypatch: pytest.MonkeyPatch) -> World:
    for name in (
        "LOCAL_WORLD_SIZE",
        "LOCAL_RANK",
        "GROUP_WORLD_SIZE",
        "GROUP_RANK",
        "TORCH_SYMMMEM",
        "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES",
    ):
        monkeypatch.delenv(name, raising=False)
    return World(monkeypatch)


# --- 1. the signal pad size: the handle's, which every supported torch has -----------------------


@pytest.mark.parametrize("version", ["2.7", "2.8", "2.9", "2.10", "2.13"])
def test_signal_pad_size_comes_from_the_handle(fake_world, version):
    symm_mem = fake_world.torch_release(version)
    group = FakeGroup(0, 2, devices=[0, 1])
    assert symmetric_memory.symm_unavailable_reason("cuda:0", group=group) is None
    ws = symmetric_memory.get_workspace(group, 4096, "cuda:0", tag="pad")
    assert ws.num_signals == PAD_BYTES // (4 * 2)
    ws.put_signal(1, channel=ws.num_signals - 1)  # the last channel is in range
    assert ws._handle.calls[-1][:3] == ("put_signal", 1, ws.num_signals - 1)
    assert [c[0] for c in symm_mem.calls if c[0] != "get_backend"] == ["empty", "rendezvous"]


def test_signal_pad_views_come_from_the_handle(fake_world):
    """The reduce-scatter's pusher writes into a peer's pad through a view of all its words."""
    fake_world.torch_release("2.13")
    ws = symmetric_memory.get_workspace(FakeGroup(0, 2, devices=[0, 1]), 64, "cuda:0", tag="pads")
    pad = ws.signal_pad(1)
    words = PAD_BYTES // 4
    assert pad.shape == (words,) and pad.dtype == torch.int32
    assert ws._handle.calls[-1] == ("get_signal_pad", 1, [words], torch.int32)
    with pytest.raises(ValueError, match=r"rank: expected a rank in \[0, 2\), got 2"):
        ws.signal_pad(2)


def test_signal_pad_size_of_this_allocation(fake_world, monkeypatch):
    """The pad the handle reports, not torch's default, sets the number of channels (a torch
    build may differ; since 2.10 set_signal_pad_size changes it)."""
    fake_world.torch_release("2.9")
    monkeypatch.setattr(InstancePadHandle, "pad_bytes", 3 * 1024)
    ws = symmetric_memory.get_workspace(FakeGroup(0, 3, devices=[0, 1, 2]), 64, "cuda:0", tag="pad")
    assert ws.num_signals == 3 * 1024 // (4 * 3)


def test_missing_symmetric_memory_api_is_named(fake_world):
    symm_mem = fake_world.torch_release("2.13")
    # A handle class with only some of what symm uses (checked on the class: no handle needed).
    symm_mem._SymmetricMemory = type("Partial", (), {"buffer_ptrs": None, "get_buffer": None})
    why = symmetric_memory.symm_unavailable_reason("cuda:0")
    assert why is not None and "lacks" in why, why
    for name in (
        "signal_pad_ptrs",
        "signal_pad_size",
        "get_signal_pad",
        "put_signal",
        "wait_signal",
        "barrier",
    ):
        assert f"handle.{name}" in why, (name, why)
    assert "handle.buffer_ptrs" not in why and "handle.get_buffer" not in why


# --- 2. torch's symmetric-memory backend ----------------------------------------------------------


@pytest.mark.parametrize("backend", ["NVSHMEM", "NCCL"])
def test_other_symm_mem_backends_are_refused(fake_world, backend):
    symm_mem = fake_world.torch_release("2.13", backend=backend)
    why = symmetric_memory.symm_unavailable_reason("cuda:1", group=FakeGroup(0, 2))
    assert why is not None, backend
    assert f"backend for cuda:1 is {backend!r}" in why, why
    assert "set_backend('CUDA')" in why and "TORCH_SYMMMEM=CUDA" in why, why
    assert ("get_backend", torch.device("cuda", 1)) in symm_mem.calls  # asked about this device
    with pytest.raises(RuntimeError, match=f"symmetric memory is unavailable: rank 0: .*{backend}"):
        symmetric_memory.get_workspace(FakeGroup(0, 2), 4096, "cuda:1")


def test_no_symm_mem_backend_registered(fake_world):
    fake_world.torch_release("2.13", backend=None)
    why = symmetric_memory.symm_unavailable_reason("cuda:0")
    assert why is not None and "has no symmetric-memory backend for cuda:0" in why, why


def test_backend_of_torch_2_8_comes_from_the_environment(fake_world, monkeypatch):
    """torch 2.8 cannot be asked (no get_backend, no set_backend): it picks the backend from
    TORCH_SYMMMEM when it loads. torch 2.7 has only the CUDA backend and ignores the variable."""
    fake_world.torch_release("2.8")
    assert symmetric_memory.symm_unavailable_reason("cuda:0") is None
    monkeypatch.setenv("TORCH_SYMMMEM", "NVSHMEM")
    why = symmetric_memory.symm_unavailable_reason("cuda:0")
    assert why is not None and "is 'NVSHMEM'" in why and "TORCH_SYMMMEM=CUDA" in why, why
    assert "set_backend" not in why
    fake_world.torch_release("2.7")
    assert symmetric_memory.symm_unavailable_reason("cuda:0") is None


# --- 3. groups that span hosts, for CPU and CUDA alike --------------------------------------------


def _reasons(group: FakeGroup) -> dict[str, str | None]:
    return {d: symmetric_memory.symm_unavailable_reason(d, group=group) for d in ("cpu", "cuda:0")}


def test_group_across_hosts_is_refused_locally(fake_world, monkeypatch):
    """torchrun with 2 hosts of 2 ranks: global ranks 0, 1 on host 0 and 2, 3 on host 1. A group
    of 2 ranks fits LOCAL_WORLD_SIZE, yet ranks 1 and 2 are on different hosts."""
    fake_world.torch_release("2.13")
    fake_world.dist(rank=1, world_size=4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "0")
    for device, why in _reasons(FakeGroup(0, 2, global_ranks=[1, 2])).items():
        assert why is not None, device
        assert "global ranks [1, 2]) run on hosts [0, 1]" in why, (device, why)
        assert "LOCAL_WORLD_SIZE=2" in why and "on one host" in why, (device, why)
    assert _reasons(FakeGroup(1, 2, global_ranks=[0, 1])) == {"cpu": None, "cuda:0": None}
    # Larger than a host: certain whatever the layout.
    for device, why in _reasons(FakeGroup(0, 3, global_ranks=[0, 1, 2])).items():
        assert why is not None, device
        assert "the group has 3 ranks but only LOCAL_WORLD_SIZE=2" in why, (device, why)


def test_uneven_hosts_leave_only_the_size_check(fake_world, monkeypatch):
    """Hosts with different numbers of ranks: g // LOCAL_WORLD_SIZE is not the host, so a group
    that fits is not refused here (get_workspace's hostname exchange decides)."""
    fake_world.torch_release("2.13")
    fake_world.dist(rank=1, world_size=5)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _reasons(FakeGroup(0, 2, global_ranks=[1, 2])) == {"cpu": None, "cuda:0": None}
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    fake_world.dist(rank=1, world_size=4)
    assert _reasons(FakeGroup(0, 2, global_ranks=[1, 2])) == {"cpu": None, "cuda:0": None}


def test_cuda_allocation_checks_hosts_for_certain(fake_world):
    fake_world.torch_release("2.13")
    group = FakeGroup(0, 2, hosts=["(this host)", "elsewhere"], devices=[0, 1])
    with pytest.raises(RuntimeError, match=r"needs every rank on one host.*, 'elsewhere'\]"):
        symmetric_memory.get_workspace(group, 4096, "cuda:0")
    assert fake_world.symm_mem.calls[-1][0] != "empty"  # refused before allocating


# --- 4. any group: the CUDA backend's rendezvous goes through the group's store -------------------


@pytest.mark.parametrize("version", ["2.7", "2.13"])
def test_gloo_group_on_one_gpu(fake_world, monkeypatch, version):
    """The one-GPU multi-rank check: ranks of a gloo group share cuda:0, with torch's permission."""
    fake_world.torch_release(version)
    group = FakeGroup(1, 2, backend="gloo", devices=[0, 0], name="gloo-on-one-gpu")
    assert symmetric_memory.symm_unavailable_reason("cuda:0", group=group) is None
    with pytest.raises(RuntimeError, match=r"ranks \[0, 1\] use cuda:0.*OVERLAPPING_DEVICES=1"):
        symmetric_memory.get_workspace(group, 4096, "cuda:0", tag="shared")
    monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    ws = symmetric_memory.get_workspace(group, 4096, "cuda:0", tag="shared")
    assert (ws.rank, ws.world_size, ws.device) == (1, 2, torch.device("cuda", 0))
    assert ("rendezvous", "gloo-on-one-gpu", 0) in fake_world.symm_mem.calls


# --- 4b. the handle's offset: the workspace must start its allocation ----------------------------


@pytest.mark.parametrize("offset", [None, 0])
def test_handle_at_the_start_of_its_allocation(fake_world, offset):
    fake_world.torch_release("2.13", offset=offset)
    group = FakeGroup(0, 2, devices=[0, 1], name=f"offset-{offset}")
    assert symmetric_memory.get_workspace(group, 4096, "cuda:0").nbytes == 4096


def test_handle_inside_a_larger_allocation_is_refused(fake_world):
    """torch's pool may place a tensor inside a block: the handle's pointers are then the block's
    and its signal pad is shared; using them as the workspace's would address the wrong bytes."""
    fake_world.torch_release("2.13", offset=8192)
    group = FakeGroup(0, 2, devices=[0, 1], name="offset-8192")
    with pytest.raises(RuntimeError, match=r"offset by rank: \[8192, 8192\].*IMPLICIT_POOL=0"):
        symmetric_memory.get_workspace(group, 4096, "cuda:0")


# --- 5. replaced CUDA workspaces stay alive with their group --------------------------------------


def test_replaced_cuda_workspace_is_kept_for_the_groups_life(fake_world):
    fake_world.torch_release("2.13")
    group = FakeGroup(0, 2, devices=[0, 1], name="grows")
    first = weakref.ref(symmetric_memory.get_workspace(group, 1000, "cuda:0", tag="grow"))
    second = weakref.ref(symmetric_memory.get_workspace(group, 1500, "cuda:0", tag="grow"))
    third = symmetric_memory.get_workspace(group, 8000, "cuda:0", tag="grow")
    gc.collect()
    # Peers' kernels may still use the replaced workspaces: nothing frees them yet.
    assert first() is not None and second() is not None
    assert first()._tensor.numel() == 1000
    # Growth at least doubles, so all that is kept is smaller than the newest.
    assert (second().nbytes, third.nbytes) == (2000, 8000)
    assert symmetric_memory.get_workspace(group, 3000, "cuda:0", tag="grow") is third
    del third, group
    gc.collect()
    assert first() is None and second() is None  # gone with the group


# --- the tensors' own device, not the current one -------------------------------------------------


def test_workspace_is_made_on_its_own_device(fake_world):
    symm_mem = fake_world.torch_release("2.13")
    assert fake_world.cuda.current == 0
    group = FakeGroup(0, 2, devices=[1, 0], name="on-cuda-1")
    ws = symmetric_memory.get_workspace(group, 4096, torch.device("cuda", 1), tag="dev")
    assert ws.device == torch.device("cuda", 1)
    made = [c for c in symm_mem.calls if c[0] in ("empty", "rendezvous")]
    assert made == [("empty", torch.device("cuda", 1), 1), ("rendezvous", "on-cuda-1", 1)]
    assert fake_world.cuda.current == 0  # the caller's current device is left as it was
    assert symmetric_memory._as_device("cuda") == torch.device(
        "cuda", 0
    )  # no index: the current device
    assert symmetric_memory._as_device("cuda:1") == torch.device("cuda", 1)
    assert symmetric_memory.symm_unavailable_reason("cuda:2") == (
        "cuda:2 does not exist: this process sees 2 GPUs"
    )


# --- 5. hosts of one NVLink domain: a GB200/GB300 NVL72 tray holds 4 GPUs, so TP=8 spans two ------

CLUSTER = "6f4a4bf1-07a0-79a1-939a-0a887f4bffa6"
OTHER_CLUSTER = "224467fd-15a8-f9eb-2bba-f6192ec16dbe"
TRAYS = ["tray-a"] * 4 + ["tray-b"] * 4


def _facts(**changes: Any) -> symmetric_memory.FabricFacts:
    """A GPU registered with the fabric as NVML reports it on an NVL72 (clique 3 of CLUSTER)."""
    fields = dict(
        state=3, status=0, cluster_uuid=CLUSTER, clique_id=3, handles=True, imex_channel=True
    )
    return symmetric_memory.FabricFacts(**{**fields, **changes})


def _two_trays(world: World, monkeypatch: pytest.MonkeyPatch, fabrics: list[Any]) -> FakeGroup:
    """torchrun on two trays of 4 GPUs (global ranks 0-3 on tray-a, 4-7 on tray-b), this process
    global rank 0; the group of all 8, whose rank r reports ``fabrics[r]``."""
    world.dist(rank=0, world_size=8)
    for name, value in (
        ("LOCAL_WORLD_SIZE", "4"),
        ("LOCAL_RANK", "0"),
        ("GROUP_WORLD_SIZE", "2"),
        ("GROUP_RANK", "0"),
    ):
        monkeypatch.setenv(name, value)
    world.fabric(fabrics[0])
    monkeypatch.setattr(symmetric_memory.socket, "gethostname", lambda: TRAYS[0])
    return FakeGroup(0, 8, hosts=TRAYS, devices=[0, 1, 2, 3] * 2, fabrics=fabrics)


def _torch_ops_reason(group: FakeGroup) -> str | None:
    """The question torch_symm_mem asks of a group (the same function as symm's)."""
    return symmetric_memory.group_unavailable_reason(
        group, torch.device("cuda", 0), "torch's ops", unknown_hosts_are_a_reason=True
    )


def test_two_trays_of_one_nvlink_domain_share_memory(fake_world, monkeypatch):
    fake_world.torch_release("2.13")
    group = _two_trays(fake_world, monkeypatch, [_facts()] * 8)
    assert symmetric_memory.symm_unavailable_reason("cuda:0", group=group) is None
    assert _torch_ops_reason(group) is None
    # The exchange agrees; the same GPU index on two trays is two GPUs, as torch counts them.
    ws = symmetric_memory.get_workspace(group, 4096, "cuda:0", tag="nvl72")
    assert (ws.rank, ws.world_size) == (0, 8)
    assert ("rendezvous", "fake", 0) in fake_world.symm_mem.calls
    # The CPU heap maps POSIX shared memory: one host, whatever the fabric.
    why = symmetric_memory.symm_unavailable_reason("cpu", group=group)
    assert why is not None and "the group has 8 ranks but only LOCAL_WORLD_SIZE=4" in why, why


def test_torch_symm_mem_counts_the_gpus_of_this_tray(fake_world, monkeypatch):
    """8 ranks, 4 GPUs seen here: on two trays of one domain no two ranks share a GPU."""
    from tp_kernels.backends import torch_symm_mem

    _two_trays(fake_world, monkeypatch, [_facts()] * 8)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert torch_symm_mem._shared_gpu_reason(FakeGroup(0, 8)) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # the 8 ranks on one host with 4 GPUs
    why = torch_symm_mem._shared_gpu_reason(FakeGroup(0, 8))
    assert why is not None and "8 ranks on this host share 4 GPU(s)" in why, why


@pytest.mark.parametrize(
    ("other", "named"),
    [
        (_facts(clique_id=7), f"clique 7 of cluster {CLUSTER}"),
        # The same clique id in another cluster is another domain (GB200 hosts of unrelated
        # racks report the same clique id; torch's own check compares the clique id alone).
        (_facts(cluster_uuid=OTHER_CLUSTER), f"clique 3 of cluster {OTHER_CLUSTER}"),
    ],
)
def test_different_nvlink_domains_are_named(fake_world, monkeypatch, other, named):
    fake_world.torch_release("2.13")
    group = _two_trays(fake_world, monkeypatch, [_facts()] * 4 + [other] * 4)
    # Locally, this GPU can join a domain: only the exchange can tell the peers' apart.
    assert symmetric_memory.symm_unavailable_reason("cuda:0", group=group) is None
    with pytest.raises(RuntimeError) as raised:
        symmetric_memory.get_workspace(group, 4096, "cuda:0")
    why = str(raised.value)
    assert "in different NVLink domains" in why, why
    assert f"ranks [0, 1, 2, 3] in clique 3 of cluster {CLUSTER}" in why, why
    assert f"ranks [4, 5, 6, 7] in {named}" in why, why
    assert f"the ranks run on {TRAYS}" in why, why
    assert fake_world.symm_mem.calls[-1][0] != "empty"  # refused before allocating


@pytest.mark.parametrize(
    ("facts", "said"),
    [
        (_facts(state=2), "NVLink fabric state 'in progress', not 'completed'"),
        (_facts(state=0), "NVLink fabric state 'not supported'"),
        (_facts(status=22), "registration failed (status 22)"),
        (_facts(cluster_uuid=str(uuid_module.UUID(int=0))), "a zero cluster UUID"),
        (_facts(handles=False), "CUDA reports no fabric handle support"),
        (_facts(handles=None), "cannot be asked (no libcuda)"),
        (_facts(imex_channel=False), "no IMEX channel in /dev/nvidia-caps-imex-channels"),
    ],
)
def test_a_gpu_that_cannot_join_a_domain(fake_world, monkeypatch, facts, said):
    """This rank's GPU: refused locally, with LOCAL_WORLD_SIZE's reason and the fabric's. A
    peer's GPU (rank 5): refused by the exchange, naming the rank and its host."""
    fake_world.torch_release("2.13")
    group = _two_trays(fake_world, monkeypatch, [facts] * 8)
    for why in (
        symmetric_memory.symm_unavailable_reason("cuda:0", group=group),
        _torch_ops_reason(group),
    ):
        assert why is not None and "only LOCAL_WORLD_SIZE=4 run on this host" in why, why
        assert "nor can cuda:0 join a multi-node NVLink domain: " in why and said in why, why
    group = _two_trays(fake_world, monkeypatch, [_facts()] * 5 + [facts] + [_facts()] * 2)
    assert symmetric_memory.symm_unavailable_reason("cuda:0", group=group) is None
    with pytest.raises(
        RuntimeError, match=f"not every GPU can join one: rank 5 \\(tray-b\\): .*{re.escape(said)}"
    ):
        symmetric_memory.get_workspace(group, 4096, "cuda:0")


def test_unknown_fabric_keeps_the_one_host_rule(fake_world, monkeypatch):
    """No NVML (or a driver before 550): what LOCAL_WORLD_SIZE proves stands, and the exchange
    refuses ranks on two hosts, as before fabrics were read."""
    fake_world.torch_release("2.13")
    unknown = "NVML cannot be asked about cuda:0 (OSError: libnvidia-ml.so.1: not found)"
    group = _two_trays(fake_world, monkeypatch, [unknown] * 8)
    why = symmetric_memory.symm_unavailable_reason("cuda:0", group=group)
    assert why is not None and "the group has 8 ranks but only LOCAL_WORLD_SIZE=4" in why, why
    assert unknown in why, why
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name)
    assert symmetric_memory.symm_unavailable_reason("cuda:0", group=group) is None
    why = _torch_ops_reason(group)  # without LOCAL_WORLD_SIZE, torch's ops are refused
    assert why is not None and "LOCAL_WORLD_SIZE is ''" in why and unknown in why, why
    with pytest.raises(RuntimeError, match="needs every rank on one host, or every rank in one"):
        symmetric_memory.get_workspace(group, 4096, "cuda:0")


def test_torch_before_fabric_handles(fake_world, monkeypatch):
    """torch 2.7 and 2.8 map peers over file descriptors only: one host, whatever the driver."""
    from torch.torch_version import TorchVersion

    fake_world.torch_release("2.8")
    monkeypatch.setattr(symmetric_memory.torch, "__version__", TorchVersion("2.8.0"))
    group = _two_trays(fake_world, monkeypatch, [_facts()] * 8)
    why = symmetric_memory.symm_unavailable_reason("cuda:0", group=group)
    assert why is not None and "exchanges fabric handles from torch 2.9 on" in why, why


def test_the_real_reader_says_why_it_cannot_read(monkeypatch):
    """On a machine without a GPU or NVML the driver's reader answers with a reason, not an
    error (the fakes above replace it; this is the real one)."""
    read = symmetric_memory.read_fabric_facts.__wrapped__
    got = read(0)
    if not isinstance(got, str):  # a GPU with NVML: whatever it reports is well formed
        assert isinstance(got, symmetric_memory.FabricFacts), got
        uuid_module.UUID(got.cluster_uuid)
