"""Matmul -> reduce-scatter: a producer GEMM that stores each rank's rows locally, and a
reduction that sums the W slots a rank received in a fixed order.

Rank ``r``'s symmetric buffer, viewed as ``slots [W, m, N]``, receives in slot ``s`` rank ``s``'s
partial product of the rows owed to ``r``. :func:`matmul_rs_producer` computes the rows owed to
rank ``d = r+1, r+2, ..., r`` (mod W, its own last) into block ``d`` of a local ``staging
[W, m, N]`` (its own rows straight into slot ``r`` of its own buffer) and, once block ``d`` is
complete, raises the local progress word ``d`` (its own block: word ``channel * W + r`` of its
own pad). Nothing it stores crosses the link: the copy engine moves
each block into slot ``r`` of ``d``'s buffer and then raises ``d``'s word ``channel * W + r``
(the pusher of :mod:`tp_kernels.backends.symm_scatter`), so no tile's release waits for remote
stores to land and the link carries the partials while the GEMM computes the next ones.
:func:`reduce_slots` waits for each slot's word and sums the slots in fp32, slot 0 first. The
words are cleared by the next call's start barrier (:func:`tp_kernels.kernels.barrier`), which
also orders this call's pushes after every peer's reduction of the previous call.

The partials cross the link in the operands' dtype (a bf16 GEMM sends bf16 partials), rounded
once from the fp32 accumulator: fp32 partials would double the bytes on the link, which is what
this op is bound by whenever it is worth fusing. A scaled (fp8) GEMM sends them in its output
dtype, the scales applied to the accumulator before that one rounding (``acc * a_scale[row] *
b_scale[col]``, :func:`matmul_rs_producer`). The sum then runs in fp32, so the result is
rounded W + 1 times in all, fewer than a ring reduce-scatter in bf16 (NCCL's, and so PyTorch's),
which rounds after every hop; the tests hold the result to twice the error of that reference.

One word per block, raised by the block's last tile: each tile counts itself on a per-block
atomic counter (acq_rel at GPU scope, after a CTA barrier, so its stores are ordered before the
count), and the tile that brings the count to the block's tile total releases the word at
system scope (W releases per launch, not one per tile). The pusher and the reducer then wait
once per block instead of once per tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tp_kernels import signals, tiling
from tp_kernels.kernels import tuning
from tp_kernels.kernels._shared import (
    DEFAULT_TIMEOUT_S,
    FP8_DTYPES,
    GROUP_M,
    INTERPRET,
    MX_SCALE_DTYPE,
    RAISED,
    WAIT_SLOT,
    _accumulate,
    _accumulate_mx,
    _block_scales,
    _cta_barrier,
    _load_block,
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
    check_tensor,
    check_world,
    dot_precision,
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


def _producer_config(m: int, n: int, kind: str) -> dict:
    """Tile shape of the producer GEMM of operands of ``kind`` (:func:`~._shared.gemm_kind`),
    chosen from the shape instead of tuned (:func:`tp_kernels.tiling.producer_shape`, a tile of
    the kind's menu), so that the cost model simulates the very tiles that run.
    """
    if INTERPRET:
        bm, bn, bk = tiling.interpreter_shape(kind)
        return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": 1}
    bm, bn, bk, warps, stages = tiling.producer_shape(m, n, kind)
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}


def _reduce_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BLOCK": 256}, num_warps=1)]
    return [triton.Config({"BLOCK": b}, num_warps=w) for b in (1024, 2048, 4096) for w in (4, 8)]


@triton.jit
def _destination_tile(tile, rank, world_size, tiles_per_slot, n_tiles):
    """``(m_tile, col_tile, d)`` of the producer's tile number ``tile``: its M tile and column tile
    (:func:`_tile_coords`, the shards being the destinations' blocks) and its destination ``d``,
    ``rank + 1`` first, ``rank`` last."""
    m_tile, col_tile = _tile_coords(tile, tiles_per_slot, n_tiles, GROUP_M)
    return m_tile, col_tile, (rank + 1 + m_tile // tiles_per_slot) % world_size


@triton.jit(do_not_specialize=["rank", "channel"])
def _matmul_rs_kernel(
    a,
    b,
    staging,
    own_slots,
    progress,
    signal_ptrs,
    counter_ptr,
    trace_ptr,
    a_scale_ptr,
    b_scale_ptr,
    rank,
    world_size,
    m,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_as,
    stride_bs,
    channel,
    DTYPE: tl.constexpr,
    A_LAYOUT: tl.constexpr,
    B_LAYOUT: tl.constexpr,
    SCALE: tl.constexpr,
    TRACE: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Tiles of ``P = A @ B`` (fp32 accumulation, rounded once to ``DTYPE``, the blocks' dtype),
    each for a destination ``d``, stored locally:

    ``blocks[d, i, n] = sum_k A[d*m + i, k] * B[k, n]``, or with ``SCALE`` (``"row"`` or
    ``"tensor"``: fp8 A and B, e4m3 or e5m2) ``(sum_k ...) * a_scale[d*m + i] * b_scale[n]``
    in fp32 before the rounding, ``a_scale[i] = a_scale_ptr[i * stride_as]`` (``"row"``) or
    ``*a_scale_ptr`` (``"tensor"``) and ``b_scale[n] = b_scale_ptr[n * stride_bs]`` (stride 0:
    one scale); or with ``SCALE == "mx"`` (e4m3 A and B with e8m0 scales per 32 elements along
    K) every K step's product scaled, ``a_scale_ptr[i * stride_as + kb]`` and
    ``b_scale_ptr[n * stride_bs + kb]`` the scale bytes of row ``i`` / column ``n`` and K block
    ``kb`` (:func:`~._shared._accumulate_mx`); with ``blocks`` = ``own_slots`` (this
    rank's buffer, [W, m, N]) for ``d == rank`` and ``staging`` [W, m, N] for the others; ``a``
    is A [W*m, K] and ``b`` is B [K, N] as
    :func:`_load_block` reads them with ``A_LAYOUT`` and ``B_LAYOUT`` (strides for ``"pointer"``).
    Tile ``t`` (program ``p`` computes ``t = p, p + P, ...`` for a grid of ``P``) is in M tile
    ``t // (cdiv(m, BLOCK_M) * cdiv(N, BLOCK_N))`` and on (:func:`_tile_coords`); M tile ``t``
    serves ``d = (rank + 1 + t // cdiv(m, BLOCK_M)) % W``.
    The tile that completes block ``d`` (counted in ``counter_ptr[d]``, which it then resets to
    zero for the next launch) raises (release, system scope) ``progress[d]``, or for ``d == rank``
    word ``channel * W + rank`` of this rank's pad (``signal_ptrs[rank]``).
    """
    n_tiles = tl.cdiv(N, BLOCK_N)
    tiles_per_slot = tl.cdiv(m, BLOCK_M)
    # Persistent: program p computes tiles p, p + P, p + 2P, ... (P programs, at most one per SM).
    # Every tensor in a range goes through _range_arg, for Triton 3.6.0's interpreter.
    first, step, tiles = tl.program_id(0), tl.num_programs(0), world_size * tiles_per_slot * n_tiles
    stored = first - step  # the epilogue's tile number, counted apart (see the epilogue)
    # flatten: Triton fuses this loop and the K loop into one, which it pipelines, so the next
    # tile's first loads are issued before this tile's epilogue instead of after it. The fusion
    # takes no branch nested in the epilogue (the announcement below is masked instead), and the
    # pipeliner no loop holding tl.debug_barrier() (hence _cta_barrier).
    for tile in tl.range(_range_arg(first), _range_arg(tiles), _range_arg(step), flatten=True):
        m_tile, col_tile, dst = _destination_tile(tile, rank, world_size, tiles_per_slot, n_tiles)
        if TRACE:
            _note_first_touch(trace_ptr, dst, world_size)
        row0 = (m_tile % tiles_per_slot) * BLOCK_M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, _range_arg(K), BLOCK_K):
            # Rows past d's m belong to the next destination (or are zeros past A): they only reach
            # output rows that the masked store below drops.
            a_blk = _load_block(
                a, dst * m + row0, k0, world_size * m, K, stride_am, stride_ak, A_LAYOUT, BLOCK_M,
                BLOCK_K,
            )  # fmt: skip
            if SCALE == "mx":
                rows = dst * m + row0 + tl.arange(0, BLOCK_M)
                cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
                a_scales = _block_scales(
                    a_scale_ptr, rows.to(tl.int64), rows < world_size * m, stride_as, k0, K,
                    BLOCK_K,
                )  # fmt: skip
                acc = _accumulate_mx(
                    acc, a_blk, a_scales, b, b_scale_ptr, k0, col_tile * BLOCK_N,
                    cols.to(tl.int64), cols < N, K, N, stride_bk, stride_bn, stride_bs, B_LAYOUT,
                    BLOCK_K, BLOCK_N,
                )  # fmt: skip
            else:
                acc = _accumulate(
                    acc, a_blk, b, k0, col_tile * BLOCK_N, K, N, stride_bk, stride_bn, B_LAYOUT,
                    BLOCK_K, BLOCK_N, BF16_BY_HAND, INPUT_PRECISION,
                )  # fmt: skip
        # The same tile, computed again from a counter of its own, as Triton's persistent matmul
        # tutorial does: the fused loop would otherwise carry the coordinates above through its
        # pipeline's stages to here (CSE would merge a computation from ``tile`` with the one
        # above), and with them carried ptxas spilled 8 B per thread (16-bit 128x128x64 on sm_100,
        # Triton 3.6.0).
        stored += step
        m_tile, col_tile, dst = _destination_tile(stored, rank, world_size, tiles_per_slot, n_tiles)
        _, rows64, cols64, row_ok, col_ok = _tile_span(
            m_tile, col_tile, tiles_per_slot, m, N, BLOCK_M, BLOCK_N
        )
        if SCALE == "row" or SCALE == "tensor":  # (block scales were applied in the K loop)
            if SCALE == "row":
                a_rows = (dst * m + rows64) * stride_as
                a_scale = tl.load(a_scale_ptr + a_rows, mask=row_ok, other=0.0)
            else:
                a_scale = tl.load(a_scale_ptr)
            acc = _scale_epilogue(
                acc, a_scale, SCALE == "row", b_scale_ptr, cols64, col_ok, stride_bs
            )
        # Block d starts at row d*m of either [W, m, N] tensor: the own rows go straight into
        # the own slot, the peers' into staging, from where the copy engine pushes them.
        if dst == rank:
            blocks = own_slots
        else:
            blocks = staging
        tl.store(
            blocks + (dst * m + rows64)[:, None] * N + cols64[None, :],
            _round_to(acc, DTYPE, BF16_BY_HAND),
            mask=row_ok[:, None] & col_ok[None, :],
        )

        # Every thread's stores precede the count; the last tile's release publishes all of them.
        # The stores are local, so the count and the release wait for this GPU's memory only.
        _cta_barrier(dst)
        done = tl.atomic_add(counter_ptr + dst, 1, sem="acq_rel", scope="gpu")
        last = done == tiles_per_slot * n_tiles - 1
        # Every tile of this block has counted, so nobody else touches the counter this launch.
        tl.atomic_xchg(counter_ptr + dst, 0, sem="relaxed", scope="gpu", mask=last)
        # System scope: the copy engine, not an SM, reads the block after the word.
        own = dst == rank
        pad = tl.load(signal_ptrs + rank, mask=last & own, other=0).to(tl.pointer_type(tl.int32))
        word = tl.where(own, pad + channel * world_size + rank, progress + dst)
        tl.atomic_xchg(word, RAISED, sem="release", scope="sys", mask=last)


@triton.jit(do_not_specialize=["rank", "channel", "status_addr", "timeout_ns"])
def _reduce_slots_kernel(
    slots_ptr,
    out_ptr,
    signal_ptrs,
    status_addr,
    rank,
    world_size,
    numel,
    channel,
    timeout_ns,
    OUT_DTYPE: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``out[e] = sum_{s=0..W-1} float32(slots[s, e])`` for a block of elements ``e``.

    ``slots`` [W, numel] is this rank's buffer. The sum runs in fp32, slot 0 first, so the result
    does not depend on timing. Before adding slot ``s`` the program waits until word
    ``channel * W + s`` of this rank's pad is raised (on timeout: ``status[s] = WAIT_SLOT``), so
    summing the slots already there overlaps with waiting for the rest.
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    pad = tl.load(signal_ptrs + rank).to(tl.pointer_type(tl.int32))
    status = status_addr.to(tl.pointer_type(tl.int32))
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    # Step the pointer slot by slot: s * numel may pass 2**31 in int32.
    ptrs = slots_ptr + offs
    for s in range(_range_arg(world_size)):
        _wait_signal(pad + channel * world_size + s, timeout_ns, status + s, WAIT_SLOT)
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        ptrs += numel
    tl.store(out_ptr + offs, _round_to(acc, OUT_DTYPE, BF16_BY_HAND), mask=mask)


def new_counters(world_size: int, device: torch.device) -> torch.Tensor:
    """The zeroed per-destination tile counters of :func:`matmul_rs_producer` (int32 [W]); the
    kernel leaves them zeroed, so one tensor serves every launch on one stream."""
    return torch.zeros(world_size, dtype=torch.int32, device=device)


class RsProducer:
    """One :func:`matmul_rs_producer` call in two steps, so that its kernel is compiled before
    the call waits for anyone (the ``symm`` backend: before its start barrier): constructing it
    checks the operands, takes the shape's tile (:func:`_producer_config`) and, on a shape new to
    the process on a GPU, compiles the launch's variant without running it (nothing to time: the
    tile is the shape's; :func:`tp_kernels.kernels.tuning.choose` keeps it);
    :meth:`launch` then runs it on the call's words."""

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        staging: torch.Tensor,
        own_slots: torch.Tensor,
        *,
        rank: int,
        world_size: int,
        channel: int,
        a_scale: torch.Tensor | None = None,
        b_scale: torch.Tensor | None = None,
    ) -> None:
        check_world(rank, world_size, channel)
        self.device, self.world_size = a.device, world_size
        m, K, N = a.shape[0] // world_size, a.shape[1], b.shape[1]
        scaled = a_scale is not None or b_scale is not None
        if scaled:
            if a_scale is None or b_scale is None or a.dtype not in FP8_DTYPES:
                raise ValueError(
                    f"a scaled product takes fp8 a (got {a.dtype}), a_scale and b_scale (got "
                    f"{'None' if a_scale is None else 'a tensor'} and "
                    f"{'None' if b_scale is None else 'a tensor'})"
                )
            if b_scale.dtype == MX_SCALE_DTYPE:
                check_block_scales(a_scale, [b_scale], [b], a.shape[0])
                # As bytes (Triton has no e8m0 pointers), a row of K / 32 per row of a, column
                # of b.
                scale, a_scale_arg, b_scale_arg = (
                    "mx",
                    a_scale.view(torch.uint8),
                    b_scale.view(torch.uint8),
                )
                strides = (a_scale.stride(0), b_scale.stride(0))
            else:
                check_scales(a_scale, [b_scale], [b], a.shape[0], a_rows_packed=False)
                scale = "row" if a_scale.dim() else "tensor"
                a_scale_arg, b_scale_arg = a_scale, b_scale
                strides = (scale_stride(a_scale), scale_stride(b_scale))
        else:
            scale, a_scale_arg, b_scale_arg, strides = "none", a, b, (0, 0)
        out_dtype = staging.dtype if scaled else a.dtype
        DTYPE = tl_dtype(out_dtype, argument="staging" if scaled else "a")
        for name, blocks in (("staging", staging), ("own_slots", own_slots)):
            check_tensor(blocks, (world_size, m, N), out_dtype, a.device, argument=name)
        config = _producer_config(m, N, gemm_kind(a.dtype, block_scaled=scale == "mx"))
        tiles = world_size * triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"])
        self.grid = (min(tiles, persistent_programs(a.device)),)
        tma = tma_supported(a.device, a.dtype)
        a_layout = tma_layout(a) if tma else "pointer"
        if a_layout == "cr" and m * a.element_size() % 16:
            # Transposed, A's rows are the descriptor's inner dimension, where a block must start
            # on a 16-byte boundary: destination d's rows start at d*m.
            a_layout = "pointer"
        b_layout = tma_layout(b) if tma else "pointer"
        a_arg, b_arg = tma_operand(a, a_layout), tma_operand(b, b_layout)
        set_block_shape(a_arg, a_layout, config["BLOCK_M"], config["BLOCK_K"])
        set_block_shape(b_arg, b_layout, config["BLOCK_K"], config["BLOCK_N"])
        self.args = dict(
            a=a_arg, b=b_arg, staging=staging, own_slots=own_slots, a_scale_ptr=a_scale_arg,
            b_scale_ptr=b_scale_arg, rank=rank, world_size=world_size, m=m, N=N, K=K,
            stride_am=a.stride(0), stride_ak=a.stride(1), stride_bk=b.stride(0),
            stride_bn=b.stride(1), stride_as=strides[0],
            stride_bs=strides[1], channel=channel, DTYPE=DTYPE,
            A_LAYOUT=a_layout, B_LAYOUT=b_layout, SCALE=scale,
            BF16_BY_HAND=INTERPRET and out_dtype == torch.bfloat16,
            INPUT_PRECISION=dot_precision(a.dtype), **config,
        )  # fmt: skip
        # Compiled once per shape in the process (the tuner keeps its one config), not per call.
        key = (world_size, m, N, K, str(a.dtype), str(out_dtype), a_layout, b_layout, scale,
               a.stride(), b.stride(), self.grid)  # fmt: skip
        blocks = {k: v for k, v in config.items() if k.startswith("BLOCK_")}
        tile = triton.Config(
            blocks, num_warps=config["num_warps"], num_stages=config.get("num_stages", 3)
        )
        tuning.choose("matmul_rs_producer", key, [tile], self._compile, a.device)

    def _compile(self, config: triton.Config) -> None:
        """Compile the launch's variant without running it (its tile is the shape's: nothing to
        time), on scratch words of the launch's types."""
        words = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        table = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        with on_device(self.device):
            _matmul_rs_kernel.warmup(
                **self.args, progress=words, signal_ptrs=table, counter_ptr=words,
                trace_ptr=words, TRACE=False, grid=self.grid,
            )  # fmt: skip

    def launch(
        self,
        progress: torch.Tensor,
        signal_ptrs: torch.Tensor,
        *,
        counters: torch.Tensor,
        order_out: torch.Tensor | None = None,
    ) -> None:
        """Compute and announce every block. Args as in :func:`matmul_rs_producer`."""
        world_size, device = self.world_size, self.device
        check_tensor(progress, (world_size,), torch.int32, device, argument="progress")
        check_ptr_table(signal_ptrs, world_size, device, argument="signal_ptrs")
        check_tensor(counters, (world_size,), torch.int32, device, argument="counters")
        trace = new_trace(order_out, world_size, device)
        with on_device(device):
            _matmul_rs_kernel[self.grid](
                **self.args,
                progress=progress,
                signal_ptrs=signal_ptrs,
                counter_ptr=counters,
                trace_ptr=counters if trace is None else trace,
                TRACE=trace is not None,
            )
        store_order(trace, order_out, world_size)


def matmul_rs_producer(
    a: torch.Tensor,
    b: torch.Tensor,
    staging: torch.Tensor,
    own_slots: torch.Tensor,
    progress: torch.Tensor,
    signal_ptrs: torch.Tensor,
    *,
    counters: torch.Tensor,
    rank: int,
    world_size: int,
    channel: int,
    order_out: torch.Tensor | None = None,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
) -> None:
    """``blocks[d] = (a @ b)[d*m:(d+1)*m]`` for every rank d, each block announced once complete.

    Shapes (W = ``world_size``): ``a`` [W*m, K], ``b`` [K, N], same dtype (fp32, fp16 or bf16; fp8
    with ``a_scale`` and ``b_scale``, then the blocks are in another dtype, see below) and
    device, any strides (on sm_90 and newer each is read with TMA when its layout allows, see
    :func:`tp_kernels.kernels.tma_layout`, else through its strides). ``staging`` and
    ``own_slots`` are contiguous [W, m, N] of that dtype: block ``d != rank`` goes into
    ``staging[d]``, then ``progress[d]`` is raised; block ``rank`` goes into ``own_slots[rank]``
    (this rank's symmetric buffer), then word ``channel * W + rank`` of this rank's pad is
    raised, where :func:`reduce_slots` waits for it. The words must be clear before the launch
    (the start barrier clears them).
    Destinations go d = rank+1, rank+2, ..., rank (mod W). Nothing here waits, so the producer
    cannot deadlock, and nothing it stores is remote: moving ``staging[d]`` to rank d is the
    pusher's (:mod:`tp_kernels.backends.symm_scatter`), which must copy block d only after its
    word and before this rank launches again with the same staging.

    Args:
        progress: int32 [W], this rank's progress words (word ``rank`` is not written).
        signal_ptrs: int64 [W], address of rank d's signal pad (only this rank's is written).
        counters: :func:`new_counters` of this device, not shared with a launch on another stream.
        order_out: optional int [W]; receives the destination ranks in the order the kernel first
            touched them (a trace for tests and debugging).
        a_scale, b_scale: a scaled (fp8) product, ``blocks[d] = ((a * a_scale) @ (b *
            b_scale))[d*m:(d+1)*m]``: ``a`` and ``b`` fp8 (e4m3 or e5m2), ``a_scale`` fp32 [] or
            [W*m, 1], ``b_scale`` fp32 [] or [1, N] (any strides); accumulated in fp32, scaled,
            then rounded once to the dtype of ``staging`` and ``own_slots`` (fp32, fp16 or
            bf16), which the partials then cross the link in. Block-scaled (MXFP8: ``b_scale``
            e8m0): ``a`` and ``b`` e4m3, ``a_scale`` e8m0 [W*m, K / 32] and ``b_scale`` e8m0
            [N, K / 32], contiguous, one scale per 32 elements along K, applied in every K step.
    """
    producer = RsProducer(
        a, b, staging, own_slots, rank=rank, world_size=world_size, channel=channel,
        a_scale=a_scale, b_scale=b_scale,
    )  # fmt: skip
    producer.launch(progress, signal_ptrs, counters=counters, order_out=order_out)


class SlotReduction:
    """One :func:`reduce_slots` call in two steps, so that its block size is chosen before the
    call waits for anyone (the ``symm`` backend: before its start barrier). Constructing it
    chooses the config (:func:`tp_kernels.kernels.tuning.choose`: on a shape new to the process,
    every candidate timed on this rank alone, summing ``slots`` into ``out`` with every slot's
    word raised in a scratch pad); :meth:`launch` then waits for the call's own words."""

    def __init__(
        self, slots: torch.Tensor, out: torch.Tensor, *, rank: int, world_size: int, channel: int
    ) -> None:
        check_world(rank, world_size, channel)
        self.slots, self.out, self.rank, self.world_size, self.channel = (
            slots, out, rank, world_size, channel
        )  # fmt: skip
        self.out_dtype = tl_dtype(out.dtype, argument="out")
        key = (world_size, out.numel(), str(slots.dtype), str(out.dtype))
        self.config = tuning.choose(
            "reduce_slots", key, _reduce_configs(), self._run_raised, slots.device
        )

    def launch(self, signal_ptrs: torch.Tensor, *, status: torch.Tensor, timeout_s: float) -> None:
        """Sum the slots, each once its word in this rank's pad (``signal_ptrs[rank]``) is
        raised; a wait past ``timeout_s`` is recorded in ``status``."""
        check_ptr_table(signal_ptrs, self.world_size, self.slots.device, argument="signal_ptrs")
        check_status(status, self.world_size)
        self._run(self.config, signal_ptrs, status, timeout_ns(timeout_s))

    def _run_raised(self, config: triton.Config) -> None:
        device = self.slots.device
        pad = torch.full(
            ((self.channel + 1) * self.world_size,), signals.RAISED, dtype=torch.int32,
            device=device,
        )  # fmt: skip
        table = torch.full((self.world_size,), pad.data_ptr(), dtype=torch.int64, device=device)
        status = new_status(self.world_size, device)
        self._run(config, table, status, timeout_ns(DEFAULT_TIMEOUT_S))

    def _run(
        self, config: triton.Config, signal_ptrs: torch.Tensor, status: torch.Tensor, wait_ns: int
    ) -> None:
        numel = self.out.numel()
        with on_device(self.slots.device):
            _reduce_slots_kernel[(triton.cdiv(numel, config.kwargs["BLOCK"]),)](
                self.slots,
                self.out,
                signal_ptrs,
                status.data_ptr(),
                self.rank,
                self.world_size,
                numel,
                self.channel,
                wait_ns,
                OUT_DTYPE=self.out_dtype,
                BF16_BY_HAND=INTERPRET and self.out.dtype == torch.bfloat16,
                **config.kwargs,
                num_warps=config.num_warps,
            )


def reduce_slots(
    slots: torch.Tensor,
    out: torch.Tensor,
    signal_ptrs: torch.Tensor,
    *,
    status: torch.Tensor,
    rank: int,
    world_size: int,
    channel: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """``out = slots[0] + slots[1] + ... + slots[W-1]``, summed in fp32 in that order (an average
    is the ops layer's division, the same for every backend).

    Shapes: ``slots`` [W, m, N] (this rank's symmetric buffer; slot s holds rank s's block of
    :func:`matmul_rs_producer`, pushed here by rank s), ``out`` [m, N] of any supported dtype
    (the fp32 sum is cast to it); both contiguous on one device. Slot s is read once word
    ``channel * W + s`` of this rank's pad is raised. Nothing here synchronizes with the
    device, but the first call of a shape in the process (its tuning, :class:`SlotReduction`).

    Args:
        signal_ptrs: int64 [W], address of each rank's signal pad; this rank waits on its own.
        status, timeout_s: as in :func:`tp_kernels.kernels.ag_matmul_consumer`.
    """
    reduction = SlotReduction(slots, out, rank=rank, world_size=world_size, channel=channel)
    reduction.launch(signal_ptrs, status=status, timeout_s=timeout_s)
