"""The GPU checks' one driver: local ranks that share one device, a row run on every rank within
its deadline, and a rank's failure told in a line.

``gpu_check``'s per-op rows (:mod:`tp_kernels.bench.fused_rows`) and capture rows
(:mod:`tp_kernels.bench.capture_check`) and ``overlap``'s probe, MPS and local-peer runs
(:mod:`tp_kernels.bench.overlap`) run on worlds started here (:class:`Ranks`); ``gpu_kernels`` and
the calibration take their device from here (:func:`device_ready`, :func:`rank_device`). Every
one of them times by :mod:`tp_kernels.bench.protocol` and prints its table by
:func:`~tp_kernels.bench.protocol.render_table`.

Ranks that share one GPU: their process group is gloo, since NCCL refuses two ranks on one
device; every rank works on ``cuda:0`` and has ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``
(:data:`SHARED_GPU_ENV`). They are time-sliced on the GPU, unless they run under an MPS daemon
(:class:`MpsDaemon`): then they share its SMs at once, each limited to an equal share. On
``--device cpu`` the ranks work on CPU tensors with ``TRITON_INTERPRET=1`` set before Triton is
first imported.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tp_kernels.testing import LocalWorld, RankError

__all__ = [
    "SHARED_GPU_ENV",
    "MpsDaemon",
    "Ranks",
    "RowRun",
    "device_ready",
    "error_tail",
    "exit_status",
    "rank_device",
    "run_row",
    "summarize_rank_error",
]

# CUDA symmetric memory refuses two ranks on one device unless this is set.
SHARED_GPU_ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}


def rank_device(kind: str) -> torch.device:
    """The device a rank of a one-GPU check works on: ``cuda:0``, shared by every rank, or the
    CPU."""
    if kind == "cuda":
        torch.cuda.set_device(0)  # every rank shares the one GPU
        return torch.device("cuda", 0)
    return torch.device("cpu")


def device_ready(parser: argparse.ArgumentParser, device: str, *, interpreted_cpu: bool) -> bool:
    """Whether this process can run its check on ``device`` (``"cuda"`` or ``"cpu"``): False when
    there is no CUDA device (the caller says so and exits 0). Exits 2 (``parser.error``) where
    ``TRITON_INTERPRET`` contradicts the device: set on CUDA (the interpreter runs no CUDA tensor,
    and ranks would inherit it), unset on a CPU run of kernels in this process
    (``interpreted_cpu``: the interpreter is chosen when Triton is first imported)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if device == "cpu":
        if interpreted_cpu and not interpret:
            parser.error(
                "--device cpu runs the kernels in Triton's interpreter: set "
                "TRITON_INTERPRET=1 before starting"
            )
        return True
    if not torch.cuda.is_available():
        return False
    if interpret:
        parser.error(
            "TRITON_INTERPRET=1 is set, and the interpreter cannot run CUDA tensors: unset it to "
            "use the GPU"
        )
    return True


class MpsDaemon:
    """An MPS control daemon of the check's own (its pipe and log directories in a temporary
    directory), started and stopped within ``timeout_s`` each; no GPU setting changes."""

    def __init__(self, control: str, timeout_s: float) -> None:
        self._control, self._timeout_s = control, timeout_s
        self._dir = Path(tempfile.mkdtemp(prefix="tp_kernels_mps_"))
        self.env = {
            "CUDA_MPS_PIPE_DIRECTORY": str(self._dir / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(self._dir / "log"),
        }
        for path in self.env.values():
            Path(path).mkdir()

    def _call(self, args: list[str], text: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self._control, *args], input=text, env={**os.environ, **self.env},
            capture_output=True, text=True, timeout=self._timeout_s, check=False,
        )  # fmt: skip

    def start(self) -> str | None:
        """Start the daemon; ``None`` when it runs, else why not."""
        try:
            done = self._call(["-d"])
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{self._control} -d: {exc}"
        if done.returncode != 0:
            return f"{self._control} -d exited {done.returncode}: {done.stderr.strip()}"
        return None

    def stop(self) -> str:
        """Stop the daemon (``quit``) and remove its directories; says how it went."""
        try:
            done = self._call([], "quit\n")
            said = f"quit: exit {done.returncode}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            said = f"quit failed: {exc}"
        shutil.rmtree(self._dir, ignore_errors=True)
        return said


