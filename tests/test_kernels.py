"""The symm backend's Triton kernels, run by Triton's interpreter on CPU.

First in one process, with W simulated ranks (a separate tensor per "peer" buffer and signal pad,
address tables from ``data_ptr()``); then across 2 and 3 processes over the shared-memory heap of
``tp_kernels.symmetric_memory``, with a peer that arrives late and repeated calls on the same
buffers.
Shapes are tiny and deliberately not multiples of the interpreter's 16x16x16 tiles.
"""

from __future__ import annotations

import os

# Must precede the first import of triton (in this process and in the ranks, which import this
# module to unpickle their functions).
os.environ["TRITON_INTERPRET"] = "1"

import functools  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tp_kernels import kernels, signals  # noqa: E402
from tp_kernels.backends import symm_gather, symm_scatter  # noqa: E402
from tp_kernels.kernels import ag_matmul  # noqa: E402
from tp_kernels.testing.numerics import check_close  # noqa: E402


def _require_interpreter() -> None:
    if not kernels.INTERPRET:
        raise RuntimeError(
            "tp_kernels.kernels was imported before TRITON_INTERPRET=1 was set, so its kernels "
            "were built for a GPU; import it only after setting the variable"
        )


_require_interpreter()

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The slot words' channel, and the two barriers' (as the symm backend numbers them).
CHANNEL = 1
START, PUBLISHED = 2, 3
NAN = float("nan")


