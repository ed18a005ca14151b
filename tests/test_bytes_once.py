"""Every remote byte crosses once: the symm backend's traffic to and from its peers' memory, per
fused call, counted by an instrumented transport, forward and backward.

On the torch path every view of a peer's buffer is watched (a tensor subclass that tallies the
bytes of each op it takes part in); on the Triton path every load and store that Triton's
interpreter performs is checked against the address ranges of the peers' buffers. Each fused
call must read exactly one shard from each peer (all-gather: ``m x K``) or write exactly one
partial block into each peer (reduce-scatter: ``m x N``), and nothing else, whatever the number
of right-hand matrices, column tiles or launches. The backward's re-gather of a saved shard (for
the weight grads; backward keeps the shard, W times smaller than A) reads one more shard from
each peer, through the same copies.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter

# The Triton path runs in the interpreter, chosen before triton is first imported.
os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

import tp_kernels as tpk  # noqa: E402
from tp_kernels import config, symmetric_memory  # noqa: E402
from tp_kernels.backends import symm as symm_backend  # noqa: E402

_traffic: Counter = Counter()  # (peer, "read" | "write") -> bytes, this rank


class _PeerView(torch.Tensor):
    """A view of a peer's buffer that tallies the bytes each op moves through it: written when
    it is the op's ``out=`` or the target of an in-place op, read when it is any other input of
    an op that makes new data; a view of it (indexing, reshaping) moves nothing and stays
    watched, and metadata (shape, sizes) is free."""

    peer: int

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Everything here, sizes included, runs on plain tensors (no recursion into this).
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
            watched = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, _PeerView)]
            if not watched:
                return result
            name = getattr(func, "__name__", "")
            in_place = name.endswith("_") and not name.startswith("__")
            written = kwargs.get("out", args[0] if in_place and args else None)
            if isinstance(result, torch.Tensor) and written is None:
                source = watched[0]
                if result.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
                    view = result.as_subclass(_PeerView)  # a view of the peer: nothing moved
                    view.peer = source.peer
                    return view
            if isinstance(result, torch.Tensor):
                for t in watched:
                    what = "write" if t is written else "read"
                    _traffic[(t.peer, what)] += t.numel() * t.element_size()
            return result


@contextlib.contextmanager
def _watched_torch_path(group: dist.ProcessGroup):
    """Hand out every view of a peer's data or re-gather buffer as a :class:`_PeerView` (the
    control workspace's headers are the protocol's, not the op's data)."""
    view = symmetric_memory.SymmWorkspace.buffer
    rank = group.rank()

    def watched(self, peer, shape, dtype, *, offset=0):
        t = view(self, peer, shape, dtype, offset=offset)
        if peer == rank or self is symm_backend._state(group, torch.device("cpu")).ctl:
            return t
        t = t.as_subclass(_PeerView)
        t.peer = peer
        return t

    symm_backend.symmetric_memory.SymmWorkspace.buffer = watched
    try:
        yield
    finally:
        symm_backend.symmetric_memory.SymmWorkspace.buffer = view


@contextlib.contextmanager
def _watched_interpreter(group: dist.ProcessGroup):
    """Tally the interpreter's loads and stores that fall in a peer's data buffer."""
    from triton.runtime.interpreter import InterpreterBuilder

    load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store
    rank = group.rank()

    def ranges():
        ws = symm_backend._state(group, torch.device("cpu")).data
        return [(s, p, p + ws.nbytes) for s, p in enumerate(ws.buffer_ptrs().tolist()) if s != rank]

    def tally(ptrs, mask, itemsize, what):
        # Pointer loads pass numpy arrays; the interpreter's descriptor loads, memoryviews.
        addresses = np.asarray(ptrs.data)[np.asarray(mask.data).astype(bool)]
        for peer, lo, hi in ranges():
            hits = int(((addresses >= lo) & (addresses < hi)).sum())
            _traffic[(peer, what)] += hits * itemsize

    # Tensor-descriptor loads (TMA) reach the same two builders, with keyword options.
    def counted_load(self, ptrs, mask, other, *rest, **options):
        out = load(self, ptrs, mask, other, *rest, **options)
        tally(ptrs, mask, out.data.dtype.itemsize, "read")
        return out

    def counted_store(self, ptrs, value, mask, *rest, **options):
        tally(ptrs, mask, value.data.dtype.itemsize, "write")
        return store(self, ptrs, value, mask, *rest, **options)

    InterpreterBuilder.create_masked_load = counted_load
    InterpreterBuilder.create_masked_store = counted_store
    config.SYMM_TRITON.set(True)
    try:
        yield
    finally:
        InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store = load, store
        config.SYMM_TRITON.reset()


