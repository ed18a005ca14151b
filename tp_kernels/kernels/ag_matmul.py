"""All-gather consumer GEMM: ``C_j = all_gather(A_s, s = 0..W-1) @ B_j`` by pulling from peers.

Rank ``s`` publishes its shard ``A_s [m, K]`` in its symmetric buffer, then calls
:func:`signal_ready`, which stores the call's epoch into word ``channel * W + s`` of every rank's
pad (its own included). :func:`ag_matmul_consumer` on rank ``r`` walks its M tiles starting with
rank ``r``'s rows, then ``r+1``'s, ... (mod W); before a tile of rank ``s``'s rows it waits on that
word of its own pad and then loads ``A_s`` straight through ``s``'s buffer address.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from tp_kernels.kernels import (
    DEFAULT_TIMEOUT_S,
    INTERPRET,
    _note_first_touch,
    _round_to,
    _wait_signal,
    check_matrix,
    check_ptr_table,
    check_world,
    dot_precision,
    gemm_configs,
    new_trace,
    raise_on_timeout,
    store_order,
    timeout_ns,
    tl_dtype,
)


@triton.jit
def _signal_ready_kernel(signal_ptrs, rank, world_size, channel, epoch):
    """``pad_d[channel * W + rank] = epoch`` for the rank ``d = program_id(0)`` (release, sys)."""
    dst = tl.program_id(0)
    pad = tl.load(signal_ptrs + dst).to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(pad + channel * world_size + rank, epoch, sem="release", scope="sys")


@triton.autotune(configs=gemm_configs(), key=["m", "K", "n_total", "NUM_B", "DTYPE"])
@triton.jit
def _ag_matmul_kernel(
    a_ptrs,
    signal_ptrs,
    b_ptrs,
    c_ptrs,
    n_sizes,
    a_out_addr,
    status_ptr,
    trace_ptr,
    rank,
    world_size,
    m,
    K,
    n_total,
    channel,
    epoch,
    timeout_ns,
    NUM_B: tl.constexpr,
    DTYPE: tl.constexpr,
    WRITE_A: tl.constexpr,
    TRACE: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One output tile: ``C_j[s*m + i, n] = sum_k A_s[i, k] * B_j[k, n]`` (fp32 accumulation).

    ``a_ptrs[s]``: address of rank s's shard A_s [m, K]; ``b_ptrs[j]`` / ``c_ptrs[j]``: addresses of
    B_j [K, N_j] and C_j [W*m, N_j] with ``N_j = n_sizes[j]``. Programs are numbered M-tile-major
    over the tiles of all j; M tile ``t`` covers rows of rank ``s = (rank + t // cdiv(m, BLOCK_M))
    % W``, so the first programs use this rank's own rows. Before loading A_s the program waits
    for ``epoch`` in word ``channel * W + s`` of this rank's pad. With WRITE_A the programs of the
    first N tile also store the A_s tile they load into the gathered A [W*m, K] at ``a_out_addr``.
    ``n_total`` (sum of the N_j) only keys the autotuning. ALIGNED: every base address is a
    multiple of 16 bytes and every N_j of 8 elements; Triton cannot see that through addresses
    loaded from tables, and without it the loads are neither vectorized nor pipelined.
    """
    pid = tl.program_id(0)
    # Which B_j and which of its column tiles this program owns (tiles of all j side by side).
    n_tiles = 0
    for jj in tl.static_range(NUM_B):
        n_tiles += tl.cdiv(tl.load(n_sizes + jj), BLOCK_N)
    m_tile = pid // n_tiles
    rest = pid % n_tiles
    first_n_tile = rest == 0
    j = 0
    col_tile = 0
    n_j = 0
    for jj in tl.static_range(NUM_B):
        size = tl.load(n_sizes + jj)
        tiles = tl.cdiv(size, BLOCK_N)
        hit = (rest >= 0) & (rest < tiles)
        j = tl.where(hit, jj, j)
        col_tile = tl.where(hit, rest, col_tile)
        n_j = tl.where(hit, size, n_j)
        rest -= tiles

    tiles_per_shard = tl.cdiv(m, BLOCK_M)
    src = (rank + m_tile // tiles_per_shard) % world_size
    pad = tl.load(signal_ptrs + rank).to(tl.pointer_type(tl.int32))
    _wait_signal(pad + channel * world_size + src, epoch, timeout_ns, status_ptr + src)
    if TRACE:
        _note_first_touch(trace_ptr, src, world_size)

    a_base = tl.load(a_ptrs + src).to(tl.pointer_type(DTYPE))
    b_base = tl.load(b_ptrs + j).to(tl.pointer_type(DTYPE))
    c_base = tl.load(c_ptrs + j).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        a_base = tl.multiple_of(a_base, 16)
        b_base = tl.multiple_of(b_base, 16)
        c_base = tl.multiple_of(c_base, 16)
        n_j = tl.multiple_of(n_j, 8)
    rows = (m_tile % tiles_per_shard) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m
    col_ok = cols < n_j
    # int64 row offsets: W*m*K or W*m*N elements may pass 2**31.
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a_mask = row_ok[:, None] & k_ok[None, :]
        a = tl.load(a_base + rows64[:, None] * K + ks[None, :], mask=a_mask, other=0.0)
        if WRITE_A:
            if first_n_tile:
                a_out = a_out_addr.to(tl.pointer_type(DTYPE))
                tl.store(a_out + (src * m + rows64)[:, None] * K + ks[None, :], a, mask=a_mask)
        b = tl.load(
            b_base + ks[:, None].to(tl.int64) * n_j + cols[None, :],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        if BF16_BY_HAND:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    c_ptrs_tile = c_base + (src * m + rows64)[:, None] * n_j + cols[None, :]
    tl.store(
        c_ptrs_tile, _round_to(acc, DTYPE, BF16_BY_HAND), mask=row_ok[:, None] & col_ok[None, :]
    )


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
    _signal_ready_kernel[(world_size,)](signal_ptrs, rank, world_size, channel, epoch)


def ag_matmul_consumer(
    a_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    bs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    *,
    rank: int,
    world_size: int,
    channel: int,
    epoch: int,
    a_out: torch.Tensor | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    check: bool = True,
    group_name: str | None = None,
    order_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``outs[j][s*m:(s+1)*m] = A_s @ bs[j]`` for every rank s and every j, in one launch.

    Shapes (W = ``world_size``): every A_s is [m, K]; ``bs[j]`` is [K, N_j]; ``outs[j]`` is
    [W*m, N_j]; all share one dtype (fp32, fp16 or bf16) and device and are contiguous.
    Rank s's rows are read once its ready word (``channel * W + s`` of this rank's pad) holds
    ``epoch``; see :func:`signal_ready`. Call this rank's :func:`signal_ready` first (on a GPU, on
    the same stream): this kernel's programs hold the device while they wait, so a signal queued
    behind them would never run.

    Args:
        a_ptrs: int64 [W], address of rank s's shard A_s (its symmetric buffer) in this process;
            each must be a multiple of 16 bytes (symmetric buffers and their halves are).
        signal_ptrs: int64 [W], address of rank s's signal pad; this rank waits on its own.
        bs, outs: the right-hand matrices and their outputs (written in place).
        a_out: optional [W*m, K]; also receives the gathered A (for ``return_a``).
        timeout_s: deadline of each wait.
        check: raise :class:`PeerWaitTimeout` if a wait timed out (synchronizes with the device);
            with ``check=False`` inspect the returned status yourself.
        group_name: named in the timeout error.
        order_out: optional int [W]; receives the source ranks in the order the kernel first
            touched them (a trace for tests and debugging; adds one atomic per tile).

    Returns:
        int32 [W] status: ``status[s] == 1`` if the wait for rank s timed out.
    """
    check_world(rank, world_size, channel, epoch)
    if len(bs) == 0 or len(bs) != len(outs):
        raise ValueError(
            f"bs, outs: got {len(bs)} and {len(outs)} matrices, expected the same "
            "number, at least one"
        )
    b0 = bs[0]
    if b0.dim() != 2:
        raise ValueError(f"bs[0]: got shape {tuple(b0.shape)}, expected [K, N_0]")
    dtype, device = b0.dtype, b0.device
    DTYPE = tl_dtype(dtype, argument="bs[0]")
    K = b0.shape[0]
    if outs[0].dim() != 2 or outs[0].shape[0] % world_size or outs[0].shape[0] == 0:
        raise ValueError(
            f"outs[0]: got shape {tuple(outs[0].shape)}, expected [W*m, N_0] with "
            f"W={world_size} and m >= 1"
        )
    m = outs[0].shape[0] // world_size
    if K == 0:
        raise ValueError(f"bs[0]: got shape {tuple(b0.shape)}, expected K >= 1")
    for j, (b, c) in enumerate(zip(bs, outs, strict=True)):
        n_j = b.shape[1] if b.dim() == 2 else -1
        if n_j < 1:
            raise ValueError(f"bs[{j}]: got shape {tuple(b.shape)}, expected [{K}, N] with N >= 1")
        check_matrix(b, (K, n_j), dtype, device, argument=f"bs[{j}]")
        check_matrix(c, (world_size * m, n_j), dtype, device, argument=f"outs[{j}]")
    if a_out is not None:
        check_matrix(a_out, (world_size * m, K), dtype, device, argument="a_out")
    check_ptr_table(a_ptrs, world_size, device, argument="a_ptrs")
    check_ptr_table(signal_ptrs, world_size, device, argument="signal_ptrs")
    if order_out is not None and tuple(order_out.shape) != (world_size,):
        raise ValueError(f"order_out: got shape {tuple(order_out.shape)}, expected ({world_size},)")

    b_ptrs = torch.tensor([b.data_ptr() for b in bs], dtype=torch.int64, device=device)
    c_ptrs = torch.tensor([c.data_ptr() for c in outs], dtype=torch.int64, device=device)
    n_sizes = torch.tensor([b.shape[1] for b in bs], dtype=torch.int32, device=device)
    status = torch.zeros(world_size, dtype=torch.int32, device=device)
    trace = new_trace(world_size, device) if order_out is not None else status

    def grid(meta: dict) -> tuple[int]:
        tiles_n = sum(triton.cdiv(b.shape[1], meta["BLOCK_N"]) for b in bs)
        return (world_size * triton.cdiv(m, meta["BLOCK_M"]) * tiles_n,)

    _ag_matmul_kernel[grid](
        a_ptrs,
        signal_ptrs,
        b_ptrs,
        c_ptrs,
        n_sizes,
        a_out.data_ptr() if a_out is not None else 0,
        status,
        trace,
        rank,
        world_size,
        m,
        K,
        sum(b.shape[1] for b in bs),
        channel,
        epoch,
        timeout_ns(timeout_s),
        NUM_B=len(bs),
        DTYPE=DTYPE,
        WRITE_A=a_out is not None,
        TRACE=order_out is not None,
        BF16_BY_HAND=INTERPRET and dtype == torch.bfloat16,
        INPUT_PRECISION=dot_precision(dtype),
        ALIGNED=all(t.data_ptr() % 16 == 0 and t.shape[1] % 8 == 0 for t in (*bs, *outs)),
    )
    if order_out is not None:
        store_order(trace, order_out, world_size)
    if check:
        raise_on_timeout(
            status,
            what="ag_matmul_consumer",
            rank=rank,
            channel=channel,
            epoch=epoch,
            timeout_s=timeout_s,
            group_name=group_name,
        )
    return status
