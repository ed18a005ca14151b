"""The GPU tests: skipped where they cannot run, else one NCCL world per pytest session.

They run under torchrun with one rank per GPU, every rank running this same pytest session::

    torchrun --nproc-per-node $(nvidia-smi -L | wc -l) -m pytest tests/gpu -m gpu

A test marked ``gpu`` in this folder is skipped, at collection and without touching CUDA or
importing Triton, when this process sees no CUDA device, and also when it needs the ``nccl``
world but was not started by a launcher (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT`` unset). So the default CPU run reports them as skipped.

Lockstep: every rank must run the same tests, in the same order, making the same collectives.
The ``nccl`` fixture checks that the ranks selected the same tests, decides backend availability
once for all ranks, and :meth:`NcclWorld.check` gathers every rank's mismatches so all ranks pass
or fail a test together. Nothing waits forever: the ops' cross-rank argument check (forced on)
makes ranks that disagree raise together, a symm wait ends at its deadline
(``TP_KERNELS_TIMEOUT_S``, 300 s by default), and past the process group's timeout NCCL's
watchdog ends a stuck rank, and torchrun the others.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
COMMAND = "torchrun --nproc-per-node $(nvidia-smi -L | wc -l) -m pytest tests/gpu -m gpu"
# Longer than any one collective or wait of these tests (compiling and tuning a kernel on
# one rank while its peers wait included); past it, a stuck rank is ended, not waited for.
PG_TIMEOUT_S = 600.0


def no_cuda_reason() -> str | None:
    """Why this process cannot run CUDA tests at all, or None."""
    if not torch.cuda.is_available():
        return (
            f"no CUDA device: torch {torch.__version__} sees none (torch.cuda.is_available() is "
            "False); the gpu tests need CUDA GPUs"
        )
    return None


def no_world_reason() -> str | None:
    """Why this process cannot join an NCCL world of every GPU, or None."""
    reason = no_cuda_reason()
    if reason is not None:
        return reason
    if not dist.is_nccl_available():
        return f"torch {torch.__version__} was built without NCCL"
    missing = [v for v in LAUNCHER_VARS if v not in os.environ]
    if missing:
        return f"not started by torchrun ({', '.join(missing)} unset); run `{COMMAND}`"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("gpu") is None or not item.path.is_relative_to(HERE):
            continue
        reason = no_world_reason() if "nccl" in item.fixturenames else no_cuda_reason()
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def cuda_device() -> torch.device:
    """This rank's GPU: ``cuda:LOCAL_RANK`` under a launcher, else the current device."""
    reason = no_cuda_reason()
    if reason is not None:
        pytest.skip(reason)
    index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
    if index >= torch.cuda.device_count():
        raise RuntimeError(
            f"LOCAL_RANK={index}, but this process sees {torch.cuda.device_count()} GPUs "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); start one rank "
            "per GPU"
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


@dataclass
class NcclWorld:
    """The default process group (NCCL, one rank per GPU) and what its ranks agreed on.

    ``backends``: ``{name: "ok" or why not}``, ``"ok"`` only when every rank's
    ``tp_kernels.available_backends(device)`` says so.
    """

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup
    backends: dict[str, str]

    def require(self, backend: str) -> None:
        """Skip the calling test (on every rank alike) unless ``backend`` runs on all ranks."""
        if self.backends[backend] != "ok":
            pytest.skip(f"backend {backend!r} cannot run on CUDA here: {self.backends[backend]}")

    def gather(self, obj: object) -> list:
        """``obj`` of every rank, in rank order (a collective)."""
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def check(self, failures: list[str]) -> None:
        """Fail on every rank if any rank has ``failures``, listing all ranks' lines."""
        lines = [f"rank {r}: {f}" for r, fs in enumerate(self.gather(failures)) for f in fs]
        assert not lines, f"{len(lines)} mismatches:\n" + "\n".join(lines[:60])


def _agreed_backends(world: NcclWorld, mine: dict[str, str]) -> dict[str, str]:
    every = world.gather(mine)
    agreed = {}
    for name in mine:
        why = {r: status[name] for r, status in enumerate(every) if status[name] != "ok"}
        agreed[name] = "ok" if not why else "; ".join(f"rank {r}: {w}" for r, w in why.items())
    return agreed


@pytest.fixture(scope="session")
def nccl(request: pytest.FixtureRequest, cuda_device: torch.device) -> Iterator[NcclWorld]:
    """Join the NCCL world of the launcher's ranks for the whole session (see the module doc)."""
    reason = no_world_reason()
    if reason is not None:
        pytest.skip(reason)
    import tp_kernels

    with pytest.MonkeyPatch.context() as mp:
        # Ranks that call with different arguments then raise together instead of hanging.
        mp.setenv("TP_KERNELS_CHECK_CONSISTENCY", "1")
        dist.init_process_group(
            "nccl", device_id=cuda_device, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S)
        )
        try:
            world = NcclWorld(
                dist.get_rank(), dist.get_world_size(), cuda_device, dist.group.WORLD, {}
            )
            selected = [i.nodeid for i in request.session.items if i.get_closest_marker("gpu")]
            orders = world.gather(selected)
            if any(order != selected for order in orders):
                raise RuntimeError(
                    "the ranks selected different gpu tests, so their collectives would not "
                    f"match; run the same command on every rank. By rank: {orders}"
                )
            world.backends = _agreed_backends(world, tp_kernels.available_backends(cuda_device))
            yield world
            # No rank frees its symmetric buffers while a peer may still read them.
            dist.barrier()
        finally:
            dist.destroy_process_group()
