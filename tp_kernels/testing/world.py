"""Local multi-process worlds: start ``world_size`` ranks once, run many functions on them.

A :class:`LocalWorld` spawns one process per rank, each joined into a ``torch.distributed`` process
group (gloo on the CPU), and then serves calls: ``world.run(fn, *args)`` runs ``fn(*args)`` on every
rank and returns the per-rank results in rank order. The tests keep one world per world size for a
whole session; the benchmarks and the example use one for a single job.

Nothing waits forever: every call has a deadline. When a rank raises, the error names the rank and
carries its traceback; when a rank does not answer in time (a hang in a collective, a crash), the
whole world is torn down, since its process group can no longer be trusted, and the next
:meth:`LocalWorld.run` starts a fresh one.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = ["LocalWorld", "RankError", "free_port"]


class RankError(RuntimeError):
    """A function failed (raised, crashed or timed out) on one or more ranks of a local world."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    threads: int,
    pg_timeout_s: float,
    env: dict[str, str],
    tasks: mp.Queue,
    results: mp.Queue,
) -> None:
    # A rank that hangs prints every thread's stack on SIGUSR1, which _fail sends before it
    # stops the world: the one clue to where a hang was.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
    except BaseException:
        results.put((rank, -1, False, traceback.format_exc()))
        return
    results.put((rank, -1, True, None))
    while True:
        item = tasks.get()
        if item is None:
            break
        call_id, fn, args, kwargs = item
        try:
            out = (True, fn(*args, **kwargs))
        except BaseException:
            out = (False, traceback.format_exc())
        # Pickled here, not by the queue's feeder thread, which would only log a result that
        # cannot be pickled and leave the caller waiting for it until the deadline.
        try:
            payload = ForkingPickler.dumps(out[1])
        except Exception:
            out = (False, f"the result of the call cannot be pickled:\n{traceback.format_exc()}")
            payload = ForkingPickler.dumps(out[1])
        results.put((rank, call_id, out[0], bytes(payload)))
    dist.destroy_process_group()


class LocalWorld:
    """``world_size`` local ranks in one process group, reused across calls.

    Args:
        world_size: number of ranks (processes) to start.
        backend: ``torch.distributed`` backend of the group; ``"gloo"`` on a CPU machine.
        threads: ``torch.set_num_threads`` of each rank (ranks share the machine's cores).
        timeout_s: default deadline of one :meth:`run`, in seconds.
        env: extra environment variables set in every rank before torch is imported.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        threads: int = 1,
        timeout_s: float = 120.0,
        env: dict[str, str] | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self.threads = threads
        self.timeout_s = timeout_s
        self.env = dict(env or {})
        self._procs: list[mp.process.BaseProcess] = []
        self._calls = 0

    def __enter__(self) -> LocalWorld:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        if self.alive:
            return
        self.close()
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        # One result queue per rank: a rank killed while writing cannot block the others' results.
        self._results = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        # The group's own timeout bounds a rank stuck in a collective whose peer died; the
        # deadline of run() bounds everything else.
        pg_timeout = max(30.0, self.timeout_s)
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    self.world_size,
                    port,
                    self.backend,
                    self.threads,
                    pg_timeout,
                    self.env,
                    self._tasks[r],
                    self._results[r],
                ),
                daemon=True,
                name=f"tp_kernels-rank{r}",
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect(-1, timeout_s=120.0, what="process group init")

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float | None = None,
        may_exit: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` must be picklable (a module-level function). Raises :class:`RankError` naming each
        failing rank with its traceback, or the ranks that missed the deadline. With
        ``may_exit=True`` (fault-injection tests) a rank whose process exits gives ``None``
        instead, once every other rank has answered; the next run starts a fresh world.
        """
        self.start()
        self._calls += 1
        for q in self._tasks:
            q.put((self._calls, fn, args, kwargs))
        name = getattr(fn, "__qualname__", repr(fn))
        timeout = timeout_s or self.timeout_s
        return self._collect(self._calls, timeout_s=timeout, what=name, may_exit=may_exit)

    def _collect(
        self, call_id: int, *, timeout_s: float, what: str, may_exit: bool = False
    ) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(results) + len(errors) < self.world_size:
            got_any = False
            for rank, q in enumerate(self._results):
                if rank in results or rank in errors:
                    continue
                try:
                    _, cid, ok, value = q.get_nowait()
                except queue.Empty:
                    continue
                if isinstance(value, bytes):  # a call's result, pickled by the rank
                    value = ForkingPickler.loads(value)
                got_any = True
                if cid != call_id:  # a late answer to an earlier, already failed call
                    continue
                if ok:
                    results[rank] = value
                else:
                    errors[rank] = value
                    # The other ranks may be blocked in a collective with the failed one: give
                    # them a short grace period, then tear the world down.
                    deadline = min(deadline, time.monotonic() + 10.0)
            if got_any:
                continue
            missing = sorted(set(range(self.world_size)) - results.keys() - errors.keys())
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            if may_exit and not errors and missing and set(missing) <= set(dead):
                results.update(dict.fromkeys(missing))
                break
            if time.monotonic() > deadline or (dead and errors) or set(missing) <= set(dead):
                self._fail(what, errors, missing, dead, timeout_s)
            time.sleep(0.002)
        if errors:
            self._fail(what, errors, [], [], timeout_s)
        return [results[r] for r in range(self.world_size)]

    def _fail(
        self,
        what: str,
        errors: dict[int, str],
        missing: list[int],
        dead: list[int],
        timeout_s: float,
    ) -> None:
        hung = [r for r in missing if r not in errors and r not in dead]
        for rank in hung:
            with contextlib.suppress(Exception):
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        if hung:
            time.sleep(1.0)  # for the stacks to be written
        self.close()
        parts = [f"{what} failed in a local world of {self.world_size} ranks"]
        for rank in sorted(errors):
            parts.append(f"--- rank {rank} raised:\n{errors[rank]}")
        silent = [r for r in missing if r not in errors]
        if silent:
            crashed = [r for r in silent if r in dead]
            if crashed:
                parts.append(
                    f"--- ranks {crashed} exited without answering (a crash: see their "
                    f"stderr above)"
                )
            if hung:
                parts.append(
                    f"--- ranks {hung} gave no answer within {timeout_s:.0f} s (hung): their "
                    "stacks are in stderr above"
                )
        raise RankError("\n".join(parts))

    def close(self) -> None:
        procs, self._procs = self._procs, []
        if not procs:
            return
        for p, q in zip(procs, self._tasks):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:
                    pass
        deadline = time.monotonic() + 5.0
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
