"""How the fused ops cut their work into tiles, chunks and blocks: the one copy of the numbers
that the kernels, the backends and the cost model share.

The kernels build their configs and constexprs from these, the backends cut their copies and
transfers by them, and the cost model (:mod:`tp_kernels.cost`) simulates the tiles, chunks and
blocks they make, so that a change here changes all three together. Plain Python: the cost model
and the backends' host side import it without Triton (kernels may read only constexpr globals,
so ``kernels/_shared.py`` wraps :data:`GROUP_M` in ``tl.constexpr``).
"""

from __future__ import annotations

from tp_kernels import config

__all__ = [
    "CHUNK_ROW_ALIGN",
    "GEMM_KINDS",
    "GROUP_M",
    "INTERPRETER_BLOCK",
    "MAX_BS_PER_LAUNCH",
    "MIN_TRANSFER_BLOCK_BYTES",
    "chunk_rows",
    "gemm_shapes",
    "interpreter_shape",
    "producer_shape",
    "transfer_blocks",
]

# The kinds of GEMM operands, each with its own tile menu (:func:`gemm_shapes`): a tile that
# wins for one kind spills, or does not fit shared memory, for another.
GEMM_KINDS: tuple[str, ...] = ("fp32", "16bit", "fp8", "mxfp8")
# The (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) the tuned GEMMs pick from on a GPU,
# per operand kind. Per rank at TP=8, Llama-3 8B/70B/405B give N and K of 512 to 16384 (hidden
# 4096/8192/16384, MLP 1792/3584/6656, q/kv/o of hidden / 8) and M of thousands of tokens.
#
# 16-bit: large tiles with two warpgroups for the wide outputs (128x256 in 3 stages, 144 KiB,
# which sm_80's 163 KiB holds, and in 4 stages, 192 KiB, for sm_90 and sm_100's 227 KiB; the
# tuner skips a config that does not fit), 128x128 and 64x256 (4 stages) where N / BLOCK_N
# leaves too few tiles for 132 SMs, and small tiles for the decode-sized and test shapes.
#
# fp8: the kernels add each K block's wgmma product into the fp32 accumulator
# (``max_num_imprecise_acc = BLOCK_K``, see ``kernels._shared._accumulate``), so a thread holds
# two accumulators: 128x256 with two warpgroups (2 x 128 fp32 registers) spills on sm_90, 128x128
# with two (2 x 64) does not, and 128x64 with one makes ptxas serialize the wgmmas (the adds
# read a wgmma's registers inside its pipeline stage). BLOCK_K = 128 (a 128-byte row, TMA's
# widest swizzle) halves the promotions per tile against 64; 4 stages of 128x128x128: 128 KiB.
# 64x64x128 takes 3 stages: with 4, Triton 3.7.1 spills 8 B per thread on sm_100.
#
# mxfp8 (e4m3 with an e8m0 scale per 32 elements along K, ``tl.dot_scaled``; run on sm_100 only,
# where it is one block-scaled tcgen05.mma): BLOCK_M 128, the MMA's M (at 64 Triton leaves the
# block-scaled MMA for an upcast), BLOCK_K 128 (four scales a row per K step). The accumulator
# lives in tensor memory, so 128x256 holds no more registers than 128x128.
#
# fp32 (TF32 tensor cores, or FMA without TF32): four bytes an element, so at most 128x128; two
# tiles, so that a new shape's tuning compiles two kernels, not eight.
#
# Every menu but mxfp8's ends with a tile of at most 64x64, the producer's smallest
# (producer_shape). Its
# registers, and the FMA loop's, swing with warps, stages and the Triton version: ptxas spilled
# 8 to 656 B per thread in some layout of B on sm_90 or sm_100 with Triton 3.6.0-3.9.0 for
# 64x64x32 in 4 warps, 128x64 fp32 and 128x128x32 fp32; the small tiles here (8 warps) and
# 128x128x16 fp32 spill in none (compile_check asserts it).
_GEMM_SHAPES: dict[str, tuple[tuple[int, int, int, int, int], ...]] = {
    "16bit": (
        (128, 256, 64, 8, 3),
        (128, 256, 64, 8, 4),
        (256, 128, 64, 8, 3),
        (128, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (64, 256, 64, 4, 4),
        (128, 64, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (64, 64, 32, 8, 4),
    ),
    "fp8": (
        (128, 128, 128, 8, 4),
        (64, 128, 128, 4, 4),
        (64, 64, 128, 4, 3),
    ),
    "mxfp8": (
        (128, 256, 128, 8, 3),
        (128, 128, 128, 4, 4),
        (128, 64, 128, 4, 4),
    ),
    "fp32": (
        (128, 128, 16, 8, 3),
        (64, 64, 32, 8, 2),
    ),
}


def gemm_shapes(kind: str) -> tuple[tuple[int, int, int, int, int], ...]:
    """The ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` menu of the GEMMs whose
    operands are of ``kind`` (one of :data:`GEMM_KINDS`): ``"fp32"``, ``"16bit"`` (fp16, bf16)
    ``"fp8"`` (e4m3, e5m2; the scaled GEMMs) or ``"mxfp8"`` (e4m3 with block scales)."""
    if kind not in _GEMM_SHAPES:
        raise ValueError(f"kind: got {kind!r}, expected one of {GEMM_KINDS}")
    return _GEMM_SHAPES[kind]


# BLOCK_M, BLOCK_N and BLOCK_K of every GEMM under Triton's interpreter: one small tile, so that
# the CPU tests run several tiles per shard in reasonable time (BLOCK_K one MX block for mxfp8:
# interpreter_shape).
INTERPRETER_BLOCK = 16
# M tiles per group in the GEMMs' tile order: a group's M tiles walk the column tiles together,
# reading its row blocks and each column block once while they are in L2.
GROUP_M = 8
# Right-hand matrices one launch of the all-gather's consumer takes at most (QKV: 3; w1/w3: 2).
MAX_BS_PER_LAUNCH = 3
# The symm all-gather's chunk boundaries are multiples of the menu's largest BLOCK_M, so that a
# consumer tile's rows lie in one chunk and the tile waits for that chunk's word alone.
CHUNK_ROW_ALIGN = max(bm for kind in GEMM_KINDS for bm, *_ in gemm_shapes(kind))
# pipelined's row blocks: a block smaller than this is dominated by per-message latency on gloo
# and NCCL alike; at most this many blocks per peer transfer.
MIN_TRANSFER_BLOCK_BYTES = 1 << 20
_MAX_TRANSFER_BLOCKS = 4


def producer_shape(m: int, n: int, kind: str) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` of the matmul-reduce-scatter
    producer on a GPU for ``m`` rows per destination, ``N`` columns and operands of ``kind``,
    chosen from the shape (the producer is not tuned: see
    ``kernels.matmul_rs._producer_config``): the first tile of the kind's menu
    (:func:`gemm_shapes`) that is at most 128 rows (64 for ``m < 128``) by 256 columns (128 for
    ``N < 256``, 64 for ``N < 128``), so the producer runs a config that the consumer may run
    too and compile_check reads. 16-bit operands take 128x256 in 3 stages (sm_80 holds it) once
    ``N >= 256``, as Llama's row-parallel Linears have at TP=8; fp8 and fp32 at most 128x128."""
    rows = 128 if m >= 128 else 64
    cols = 256 if n >= 256 else 128 if n >= 128 else 64
    menu = gemm_shapes(kind)
    # mxfp8's tiles are all 128 rows (the block-scaled MMA's M): its smallest then.
    return next((s for s in menu if s[0] <= rows and s[1] <= cols), menu[-1])


def interpreter_shape(kind: str) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` of a GEMM of operands of ``kind`` under Triton's
    interpreter: :data:`INTERPRETER_BLOCK` each, but a K step of one whole MX block
    (:data:`MX_BLOCK`) for ``"mxfp8"``, whose scales come a block at a time."""
    block_k = MX_BLOCK if kind == "mxfp8" else INTERPRETER_BLOCK
    return INTERPRETER_BLOCK, INTERPRETER_BLOCK, block_k


def chunk_rows(m: int, chunks: int, *, interpret: bool) -> int:
    """Rows per chunk of the symm all-gather's copies of an ``m``-row shard cut into ``chunks``,
    rounded up to whole consumer tiles (:data:`CHUNK_ROW_ALIGN` rows on a GPU,
    :data:`INTERPRETER_BLOCK` in the interpreter), so the shard may take fewer chunks."""
    align = INTERPRETER_BLOCK if interpret else CHUNK_ROW_ALIGN
    rows = -(-m // chunks)
    return max(-(-rows // align) * align, 1)


def transfer_blocks(rows: int, row_bytes: int) -> int:
    """pipelined's row blocks per peer transfer of ``rows`` rows of ``row_bytes`` bytes each: the
    count set (:data:`tp_kernels.config.PIPELINE_CHUNKS`), else one per
    :data:`MIN_TRANSFER_BLOCK_BYTES`, from 1 to 4; never more than the rows."""
    chosen = config.PIPELINE_CHUNKS.get()
    if chosen is None:
        chosen = min(_MAX_TRANSFER_BLOCKS, max(1, rows * row_bytes // MIN_TRANSFER_BLOCK_BYTES))
    return max(1, min(chosen, rows))


ROW_SCALE_BYTES = 16
"""Bytes a packed fp8 row carries after its ``K`` fp8 bytes (a scaled all-gather's row-wise
shard, :mod:`tp_kernels.backends.scaled`): its fp32 scale, then padding to 16 bytes, so that every
row starts 16-byte aligned for TMA and vector loads. The backends pack by it, the consumer kernel
reads by it and the cost model counts it on the wire."""

MX_BLOCK = 32
"""Elements per MX scale (OCP MX v1.0; torchao's MXFP8 recipes): one e8m0 scale byte per 32
consecutive elements along the dim a cast reduces."""


def mx_row_bytes(k: int) -> int:
    """Bytes of one packed MXFP8 row of ``k`` elements (a block-scaled all-gather's shard,
    :mod:`tp_kernels.backends.scaled`): ``k`` e4m3 bytes, then its ``k / 32`` e8m0 scale bytes,
    padded to 16 so that every row starts 16-byte aligned. About 0.52 of a bf16 row at any
    ``k`` of 512 or more."""
    return k + -(-(k // MX_BLOCK) // 16) * 16