@dataclass(frozen=True)
class Ranks:
    """How a check's local ranks start: on ``device`` (``"cuda"``: all on ``cuda:0``; ``"cpu"``),
    each run on them within ``timeout_s`` (compiling included), symm's signal waits within
    ``symm_timeout_s`` (None: tp_kernels' own), ``cuda_max_connections`` hardware queues per rank
    (None: the driver's, 8), and under the MPS daemon ``mps`` (None: time-sliced)."""

    device: str
    timeout_s: float
    symm_timeout_s: float | None = None
    cuda_max_connections: int | None = None
    mps: MpsDaemon | None = None

    def env(self, world_size: int | None = None) -> dict[str, str]:
        """What the ranks' environment sets; with ``world_size`` on CUDA also how many ranks
        share the GPU (under MPS: each rank's share of its SMs)."""
        env: dict[str, str] = {}
        if self.symm_timeout_s is not None:
            env["TP_KERNELS_TIMEOUT_S"] = f"{self.symm_timeout_s:g}"
        if self.mps is not None and world_size is not None:
            # The ranks reach the daemon by its pipe directory; each gets an equal share of SMs.
            env.update(self.mps.env)
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(100 // world_size)
        if self.device == "cuda":
            env.update(SHARED_GPU_ENV)
            if self.cuda_max_connections is not None:
                # Fewer hardware queues than streams: a stream wait stalls the streams that share
                # its queue (1, as Megatron-style TP overlap sets it, puts every stream in one).
                env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(self.cuda_max_connections)
            if world_size is not None:
                # Every rank on cuda:0, however many GPUs the machine has: each persistent GEMM
                # takes its share of the SMs (config.shared_device_ranks would guess from the
                # GPU count).
                env["TP_KERNELS_SHARED_DEVICE_RANKS"] = str(world_size)
        else:
            # Before Triton is first imported in the rank: the interpreter is chosen at import.
            env["TRITON_INTERPRET"] = "1"
        return env

    def world(self, world_size: int) -> LocalWorld:
        """A world of ``world_size`` local gloo ranks, started on its first run; the caller
        closes it."""
        return LocalWorld(world_size, timeout_s=self.timeout_s, env=self.env(world_size))


@dataclass
class RowRun:
    """One row run on every rank: what each rank returned, or (``per_rank`` None) every failed
    rank's story, and how long it took."""

    per_rank: list[Any] | None
    error: str
    seconds: float


def run_row(
    world: LocalWorld, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None
) -> RowRun:
    """``fn(*args)`` on every rank of ``world`` within its deadline (``timeout_s``, else the
    world's). A rank that raises, crashes or misses the deadline fails the row, not the check: the
    world is torn down (its next run starts a fresh one) and the error's text is returned."""
    started = time.perf_counter()
    try:
        per_rank, error = world.run(fn, *args, timeout_s=timeout_s), ""
    except RankError as exc:
        per_rank, error = None, str(exc)
    return RowRun(per_rank, error, time.perf_counter() - started)


def summarize_rank_error(text: str) -> str:
    """The last line of each rank's traceback (deduplicated) and the hung or crashed ranks, from
    the message of a :class:`~tp_kernels.testing.RankError`."""
    found: list[str] = []
    blocks = text.split("\n--- ")
    for block in blocks[1:]:
        head, _, body = block.partition("\n")
        if head.endswith("raised:"):
            lines = [line for line in body.splitlines() if line.strip()]
            last = lines[-1].strip() if lines else "(no traceback)"
            line = f"{head[: -len(' raised:')]}: {last}"
        else:
            line = head
        if line.split(": ", 1)[-1] not in [f.split(": ", 1)[-1] for f in found]:
            found.append(line)
    return "; ".join(found) or text.splitlines()[0]


def error_tail(text: str, lines: int = 14) -> str:
    """The first failing rank's traceback in a :class:`~tp_kernels.testing.RankError`'s message,
    its last ``lines`` lines, indented."""
    first = text.split("\n--- ")
    body = first[1] if len(first) > 1 else text
    kept = body.splitlines()[-lines:]
    return "\n".join("      " + line for line in kept)


def exit_status(failed: Sequence[str], tables: str = "the table above") -> int:
    """A check's exit status: 0 when ``failed`` (what failed) is empty, else 1, said on stderr
    with where to read why (``tables``)."""
    if failed:
        print(f"ERROR: checks failed for {list(failed)}; see {tables}", file=sys.stderr)
        return 1
    return 0
