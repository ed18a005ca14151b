"""``backend="auto"``: rule out what cannot win, then time what is left, once per shape class.

For one call of an op (shapes as in ``backends/base.py``) on a group of ``W`` ranks:

1. **Candidates.** The backends that can run for the group and device, in the order of
   preference ``torch_symm_mem`` (CUDA only), ``symm``, ``pipelined``, ``reference``; a group of
   one takes ``reference`` (nothing to overlap). Ruled out: ``pipelined`` below one block of
   :data:`tp_kernels.tiling.MIN_TRANSFER_BLOCK_BYTES` per rank (per-message latency would
   dominate).
2. **Untimed choice**: the first candidate. It is what a call uses while its shape class has not
   been timed (under ``torch.compile``, or with ``TP_KERNELS_AUTO_TIMING=0``). It depends on
   nothing measured, so every rank makes the same one.
3. **Timed choice** (eager, ``W > 1``, two candidates or more): on the first call of a shape
   class, the ranks agree on the largest of their predictions from :mod:`tp_kernels.cost` for this
   device and rule out every candidate predicted over :data:`RULE_OUT` times the best (the
   model's efficiencies are assumptions, so only a wide margin rules out) and, on CUDA, every
   fused one when the model predicts none of them faster than ``reference``; then every rank runs
   each remaining candidate :data:`WARMUP` + :data:`ROUNDS` times, interleaved round by
   round, without autograd; each rank takes its median per candidate; one all-reduce (max) gives
   the slowest rank's median, so all ranks see the same numbers and pick the same winner: the
   first candidate within :data:`MARGIN` of the fastest. The choice is kept for the process and
   logged at INFO on the ``tp_kernels`` logger, the model's prediction beside each measurement.
4. **Under CUDA graph capture** nothing is timed: a call reuses the plan its warmup made. Where
   that backend cannot be captured for the call, the call takes the next of :func:`ranking` that
   can (the winner, the other timed candidates fastest first, then those the model ruled out, in
   the order of preference; the untimed order where nothing was timed): the same numbers on every
   rank, so the same fallback.

A shape class is (op, group, device type, dtype, number of right-hand matrices) and the power-of-
two classes of the sizes every rank shares: ``m`` (rows per rank) and ``K`` for an all-gather-
matmul, ``m`` and ``N`` for a matmul-reduce-scatter (a colwise weight's ``N`` and a rowwise
weight's ``K`` may differ by rank when uneven); shapes within a factor of two of each other share
a choice. On CUDA the timing synchronizes the
device around each call; that happens once per shape class, never on the steady-state path.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tp_kernels import config, cost, deadline, tiling

logger = logging.getLogger("tp_kernels")

PREFERENCE = ("torch_symm_mem", "symm", "pipelined", "reference")
RULE_OUT = 2.0
WARMUP = 1
ROUNDS = 5
# A later candidate must beat an earlier one by this factor to be chosen over it: a few calls on
# a shared machine vary by more than a few percent, and the order of preference is the better
# guess where the measurements cannot tell the candidates apart.
MARGIN = 1.05


@dataclass(frozen=True)
class Shape:
    """One call as ``auto`` sees it: ``m`` rows per rank, ``k`` the reduction dim, ``ns`` the
    right-hand matrices' widths (an all-gather-matmul's ``N_j``; a matmul-reduce-scatter's one
    ``N``). The cost model needs each width: a GEMM's waves of tiles depend on its own ``N_j``,
    so Llama-3 70B's QKV (wq 8x wider than wk and wv) is not three GEMMs of a third each."""

    op: str
    m: int
    k: int
    ns: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def n(self) -> int:
        """The output columns, summed over the right-hand matrices."""
        return sum(self.ns)

    @property
    def num_bs(self) -> int:
        """How many right-hand matrices."""
        return len(self.ns)

    @classmethod
    def of_all_gather_matmul(cls, a_shard: torch.Tensor, bs: list[torch.Tensor]) -> Shape:
        """``a_shard`` [..., K] (any leading dims: its rows), ``bs[j]`` [K, N_j]."""
        k = a_shard.shape[-1]
        m = a_shard.numel() // k
        ns = tuple(b.shape[1] for b in bs)
        return cls("all_gather_matmul", m, k, ns, a_shard.dtype, a_shard.device)

    @classmethod
    def of_matmul_reduce_scatter(cls, a: torch.Tensor, b: torch.Tensor, world: int) -> Shape:
        """``a`` [..., K] (its rows: ``W*m``), ``b`` [K, N]."""
        k = a.shape[-1]
        m = a.numel() // k // world
        return cls("matmul_reduce_scatter", m, k, (b.shape[1],), a.dtype, a.device)

    def key(self, group: dist.ProcessGroup) -> tuple:
        # Only the sizes every rank shares: a colwise weight's N (all-gather) and a rowwise
        # weight's K (reduce-scatter) may differ by rank when they do not divide evenly, and
        # ranks that disagreed on whether a class is timed would not meet in the timing.
        shared = (self.m, self.k) if self.op == "all_gather_matmul" else (self.m, self.n)
        classes = tuple(x.bit_length() for x in shared)
        return (self.op, group.group_name, self.device.type, self.dtype, self.num_bs, classes)

    def rows_bytes(self, world: int) -> int:
        """Bytes of one rank's block that a peer receives (its shard, or one partial block)."""
        width = self.k if self.op == "all_gather_matmul" else self.n
        return self.m * width * self.dtype.itemsize


