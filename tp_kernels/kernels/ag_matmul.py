"""All-gather consumer GEMM: ``C = all_gather(A_s, s = 0..W-1) @ B`` by pulling from peers.

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
    check_status,
    check_world,
    dot_precision,
    gemm_configs,
    new_trace,
    on_device,
    store_order,
    timeout_ns,
    tl_dtype,
)


@triton.jit(do_not_specialize=["rank", "channel", "epoch"])
def _signal_ready_kernel(signal_ptrs, rank, world_size, channel, epoch):
    """``pad_d[channel * W + rank] = epoch`` for the rank ``d = program_id(0)`` (release, sys)."""
    dst = tl.program_id(0)
    pad = tl.load(signal_ptrs + dst).to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(pad + channel * world_size + rank, epoch, sem="release", scope="sys")


@triton.autotune(configs=gemm_configs(), key=["m", "K", "N", "DTYPE", "WRITE_A"])
@triton.jit(do_not_specialize=["rank", "channel", "epoch", "status_addr", "timeout_ns"])
def _ag_matmul_kernel(
    a_ptrs,
    signal_ptrs,
    b_ptr,
    c_ptr,
    a_out_ptr,
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
    WRITE_A: tl.constexpr,
    TRACE: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One output tile: ``C[s*m + i, n] = sum_k A_s[i, k] * B[k, n]`` (fp32 accumulation).

    ``a_ptrs[s]``: address of rank s's shard A_s [m, K] (row-major, 16-byte aligned); B [K, N] is
    read through its strides; C [W*m, N] is row-major. Programs are numbered M-tile-major; M tile
    ``t`` covers rows of rank ``s = (rank + t // cdiv(m, BLOCK_M)) % W``, so the first programs use
    this rank's own rows. Before loading A_s the program waits for ``epoch`` in word
    ``channel * W + s`` of this rank's pad (on timeout: ``status[s] = epoch``). With WRITE_A the
    programs of the first N tile also store the A_s tile they load into the gathered A [W*m, K].
    """
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    m_tile = pid // n_tiles
    col_tile = pid % n_tiles
    tiles_per_shard = tl.cdiv(m, BLOCK_M)
    src = (rank + m_tile // tiles_per_shard) % world_size
    pad = tl.load(signal_ptrs + rank).to(tl.pointer_type(tl.int32))
    status = status_addr.to(tl.pointer_type(tl.int32))
    _wait_signal(pad + channel * world_size + src, epoch, timeout_ns, status + src)
    if TRACE:
        _note_first_touch(trace_ptr, src, world_size)

    # Symmetric buffers (and their halves) start on 16-byte multiples; Triton cannot see that
    # through an address loaded from a table, and without it the loads are not vectorized.
    a_base = tl.multiple_of(tl.load(a_ptrs + src).to(tl.pointer_type(DTYPE)), 16)
    rows = (m_tile % tiles_per_shard) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m
    col_ok = cols < N
    # int64 offsets: W*m*K or W*m*N elements may pass 2**31.
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a_mask = row_ok[:, None] & k_ok[None, :]
        a = tl.load(a_base + rows64[:, None] * K + ks[None, :], mask=a_mask, other=0.0)
        if WRITE_A:
            if col_tile == 0:
                a_out = a_out_ptr + (src * m + rows64)[:, None] * K + ks[None, :]
                tl.store(a_out, a, mask=a_mask)
        b = tl.load(
            b_ptr + ks[:, None].to(tl.int64) * stride_bk + cols64[None, :] * stride_bn,
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        if BF16_BY_HAND:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    c_tile = c_ptr + (src * m + rows64)[:, None] * N + cols64[None, :]
    tl.store(c_tile, _round_to(acc, DTYPE, BF16_BY_HAND), mask=row_ok[:, None] & col_ok[None, :])


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


def ag_matmul_consumer(
    a_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    bs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    *,
    status: torch.Tensor,
    rank: int,
    world_size: int,
    channel: int,
    epoch: int,
    a_out: torch.Tensor | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    order_out: torch.Tensor | None = None,
) -> None:
    """``outs[j][s*m:(s+1)*m] = A_s @ bs[j]`` for every rank s and every j (one launch per j).

    Shapes (W = ``world_size``): every A_s is [m, K]; ``bs[j]`` is [K, N_j] with any strides;
    ``outs[j]`` is [W*m, N_j], contiguous; all share one dtype (fp32, fp16 or bf16) and device.
    Rank s's rows are read once its ready word (``channel * W + s`` of this rank's pad) holds
    ``epoch``; see :func:`signal_ready`. Call this rank's :func:`signal_ready` first (on a GPU, on
    the same stream): this kernel's programs hold the device while they wait, so a signal queued
    behind them would never run. Nothing here synchronizes with the device.

    Args:
        a_ptrs: int64 [W], address of rank s's shard A_s (its symmetric buffer) in this process;
            each a multiple of 16 bytes (symmetric buffers and their halves are).
        signal_ptrs: int64 [W], address of rank s's signal pad; this rank waits on its own.
        bs, outs: the right-hand matrices and their outputs (written in place).
        status: the timeout record (:func:`tp_kernels.kernels.new_status`): a wait for rank s
            that passes ``timeout_s`` stores ``epoch`` into ``status[s]``; read it with
            :func:`tp_kernels.kernels.raise_on_timeout`.
        a_out: optional [W*m, K], contiguous; also receives the gathered A (for ``return_a``).
        timeout_s: deadline of each wait.
        order_out: optional int [W]; receives the source ranks in the order the kernel first
            touched them (a trace for tests and debugging; adds one atomic per tile).
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
        check_matrix(b, (K, n_j), dtype, device, argument=f"bs[{j}]", contiguous=False)
        check_matrix(c, (world_size * m, n_j), dtype, device, argument=f"outs[{j}]")
    if a_out is not None:
        check_matrix(a_out, (world_size * m, K), dtype, device, argument="a_out")
    check_ptr_table(a_ptrs, world_size, device, argument="a_ptrs")
    check_ptr_table(signal_ptrs, world_size, device, argument="signal_ptrs")
    check_status(status, world_size)
    if order_out is not None and tuple(order_out.shape) != (world_size,):
        raise ValueError(f"order_out: got shape {tuple(order_out.shape)}, expected ({world_size},)")

    trace = new_trace(world_size, device) if order_out is not None else None
    wait_ns = timeout_ns(timeout_s)
    with on_device(device):
        for j, (b, c) in enumerate(zip(bs, outs)):
            first = j == 0
            write_a = first and a_out is not None
            n = b.shape[1]

            def grid(meta: dict, n: int = n) -> tuple[int]:
                tiles = triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])
                return (world_size * tiles,)

            _ag_matmul_kernel[grid](
                a_ptrs,
                signal_ptrs,
                b,
                c,
                a_out if write_a else c,
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
                WRITE_A=write_a,
                TRACE=first and trace is not None,
                BF16_BY_HAND=INTERPRET and dtype == torch.bfloat16,
                INPUT_PRECISION=dot_precision(dtype),
            )
    if order_out is not None:
        store_order(trace, order_out, world_size)
