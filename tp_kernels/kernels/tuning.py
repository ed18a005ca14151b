"""Each tuned kernel's config, chosen per shape on this rank alone, kept in memory and on disk.

The fused calls' kernels wait for their peers (barriers, progress words, slot words), so a config
is never chosen by timing the call's own launch, as ``triton.autotune`` would: the timed kernel
could spin on a peer that is itself still compiling, and every wait's deadline would count that
time. A launcher instead asks :func:`choose` before its call's first cross-rank wait. On a shape
the process has not seen, it compiles every candidate and times it (the median of a few runs) on
a *rank-local problem*: the call's own operands, with every word the kernel would wait for
raised in a local scratch vector, so no run waits for anything and nothing crosses the link.
The run that compiles a config has the specialization of the real launch (the same tensors and
scalars), so the call's own launch finds its kernel compiled.

The choice is kept for the process and, on a GPU, in a JSON file per device model, Triton and
torch version under :data:`tp_kernels.config.TUNING_CACHE` (default
``~/.cache/tp_kernels/tuning``; ``0``: memory only), so the next process starts tuned: a choice
found there compiles only the chosen config. The first call of each shape logs once, at INFO on
the ``tp_kernels`` logger, what it compiled, how long compiling and timing took, and what it
chose. A peer waiting for this rank meanwhile is told not to count it (the ``symm`` backend runs
the choice inside :func:`tp_kernels.deadline.local_work`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import triton
from triton.runtime.errors import OutOfResources

from tp_kernels import config
from tp_kernels.kernels._shared import INTERPRET

__all__ = ["choose", "forget"]

_log = logging.getLogger("tp_kernels")
# Runs of each candidate timed on the rank-local problem after its compiling run; the median
# decides. A few suffice: the configs differ by 10% and more where they differ at all.
_TIMED_RUNS = 5

# (kernel, key) -> the chosen config, for this process.
_chosen: dict[tuple[str, tuple], triton.Config] = {}


def forget() -> None:
    """Drop every choice this process made or loaded (tests; the disk file stays)."""
    _chosen.clear()


def choose(
    kernel: str,
    key: tuple,
    configs: Sequence[triton.Config],
    run: Callable[[triton.Config], None],
    device: torch.device,
) -> triton.Config:
    """The config of ``kernel`` for the shape ``key`` (plain values: ints, strings), from
    ``configs``: this process's earlier choice, else the disk's, else the fastest of ``configs``
    by the median of :data:`_TIMED_RUNS` runs of ``run(config)`` after one that compiles it.
    ``run`` must launch the kernel on a rank-local problem: nothing it runs may wait for a peer.
    A config the device cannot run (too much shared memory) is skipped; one config only is
    compiled, not timed."""
    found = _chosen.get((kernel, key))
    if found is not None:
        return found
    if INTERPRET and len(configs) == 1:
        # The interpreter compiles nothing and its menu is one config: nothing to choose.
        _chosen[(kernel, key)] = configs[0]
        return configs[0]
    started = time.perf_counter()
    path = _cache_file(device) if len(configs) > 1 else None
    stored = _load(path).get(_entry(kernel, key)) if path is not None else None
    candidates = [c for c in configs if _describe(c) == stored] or list(configs)
    compiled, timings = [], {}
    for candidate in candidates:
        try:
            _run_synchronized(run, candidate, device)
        except OutOfResources:
            continue
        compiled.append(candidate)
    compile_s = time.perf_counter() - started
    if not compiled:
        raise RuntimeError(
            f"{kernel} {key}: none of its {len(candidates)} tile configs fits this device "
            f"({[_describe(c) for c in candidates]})"
        )
    if len(compiled) > 1:
        for candidate in compiled:
            timings[_describe(candidate)] = _median_seconds(run, candidate, device)
        chosen = min(compiled, key=lambda c: timings[_describe(c)])
    else:
        chosen = compiled[0]
    _chosen[(kernel, key)] = chosen
    if path is not None and stored != _describe(chosen):
        _store(path, _entry(kernel, key), _describe(chosen))
    if stored is not None and len(candidates) == 1:
        how = "from the tuning cache"
    else:
        how = "tuned" if timings else "compiled (one config)"
    _log.info(
        "tp_kernels: first %s call of %s: %s, compiled %d config(s) in %.1f s, timed %d in "
        "%.1f s, chose %s%s",
        kernel, key, how, len(compiled), compile_s, len(timings),
        time.perf_counter() - started - compile_s, _describe(chosen),
        f" (kept in {path})" if path is not None else "",
    )  # fmt: skip
    return chosen


def _run_synchronized(run: Callable[[triton.Config], None], c: triton.Config, device) -> None:
    run(c)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(run: Callable[[triton.Config], None], c: triton.Config, device) -> float:
    times = []
    for _ in range(_TIMED_RUNS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        _run_synchronized(run, c, device)
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def _describe(c: triton.Config) -> str:
    """A config as its file entry: its constexprs, warps and stages."""
    blocks = ",".join(f"{k}={v}" for k, v in sorted(c.kwargs.items()))
    return f"{blocks};num_warps={c.num_warps};num_stages={c.num_stages}"


def _entry(kernel: str, key: tuple) -> str:
    return f"{kernel}{key!r}"


def _cache_file(device: torch.device) -> Path | None:
    """The tuning file of this device model, Triton and torch (None: no disk cache)."""
    folder = config.TUNING_CACHE.get()
    if not folder:
        return None
    model = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    name = f"{model}-triton{triton.__version__}-torch{torch.__version__.split('+')[0]}"
    return Path(folder).expanduser() / (re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".json")


def _load(path: Path) -> dict[str, str]:
    """The file's entries; an unreadable file counts as empty (it is a cache)."""
    with contextlib.suppress(OSError, ValueError):
        entries = json.loads(path.read_text())
        if isinstance(entries, dict):
            return {str(k): str(v) for k, v in entries.items()}
    return {}


def _store(path: Path, entry: str, value: str) -> None:
    """Add one entry, replacing the file whole (ranks of one host write the same file: a reader
    sees the old file or the new one, never half of one; a concurrent writer's entry may be
    lost, and is tuned again by the next process)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _load(path) | {entry: value}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as f:
            json.dump(entries, f, indent=0, sort_keys=True)
        os.replace(f.name, path)
    except OSError as exc:
        _log.warning("tp_kernels: could not keep a tuning choice in %s: %s", path, exc)
