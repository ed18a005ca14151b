"""All-gather consumer GEMM: ``C = all_gather(A_s, s = 0..W-1) @ B``, each remote byte read once.

Rank ``s`` publishes its shard ``A_s [m, K]`` in its symmetric buffer, then calls
:func:`signal_ready`, which stores the call's epoch into word ``channel * W + s`` of every rank's
pad (its own included). :func:`ag_matmul_consumer` on rank ``r`` walks its output tiles starting
with rank ``r``'s rows, then ``r+1``'s, ... (mod W). The first column tile of each M tile is its
**puller**: it waits on that word of its own pad, reads its rows of ``A_s`` straight from ``s``'s
buffer, stores them into the local gathered ``A`` as it goes, and once its tile is done releases a
local flag (the epoch) for that M tile. The other column tiles of the M tile acquire the flag and
read the rows from the local ``A``: every remote byte crosses the link once, however wide ``C``
is (peer memory is not cached in this GPU's L2, so reading it once per column tile would cross
the link ``cdiv(N, BLOCK_N)`` times). The launch is persistent (at most one program per SM, each
looping over tiles), and tiles are handed out by an atomic ticket in that order, so a puller has
always been drawn by a running program before the tiles that wait for it: no tile can wait for
one that is not running. Further right-hand matrices of the same call read the local ``A`` only
(no waits), their tiles strided over the programs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from tp_kernels.kernels._shared import (
    DEFAULT_TIMEOUT_S,
    GROUP_M,
    INTERPRET,
    _accumulate,
    _note_first_touch,
    _round_to,
    _tile_coords,
    _tile_span,
    _wait_signal,
    check_ptr_table,
    check_status,
    check_tensor,
    check_world,
    dot_precision,
    gemm_configs,
    new_trace,
    on_device,
    persistent_programs,
    set_block_shape,
    store_order,
    timeout_ns,
    tl_dtype,
    tma_layout,
    tma_operand,
    tma_supported,
)


@triton.jit(do_not_specialize=["rank", "channel", "epoch"])
def _signal_ready_kernel(signal_ptrs, rank, world_size, channel, epoch):
    """``pad_d[channel * W + rank] = epoch`` for the rank ``d = program_id(0)`` (release, sys)."""
    dst = tl.program_id(0)
    pad = tl.load(signal_ptrs + dst).to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(pad + channel * world_size + rank, epoch, sem="release", scope="sys")


def _set_block_shapes(nargs: dict) -> None:
    """Autotuner pre-hook: the descriptors' block shapes are those of the config being run."""
    set_block_shape(nargs["a_local_desc"], nargs["A_LAYOUT"], nargs["BLOCK_M"], nargs["BLOCK_K"])
    set_block_shape(nargs["b"], nargs["B_LAYOUT"], nargs["BLOCK_K"], nargs["BLOCK_N"])