@dataclass(frozen=True)
class Candidates:
    """The backends worth trying, best first, and why the others are not."""

    names: tuple[str, ...]
    ruled_out: dict[str, str]
    predicted_s: dict[str, float]


_timed: dict[tuple, str] = {}
# shape class -> every candidate that can run, best first (see ranking()).
_ranked: dict[tuple, tuple[str, ...]] = {}
_logged: set[tuple] = set()


def timing_enabled() -> bool:
    """``TP_KERNELS_AUTO_TIMING`` (default 1): ``0`` keeps ``auto`` to its untimed choice."""
    return config.AUTO_TIMING.get()


def candidates(
    shape: Shape, group: dist.ProcessGroup, unavailable: Callable[[str], str | None]
) -> Candidates:
    """The backends that can run for this call, best first (step 1 of the module docstring,
    before the model: what is left here is the same on every rank of a uniform group);
    ``unavailable(name)`` says why a backend cannot run here, or ``None``."""
    if group.size() == 1:
        return Candidates(("reference",), {"*": "world size 1: there is nothing to overlap"}, {})
    ruled_out: dict[str, str] = {}
    names = []
    for name in PREFERENCE:
        if name == "torch_symm_mem" and shape.device.type != "cuda":
            continue  # PyTorch's symmetric-memory ops run on CUDA only; not worth a probe
        why = unavailable(name)
        if why is None:
            names.append(name)
        else:
            ruled_out[name] = f"unavailable: {why}"
    block = shape.rows_bytes(group.size())
    if "pipelined" in names and block < tiling.MIN_TRANSFER_BLOCK_BYTES:
        names.remove("pipelined")
        ruled_out["pipelined"] = (
            f"the {block} B per-rank block is below {tiling.MIN_TRANSFER_BLOCK_BYTES} B, too small "
            "to pipeline"
        )
    return Candidates(tuple(names), ruled_out, {})


def _agreed_max(values: list[float], group: dist.ProcessGroup, device: torch.device) -> list[float]:
    """The element-wise maximum of ``values`` over the ranks of ``group`` (one all-reduce)."""
    local = torch.tensor(values, dtype=torch.float64)
    if "nccl" in str(dist.get_backend(group)):
        local = local.to(device)
    deadline.complete(
        lambda: dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group, async_op=True),
        group,
        "auto backend choice",
    )
    return local.cpu().tolist()


def _ruled_out_by_model(shape: Shape, group: dist.ProcessGroup, found: Candidates) -> Candidates:
    """``found`` less what the model rules out. Predictions from a measured device (the CPU)
    differ a little from rank to rank, so the ranks first agree on the largest of each."""
    local = _predicted_s(shape, group.size())
    if not local:
        return found
    predicted = dict(
        zip(found.names, _agreed_max([local[n] for n in found.names], group, shape.device))
    )
    best = min(predicted.values())
    names, ruled_out = [], dict(found.ruled_out)
    # On CUDA the model simulates the schedules as built: where no fused one beats the unfused
    # one, fusion is ruled out (on a CPU its latencies are estimates, so the timing decides).
    unfused = predicted.get("reference")
    fused = [predicted[n] for n in found.names if n != "reference"]
    no_fusion = (
        shape.device.type == "cuda"
        and unfused is not None
        and bool(fused)
        and min(fused) >= unfused
    )
    for name in found.names:
        if no_fusion and name != "reference":
            ruled_out[name] = (
                f"the model predicts {predicted[name] * 1e3:.3g} ms, no fused backend beating "
                f"reference's {unfused * 1e3:.3g} ms"
            )
        elif predicted[name] > RULE_OUT * best:
            ruled_out[name] = (
                f"the model predicts {predicted[name] * 1e3:.3g} ms, over {RULE_OUT}x the best "
                f"{best * 1e3:.3g} ms"
            )
        else:
            names.append(name)
    return Candidates(tuple(names), ruled_out, predicted)


