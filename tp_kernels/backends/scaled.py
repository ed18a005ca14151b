"""Scaled (fp8) calls of the two fused patterns: what a backend needs beyond the unscaled call.

A scaled call's operands are fp8 (``float8_e4m3fn`` or ``float8_e5m2``) with fp32 **dequant
scales** in torch's convention (``torch._scaled_mm``'s ``scale_a``/``scale_b``: the real value
is ``fp8 * scale``)::

    all_gather_matmul:      A_s [m, K] fp8 with row-wise scales [m, 1] (or one tensor-wise []
                            scale, the same on every rank), B_j [K, N_j] fp8 with scales
                            [1, N_j] (or []):  C_j = dequant(cat_s A_s) @ dequant(B_j)  [W*m, N_j]
    matmul_reduce_scatter:  a [W*m, K] fp8 with scales [W*m, 1] (or []), b [K, N] with [1, N]
                            (or []): this rank's rows of sum over ranks of (scaled a @ b + addend)

Outputs are ``out_dtype`` (high precision); the reduce-scatter moves those partials and sums them
in fp32 in rank order, as the unscaled one does.

**Packed rows.** A row-wise scale travels with its row: the gather moves ``[m, K + 16]`` bytes
per shard, the row's fp8 bytes then its fp32 scale (and 12 bytes of padding, so that every row
starts 16-byte aligned, as TMA and the vector loads want: ``K`` is a multiple of 16 for any fp8
GEMM). One tensor, so one collective (one Work on NCCL), one set of transfers per block, and on
``symm`` one set of progress words cover the bytes and their scales. A tensor-wise scale is one
number every rank holds: only the fp8 bytes travel.

**The block product** (:func:`scaled_mm`) is ``torch._scaled_mm``'s (the public scaled ops'), or
with ``post_scale`` torchao's rule for Float8Linear's GEMMs, so that a fused call equals torchao's
unfused one bit for bit where the same rows meet the same ``torch._scaled_mm``: a row-wise product
without fast accumulation runs unscaled into bf16 and is then multiplied by the outer product of
the scales (torchao's choice for its slow-accumulation GEMMs). Either way fp16/fp32 outputs of
row-wise products are made in bf16 and cast, as ``_scaled_mm`` has no fp32 row-wise output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tp_kernels.tiling import MX_BLOCK, ROW_SCALE_BYTES, mx_row_bytes

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class _LeftRows:
    """What both scalings do alike with the left operand of a block: its rows and their scales,
    read from the all-gather's packed bytes when :attr:`packed`, else taken from the
    reduce-scatter's ``a`` and ``a_scale``. The packing (:meth:`_unpack`) is each scaling's."""

    a_scale: torch.Tensor | None
    a_dtype: torch.dtype
    _unpack: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]  # (packed, K)

    @property
    def packed(self) -> bool:
        """Whether the gathered rows carry their own scales (row-wise all-gather)."""
        return self.a_scale is None

    def _left(
        self, a: torch.Tensor, k: int, rows: slice | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, scale)`` of left-operand rows ``a`` (gathered bytes: packed when
        :attr:`packed`; or rows ``rows`` of the reduce-scatter's ``a``) of ``k`` columns."""
        if self.packed:
            return self._unpack(a, k)
        data = a.view(self.a_dtype) if a.dtype == torch.uint8 else a
        scale = self.a_scale
        if scale.dim() and rows is not None:  # a tensor-wise scale serves every row
            scale = scale[rows]
        return data, scale


@dataclass(frozen=True)
class Scaling(_LeftRows):
    """What makes a fused call scaled. ``a_scale``: the left operand's dequant scale: ``[]``
    tensor-wise, ``[rows, 1]`` row-wise beside the reduce-scatter's ``a``, or None for the
    all-gather's row-wise scales, which travel in its packed rows (:func:`pack_rows`).
    ``b_scales``: one per right-hand side, ``[]`` or ``[1, N_j]``. ``out_dtype``: the
    products' dtype. ``fast_accum``: ``_scaled_mm``'s ``use_fast_accum`` (torchao's forward
    GEMM uses it; its backward GEMMs do not). ``post_scale``: torchao's rule (see the module
    docstring). ``a_dtype``: the left operand's fp8 dtype (the
    all-gather moves it as ``uint8`` bytes: gloo cannot gather fp8 tensors)."""

    a_scale: torch.Tensor | None
    b_scales: tuple[torch.Tensor, ...]
    out_dtype: torch.dtype
    fast_accum: bool = True
    a_dtype: torch.dtype = torch.float8_e4m3fn
    post_scale: bool = False

    def _unpack(self, packed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return unpack_rows(packed, k, self.a_dtype)

    def block(
        self, a: torch.Tensor, j: int, b: torch.Tensor, rows: slice | None = None
    ) -> torch.Tensor:
        """The product of left-operand rows ``a`` (gathered bytes: packed when :attr:`packed`;
        or rows ``rows`` of the reduce-scatter's fp8 ``a``) and right-hand side ``j`` (``b``)."""
        data, a_scale = self._left(a, b.shape[0], rows)
        return scaled_mm(
            data,
            a_scale,
            b,
            self.b_scales[j],
            self.out_dtype,
            fast_accum=self.fast_accum,
            post_scale=self.post_scale,
        )


def scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    fast_accum: bool,
    post_scale: bool = False,
) -> torch.Tensor:
    """``(a * a_scale) @ (b * b_scale)`` in ``out_dtype``, by the rule in the module docstring:
    ``a [M, K]`` and ``b [K, N]`` fp8, ``a_scale`` ``[M, 1]`` or ``[]``, ``b_scale`` ``[1, N]`` or
    ``[]`` (the rule's "row-wise" is both row-wise)."""
    # torchao's test: both row-wise (a tensor-wise and a row-wise scale go to _scaled_mm as
    # they are, as in rowwise_with_gw_hp's input-grad GEMM).
    rowwise = a_scale.shape == (a.shape[0], 1) and b_scale.shape == (1, b.shape[1])
    mm_dtype = torch.bfloat16 if rowwise and out_dtype != torch.bfloat16 else out_dtype
    if rowwise and post_scale and not fast_accum:
        one = a_scale.new_ones(())
        out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=mm_dtype)
        out *= a_scale * b_scale
    else:
        # contiguous(): a packed row's scale is a strided view (unpack_rows), which
        # _scaled_mm's row-wise check refuses.
        out = torch._scaled_mm(
            a,
            b,
            scale_a=a_scale.contiguous(),
            scale_b=b_scale.contiguous(),
            out_dtype=mm_dtype,
            use_fast_accum=fast_accum,
        )
    return out if mm_dtype == out_dtype else out.to(out_dtype)


