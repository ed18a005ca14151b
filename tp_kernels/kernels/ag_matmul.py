"""All-gather consumer GEMM: ``C = all_gather(A_s, s = 0..W-1) @ B`` from a local gathered ``A``
that a copy engine fills chunk by chunk.

A call opens with :func:`barrier` on the start channel (which also clears the progress words:
every peer has finished its previous call, so none still reads this rank's buffer), then rank
``s`` publishes its shard ``A_s [m, K]`` in its symmetric buffer and a second :func:`barrier`
on the publish channel returns once every peer's shard is there. A copier outside the kernels
(the copy engine on a side stream on a GPU, a host thread on a CPU: see
:mod:`tp_kernels.backends.symm_gather`) then copies each peer's shard, ``r+1, r+2, ...`` (mod
W), in chunks of ``chunk_rows`` rows into the local gathered ``A`` [W*m, K], and after each
chunk raises a local **progress word** (word ``s * chunks + j`` for chunk ``j`` of rank ``s``; a
system-scope fenced stream write on a GPU, a release store on a CPU). The copies of one call run
in order, one after another.

:func:`ag_matmul_consumer` on rank ``r`` walks its output tiles starting with rank ``r``'s rows
(in ``A`` before the launch: stream order), then ``r+1``'s, ... . A tile of rank ``s``'s rows
first waits (acquire, deadline) for the progress word of the chunk holding its last row (the
copies run in order, so every earlier chunk is in place too), then reads ``A`` from local memory
only, with TMA on sm_90 and newer, where it also stores its output tiles with TMA (through a
descriptor over ``C`` viewed as [W, m, N], whose bounds clip a tile's rows at its shard's end).
No SM moves bytes between GPUs and no tile waits for another tile: a tile waits only for the
copy engine, which progresses whatever the SMs do, so the launch may be persistent (at most one
program per SM, tiles strided over the programs) without a ticket.
One launch takes up to three right-hand matrices (QKV's, w1/w3's), each shard's tiles of every
one of them before the next shard's, so all their math overlaps the copies; a call with more runs
further launches after the first on the same stream, which read the complete ``A`` without
waiting.

Scaled (fp8) calls run the same kernel with ``SCALE`` set: ``A`` is then the gathered bytes as
the copier moved them (packed rows ``[W*m, K + 16]``, each row's fp8 data and its fp32 scale at
byte ``K``, or fp8 bytes ``[W*m, K]`` with one tensor-wise scale), under the same progress
words; ``C_j = (A_data @ B_j) * a_scale[:, None] * b_scale_j[None, :]``, the scales applied to
the fp32 accumulator, rounded once to C's dtype (:func:`ag_matmul_consumer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from tp_kernels import signals
from tp_kernels.kernels import tuning
from tp_kernels.kernels._shared import (
    DEFAULT_TIMEOUT_S,
    FP8_DTYPES,
    GROUP_M,
    INTERPRET,
    MX_SCALE_DTYPE,
    RAISED,
    WAIT_CHUNK,
    _accumulate,
    _accumulate_mx,
    _block_scales,
    _fence_proxy_async,
    _note_first_touch,
    _range_arg,
    _round_to,
    _scale_epilogue,
    _tile_coords,
    _tile_span,
    _wait_signal,
    check_block_scales,
    check_ptr_table,
    check_scales,
    check_status,
    check_world,
    dot_precision,
    gemm_configs,
    gemm_kind,
    new_status,
    new_trace,
    on_device,
    persistent_programs,
    scale_stride,
    set_block_shape,
    store_order,
    timeout_ns,
    tl_dtype,
    tma_layout,
    tma_operand,
    tma_supported,
)
from tp_kernels.tiling import MAX_BS_PER_LAUNCH, ROW_SCALE_BYTES, mx_row_bytes


@triton.jit(do_not_specialize=["rank", "channel", "status_addr", "timeout_ns"])
def _barrier_kernel(
    signal_ptrs, words, status_addr, rank, world_size, channel, n_words, slot_channel, timeout_ns,
    CLEAR: tl.constexpr, WORDS_PER_PROGRAM: tl.constexpr, WAIT: tl.constexpr,
):  # fmt: skip
    """Program ``s`` of W: with ``CLEAR``, zero the local words ``words[s], words[s + W], ...``
    (of ``n_words``) and word ``slot_channel * W + s`` of this rank's pad; then, for ``s !=
    rank``, raise word ``channel * W + rank`` of ``s``'s pad (release, sys), wait until word
    ``channel * W + s`` of this rank's pad is raised (acquire, sys; past ``timeout_ns``:
    ``status[s] = WAIT``) and clear it: this program is its only reader."""
    src = tl.program_id(0)
    own_pad = tl.load(signal_ptrs + rank).to(tl.pointer_type(tl.int32))
    if CLEAR:
        # Before the release below: a peer writes into this rank's slot word only after it saw
        # this rank arrive, so the clear cannot land on the peer's signal of this call.
        offsets = src + world_size * tl.arange(0, WORDS_PER_PROGRAM)
        tl.store(words + offsets, tl.zeros((WORDS_PER_PROGRAM,), tl.int32), mask=offsets < n_words)
        tl.atomic_xchg(own_pad + slot_channel * world_size + src, 0, sem="relaxed", scope="sys")
    if src != rank:
        pad = tl.load(signal_ptrs + src).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(pad + channel * world_size + rank, RAISED, sem="release", scope="sys")
        status = status_addr.to(tl.pointer_type(tl.int32))
        word = own_pad + channel * world_size + src
        _wait_signal(word, timeout_ns, status + src, WAIT)
        tl.atomic_xchg(word, 0, sem="relaxed", scope="sys")


# The consumer's TMA stores go in two halves of BLOCK_N / 2 columns from this BLOCK_N on (the
# second half's move into shared memory overlaps the first's store); narrower tiles store whole:
# their epilogue is short, and halving 64x64 tiles made ptxas spill 8 B per thread on sm_100.
_SPLIT_STORES_FROM = tl.constexpr(128)


def store_columns(block_n: int) -> int:
    """The columns of each TMA store of a consumer tile ``block_n`` wide (the block shape of
    its output descriptors), as :func:`_store_tile` splits it."""
    return block_n // 2 if block_n >= _SPLIT_STORES_FROM else block_n


@triton.jit
def _consumer_tile(
    a, a_ptr, b, c, src, m_tile, col_tile, tiles_per_shard, m, K, N, stride_am, stride_bk,
    stride_bn, a_scale_ptr, b_scale_ptr, stride_bsn,
    DTYPE: tl.constexpr, A_LAYOUT: tl.constexpr, B_LAYOUT: tl.constexpr, C_LAYOUT: tl.constexpr,
    SCALE: tl.constexpr, BF16_BY_HAND: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One output tile ``C[src*m + rows, cols] = A[src*m + rows, :] @ B[:, cols]`` (fp32
    accumulation), ``(rows, cols)`` tile ``(m_tile, col_tile)`` of an ``N``-wide ``C``; scaled
    (``SCALE`` ``"row"`` or ``"tensor"``), ``acc * a_scale[rows, None] * b_scale[None, cols]``
    before the one rounding to ``DTYPE`` (see :func:`~._shared._scale_epilogue`); block-scaled
    (``"mx"``), every K step's product scaled (:func:`~._shared._accumulate_mx`); stored through
    ``c``, a descriptor over C viewed as [W, m, N] (``C_LAYOUT == "tma"``) or C's pointer."""
    row0, rows64, cols64, row_ok, col_ok = _tile_span(
        m_tile, col_tile, tiles_per_shard, m, N, BLOCK_M, BLOCK_N
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, _range_arg(K), BLOCK_K):  # _range_arg: for Triton 3.6.0's interpreter
        if A_LAYOUT == "rc":
            # Rows past this shard's m come from the next shard (or TMA's zero fill): they only
            # reach output rows that the masked store below drops.
            a_blk = a.load([src * m + row0, k0])
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            a_offsets = (src * m + rows64)[:, None] * stride_am + ks[None, :]
            a_blk = tl.load(a_ptr + a_offsets, mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
        if SCALE == "mx":
            # A packed MXFP8 row: K e4m3 bytes, then its K / 32 e8m0 scales from byte K.
            a_scales = _block_scales(
                a_ptr.to(tl.pointer_type(tl.uint8)) + K, src * m + rows64, row_ok, stride_am, k0,
                K, BLOCK_K,
            )  # fmt: skip
            acc = _accumulate_mx(
                acc, a_blk, a_scales, b, b_scale_ptr, k0, col_tile * BLOCK_N, cols64, col_ok, K,
                N, stride_bk, stride_bn, stride_bsn, B_LAYOUT, BLOCK_K, BLOCK_N,
            )  # fmt: skip
        else:
            acc = _accumulate(
                acc, a_blk, b, k0, col_tile * BLOCK_N, K, N, stride_bk, stride_bn, B_LAYOUT,
                BLOCK_K, BLOCK_N, BF16_BY_HAND, INPUT_PRECISION,
            )  # fmt: skip
    if SCALE == "row" or SCALE == "tensor":  # (block scales were applied in the K loop)
        if SCALE == "row":
            # A packed row: K fp8 bytes, then its fp32 scale at byte K (16-byte aligned rows).
            row_bytes = a_ptr.to(tl.pointer_type(tl.uint8)) + (src * m + rows64) * stride_am + K
            a_scale = tl.load(row_bytes.to(tl.pointer_type(tl.float32)), mask=row_ok, other=0.0)
        else:
            a_scale = tl.load(a_scale_ptr)
        acc = _scale_epilogue(acc, a_scale, SCALE == "row", b_scale_ptr, cols64, col_ok, stride_bsn)
    _store_tile(
        c, _round_to(acc, DTYPE, BF16_BY_HAND), src, row0, col_tile * BLOCK_N, m, N, C_LAYOUT,
        BLOCK_M, BLOCK_N,
    )  # fmt: skip


@triton.jit
def _store_tile(
    c, out, src, row0, col0, m, N,
    C_LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``C[src*m + row0 + i, col0 + n] = out[i, n]`` for the tile's rows inside shard ``src``
    (``row0 + i < m``) and columns inside C (``col0 + n < N``), nothing else: rows past ``m``
    belong to shard ``src + 1``, whose tiles may already have stored them. ``c`` is a
    descriptor over C's view [W, m, N] (``C_LAYOUT == "tma"``), or C's pointer."""
    if C_LAYOUT == "tma":
        # TMA clips a store at the view's bounds, so at m within block [src]; wide tiles in two
        # halves (store_columns).
        if BLOCK_N >= _SPLIT_STORES_FROM:
            halves = out.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
            c.store([src, row0, col0], halves[0].reshape(1, BLOCK_M, BLOCK_N // 2))
            c.store([src, row0, col0 + BLOCK_N // 2], halves[1].reshape(1, BLOCK_M, BLOCK_N // 2))
        else:
            c.store([src, row0, col0], out.reshape(1, BLOCK_M, BLOCK_N))
    else:
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)
        c_tile = c + (src * m + rows.to(tl.int64))[:, None] * N + cols.to(tl.int64)[None, :]
        tl.store(c_tile, out, mask=(rows < m)[:, None] & (cols < N)[None, :])


@triton.jit(do_not_specialize=["rank", "status_addr", "timeout_ns"])
def _ag_matmul_kernel(
    a,
    b0,
    b1,
    b2,
    c0,
    c1,
    c2,
    a_ptr,
    a_scale_ptr,
    b0_scale,
    b1_scale,
    b2_scale,
    progress_addr,
    trace_ptr,
    status_addr,
    rank,
    world_size,
    m,
    K,
    N0,
    N1,
    N2,
    stride_am,
    stride_b0k,
    stride_b0n,
    stride_b1k,
    stride_b1n,
    stride_b2k,
    stride_b2n,
    stride_b0s,
    stride_b1s,
    stride_b2s,
    chunk_rows,
    chunks,
    timeout_ns,
    DTYPE: tl.constexpr,
    WAIT: tl.constexpr,
    A_LAYOUT: tl.constexpr,
    B_LAYOUT: tl.constexpr,
    C_LAYOUT: tl.constexpr,
    NUM_B: tl.constexpr,
    SCALE: tl.constexpr,
    TRACE: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Output tiles of ``NUM_B`` (1 to 3) products: ``C_j[s*m + i, n] = sum_k A[s*m + i, k] *
    B_j[k, n]`` (fp32 accumulation) for ``j < NUM_B``, rounded once to ``DTYPE`` (C's dtype).

    ``A`` [W*m, K] is the local gathered A, rows ``stride_am`` elements apart (unit column
    stride): ``a`` is a descriptor over it when ``A_LAYOUT == "rc"``, else ``a_ptr`` is read
    through pointers (``a`` is then ``a_ptr``); ``a_ptr`` always points at it. ``SCALE``:
    ``"none"``, or fp8 operands (A and the B_j e4m3 or e5m2) whose fp32 dequant scales multiply
    the accumulator before the rounding, ``C_j = (acc * a_scale[:, None]) * b_scale_j[None, :]``:
    ``"row"``, A's rows are packed (``stride_am = K + 16`` bytes, row ``i``'s scale the fp32 at
    byte ``K`` of the row: :func:`tp_kernels.backends.scaled.pack_rows`); ``"tensor"``, A is plain
    fp8 and its one scale is ``*a_scale_ptr``. ``bj_scale[n * stride_bjs]`` is B_j's scale of
    column ``n`` (stride 0: one scale). Or ``"mx"``, MXFP8 (e4m3 with e8m0 scales per 32
    elements along K, applied in every K step): A's rows are packed (``stride_am =
    mx_row_bytes(K)``, row ``i``'s scales the bytes from ``K`` on:
    :func:`tp_kernels.backends.scaled.pack_mx_rows`), ``bj_scale[n * stride_bjs + kb]`` is
    B_j's scale byte of column ``n`` and K block ``kb``;
    ``b_j`` is B_j [K, N_j] as :func:`_load_block` reads it with ``B_LAYOUT`` (strides
    ``stride_bjk``, ``stride_bjn`` for ``"pointer"``); C_j [W*m, N_j] is row-major: ``c_j`` is
    a descriptor over its view [W, m, N_j] when ``C_LAYOUT == "tma"``, else its pointer.
    Tiles go shard by shard, rank ``s = (rank + step) % W`` at step ``step``, so the first tiles
    use this rank's own rows; inside a shard, B_0's tiles, then B_1's, then B_2's, each in
    :func:`_tile_coords`'s order. WAIT (the call's first launch): a tile of a peer's rows first
    waits until progress word ``s * chunks + (last row // chunk_rows)`` (int32 at
    ``progress_addr``) is raised (acquire, system scope); on a timeout ``status[s] =
    WAIT_CHUNK``. Persistent:
    the grid has at most :func:`~._shared.persistent_programs` programs, each taking every
    ``num_programs``-th tile.
    """
    tiles_per_shard = tl.cdiv(m, BLOCK_M)
    per_b0 = tiles_per_shard * tl.cdiv(N0, BLOCK_N)
    per_b1 = 0
    per_b2 = 0
    if NUM_B >= 2:
        per_b1 = tiles_per_shard * tl.cdiv(N1, BLOCK_N)
    if NUM_B >= 3:
        per_b2 = tiles_per_shard * tl.cdiv(N2, BLOCK_N)
    per_shard = per_b0 + per_b1 + per_b2
    tile = tl.program_id(0)
    while tile < world_size * per_shard:
        step = tile // per_shard
        t = tile % per_shard
        src = (rank + step) % world_size
        # Which product the tile belongs to, and its number among that product's tiles (by
        # where, not branches: a size the runtime specializes to a constant 1 is a constexpr).
        j = (t >= per_b0).to(tl.int32) + (t >= per_b0 + per_b1).to(tl.int32)
        t -= tl.where(j >= 1, per_b0, 0) + tl.where(j >= 2, per_b1, 0)
        n_tiles = tl.where(j == 0, per_b0, tl.where(j == 1, per_b1, per_b2)) // tiles_per_shard
        m_tile, col_tile = _tile_coords(step * tiles_per_shard * n_tiles + t, tiles_per_shard,
                                        n_tiles, GROUP_M)  # fmt: skip
        if WAIT:
            if step > 0:
                # Copies run in order: the chunk of the tile's last row completes its rows.
                last = tl.minimum((m_tile % tiles_per_shard) * BLOCK_M + BLOCK_M, m) - 1
                word = progress_addr.to(tl.pointer_type(tl.int32)) + src * chunks
                status = status_addr.to(tl.pointer_type(tl.int32))
                _wait_signal(word + last // chunk_rows, timeout_ns, status + src, WAIT_CHUNK)
                if A_LAYOUT == "rc":
                    # TMA reads through the async proxy: order it after the acquire.
                    _fence_proxy_async(src)
        if TRACE:
            _note_first_touch(trace_ptr, src, world_size)
        # One call per product: a tensor descriptor cannot be picked at run time, so each
        # operand has its own (inlined) tile loop, pruned by NUM_B.
        if j == 0:
            _consumer_tile(
                a, a_ptr, b0, c0, src, m_tile, col_tile, tiles_per_shard, m, K, N0, stride_am,
                stride_b0k, stride_b0n, a_scale_ptr, b0_scale, stride_b0s, DTYPE, A_LAYOUT,
                B_LAYOUT, C_LAYOUT, SCALE, BF16_BY_HAND, INPUT_PRECISION, BLOCK_M, BLOCK_N,
                BLOCK_K,
            )  # fmt: skip
        if NUM_B >= 2:
            if j == 1:
                _consumer_tile(
                    a, a_ptr, b1, c1, src, m_tile, col_tile, tiles_per_shard, m, K, N1,
                    stride_am, stride_b1k, stride_b1n, a_scale_ptr, b1_scale, stride_b1s,
                    DTYPE, A_LAYOUT, B_LAYOUT, C_LAYOUT, SCALE, BF16_BY_HAND, INPUT_PRECISION,
                    BLOCK_M, BLOCK_N, BLOCK_K,
                )  # fmt: skip
        if NUM_B >= 3:
            if j == 2:
                _consumer_tile(
                    a, a_ptr, b2, c2, src, m_tile, col_tile, tiles_per_shard, m, K, N2,
                    stride_am, stride_b2k, stride_b2n, a_scale_ptr, b2_scale, stride_b2s,
                    DTYPE, A_LAYOUT, B_LAYOUT, C_LAYOUT, SCALE, BF16_BY_HAND, INPUT_PRECISION,
                    BLOCK_M, BLOCK_N, BLOCK_K,
                )  # fmt: skip
        tile += tl.num_programs(0)


def _launch_groups(layouts: Sequence[str]) -> list[list[int]]:
    """The indices of the right-hand matrices, in order, cut into launches: runs of one layout
    (a launch reads every ``b`` the same way), at most :data:`MAX_BS_PER_LAUNCH` each."""
    groups: list[list[int]] = []
    for j, layout in enumerate(layouts):
        if groups and layout == layouts[groups[-1][0]] and len(groups[-1]) < MAX_BS_PER_LAUNCH:
            groups[-1].append(j)
        else:
            groups.append([j])
    return groups


def _c_operand(out: torch.Tensor, world_size: int, m: int, layout: str) -> object:
    """What the consumer takes for the output ``out`` [W*m, N]: with ``layout == "tma"`` a
    descriptor over its view [W, m, N] (its block shape set before each launch), else ``out``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if layout != "tma":
        return out
    return TensorDescriptor.from_tensor(out.view(world_size, m, out.shape[1]), [1, 16, 16])


def barrier(
    signal_ptrs: torch.Tensor,
    *,
    status: torch.Tensor,
    rank: int,
    world_size: int,
    channel: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    clear: tuple[torch.Tensor, int] | None = None,
    wait: int = signals.WAIT_PUBLISHED,
) -> None:
    """A barrier of the group on signal channel ``channel``: returns (in stream order) once every
    peer has reached its own barrier on that channel. One program per rank; word ``channel * W +
    s`` of rank ``d``'s pad is raised by ``s`` (release, system scope) and waited for and
    cleared by ``d`` (acquire, bounded by ``timeout_s``: a wait past it stores ``wait``, a
    ``WAIT_*`` code, into ``status[s]``). Nothing depends on the call: a replayed launch is the
    same barrier. A peer's next raise of the word comes after its next barrier on another
    channel, which needs this rank's arrival, made after this barrier ended: so a word is never
    raised twice before it is cleared.

    ``clear=(words, slot_channel)``: before arriving, zero the local int32 ``words`` (the
    progress words, contiguous, on the pad's device) and this rank's slot words (word
    ``slot_channel * W + s`` of its pad, raised by peer ``s`` for the reduce-scatter), each
    peer's before this rank's arrival is released to that peer. The start barrier of a call
    clears them: every reader and writer of the previous call is finished in stream order, and
    no peer writes one for this call before it sees this rank arrive.

    On a GPU it runs on the current stream; nothing here synchronizes with the device.

    Args:
        signal_ptrs: int64 [W], address of each rank's signal pad (int32 words) in this process.
        status: the timeout record (:func:`tp_kernels.kernels.new_status`).
    """
    check_world(rank, world_size, channel)
    check_ptr_table(signal_ptrs, world_size, signal_ptrs.device, argument="signal_ptrs")
    check_status(status, world_size)
    if clear is None:
        words, slot_channel, n_words = signal_ptrs, 0, 0  # not read (CLEAR=False)
    else:
        words, slot_channel = clear
        n_words = words.numel()
        check_progress(words, n_words, signal_ptrs.device, argument="clear[0] (the words)")
    per_program = triton.next_power_of_2(max(-(-n_words // world_size), 1))
    with on_device(signal_ptrs.device):
        _barrier_kernel[(world_size,)](
            signal_ptrs,
            words,
            status.data_ptr(),
            rank,
            world_size,
            channel,
            n_words,
            slot_channel,
            timeout_ns(timeout_s),
            CLEAR=clear is not None,
            WORDS_PER_PROGRAM=per_program,
            WAIT=wait,
        )


def check_progress(
    progress: torch.Tensor, words: int, device: torch.device, *, argument: str = "progress"
) -> None:
    """``progress`` must be a contiguous int32 (or uint32) vector of at least ``words`` words on
    ``device``: the call's progress words, one per chunk of each rank's shard."""
    if (
        progress.dtype not in (torch.int32, torch.uint32)
        or progress.dim() != 1
        or progress.numel() < words
        or progress.device != device
        or not progress.is_contiguous()
    ):
        raise ValueError(
            f"{argument}: got {progress.dtype} of shape {tuple(progress.shape)} on "
            f"{progress.device}, expected a contiguous int32 vector of at least {words} words "
            f"on {device}"
        )


def _scaled_operands(
    a: torch.Tensor,
    bs: Sequence[torch.Tensor],
    a_dtype: torch.dtype | None,
    a_scale: torch.Tensor | None,
    b_scales: Sequence[torch.Tensor] | None,
) -> tuple[torch.Tensor, int, str, Callable[[list[int]], tuple]]:
    """``(A's data as the kernel reads it, K, SCALE, scale_args)`` of :func:`ag_matmul_consumer`'s
    operands; ``scale_args(group)`` gives a launch's ``(a_scale, [b_j scales], [their strides])``
    (unread tensors where unscaled)."""
    if b_scales is None:
        if a_dtype is not None or a_scale is not None:
            raise ValueError("a_dtype and a_scale: only with b_scales (a scaled call)")
        return a, a.shape[1], "none", lambda group: (a, [a] * len(group), [0] * len(group))
    K = bs[0].shape[0]
    block_scaled = any(scale.dtype == MX_SCALE_DTYPE for scale in b_scales)
    if block_scaled:
        check_block_scales(None, b_scales, bs, a.shape[0])
        scale, row_bytes, what = "mx", mx_row_bytes(K), "packed MXFP8 rows"
    else:
        if a_dtype not in FP8_DTYPES:
            raise TypeError(f"a_dtype: got {a_dtype}, expected one of {list(FP8_DTYPES)}")
        check_scales(a_scale, b_scales, bs, a.shape[0], a_rows_packed=True)
        scale = "row" if a_scale is None else "tensor"
        row_bytes = K + ROW_SCALE_BYTES if a_scale is None else K
        what = "packed rows" if a_scale is None else "fp8 bytes"
    if a.dtype != torch.uint8 or a.dim() != 2 or a.shape[1] != row_bytes or not a.is_contiguous():
        raise ValueError(
            f"a: got {a.dtype} of shape {tuple(a.shape)}, expected contiguous uint8 {what} of "
            f"{row_bytes} bytes per row (K = {K})"
        )
    # Rows a.stride(0) bytes apart: K + 16 when packed, mx_row_bytes(K) for MXFP8.
    data = a[:, :K].view(torch.float8_e4m3fn if block_scaled else a_dtype)
    a_arg = data if a_scale is None else a_scale
    # A block-scaled B_j's scales [N_j, K / 32] go as bytes (Triton has no e8m0 pointers), row
    # by row (contiguous: check_block_scales).
    b_scale_args = [s.view(torch.uint8) if block_scaled else s for s in b_scales]

    def scale_args(group: list[int]) -> tuple:
        strides = [b_scale_args[j].stride(0) if block_scaled else scale_stride(b_scales[j])
                   for j in group]  # fmt: skip
        return a_arg, [b_scale_args[j] for j in group], strides

    return data, K, scale, scale_args


class AgMatmulConsumer:
    """The launches of one :func:`ag_matmul_consumer` call, made in two steps so that a caller
    chooses their tile configs before its call waits for anyone (the ``symm`` backend: before
    its start barrier). Constructing it checks the operands and chooses each launch's config
    (:func:`tp_kernels.kernels.tuning.choose`: on a shape new to the process, every candidate
    compiled and timed on this rank alone, the first launch's progress words raised in a
    scratch vector); :meth:`launch` then launches them, waiting for the call's own words."""

    def __init__(
        self,
        a: torch.Tensor,
        bs: Sequence[torch.Tensor],
        outs: Sequence[torch.Tensor],
        *,
        chunk_rows: int,
        rank: int,
        world_size: int,
        a_dtype: torch.dtype | None = None,
        a_scale: torch.Tensor | None = None,
        b_scales: Sequence[torch.Tensor] | None = None,
    ) -> None:
        check_world(rank, world_size)
        if not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows: got {chunk_rows!r}, expected a positive int")
        self.device, self.world_size = a.device, world_size
        self.m = m = a.shape[0] // world_size
        self.chunks = triton.cdiv(m, chunk_rows)
        a_data, K, scale, scale_args = _scaled_operands(a, bs, a_dtype, a_scale, b_scales)
        dtype = a_data.dtype
        # Unscaled, A, the bs and the outs share one dtype; scaled, the outs' is the products'.
        out_dtype = outs[0].dtype if scale != "none" else dtype
        DTYPE = tl_dtype(out_dtype, argument="outs[0]" if scale != "none" else "a")
        tma = tma_supported(self.device, dtype)
        self.a_layout = tma_layout(a_data) if tma else "pointer"
        self.a_arg = tma_operand(a_data, self.a_layout)
        self.programs = persistent_programs(self.device)
        layouts = [tma_layout(b) if tma else "pointer" for b in bs]
        self.launches: list[_Launch] = []
        for number, group in enumerate(_launch_groups(layouts)):
            group_bs = [bs[j] for j in group]
            ns = tuple(b.shape[1] for b in group_bs)
            unused = MAX_BS_PER_LAUNCH - len(group)
            b_args = [tma_operand(b, layouts[group[0]]) for b in group_bs]
            # TMA stores where every output of the launch takes a descriptor over its
            # [W, m, N_j] view (its rows 16-byte multiples), else pointer stores.
            c_tma = tma and all(tma_layout(outs[j]) == "rc" for j in group)
            c_layout = "tma" if c_tma else "pointer"
            c_args = [_c_operand(outs[j], world_size, m, c_layout) for j in group]
            strides = [stride for b in group_bs for stride in (b.stride(0), b.stride(1))]
            a_scale_arg, b_scale_args, scale_strides = scale_args(group)
            wait = number == 0
            operands = [
                self.a_arg, *b_args, *b_args[:1] * unused,  # unused: never read (NUM_B)
                *c_args, *c_args[:1] * unused,
                a_data, a_scale_arg, *b_scale_args, *b_scale_args[:1] * unused,
                rank, world_size, m, K, *ns, *[0] * unused, a_data.stride(0),
                *strides, *[0, 0] * unused, *scale_strides, *[0] * unused, chunk_rows, self.chunks,
            ]  # fmt: skip
            args = dict(
                zip(_OPERANDS, operands, strict=True),
                DTYPE=DTYPE,
                WAIT=wait,
                A_LAYOUT=self.a_layout,
                B_LAYOUT=layouts[group[0]],
                C_LAYOUT=c_layout,
                NUM_B=len(group),
                SCALE=scale,
                BF16_BY_HAND=INTERPRET and out_dtype == torch.bfloat16,
                INPUT_PRECISION=dot_precision(dtype),
            )
            key = (world_size, m, K, ns, str(dtype), str(out_dtype), wait, self.a_layout,
                   layouts[group[0]], c_layout, scale, self.programs)  # fmt: skip
            launch = _Launch(args, b_args, c_args, ns)
            launch.config = tuning.choose(
                "ag_matmul_consumer",
                key,
                gemm_configs(gemm_kind(dtype, block_scaled=scale == "mx")),
                lambda config, launch=launch: self._run_raised(launch, config),
                self.device,
            )
            self.launches.append(launch)

    def launch(
        self,
        *,
        progress: torch.Tensor,
        status: torch.Tensor,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        order_out: torch.Tensor | None = None,
    ) -> None:
        """Launch every product: tiles of peers' rows wait for their chunk's word in
        ``progress`` (the first launch; later ones read A as it is). Args as in
        :func:`ag_matmul_consumer`."""
        world_size = self.world_size
        check_progress(progress, world_size * self.chunks, self.device)
        check_status(status, world_size)
        trace = new_trace(order_out, world_size, self.device)
        wait_ns = timeout_ns(timeout_s)
        for launch in self.launches:
            traced = launch.args["WAIT"] and trace is not None
            self._run(launch, launch.config, progress, status, wait_ns, trace if traced else None)
        store_order(trace, order_out, world_size)

    def _run_raised(self, launch: _Launch, config: triton.Config) -> None:
        """One launch with ``config`` on a rank-local problem: every word it would wait for is
        raised in a scratch vector, so it waits for nobody (tuning)."""
        words = torch.full(
            (self.world_size * self.chunks,), signals.RAISED, dtype=torch.int32, device=self.device
        )
        status = new_status(self.world_size, self.device)
        self._run(launch, config, words, status, timeout_ns(DEFAULT_TIMEOUT_S), None)

    def _run(
        self,
        launch: _Launch,
        config: triton.Config,
        progress: torch.Tensor,
        status: torch.Tensor,
        wait_ns: int,
        trace: torch.Tensor | None,
    ) -> None:
        blocks = config.kwargs
        set_block_shape(self.a_arg, self.a_layout, blocks["BLOCK_M"], blocks["BLOCK_K"])
        for b in launch.b_args:
            set_block_shape(b, launch.args["B_LAYOUT"], blocks["BLOCK_K"], blocks["BLOCK_N"])
        if launch.args["C_LAYOUT"] == "tma":
            for c in launch.c_args:
                c.block_shape = [1, blocks["BLOCK_M"], store_columns(blocks["BLOCK_N"])]
        col_tiles = sum(triton.cdiv(n, blocks["BLOCK_N"]) for n in launch.ns)
        tiles = self.world_size * triton.cdiv(self.m, blocks["BLOCK_M"]) * col_tiles
        with on_device(self.device):
            _ag_matmul_kernel[(min(tiles, self.programs),)](
                **launch.args,
                progress_addr=progress.data_ptr(),
                trace_ptr=progress if trace is None else trace,
                status_addr=status.data_ptr(),
                timeout_ns=wait_ns,
                TRACE=trace is not None,
                **blocks,
                num_warps=config.num_warps,
                num_stages=config.num_stages,
            )


# The kernel's arguments that a call fixes before it launches, in order (the rest: the protocol's
# words, the trace, the status, the timeout, and the constexprs).
_OPERANDS = (
    "a", "b0", "b1", "b2", "c0", "c1", "c2", "a_ptr", "a_scale_ptr", "b0_scale", "b1_scale",
    "b2_scale", "rank", "world_size", "m", "K", "N0", "N1", "N2", "stride_am", "stride_b0k",
    "stride_b0n", "stride_b1k", "stride_b1n", "stride_b2k", "stride_b2n", "stride_b0s",
    "stride_b1s", "stride_b2s", "chunk_rows", "chunks",
)  # fmt: skip


class _Launch:
    """One launch of :class:`AgMatmulConsumer`: its fixed arguments (``WAIT`` among them: the
    first launch waits), right-hand and output operands (descriptors take the config's block
    shapes), widths, and its chosen config."""

    def __init__(self, args: dict, b_args: list, c_args: list, ns: tuple[int, ...]) -> None:
        self.args, self.b_args, self.c_args, self.ns = args, b_args, c_args, ns
        self.config: triton.Config | None = None


def ag_matmul_consumer(
    a: torch.Tensor,
    bs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    *,
    progress: torch.Tensor,
    chunk_rows: int,
    status: torch.Tensor,
    rank: int,
    world_size: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    order_out: torch.Tensor | None = None,
    a_dtype: torch.dtype | None = None,
    a_scale: torch.Tensor | None = None,
    b_scales: Sequence[torch.Tensor] | None = None,
) -> None:
    """``outs[j] = A @ bs[j]`` for every j while a copier fills ``A``: one launch for up to
    :data:`MAX_BS_PER_LAUNCH` consecutive ``bs`` of one layout (QKV's, w1/w3's: one launch), so
    every product's tiles overlap the copies; only the first launch waits. Its tile configs are
    chosen first, on this rank alone (:class:`AgMatmulConsumer`, which a caller that must choose
    them before other waits constructs itself).

    Shapes (W = ``world_size``, m rows per rank): ``a`` is the gathered A [W*m, K], contiguous,
    local; its rows ``[rank*m, (rank+1)*m)`` are in place before the launch (on a GPU: written
    on the same stream). Rows ``[s*m + j*chunk_rows, s*m + min((j+1)*chunk_rows, m))`` of a peer
    ``s`` may be read once ``progress[s * chunks + j]`` is raised, with ``chunks = cdiv(m,
    chunk_rows)``, and the chunks of one call complete in order. ``bs[j]`` is [K, N_j] with any
    strides (on sm_90 and newer read with TMA when its layout allows, see
    :func:`tp_kernels.kernels.tma_layout`, else through its strides; so is ``a``); ``outs[j]`` is
    [W*m, N_j], contiguous; all share one dtype (fp32, fp16 or bf16) and device. Nothing here
    synchronizes with the device, but for the first call of a shape in the process (its tuning).

    Scaled (fp8, ``b_scales`` given): ``outs[j] = (A_data * a_scale) @ (bs[j] * b_scales[j])``,
    accumulated in fp32 and rounded once to ``outs[j]``'s dtype (fp32, fp16 or bf16), where
    ``a`` holds the gathered bytes (uint8, moved by the copier as they are): either packed rows
    ``[W*m, K + 16]`` (``a_scale`` None: row ``i``'s ``K`` fp8 bytes, then its fp32 scale at byte
    ``K``, :func:`tp_kernels.backends.scaled.pack_rows`) or ``[W*m, K]`` of fp8 bytes with one
    fp32 ``a_scale`` ``[]``; the fp8 dtype of those bytes is ``a_dtype`` (e4m3 or e5m2);
    ``bs[j]`` are fp8 [K, N_j] (any strides) with ``b_scales[j]`` fp32 ``[]`` or ``[1, N_j]``.
    The progress words and chunks are the same as unscaled: a chunk carries its rows' scales.

    Args:
        progress: int32 (uint32 on CUDA, as stream writes take it), at least ``W * chunks``
            words on the device, zero before the call (the start barrier clears them).
        chunk_rows: rows per chunk of a shard (>= 1).
        status: the timeout record (:func:`tp_kernels.kernels.new_status`): a wait for rank s
            that passes ``timeout_s`` stores ``WAIT_CHUNK`` into ``status[s]`` (the ``symm``
            backend reads it and raises).
        timeout_s: deadline of each wait.
        order_out: optional int [W]; receives the source ranks in the order the kernel first
            touched them (a trace for tests and debugging; adds one atomic per tile).
    """
    consumer = AgMatmulConsumer(
        a, bs, outs, chunk_rows=chunk_rows, rank=rank, world_size=world_size, a_dtype=a_dtype,
        a_scale=a_scale, b_scales=b_scales,
    )  # fmt: skip
    consumer.launch(progress=progress, status=status, timeout_s=timeout_s, order_out=order_out)