def _addresses(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


def _pads(world_size: int, channels: int = 4) -> tuple[list[torch.Tensor], torch.Tensor]:
    pads = [torch.zeros(channels * world_size, dtype=torch.int32) for _ in range(world_size)]
    return pads, _addresses(pads)


def _progress(world_size: int) -> torch.Tensor:
    """The consumer's progress words for one call, clear (zero)."""
    return torch.zeros(world_size * symm_gather.MAX_CHUNKS, dtype=torch.int32)


def _arrive(pads: list[torch.Tensor], rank: int, channel: int) -> None:
    """What every peer's barrier on ``channel`` does to ``rank``'s pad: raise its word."""
    world_size = len(pads)
    row = pads[rank].view(-1, world_size)[channel]
    for s in range(world_size):
        if s != rank:
            row[s] = signals.RAISED


def _copy_in(shards, a_out, rank, rows, progress, delay_s=0.0) -> threading.Thread:
    """The copier as the symm backend runs it: rank's own rows first (before the consumer), then
    on a host thread, after ``delay_s`` (so that the consumer's tiles wait), every peer's rows in
    chunks of ``rows``, each chunk's progress word after it. Join the returned thread."""
    world_size, m = len(shards), shards[0].shape[0]
    a_out[rank * m : (rank + 1) * m].copy_(shards[rank])
    peers = [(rank + k) % world_size for k in range(1, world_size)]
    copier = symm_gather.Copier(torch.device("cpu"))

    def run():
        time.sleep(delay_s)
        copier.start([(s, shards[s]) for s in peers], a_out, rows, progress).join()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _rotation(start: int, world_size: int) -> list[int]:
    return [(start + k) % world_size for k in range(world_size)]


def _ag_reference(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``a @ b``: (float64 truth, torch's matmul in a's dtype, float64 ``|a| @ |b|``)."""
    return a.double() @ b.double(), a @ b, a.double().abs() @ b.double().abs()


def _rs_reference(parts_a: list[torch.Tensor], parts_b: list[torch.Tensor], dst: int, m: int):
    """Rows of rank ``dst`` of sum_s a_s @ b_s: (float64 truth, reduce-scatter in the dtype,
    float64 sum_s |a_s| @ |b_s|).

    The same-dtype reference is what a collective does: each rank's product rounded to the
    dtype, then added up in the dtype.
    """
    rows = slice(dst * m, (dst + 1) * m)
    truth = sum(a[rows].double() @ b.double() for a, b in zip(parts_a, parts_b, strict=True))
    magnitude = sum(
        a[rows].double().abs() @ b.double().abs() for a, b in zip(parts_a, parts_b, strict=True)
    )
    same = parts_a[0][rows] @ parts_b[0]
    for a, b in zip(parts_a[1:], parts_b[1:], strict=True):
        same = same + a[rows] @ b
    return truth, same, magnitude


def _fixed_order_sum(slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reduction spelled out: fp32, slot 0 first; the kernel must match it bit for bit."""
    acc = slots[0].float()
    for s in range(1, slots.shape[0]):
        acc = acc + slots[s].float()
    return acc.to(dtype)


# ---------------------------------------------------------------- one process, simulated ranks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("world_size", "rank", "m", "k", "ns", "rows"),
    [
        (3, 1, 40, 40, (24, 17), 16),
        (3, 1, 40, 40, (24, 32), 16),
        (4, 3, 8, 16, (33,), 8),
        (2, 0, 5, 24, (7,), 2),
        (3, 2, 20, 16, (9, 40, 1, 18), 16),
    ],
)
def test_ag_matmul_consumer(dtype, world_size, rank, m, k, ns, rows):
    """The barrier (the peers' arrivals raised by hand), then a copier thread that starts late
    (the consumer's tiles of peer rows wait on its progress words) beside the consumer: chunks
    of 16 rows (several per shard, tiles on their boundaries), of 8 rows (shards smaller than a
    tile) and of 2 rows (a tile spans chunks and waits for its last row's). Several ``bs`` share
    a launch (three at most: the fourth is a launch of its own after them), a width of 1 among
    them. Outputs whose rows are 16-byte multiples (``(24, 32)``) take TMA stores, the others
    pointer stores; m = 40 leaves each shard's last tile 8 rows past it."""
    gen = torch.Generator().manual_seed(world_size * 100 + m)
    a = torch.randn(world_size * m, k, generator=gen).to(dtype)
    shards = [a[s * m : (s + 1) * m].clone() for s in range(world_size)]
    bs = [torch.randn(k, n, generator=gen).to(dtype) for n in ns]
    pads, signal_ptrs = _pads(world_size)
    _arrive(pads, rank, PUBLISHED)
    status = kernels.new_status(world_size, torch.device("cpu"))
    kernels.barrier(signal_ptrs, status=status, rank=rank, world_size=world_size, channel=PUBLISHED)
    # The barrier consumed its peers' words and raised its own word in every peer's pad.
    words = [p.view(-1, world_size)[PUBLISHED].tolist() for p in pads]
    assert words == [
        [int(d != rank and s == rank) for s in range(world_size)] for d in range(world_size)
    ], words

    outs = [torch.full((world_size * m, n), NAN, dtype=dtype) for n in ns]
    a_out = torch.full((world_size * m, k), NAN, dtype=dtype)
    order = torch.empty(world_size, dtype=torch.int64)
    progress = _progress(world_size)
    copier = _copy_in(shards, a_out, rank, rows, progress, delay_s=0.3)
    kernels.ag_matmul_consumer(
        a_out,
        bs,
        outs,
        progress=progress,
        chunk_rows=rows,
        status=status,
        rank=rank,
        world_size=world_size,
        order_out=order,
    )
    copier.join()
    assert status.tolist() == [0] * world_size
    assert order.tolist() == _rotation(rank, world_size)
    assert torch.equal(a_out, a)
    chunks = -(-m // rows)
    # One word per chunk of every peer, none for the own rows (in place before the launch).
    want = [0 if s == rank else 1 for s in range(world_size) for _ in range(chunks)]
    assert progress[: world_size * chunks].tolist() == want
    for j, (b, c) in enumerate(zip(bs, outs, strict=True)):
        reference = _ag_reference(a, b)
        assert (problem := check_close(f"outs[{j}]", c, *reference)) is None, problem


def test_right_hand_matrices_share_launches_by_layout_three_at_most():
    from tp_kernels.kernels import ag_matmul

    groups = ag_matmul._launch_groups
    assert groups(["cr"]) == [[0]]
    assert groups(["cr", "cr", "cr"]) == [[0, 1, 2]]  # QKV: one launch
    assert groups(["cr"] * 5) == [[0, 1, 2], [3, 4]]
    assert groups(["cr", "pointer", "pointer", "cr"]) == [[0], [1, 2], [3]]


def test_persistent_launches_take_a_share_of_the_sms_when_ranks_share_a_gpu():
    """Ranks on one GPU (gpu_check's 2 and 4): every rank's persistent GEMM together must leave
    SMs that no program holds, for the copy kernels and barriers their tiles wait for."""
    from tp_kernels.kernels._shared import SHARED_DEVICE_FREE_SMS, programs_for

    assert programs_for(132, 1) == 132  # a GPU of its own: one program per SM
    assert programs_for(132, 2) == 64 and programs_for(132, 4) == 31
    assert programs_for(4, 8) == 1  # never none
    for sms in (16, 78, 108, 132):
        for ranks in (2, 3, 4, 8):
            if sms // ranks > SHARED_DEVICE_FREE_SMS:
                assert ranks * programs_for(sms, ranks) <= sms - ranks * SHARED_DEVICE_FREE_SMS


def test_ranks_on_one_gpu_come_from_the_setting_or_torchs_variable(monkeypatch):
    from tp_kernels import config

    monkeypatch.delenv("TP_KERNELS_SHARED_DEVICE_RANKS", raising=False)
    monkeypatch.delenv(config.ALLOW_OVERLAPPING_DEVICES, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    config.SHARED_DEVICE_RANKS.reset()
    try:
        assert config.shared_device_ranks(1) == 1  # torch refuses ranks on one device
        monkeypatch.setenv(config.ALLOW_OVERLAPPING_DEVICES, "1")
        assert config.shared_device_ranks(1) == 4
        assert config.shared_device_ranks(2) == 2 and config.shared_device_ranks(8) == 1
        config.SHARED_DEVICE_RANKS.set(3)
        assert config.shared_device_ranks(8) == 3
        config.SHARED_DEVICE_RANKS.reset()
        monkeypatch.setenv("TP_KERNELS_SHARED_DEVICE_RANKS", "2")
        assert config.shared_device_ranks(1) == 2
        config.SHARED_DEVICE_RANKS.reset()
        monkeypatch.setenv("TP_KERNELS_SHARED_DEVICE_RANKS", "0")
        with pytest.raises(ValueError, match="TP_KERNELS_SHARED_DEVICE_RANKS"):
            config.shared_device_ranks(1)
    finally:
        config.SHARED_DEVICE_RANKS.reset()


def test_launchers_grids_hold_a_share_of_the_sms(monkeypatch):
    """Both persistent launchers as on a GPU of 132 SMs that 4 ranks share (torch's variable set,
    as in gpu_check's ranks): the grid each would launch has at most 132 // 4 - 2 programs,
    though there are far more tiles (the kernels are not run: a recorder stands in for them)."""
    import types

    from tp_kernels.kernels import _shared, ag_matmul, matmul_rs

    grids = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: grids.append(grid)

    monkeypatch.setattr(_shared, "INTERPRET", False)  # persistent_programs as on a GPU
    monkeypatch.setattr(_shared, "_programs", {}, raising=False)  # its cache, fresh
    monkeypatch.delenv("TP_KERNELS_SHARED_DEVICE_RANKS", raising=False)
    monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    props = types.SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(ag_matmul, "_ag_matmul_kernel", Recorder())
    # One 16 x 16 x 16 config, so the consumer has nothing to tune (its menu is the GPU's here).
    tile = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, num_warps=1)
    monkeypatch.setattr(ag_matmul, "gemm_configs", lambda kind: [tile])
    monkeypatch.setattr(matmul_rs, "_matmul_rs_kernel", Recorder())
    world_size, m, k, n = 4, 256, 16, 256  # 4 * 16 * 16 tiles of 16 x 16
    a = torch.zeros(world_size * m, k)
    b = torch.zeros(k, n)
    status = kernels.new_status(world_size, torch.device("cpu"))

    def consume() -> None:
        kernels.ag_matmul_consumer(
            a, [b], [torch.empty(world_size * m, n)], progress=_progress(world_size),
            chunk_rows=m, status=status, rank=0, world_size=world_size,
        )  # fmt: skip

    consume()
    blocks = torch.empty(world_size, m, n)
    kernels.matmul_rs_producer(
        a, b, blocks, torch.empty_like(blocks), torch.zeros(world_size, dtype=torch.int32),
        _pads(world_size)[1], counters=kernels.new_counters(world_size, torch.device("cpu")),
        rank=0, world_size=world_size, channel=CHANNEL,
    )  # fmt: skip
    # Without the variable (a GPU of its own): one program per SM.
    monkeypatch.delenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES")
    monkeypatch.setattr(_shared, "_programs", {}, raising=False)
    consume()
    assert grids == [(31,), (31,), (132,)]


def test_the_producer_is_compiled_once_per_shape_not_per_call(monkeypatch):
    """On a GPU the producer compiles its launch's variant before the call waits for anyone
    (``warmup``), once per shape in the process: a later call of the shape only launches (the
    kernels are not run here: a recorder stands in for the kernel, as on a GPU otherwise)."""
    from tp_kernels.kernels import matmul_rs, tuning

    compiled, launched = [], []

    class Recorder:
        def warmup(self, **kwargs):
            compiled.append((kwargs["m"], kwargs["N"]))

        def __getitem__(self, grid):
            return lambda **kwargs: launched.append((kwargs["m"], kwargs["N"]))

    monkeypatch.setattr(tuning, "INTERPRET", False)  # the tuner as on a GPU
    monkeypatch.setattr(matmul_rs, "_matmul_rs_kernel", Recorder())
    tuning.forget()
    world_size = 2

    def produce(m: int, n: int) -> None:
        a, b = torch.zeros(world_size * m, 16), torch.zeros(16, n)
        blocks = torch.empty(world_size, m, n)
        kernels.matmul_rs_producer(
            a, b, blocks, torch.empty_like(blocks), torch.zeros(world_size, dtype=torch.int32),
            _pads(world_size)[1], counters=kernels.new_counters(world_size, torch.device("cpu")),
            rank=0, world_size=world_size, channel=CHANNEL,
        )  # fmt: skip

    for m, n in ((32, 16), (32, 16), (48, 16), (32, 16)):
        produce(m, n)
    tuning.forget()
    assert compiled == [(32, 16), (48, 16)]
    assert launched == [(32, 16), (32, 16), (48, 16), (32, 16)]


def _push_by_hand(staging, buffers, pads, rank: int) -> None:
    """What the pusher does for ``rank`` (tested in test_symm_backend.py): each peer's block of
    its staging into slot ``rank`` of the peer's buffer, then the peer's word."""
    world_size = len(buffers)
    for d in range(world_size):
        if d != rank:
            buffers[d][rank].copy_(staging[d])
            pads[d].view(-1, world_size)[CHANNEL, rank] = signals.RAISED


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("world_size", "m", "k", "n"), [(3, 12, 40, 20), (2, 20, 24, 36)])
def test_matmul_rs_producer_and_reduce(dtype, world_size, m, k, n):
    """The producer stores the peers' blocks into its local staging and raises their progress
    words, its own block into its own slot and its own word; nothing of a peer's is touched.
    Pushed by hand, the slots reduce to the reduce-scatter."""
    gen = torch.Generator().manual_seed(world_size * 100 + n)
    parts_a = [torch.randn(world_size * m, k, generator=gen).to(dtype) for _ in range(world_size)]
    parts_b = [torch.randn(k, n, generator=gen).to(dtype) for _ in range(world_size)]
    buffers = [torch.full((world_size, m, n), NAN, dtype=dtype) for _ in range(world_size)]
    stagings = [torch.full((world_size, m, n), NAN, dtype=dtype) for _ in range(world_size)]
    progress = [torch.zeros(world_size, dtype=torch.int32) for _ in range(world_size)]
    pads, signal_ptrs = _pads(world_size)
    counters = kernels.new_counters(world_size, torch.device("cpu"))
    for r in range(world_size):
        order = torch.empty(world_size, dtype=torch.int64)
        kernels.matmul_rs_producer(
            parts_a[r],
            parts_b[r],
            stagings[r],
            buffers[r],
            progress[r],
            signal_ptrs,
            counters=counters,
            rank=r,
            world_size=world_size,
            channel=CHANNEL,
            order_out=order,
        )
        assert order.tolist() == _rotation(r + 1, world_size)
        # One word per block, raised once the block is complete: the own block's in the own
        # pad, the peers' in the local progress words; no peer's pad or buffer is written.
        assert progress[r].tolist() == [0 if d == r else 1 for d in range(world_size)]
        assert [p.view(-1, world_size)[CHANNEL].tolist() for p in pads] == [
            [1 if (d == s and s <= r) else 0 for s in range(world_size)] for d in range(world_size)
        ]
        assert all(buffers[d][r].isnan().all() for d in range(world_size) if d != r)
        assert stagings[r][r].isnan().all()
        for d in range(world_size):
            rows = slice(d * m, (d + 1) * m)
            got = buffers[r][r] if d == r else stagings[r][d]
            reference = _ag_reference(parts_a[r][rows], parts_b[r])
            problem = check_close(f"block {d} of rank {r}", got, *reference)
            assert problem is None, problem
    for r in range(world_size):
        _push_by_hand(stagings[r], buffers, pads, r)
    for dst in range(world_size):
        out = torch.full((m, n), NAN, dtype=dtype)
        status = kernels.new_status(world_size, torch.device("cpu"))
        kernels.reduce_slots(
            buffers[dst],
            out,
            signal_ptrs,
            status=status,
            rank=dst,
            world_size=world_size,
            channel=CHANNEL,
        )
        assert status.tolist() == [0] * world_size
        assert torch.equal(out, _fixed_order_sum(buffers[dst], dtype))
        reference = _rs_reference(parts_a, parts_b, dst, m)
        assert (problem := check_close(f"rank {dst}", out, *reference)) is None, problem


def _misaligned(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A row-major [rows, cols] whose base is not 16-byte aligned (one element in)."""
    return torch.randn(rows * cols + 1).to(dtype)[1:].view(rows, cols)


def test_tma_layout_follows_strides_and_alignment():
    w = torch.randn(24, 40)
    assert kernels.tma_layout(w) == "rc"
    assert kernels.tma_layout(w.t()) == "cr"  # a Linear's weight.t(): TMA reads the weight
    odd = torch.randn(40, 17)  # rows of 68 bytes: no TMA either way round
    assert kernels.tma_layout(odd) == "pointer" and kernels.tma_layout(odd.t()) == "pointer"
    assert kernels.tma_layout(_misaligned(24, 40, torch.float32)) == "pointer"
    assert kernels.tma_layout(w[:, ::2]) == "pointer"  # no contiguous dimension


@triton.jit
def _store_ones(
    c, src, row0, col0, m, N,
    C_LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The consumer's epilogue store of a tile of ones (``BLOCK_M`` x ``BLOCK_N``)."""
    ones = tl.full((BLOCK_M, BLOCK_N), 1.0, tl.float32)
    ag_matmul._store_tile(c, ones, src, row0, col0, m, N, C_LAYOUT, BLOCK_M, BLOCK_N)


@pytest.mark.parametrize("layout", ["tma", "pointer"])
@pytest.mark.parametrize("block_n", [16, 128])
def test_consumer_stores_no_row_past_its_shard(layout, block_n):
    """A tile that runs past its shard's m rows (and past C's columns) stores its rows inside
    the shard alone: TMA clips at the [W, m, N] view's bounds (a tile 128 wide in two halves,
    the second wholly past C), pointers by the mask. Shard 1's rows 16.. of the tile's columns
    are ones; its other rows and shard 2's stay untouched."""
    world_size, m, n, block_m = 3, 24, 40, 16
    c = torch.zeros(world_size * m, n)
    target = ag_matmul._c_operand(c, world_size, m, layout)
    if layout == "tma":
        target.block_shape = [1, block_m, ag_matmul.store_columns(block_n)]
    _store_ones[(1,)](target, 1, 16, 8, m, n, C_LAYOUT=layout, BLOCK_M=block_m, BLOCK_N=block_n)
    want = torch.zeros_like(c)
    want[m + 16 : 2 * m, 8 : 8 + block_n] = 1.0
    assert torch.equal(c, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemms_read_each_layout_of_their_operands(dtype, monkeypatch):
    """B transposed (TMA over the weight), B with rows no multiple of 16 bytes and B off a
    16-byte boundary (pointer loads), in one all-gather call whose launches all read the
    gathered A with TMA; then the producer with a transposed A and each B. Results against
    torch's matmul; the layouts the launchers chose are recorded."""
    gen = torch.Generator().manual_seed(5)
    world_size, rank, m, k = 2, 1, 24, 40
    chosen = []

    def recording(module):
        original = module.tma_operand

        def tma_operand(t, layout):
            chosen.append(layout)
            return original(t, layout)

        monkeypatch.setattr(module, "tma_operand", tma_operand)

    recording(kernels.ag_matmul)
    recording(kernels.matmul_rs)
    a = torch.randn(world_size * m, k, generator=gen).to(dtype)
    shards = [a[s * m : (s + 1) * m].clone() for s in range(world_size)]
    bs = [
        torch.randn(24, k, generator=gen).to(dtype).t(),
        torch.randn(k, 17, generator=gen).to(dtype),
        _misaligned(k, 24, dtype),
    ]
    _, signal_ptrs = _pads(world_size)
    outs = [torch.full((world_size * m, b.shape[1]), NAN, dtype=dtype) for b in bs]
    a_out = torch.full((world_size * m, k), NAN, dtype=dtype)
    status = kernels.new_status(world_size, torch.device("cpu"))
    progress = _progress(world_size)
    _copy_in(shards, a_out, rank, 16, progress).join()
    kernels.ag_matmul_consumer(
        a_out,
        bs,
        outs,
        progress=progress,
        chunk_rows=16,
        status=status,
        rank=rank,
        world_size=world_size,
    )
    # The gathered A once (TMA in every launch), then each launch's B.
    assert chosen == ["rc", "cr", "pointer", "pointer"], chosen
    assert torch.equal(a_out, a) and status.tolist() == [0] * world_size
    for j, (b, c) in enumerate(zip(bs, outs, strict=True)):
        assert (problem := check_close(f"outs[{j}]", c, *_ag_reference(a, b))) is None, problem

    chosen.clear()
    a_t = torch.randn(k, world_size * m, generator=gen).to(dtype).t()
    for b in bs:
        staging, own = (torch.full((world_size, m, b.shape[1]), NAN, dtype=dtype) for _ in "so")
        kernels.matmul_rs_producer(
            a_t,
            b,
            staging,
            own,
            torch.zeros(world_size, dtype=torch.int32),
            signal_ptrs,
            counters=kernels.new_counters(world_size, torch.device("cpu")),
            rank=0,
            world_size=world_size,
            channel=CHANNEL,
        )
        for dst in range(world_size):
            reference = _ag_reference(a_t[dst * m : (dst + 1) * m], b)
            got = own[0] if dst == 0 else staging[dst]
            assert (problem := check_close("block", got, *reference)) is None, problem
    assert chosen == ["cr", "cr", "cr", "pointer", "cr", "pointer"], chosen


def test_reduce_slots_casts_to_out_dtype():
    slots = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    pads, signal_ptrs = _pads(3)
    pads[2].view(-1, 3)[0] = signals.RAISED  # every slot pushed, the own one too
    out = torch.empty(5, 7, dtype=torch.float32)
    status = kernels.new_status(3, torch.device("cpu"))
    kernels.reduce_slots(slots, out, signal_ptrs, status=status, rank=2, world_size=3, channel=0)
    assert torch.equal(out, _fixed_order_sum(slots, torch.float32))


def test_start_barrier_clears_the_words_before_it_arrives():
    """The start barrier zeroes every progress word and this rank's slot words (the previous
    call's raised values), raises its arrival in every peer's pad and consumes the peers'
    arrivals in its own, so nothing of the previous call satisfies a wait of the next."""
    world_size, rank = 3, 1
    pads, signal_ptrs = _pads(world_size)
    for p in pads:
        p.view(-1, world_size)[CHANNEL] = signals.RAISED  # the last call's pushes
    words = torch.ones(world_size * (symm_gather.MAX_CHUNKS + 1), dtype=torch.int32)
    _arrive(pads, rank, START)
    status = kernels.new_status(world_size, torch.device("cpu"))
    kernels.barrier(
        signal_ptrs,
        status=status,
        rank=rank,
        world_size=world_size,
        channel=START,
        clear=(words, CHANNEL),
        wait=signals.WAIT_START,
    )
    assert status.tolist() == [0] * world_size
    assert words.eq(0).all(), words
    rows = [p.view(-1, world_size) for p in pads]
    assert rows[rank][CHANNEL].eq(0).all() and rows[rank][START].eq(0).all()
    for d in (0, 2):  # the peers' own words are theirs to clear; this rank's arrival is raised
        assert rows[d][CHANNEL].eq(1).all()
        assert rows[d][START].tolist() == [int(s == rank) for s in range(world_size)]


def test_unraised_signal_times_out():
    """A word never raised (a peer that did not arrive, a chunk not copied, a slot not pushed)
    does not satisfy a wait: each records which wait it was, the record the host raises from
    (tests/test_gpu_path.py: the symm backend's error names each peer's wait)."""
    world_size, m, k, n = 3, 32, 20, 18
    gen = torch.Generator().manual_seed(5)
    shards = [torch.randn(m, k, generator=gen) for _ in range(world_size)]
    b = torch.randn(k, n, generator=gen)
    pads, signal_ptrs = _pads(world_size)
    pads[0].view(-1, world_size)[START, 1] = signals.RAISED  # rank 2 never arrives
    status = kernels.new_status(world_size, torch.device("cpu"))
    started = time.monotonic()
    kernels.barrier(
        signal_ptrs,
        status=status,
        rank=0,
        world_size=world_size,
        channel=START,
        timeout_s=0.2,
        wait=signals.WAIT_START,
    )
    assert 0.2 <= time.monotonic() - started < 5.0
    assert status.tolist() == [0, 0, signals.WAIT_START]

    # The consumer: rank 1's two chunks copied, rank 2's words never raised.
    a_out = torch.full((world_size * m, k), NAN)
    a_out[: 2 * m] = torch.cat(shards[:2])
    progress = _progress(world_size)
    progress[2:4] = signals.RAISED
    out = torch.full((world_size * m, n), NAN)
    status = kernels.new_status(world_size, torch.device("cpu"))
    started = time.monotonic()
    kernels.ag_matmul_consumer(
        a_out,
        [b],
        [out],
        progress=progress,
        chunk_rows=16,
        status=status,
        rank=0,
        world_size=world_size,
        timeout_s=0.2,
    )
    # Rank 2's first tile waits 0.2 s; its later tiles see the record and give up at once.
    assert 0.2 <= time.monotonic() - started < 5.0
    assert status.tolist() == [0, 0, signals.WAIT_CHUNK]
    # The ranks that did signal are computed; only rank 2's rows are undefined.
    for s in (0, 1):
        rows = slice(s * m, (s + 1) * m)
        reference = _ag_reference(shards[s], b)
        assert (problem := check_close(f"rows of {s}", out[rows], *reference)) is None, problem

    slots = torch.zeros(world_size, m, n)
    row = pads[1].view(-1, world_size)[CHANNEL]
    row[0] = row[2] = signals.RAISED  # rank 1's own block was never produced
    status = kernels.new_status(world_size, torch.device("cpu"))
    kernels.reduce_slots(
        slots,
        torch.empty(m, n),
        signal_ptrs,
        status=status,
        rank=1,
        world_size=world_size,
        channel=CHANNEL,
        timeout_s=0.2,
    )
    assert status.tolist() == [0, signals.WAIT_SLOT, 0]


def _bad_ag(**change):
    world_size, m, k = 2, 4, 8
    args = dict(
        a=torch.ones(world_size * m, k),
        bs=[torch.ones(k, 5)],
        outs=[torch.ones(world_size * m, 5)],
        progress=_progress(world_size),
        chunk_rows=2,
        status=kernels.new_status(world_size, torch.device("cpu")),
        rank=0,
        world_size=world_size,
    )
    args.update(change)
    kernels.ag_matmul_consumer(**args)


def _bad_barrier(**change):
    args = dict(
        signal_ptrs=torch.zeros(3, dtype=torch.int64),
        status=kernels.new_status(2, torch.device("cpu")),
        rank=0,
        world_size=2,
        channel=0,
    )
    args.update(change)
    kernels.barrier(**args)


def _bad_rs(**change):
    args = dict(
        a=torch.ones(8, 3),
        b=torch.ones(3, 5),
        staging=torch.ones(2, 4, 5),
        own_slots=torch.ones(2, 4, 5),
        progress=torch.zeros(2, dtype=torch.int32),
        signal_ptrs=torch.zeros(2, dtype=torch.int64),
        counters=kernels.new_counters(2, torch.device("cpu")),
        rank=1,
        world_size=2,
        channel=0,
    )
    args.update(change)
    kernels.matmul_rs_producer(**args)


def _bad_reduce(**change):
    args = dict(
        slots=torch.ones(2, 4, 5),
        out=torch.ones(4, 5),
        signal_ptrs=torch.zeros(2, dtype=torch.int64),
        status=kernels.new_status(2, torch.device("cpu")),
        rank=0,
        world_size=2,
        channel=0,
    )
    args.update(change)
    kernels.reduce_slots(**args)


# The launchers check what the symm backend makes (address tables, scratch, timeout record, rank,
# channel). Operand shapes and dtypes are the ops layer's checks (test_ops.py), which the
# launchers trust since issue 12: cases that fed them bad operands went with their checks.
@pytest.mark.parametrize(
    ("call", "change", "message"),
    [
        (
            _bad_barrier,
            {},
            r"signal_ptrs: .* shape \(3,\), expected int64 of shape \(2,\)",
        ),
        (_bad_ag, dict(a=torch.ones(8, 8, dtype=torch.int32)), r"a: dtype torch.int32"),
        (
            _bad_ag,
            dict(progress=torch.zeros(3, dtype=torch.int32)),
            r"progress: got torch.int32 of shape \(3,\) on cpu, expected a contiguous int32 "
            r"vector of at least 4 words",
        ),
        (_bad_ag, dict(chunk_rows=0), r"chunk_rows: got 0, expected a positive int"),
        (
            _bad_ag,
            dict(status=torch.zeros(3, dtype=torch.int32)),
            r"status: got torch.int32 of shape \(3,\), expected torch.int32 of shape \(2,\)",
        ),
        (
            _bad_barrier,
            dict(
                signal_ptrs=torch.zeros(2, dtype=torch.int64),
                clear=(torch.zeros(4, dtype=torch.int64), 1),
            ),
            r"clear\[0\] \(the words\): got torch.int64 of shape \(4,\) on cpu, expected a "
            r"contiguous int32",
        ),
        (_bad_ag, dict(rank=2), r"rank: got 2, expected 0 <= rank < world_size=2"),
        (_bad_ag, dict(timeout_s=0.0), r"timeout_s: got 0.0"),
        (
            _bad_rs,
            dict(signal_ptrs=torch.zeros(1, dtype=torch.int64)),
            r"signal_ptrs: .* shape \(1,\), expected int64 of shape \(2,\)",
        ),
        (
            _bad_rs,
            dict(staging=torch.ones(2, 5, 5)),
            r"staging: got torch.float32 of shape \(2, 5, 5\) on cpu, expected torch.float32 "
            r"of shape \(2, 4, 5\)",
        ),
        (
            _bad_rs,
            dict(own_slots=torch.ones(2, 4, 5, dtype=torch.float16)),
            r"own_slots: got torch.float16 .* expected torch.float32",
        ),
        (
            _bad_rs,
            dict(progress=torch.zeros(3, dtype=torch.int32)),
            r"progress: got torch.int32 of shape \(3,\) on cpu, expected torch.int32 of shape "
            r"\(2,\)",
        ),
        (
            _bad_rs,
            dict(counters=torch.zeros(3, dtype=torch.int32)),
            r"counters: got torch.int32 of shape \(3,\) on cpu, expected torch.int32 of shape "
            r"\(2,\)",
        ),
        (_bad_rs, dict(channel=-1), r"channel: got -1, expected >= 0"),
        (
            _bad_rs,
            dict(order_out=torch.zeros(3, dtype=torch.int64)),
            r"order_out: got shape \(3,\), expected \(2,\)",
        ),
        (_bad_reduce, dict(out=torch.ones(4, 5, dtype=torch.int32)), r"out: dtype torch.int32"),
        (
            _bad_reduce,
            dict(status=kernels.new_status(2, torch.device("cpu")).to(torch.int64)),
            r"status: got torch.int64 of shape \(2,\)",
        ),
    ],
)
def test_bad_input_is_named(call, change, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call(**change)


# ---------------------------------------------------------------- across processes


def _workspace(tag: str, nbytes: int):
    import torch.distributed as dist

    from tp_kernels import symmetric_memory

    _require_interpreter()
    ws = symmetric_memory.get_workspace(dist.group.WORLD, nbytes, torch.device("cpu"), tag=tag)
    return (
        ws,
        torch.as_tensor(ws.buffer_ptrs(), dtype=torch.int64),
        torch.as_tensor(ws.signal_pad_ptrs(), dtype=torch.int64),
    )


# One call per dtype, each with a different late rank (the last call has none); the late rank
# sleeps with its buffer full of NaN and its words cleared (the previous call's values gone).
_CALLS = ((torch.float32, -1), (torch.bfloat16, 0), (torch.float16, None))


def _late(world_size: int, late: int | None) -> int | None:
    return None if late is None else late % world_size


def _rank_ag(m: int, k: int, ns: tuple[int, ...]) -> list[str]:
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    tag = "test_kernels.ag"
    ws, _, signal_ptrs = _workspace(tag, m * k * 4)
    copier = symm_gather.Copier(torch.device("cpu"))
    progress = _progress(world_size)
    problems = []
    for call, (dtype, late) in enumerate(_CALLS):
        gen = torch.Generator().manual_seed(call)
        a = torch.randn(world_size * m, k, generator=gen).to(dtype)
        bs = [torch.randn(k, n, generator=gen).to(dtype) for n in ns]
        mine = ws.buffer(rank, (m, k), dtype)
        status = kernels.new_status(world_size, torch.device("cpu"))
        barrier = functools.partial(
            kernels.barrier, signal_ptrs, status=status, rank=rank, world_size=world_size
        )
        # The protocol of the symm backend's _ag_triton: the start barrier (every rank is done
        # reading the previous call's shards; the progress words cleared), publish, the
        # publish barrier, then the copier from the peers' mappings beside the consumer.
        barrier(channel=START, clear=(progress, CHANNEL), timeout_s=60.0)
        mine.fill_(NAN)
        if rank == _late(world_size, late):
            time.sleep(1.0)
        mine.copy_(a[rank * m : (rank + 1) * m])
        barrier(channel=PUBLISHED, timeout_s=60.0)
        outs = [torch.full((world_size * m, n), NAN, dtype=dtype) for n in ns]
        a_out = torch.full((world_size * m, k), NAN, dtype=dtype)
        a_out[rank * m : (rank + 1) * m].copy_(mine)
        order = torch.empty(world_size, dtype=torch.int64)
        peers = [(rank + j) % world_size for j in range(1, world_size)]
        sources = [(s, ws.buffer(s, (m, k), dtype)) for s in peers]
        copies = copier.start(sources, a_out, 16, progress)
        kernels.ag_matmul_consumer(
            a_out,
            bs,
            outs,
            progress=progress,
            chunk_rows=16,
            status=status,
            rank=rank,
            world_size=world_size,
            timeout_s=60.0,
            order_out=order,
        )
        copies.join()
        where = f"call {call} ({dtype}, late rank {_late(world_size, late)})"
        if status.any():
            problems.append(f"{where}: a wait timed out: {status.tolist()}")
        if order.tolist() != _rotation(rank, world_size):
            problems.append(f"{where}: tile order {order.tolist()}")
        if not torch.equal(a_out, a):
            problems.append(f"{where}: gathered A differs")
        for j, (b, c) in enumerate(zip(bs, outs, strict=True)):
            reference = _ag_reference(a, b)
            if problem := check_close(f"{where} outs[{j}]", c, *reference):
                problems.append(problem)
    return problems


def _rank_rs(m: int, k: int, n: int) -> list[str]:
    """The producer beside the pusher, as the symm backend runs them, then the reduction."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    tag = "test_kernels.rs"
    ws, _, signal_ptrs = _workspace(tag, world_size * m * n * 4)
    counters = kernels.new_counters(world_size, torch.device("cpu"))
    status = kernels.new_status(world_size, torch.device("cpu"))
    pads = [ws.signal_pad(s) for s in range(world_size)]
    pusher = symm_scatter.Pusher(torch.device("cpu"), pads, "test_kernels")
    progress = torch.zeros(world_size, dtype=torch.int32)
    peers = [(rank + j) % world_size for j in range(1, world_size)]
    problems = []
    for call, (dtype, late) in enumerate(_CALLS):
        gen = torch.Generator().manual_seed(call)
        parts_a = [
            torch.randn(world_size * m, k, generator=gen).to(dtype) for _ in range(world_size)
        ]
        parts_b = [torch.randn(k, n, generator=gen).to(dtype) for _ in range(world_size)]
        slots = ws.buffer(rank, (world_size, m, n), dtype)
        staging = torch.full((world_size, m, n), NAN, dtype=dtype)
        # No peer pushes into this buffer before this rank's start barrier (the previous call's
        # pushes all landed before its reduction), so the NaN goes in first.
        slots.fill_(NAN)
        if rank == _late(world_size, late):
            time.sleep(1.0)
        # The protocol of the symm backend's _rs_triton: the start barrier (clearing the
        # progress and slot words), then the producer beside the pusher, then the reduction.
        kernels.barrier(
            signal_ptrs,
            status=status,
            rank=rank,
            world_size=world_size,
            channel=START,
            timeout_s=60.0,
            clear=(progress, CHANNEL),
        )
        order = torch.empty(world_size, dtype=torch.int64)

        produce = functools.partial(
            kernels.matmul_rs_producer,
            parts_a[rank],
            parts_b[rank],
            staging,
            slots,
            progress,
            signal_ptrs,
            counters=counters,
            rank=rank,
            world_size=world_size,
            channel=CHANNEL,
            order_out=order,
        )
        pushes = [(d, staging[d], ws.buffer(d, (world_size, m, n), dtype)[rank]) for d in peers]
        copies = pusher.run(produce, pushes, progress, CHANNEL * world_size + rank)
        out = torch.full((m, n), NAN, dtype=dtype)
        kernels.reduce_slots(
            slots,
            out,
            signal_ptrs,
            status=status,
            rank=rank,
            world_size=world_size,
            channel=CHANNEL,
            timeout_s=60.0,
        )
        copies.join()
        where = f"call {call} ({dtype}, late rank {_late(world_size, late)})"
        if status.any():
            problems.append(f"{where}: a wait timed out: {status.tolist()}")
        if order.tolist() != _rotation(rank + 1, world_size):
            problems.append(f"{where}: destination order {order.tolist()}")
        if not torch.equal(out, _fixed_order_sum(slots, dtype)):
            problems.append(f"{where}: not the fixed-order fp32 sum of the slots")
        reference = _rs_reference(parts_a, parts_b, rank, m)
        if problem := check_close(where, out, *reference):
            problems.append(problem)
    return problems


@pytest.mark.parametrize(("world_size", "m", "k", "ns"), [(2, 36, 40, (24, 17)), (3, 8, 20, (18,))])
def test_ag_matmul_across_ranks(worlds, world_size, m, k, ns):
    results = worlds(world_size).run(_rank_ag, m, k, ns)
    assert results == [[]] * world_size, results


@pytest.mark.parametrize(("world_size", "m", "k", "n"), [(2, 12, 40, 20), (3, 8, 20, 18)])
def test_matmul_rs_across_ranks(worlds, world_size, m, k, n):
    results = worlds(world_size).run(_rank_rs, m, k, n)
    assert results == [[]] * world_size, results