def _expect(peers: list[int], what: str, nbytes: int) -> dict:
    return {(p, what): nbytes for p in peers}


def _one_call_each(path: str, dtype: torch.dtype) -> list[str]:
    """An all-gather-matmul with two bs and return_a, then a matmul-reduce-scatter, forward and
    backward; after each fused call the traffic must be one block per peer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    peers = [p for p in range(world) if p != rank]
    elt = torch.tensor([], dtype=dtype).element_size()
    m, k, ns = 5, 24, (40, 19)  # several column tiles in the interpreter's 16-wide tiles
    gen = torch.Generator().manual_seed(rank)
    problems = []

    def check(where: str, want: dict) -> None:
        got = {key: v for key, v in _traffic.items() if v}
        if got != want:
            problems.append(f"{where}: peer traffic {got}, expected {want}")
        _traffic.clear()

    watch = contextlib.ExitStack()
    # Peer views are watched on both paths: the Triton path hands a reduce-scatter with an addend
    # (the backward of a returned A) to the torch path.
    watch.enter_context(_watched_torch_path(group))
    if path == "triton":
        watch.enter_context(_watched_interpreter(group))
    try:
        with watch:
            # Set up (and size) the buffers first, outside the count: a collective of its own.
            tpk.all_gather_matmul(torch.ones(m, k, dtype=dtype), [torch.ones(k, 64, dtype=dtype)],
                                  0, group, backend="symm")  # fmt: skip
            _traffic.clear()
            # One b and no gathered A wanted: on the torch path the matmul reads the peer itself.
            tpk.all_gather_matmul(torch.randn(m, k, generator=gen).to(dtype),
                                  [torch.randn(k, ns[0], generator=gen).to(dtype)], 0, group,
                                  backend="symm")  # fmt: skip
            check("all_gather_matmul forward, one b", _expect(peers, "read", m * k * elt))
            a_shard = torch.randn(m, k, generator=gen).to(dtype).requires_grad_()
            bs = [torch.randn(n, k, generator=gen).to(dtype).t().requires_grad_() for n in ns]
            a, outs = tpk.all_gather_matmul(a_shard, bs, 0, group, backend="symm", return_a=True)
            check("all_gather_matmul forward", _expect(peers, "read", m * k * elt))
            (sum(o.float().sum() for o in outs) + a.float().sum()).backward()
            # backward: d a_shard = reduce-scatter of [W*m, sum(N)] @ [sum(N), K]: one [m, K]
            # partial into each peer; the weight grads' re-gather of the saved shard: one [m, K]
            # shard from each peer.
            check(
                "all_gather_matmul backward",
                _expect(peers, "write", m * k * elt) | _expect(peers, "read", m * k * elt),
            )
            # Frozen input: only the re-gather.
            a, outs = tpk.all_gather_matmul(a_shard.detach(), bs, 0, group, backend="symm")
            _traffic.clear()
            sum(o.float().sum() for o in outs).backward()
            check("all_gather_matmul backward, weights only", _expect(peers, "read", m * k * elt))

            x = torch.randn(world * m, k, generator=gen).to(dtype).requires_grad_()
            w = torch.randn(ns[0], k, generator=gen).to(dtype).t().requires_grad_()
            y = tpk.matmul_reduce_scatter(x, w, 0, group, backend="symm")
            check("matmul_reduce_scatter forward", _expect(peers, "write", m * ns[0] * elt))
            y.float().sum().backward()
            # backward: d x = all_gather(d y) @ w^T: one [m, N] shard from each peer.
            check("matmul_reduce_scatter backward", _expect(peers, "read", m * ns[0] * elt))
            # Frozen input: d w = x^T @ all_gather(d y), gathered by the re-gather alone.
            y = tpk.matmul_reduce_scatter(x.detach(), w, 0, group, backend="symm")
            _traffic.clear()
            y.float().sum().backward()
            check(
                "matmul_reduce_scatter backward, weight only",
                _expect(peers, "read", m * ns[0] * elt),
            )
    finally:
        dist.destroy_process_group(group)
    return problems


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_each_remote_byte_crosses_once(worlds, world_size, path):
    for dtype in (torch.float32, torch.bfloat16):
        results = worlds(world_size).run(_one_call_each, path, dtype)
        assert results == [[]] * world_size, (dtype, results)