def _predicted_s(shape: Shape, world: int) -> dict[str, float]:
    spec = cost.device_spec(shape.device)
    dtype = cost.DTYPE_NAMES.get(shape.dtype)
    if spec is None or dtype is None:
        return {}
    # An uneven split's empty shard as one column: the model needs widths >= 1, and this rank
    # must still predict, to meet its peers in the agreement that follows.
    ns = tuple(max(n, 1) for n in shape.ns)
    return cost.op_cost(shape.op, shape.m, shape.k, sum(ns), world, dtype, spec, ns=ns).backends_s


def cached_choice(shape: Shape, group: dist.ProcessGroup) -> str | None:
    """The timed winner of this shape class, if it has been timed in this process."""
    return _timed.get(shape.key(group))


def ranking(shape: Shape, group: dist.ProcessGroup) -> tuple[str, ...] | None:
    """The candidates of this shape class best first, as its timing left them (step 4 of the
    module docstring); None if it was not timed in this process."""
    return _ranked.get(shape.key(group))


def log_once(shape: Shape, group: dist.ProcessGroup, chosen: str, why: str) -> None:
    """Log ``auto``'s choice at INFO, once per (shape class, choice)."""
    key = (*shape.key(group), chosen)
    if key in _logged:
        return
    _logged.add(key)
    logger.info(
        "auto backend for %s on group %s (%s %s, m=%d K=%d N=%d): %s, because %s",
        shape.op,
        group.group_name,
        shape.device.type,
        shape.dtype,
        shape.m,
        shape.k,
        shape.n,
        chosen,
        why,
    )


def time_and_choose(
    shape: Shape,
    group: dist.ProcessGroup,
    found: Candidates,
    run: Callable[[str], None],
) -> str:
    """Steps 1 (the model) and 3 of the module docstring: rule out what the model says cannot win,
    time ``run(name)`` for every other candidate on every rank, agree on the slowest rank's
    medians, keep and log the winner. Collective: every rank of ``group`` must call it for the
    same shape class with the same candidates."""
    with deadline.fused_call(group, shape.op, "forward"):
        return _time_and_choose(shape, group, found, run)


def _time_and_choose(
    shape: Shape, group: dist.ProcessGroup, found: Candidates, run: Callable[[str], None]
) -> str:
    runnable = found.names
    found = _ruled_out_by_model(shape, group, found)
    names = found.names
    if len(names) == 1:
        why = "the only candidate the model leaves"
        return _keep(shape, group, names[0], why, found, names + _rest(runnable, names))
    samples: dict[str, list[float]] = {name: [] for name in names}
    sync = torch.cuda.synchronize if shape.device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        for round_ in range(WARMUP + ROUNDS):
            for name in names:
                sync()
                start = time.perf_counter()
                run(name)
                sync()
                if round_ >= WARMUP:
                    samples[name].append(time.perf_counter() - start)
    slowest = _agreed_max([statistics.median(samples[n]) for n in names], group, shape.device)
    best = min(slowest)
    winner = next(n for n, t in zip(names, slowest) if t <= MARGIN * best)
    model = found.predicted_s
    measured = ", ".join(
        f"{n} {t * 1e3:.3g} ms" + (f" (model {model[n] * 1e3:.3g} ms)" if model else "")
        for n, t in zip(names, slowest)
    )
    why = f"timed fastest on the slowest rank: {measured}"
    timed = sorted(names, key=lambda n: (n != winner, slowest[names.index(n)]))
    return _keep(shape, group, winner, why, found, (*timed, *_rest(runnable, timed)))


def _rest(runnable: tuple[str, ...], ranked: Sequence[str]) -> tuple[str, ...]:
    """The candidates of ``runnable`` not in ``ranked``, in ``runnable``'s order (of preference)."""
    return tuple(n for n in runnable if n not in ranked)


def _keep(
    shape: Shape,
    group: dist.ProcessGroup,
    winner: str,
    why: str,
    found: Candidates,
    ranked: tuple[str, ...],
) -> str:
    _timed[shape.key(group)] = winner
    _ranked[shape.key(group)] = ranked
    if found.ruled_out:
        why += "; ruled out: " + "; ".join(f"{n} ({w})" for n, w in found.ruled_out.items())
    log_once(shape, group, winner, why)
    return winner