@triton.autotune(
    configs=gemm_configs(pre_hook=_set_block_shapes),
    key=["m", "K", "N", "DTYPE", "PULL", "A_LAYOUT", "B_LAYOUT"],
)
@triton.jit(do_not_specialize=["rank", "channel", "epoch", "status_addr", "timeout_ns"])
def _ag_matmul_kernel(
    a_ptrs,
    signal_ptrs,
    b,
    c_ptr,
    a_local_ptr,
    a_local_desc,
    flags_ptr,
    sched_ptr,
    trace_ptr,
    status_addr,
    rank,
    world_size,
    m,
    K,
    N,
    stride_bk,
    stride_bn,
    channel,
    epoch,
    timeout_ns,
    DTYPE: tl.constexpr,
    PULL: tl.constexpr,
    A_LAYOUT: tl.constexpr,
    B_LAYOUT: tl.constexpr,
    TRACE: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Output tiles: ``C[s*m + i, n] = sum_k A_s[i, k] * B[k, n]`` (fp32 accumulation).

    ``a_ptrs[s]``: address of rank s's shard A_s [m, K] in its symmetric buffer (row-major,
    16-byte aligned); ``a_local`` [W*m, K] is this rank's gathered A (``a_local_ptr``, and
    ``a_local_desc``: a descriptor over it when ``A_LAYOUT == "rc"``, which only launches without
    PULL use); ``b`` is B [K, N] as :func:`_load_block` reads it with ``B_LAYOUT`` (strides
    ``stride_bk``, ``stride_bn`` for ``"pointer"``); C [W*m, N] is row-major. Tile ``t`` covers
    M tile ``t // (cdiv(m, BLOCK_M) * cdiv(N, BLOCK_N))`` and on (:func:`_tile_coords`), rows of
    rank ``s = (rank + m_tile // cdiv(m, BLOCK_M)) % W``, so the first tiles use this rank's own
    rows. PULL (the call's first launch): tiles come from the ticket ``sched[0]``; the first
    column tile of an M tile waits for ``epoch`` in word ``channel * W + s`` of this rank's pad,
    reads A_s, stores it into ``a_local`` and then releases ``flags[M tile] = epoch``; the other
    column tiles acquire that flag and read ``a_local``; the program that draws the last ticket
    zeroes ``sched`` for the next launch. On a timeout ``status[s] = epoch``. Without PULL every
    tile reads ``a_local``, complete since the first launch (stream order). Persistent: the grid
    has at most :func:`~._shared.persistent_programs` programs, each looping over tiles
    (by ticket with PULL, else strided by the grid size).
    """
    n_tiles = tl.cdiv(N, BLOCK_N)
    tiles_per_shard = tl.cdiv(m, BLOCK_M)
    total = world_size * tiles_per_shard * n_tiles
    programs = tl.num_programs(0)
    # Persistent: each program computes tiles until none is left (the grid is at most one
    # program per SM, so no program waits behind another for a place to run).
    if PULL:
        tile = tl.atomic_add(sched_ptr, 1, sem="relaxed", scope="gpu")
    else:
        tile = tl.program_id(0)
    while tile < total:
        m_tile, col_tile = _tile_coords(tile, tiles_per_shard, n_tiles, GROUP_M)
        src = (rank + m_tile // tiles_per_shard) % world_size
        row0, rows64, cols64, row_ok, col_ok = _tile_span(
            m_tile, col_tile, tiles_per_shard, m, N, BLOCK_M, BLOCK_N
        )
        local_rows = a_local_ptr + src.to(tl.int64) * m * K
        puller = PULL & (col_tile == 0)
        if PULL:
            # The puller waits for the peer's data, every other tile for the puller's local copy:
            # one wait, on the address of one word or the other.
            pad = tl.load(signal_ptrs + rank)
            ready_word = pad + (channel * world_size + src).to(tl.int64) * 4
            flag_word = flags_ptr.to(tl.int64) + m_tile.to(tl.int64) * 4
            word = tl.where(puller, ready_word, flag_word).to(tl.pointer_type(tl.int32))
            status = status_addr.to(tl.pointer_type(tl.int32))
            _wait_signal(word, epoch, timeout_ns, status + src)
            # Symmetric buffers (and their halves) start on 16-byte multiples; Triton cannot see
            # that through an address loaded from a table.
            remote = tl.load(a_ptrs + src)
            a_base = tl.where(puller, remote, local_rows.to(tl.int64)).to(tl.pointer_type(DTYPE))
            a_base = tl.multiple_of(a_base, 16)
        else:
            a_base = local_rows
        if TRACE:
            _note_first_touch(trace_ptr, src, world_size)

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if A_LAYOUT == "rc":
                # Rows past this shard's m come from the next shard (or TMA's zero fill): they only
                # reach output rows that the masked store below drops.
                a = a_local_desc.load([src * m + row0, k0])
            else:
                ks = k0 + tl.arange(0, BLOCK_K)
                a_mask = row_ok[:, None] & (ks < K)[None, :]
                a_offsets = rows64[:, None] * K + ks[None, :]
                a = tl.load(a_base + a_offsets, mask=a_mask, other=0.0)
                if PULL:
                    tl.store(local_rows + a_offsets, a, mask=a_mask & puller)
            acc = _accumulate(
                acc, a, b, k0, col_tile * BLOCK_N, K, N, stride_bk, stride_bn, B_LAYOUT, BLOCK_K,
                BLOCK_N, BF16_BY_HAND, INPUT_PRECISION,
            )  # fmt: skip
        c_tile = c_ptr + (src * m + rows64)[:, None] * N + cols64[None, :]
        tl.store(
            c_tile, _round_to(acc, DTYPE, BF16_BY_HAND), mask=row_ok[:, None] & col_ok[None, :]
        )

        if PULL:
            # Every thread's stores of the local rows precede the flag's release.
            tl.debug_barrier()
            if puller:
                tl.atomic_xchg(flags_ptr + m_tile, epoch, sem="release", scope="gpu")
        if PULL:
            tile = tl.atomic_add(sched_ptr, 1, sem="relaxed", scope="gpu")
        else:
            tile += programs
    if PULL:
        # Every program draws tickets until one is past the last tile, so the launch draws
        # total + programs of them; whoever draws the last knows no program draws again and
        # zeroes the ticket for the next launch.
        if tile == total + programs - 1:
            tl.atomic_xchg(sched_ptr, 0, sem="relaxed", scope="gpu")


def signal_ready(
    signal_ptrs: torch.Tensor, *, rank: int, world_size: int, channel: int, epoch: int
) -> None:
    """Announce "rank ``rank``'s data for ``epoch`` is ready" to every rank, itself included.

    Stores ``epoch`` into word ``channel * W + rank`` of every pad ``signal_ptrs[d]`` with release
    semantics at system scope. Call it after the data is in place (on a GPU: on the stream that
    wrote it, so stream order puts the writes first).

    Args:
        signal_ptrs: int64 [W], address of each rank's signal pad (int32 words) in this process.
    """
    check_world(rank, world_size, channel, epoch)
    check_ptr_table(signal_ptrs, world_size, signal_ptrs.device, argument="signal_ptrs")
    with on_device(signal_ptrs.device):
        _signal_ready_kernel[(world_size,)](signal_ptrs, rank, world_size, channel, epoch)


def flag_words(world_size: int, m: int) -> int:
    """How many int32 flags :func:`ag_matmul_consumer` needs for ``m`` rows per rank: one per M
    tile of the smallest tile any config uses."""
    smallest = min(c.kwargs["BLOCK_M"] for c in gemm_configs())
    return world_size * triton.cdiv(m, smallest)


def new_flags(world_size: int, m: int, device: torch.device) -> torch.Tensor:
    """Zeroed local-arrival flags of :func:`ag_matmul_consumer` for ``m`` rows per rank."""
    return torch.zeros(flag_words(world_size, m), dtype=torch.int32, device=device)


def new_sched(device: torch.device) -> torch.Tensor:
    """The zeroed tile ticket of :func:`ag_matmul_consumer` (int32 [1]); the kernel leaves it
    zeroed, so one tensor serves every launch on one stream."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def ag_matmul_consumer(
    a_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    bs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    *,
    a_local: torch.Tensor,
    flags: torch.Tensor,
    sched: torch.Tensor,
    status: torch.Tensor,
    rank: int,
    world_size: int,
    channel: int,
    epoch: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    order_out: torch.Tensor | None = None,
) -> None:
    """``A = cat_s A_s`` into ``a_local`` and ``outs[j] = A @ bs[j]`` for every j (one launch per
    j), each peer's rows read from its memory once.

    Shapes (W = ``world_size``): every A_s is [m, K]; ``a_local`` is [W*m, K], contiguous;
    ``bs[j]`` is [K, N_j] with any strides (on sm_90 and newer read with TMA when its layout
    allows, see :func:`tp_kernels.kernels.tma_layout`, else through its strides); ``outs[j]`` is
    [W*m, N_j], contiguous; all share one dtype (fp32, fp16 or bf16) and device. Rank s's rows
    are read once its ready word (``channel * W + s`` of this rank's pad) holds ``epoch``; see
    :func:`signal_ready`. Call this rank's
    :func:`signal_ready` first (on a GPU, on the same stream): the kernel's tiles hold the device
    while they wait, so a signal queued behind them would never run. Nothing here synchronizes
    with the device.

    Args:
        a_ptrs: int64 [W], address of rank s's shard A_s (its symmetric buffer) in this process;
            each a multiple of 16 bytes (symmetric buffers and their halves are).
        signal_ptrs: int64 [W], address of rank s's signal pad; this rank waits on its own.
        bs, outs: the right-hand matrices and their outputs (written in place).
        a_local: receives the gathered A; the GEMMs read the peers' rows from it.
        flags: int32, at least :func:`flag_words` of them, on the device: "the rows of M tile t
            are in ``a_local``", as epochs (one buffer per caller, never reset: each call waits for
            its own epoch).
        sched: int32 [1], zero, on the device: the tile ticket; the kernel leaves it zeroed, so
            one serves every launch on one stream.
        status: the timeout record (:func:`tp_kernels.kernels.new_status`): a wait for rank s
            that passes ``timeout_s`` stores ``epoch`` into ``status[s]``; read it with
            :func:`tp_kernels.kernels.raise_on_timeout`.
        timeout_s: deadline of each wait.
        order_out: optional int [W]; receives the source ranks in the order the kernel first
            touched them (a trace for tests and debugging; adds one atomic per tile).
    """
    check_world(rank, world_size, channel, epoch)
    dtype, device = bs[0].dtype, bs[0].device
    m, K = outs[0].shape[0] // world_size, bs[0].shape[0]
    need = flag_words(world_size, m)
    if flags.dtype != torch.int32 or flags.dim() != 1 or flags.numel() < need:
        raise ValueError(
            f"flags: got {flags.dtype} of shape {tuple(flags.shape)}, expected int32 with at "
            f"least {need} words (flag_words({world_size}, {m}))"
        )
    check_tensor(flags, tuple(flags.shape), torch.int32, device, argument="flags")
    check_tensor(sched, (1,), torch.int32, device, argument="sched")
    check_ptr_table(a_ptrs, world_size, device, argument="a_ptrs")
    check_ptr_table(signal_ptrs, world_size, device, argument="signal_ptrs")
    check_status(status, world_size)
    trace = new_trace(order_out, world_size, device)
    DTYPE = tl_dtype(dtype, argument="bs[0]")
    wait_ns = timeout_ns(timeout_s)
    tma = tma_supported(device, dtype)
    programs = persistent_programs(device)
    with on_device(device):
        for j, (b, c) in enumerate(zip(bs, outs)):
            first = j == 0
            n = b.shape[1]
            # The first launch reads peers' rows and stores them into a_local: pointer loads.
            a_layout = "pointer" if first or not tma else tma_layout(a_local)
            b_layout = tma_layout(b) if tma else "pointer"

            def grid(meta: dict, n: int = n) -> tuple[int]:
                tiles = triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])
                return (min(world_size * tiles, programs),)

            _ag_matmul_kernel[grid](
                a_ptrs,
                signal_ptrs,
                tma_operand(b, b_layout),
                c,
                a_local,
                tma_operand(a_local, a_layout),
                flags,
                sched,
                trace if first and trace is not None else a_ptrs,
                status.data_ptr(),
                rank,
                world_size,
                m,
                K,
                n,
                b.stride(0),
                b.stride(1),
                channel,
                epoch,
                wait_ns,
                DTYPE=DTYPE,
                PULL=first,
                A_LAYOUT=a_layout,
                B_LAYOUT=b_layout,
                TRACE=first and trace is not None,
                BF16_BY_HAND=INTERPRET and dtype == torch.bfloat16,
                INPUT_PRECISION=dot_precision(dtype),
            )
    store_order(trace, order_out, world_size)
