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
    "GEMM_SHAPES",
    "GROUP_M",
    "INTERPRETER_BLOCK",
    "MAX_BS_PER_LAUNCH",
    "MIN_TRANSFER_BLOCK_BYTES",
    "chunk_rows",
    "producer_blocks",
    "transfer_blocks",
]

# The (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) the autotuned GEMM picks from on a GPU.
# Per rank at TP=8, Llama-3 8B/70B/405B give N and K of 512 to 16384 (hidden 4096/8192/16384,
# MLP 1792/3584/6656, q/kv/o of hidden / 8) and M of thousands of tokens: large tiles
# (128x256 and 256x128 with two warpgroups, 3 stages of 144 KiB in 16 bits) for the wide
# outputs, 128x128 and 64x256 (4 stages) where N / BLOCK_N leaves too few tiles for 132 SMs, and
# small tiles for the decode-sized and test shapes. Configs whose stage buffers exceed a GPU's
# shared memory (fp32 with the large tiles) fail to load there and the autotuner drops them.
GEMM_SHAPES: tuple[tuple[int, int, int, int, int], ...] = (
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (64, 256, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 64, 32, 4, 4),
)
# BLOCK_M, BLOCK_N and BLOCK_K of every GEMM under Triton's interpreter: one small tile, so that
# the CPU tests run several tiles per shard in reasonable time.
INTERPRETER_BLOCK = 16
# M tiles per group in the GEMMs' tile order: a group's M tiles walk the column tiles together,
# reading its row blocks and each column block once while they are in L2.
GROUP_M = 8
# Right-hand matrices one launch of the all-gather's consumer takes at most (QKV: 3; w1/w3: 2).
MAX_BS_PER_LAUNCH = 3
# The symm all-gather's chunk boundaries are multiples of the menu's largest BLOCK_M, so that a
# consumer tile's rows lie in one chunk and the tile waits for that chunk's word alone.
CHUNK_ROW_ALIGN = max(bm for bm, *_ in GEMM_SHAPES)
# pipelined's row blocks: a block smaller than this is dominated by per-message latency on gloo
# and NCCL alike; at most this many blocks per peer transfer.
MIN_TRANSFER_BLOCK_BYTES = 1 << 20
_MAX_TRANSFER_BLOCKS = 4


def producer_blocks(m: int, n: int, *, fp32: bool) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` of the matmul-reduce-scatter producer on a GPU for ``m``
    rows per destination and ``N`` columns, chosen from the shape (the producer is not
    autotuned: see ``kernels.matmul_rs._producer_config``). 16-bit operands take 128x256 tiles
    once ``N >= 256``, as Llama's row-parallel Linears have at TP=8; fp32 keeps ``BLOCK_K = 32``
    and ``BLOCK_N <= 128`` so that its stages fit in shared memory."""
    bm = 128 if m >= 128 else 64
    if fp32:
        return bm, (128 if n >= 128 else 64), 32
    return bm, (256 if n >= 256 else 128 if n >= 128 else 64), 64


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