def pack_rows(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[m, K + ROW_SCALE_BYTES]`` uint8: each row's fp8 bytes (``data [m, K]``), then its fp32
    ``scale [m, 1]``, then zeros."""
    m, k = data.shape
    packed = data.new_zeros((m, k + ROW_SCALE_BYTES), dtype=torch.uint8)
    packed[:, :k] = data.view(torch.uint8)
    packed[:, k : k + 4] = scale.to(torch.float32).reshape(m, 1).view(torch.uint8)
    return packed


def unpack_rows(
    packed: torch.Tensor, k: int, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data [rows, K] as dtype, scale [rows, 1] fp32)``: views of packed rows."""
    data = packed[:, :k].view(dtype)
    scale = packed[:, k : k + 4].view(torch.float32)
    return data, scale


@dataclass(frozen=True)
class BlockScaling(_LeftRows):
    """What makes a fused call block-scaled (MXFP8: e4m3 data, one e8m0 scale per
    :data:`~tp_kernels.tiling.MX_BLOCK` elements along K), with the same face as
    :class:`Scaling` for the backends: ``packed`` rows for the all-gather (each row's data, then
    its scales, :func:`pack_mx_rows`), else ``a_scale`` ``[rows, K / 32]`` beside the
    reduce-scatter's ``a``; :meth:`block` gives a block's product in ``out_dtype``.

    The product itself is ``products[j](data, scale)``: given by the caller (the styles' layer
    owns torchao, whose MX GEMM it runs: ``tp_kernels/mxfp8.py``), so that a fused call's rows
    meet exactly the GEMM torchao would run on them. ``b`` (the right-hand side's e4m3 data,
    ``[K, N_j]``) is what the backends size outputs by; ``b_scales[j]`` (e8m0 ``[N_j, K / 32]``,
    contiguous: column ``n``'s scales in a row) is what the ``symm`` backend's Triton GEMMs take
    with it where they run block-scaled operands (:func:`tp_kernels.kernels.block_scaled_mma`)."""

    a_scale: torch.Tensor | None
    products: tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], ...]
    b_scales: tuple[torch.Tensor, ...]
    out_dtype: torch.dtype
    a_dtype: torch.dtype = torch.float8_e4m3fn

    def _unpack(self, packed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return unpack_mx_rows(packed, k, self.a_dtype)

    def block(
        self, a: torch.Tensor, j: int, b: torch.Tensor, rows: slice | None = None
    ) -> torch.Tensor:
        """The product of left-operand rows ``a`` (packed bytes when :attr:`packed`, else
        rows ``rows`` of the reduce-scatter's e4m3 ``a``) and right-hand side ``j``."""
        data, scale = self._left(a, b.shape[0], rows)
        out = self.products[j](data, scale)
        return out if out.dtype == self.out_dtype else out.to(self.out_dtype)


def pack_mx_rows(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[m, mx_row_bytes(K)]`` uint8: each row's e4m3 bytes (``data [m, K]``), then its e8m0
    ``scale [m, K / 32]`` bytes, then zeros."""
    m, k = data.shape
    packed = data.new_zeros((m, mx_row_bytes(k)), dtype=torch.uint8)
    packed[:, :k] = data.view(torch.uint8)
    packed[:, k : k + k // MX_BLOCK] = scale.reshape(m, k // MX_BLOCK).view(torch.uint8)
    return packed


def unpack_mx_rows(
    packed: torch.Tensor, k: int, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data [rows, K] as dtype, scale [rows, K / 32] e8m0)``, contiguous (torchao's MX GEMMs
    want them so)."""
    data = packed[:, :k].contiguous().view(dtype)
    scale = packed[:, k : k + k // MX_BLOCK].contiguous().view(torch.float8_e8m0fnu)
    return data, scale


Scaled = Scaling | BlockScaling
"""What a backend's ``scaling`` argument may be: both answer ``packed``, ``block``,
``b_scales``, ``out_dtype`` and ``a_dtype``."""
