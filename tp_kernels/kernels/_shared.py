"""What the kernels of this package share: the launchers' host helpers (dtypes, configs, TMA
operands, argument checks of the kernels' own protocol arguments, the timeout record) and the
``@triton.jit`` helpers every kernel calls (signal waits, rounding, tile order, block loads).
The protocol they implement is described in the package docstring."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterator, Sequence

import torch
import triton
import triton.language as tl

from tp_kernels import config, signals, tiling

INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"
DEFAULT_TIMEOUT_S: float = config.TIMEOUT_S.default
# The oldest Triton whose kernels compile_check has compiled and read (torch 2.10/2.11 pin it).
MIN_TRITON: tuple[int, int] = (3, 6)
# Scalar arguments that are the same on no two ranks, or are addresses: Triton must not compile
# a variant for the values 1 and multiples of 16 (rank 1 would get a kernel of its own, and an
# address's alignment would pick one), so every kernel lists them in ``do_not_specialize``.
VARYING_ARGS: tuple[str, ...] = ("rank", "channel", "status_addr", "timeout_ns")
# The protocol's values (see tp_kernels.signals), as constants the kernels can use.
RAISED = tl.constexpr(signals.RAISED)
WAIT_START = tl.constexpr(signals.WAIT_START)
WAIT_PUBLISHED = tl.constexpr(signals.WAIT_PUBLISHED)
WAIT_CHUNK = tl.constexpr(signals.WAIT_CHUNK)
WAIT_SLOT = tl.constexpr(signals.WAIT_SLOT)

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
# The operands of a scaled GEMM (fp8 with fp32 dequant scales; out in one of _TL_DTYPES).
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)


def _triton_version(version: str = triton.__version__) -> tuple[int, int]:
    """``(major, minor)`` of a Triton version string; ValueError if it has none."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return major, minor


def triton_unsupported_reason(version: str = triton.__version__) -> str | None:
    """Why the installed Triton cannot build these kernels, or ``None`` if it can."""
    try:
        major_minor = _triton_version(version)
    except ValueError:
        return f"cannot read the Triton version {version!r}"
    if major_minor < MIN_TRITON:
        need = ".".join(map(str, MIN_TRITON))
        return (
            f"Triton {version} is older than {need}, the oldest these kernels are compiled and "
            f"checked with (torch >= 2.10 pins Triton >= {need})"
        )
    return None


def tl_dtype(dtype: torch.dtype, *, argument: str) -> tl.dtype:
    """The Triton element type of a supported torch floating dtype (fp32, fp16, bf16)."""
    if dtype not in _TL_DTYPES:
        raise TypeError(
            f"{argument}: dtype {dtype} is not supported; expected one of "
            f"{sorted(str(d) for d in _TL_DTYPES)}"
        )
    return _TL_DTYPES[dtype]


def _fp32_matmul_uses_tf32() -> bool:
    """Whether ``torch.matmul`` of fp32 CUDA tensors uses TF32 right now.

    torch >= 2.9 has ``fp32_precision`` ("tf32", "ieee", or "none": ask the legacy flag); reading
    the legacy ``allow_tf32`` raises once a user has set the new one, so the new one comes first.
    """
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", "none")
    if precision != "none":
        return precision == "tf32"
    return bool(matmul.allow_tf32)


def check_scales(
    a_scale: torch.Tensor | None,
    b_scales: Sequence[torch.Tensor],
    bs: Sequence[torch.Tensor],
    rows: int,
    *,
    a_rows_packed: bool,
) -> None:
    """A scaled GEMM's operands: every ``bs[j]`` fp8 [K, N_j] with a fp32 ``b_scales[j]`` of
    shape [] or [1, N_j] (any stride); ``a_scale`` fp32 [] or (unless A's rows are packed with
    their scales) [rows, 1]. Cheap, and what a wrong scale would turn into a wrong address."""
    if len(b_scales) != len(bs):
        raise ValueError(f"b_scales: got {len(b_scales)}, expected one per b ({len(bs)})")
    for j, (b, scale) in enumerate(zip(bs, b_scales, strict=True)):
        if b.dtype not in FP8_DTYPES:
            raise TypeError(f"bs[{j}]: a scaled GEMM takes fp8 operands, got {b.dtype}")
        if scale.dtype != torch.float32 or tuple(scale.shape) not in ((), (1, b.shape[1])):
            raise ValueError(
                f"b_scales[{j}]: got {scale.dtype} of shape {tuple(scale.shape)}, expected "
                f"float32 of shape () or (1, {b.shape[1]})"
            )
    if a_scale is None:
        if not a_rows_packed:
            raise ValueError("a_scale: required unless A's rows carry their scales")
        return
    shapes = ((),) if a_rows_packed else ((), (rows, 1))
    if a_scale.dtype != torch.float32 or tuple(a_scale.shape) not in shapes:
        raise ValueError(
            f"a_scale: got {a_scale.dtype} of shape {tuple(a_scale.shape)}, expected float32 of "
            f"shape {' or '.join(str(s) for s in shapes)}"
        )


# The dtype of an MXFP8 operand's scales (one e8m0 byte per 32 elements along K).
MX_SCALE_DTYPE = torch.float8_e8m0fnu


def check_block_scales(
    a_scale: torch.Tensor | None,
    b_scales: Sequence[torch.Tensor],
    bs: Sequence[torch.Tensor],
    rows: int,
) -> None:
    """A block-scaled (MXFP8) GEMM's operands: every ``bs[j]`` e4m3 ``[K, N_j]`` with its
    e8m0 ``b_scales[j]`` ``[N_j, K / 32]`` contiguous (column ``n``'s scales in a row, as
    ``tl.dot_scaled`` takes them), ``K`` a multiple of 32; ``a_scale`` (unless A's rows carry
    their scales) e8m0 ``[rows, K / 32]`` contiguous. What a wrong shape would turn into a
    wrong address."""
    if len(b_scales) != len(bs):
        raise ValueError(f"b_scales: got {len(b_scales)}, expected one per b ({len(bs)})")
    k = bs[0].shape[0]
    if k % tiling.MX_BLOCK:
        raise ValueError(f"bs: K = {k} is not a multiple of {tiling.MX_BLOCK} (one MX block)")
    blocks = k // tiling.MX_BLOCK
    named = [
        (f"b_scales[{j}]", s, (b.shape[1], blocks)) for j, (b, s) in enumerate(zip(bs, b_scales))
    ]
    if a_scale is not None:
        named.append(("a_scale", a_scale, (rows, blocks)))
    for j, b in enumerate(bs):
        if b.dtype != torch.float8_e4m3fn or b.shape[0] != k:
            raise TypeError(f"bs[{j}]: got {b.dtype} [{tuple(b.shape)}], expected e4m3 [{k}, N]")
    for name, scale, shape in named:
        if (
            scale.dtype != MX_SCALE_DTYPE
            or tuple(scale.shape) != shape
            or not scale.is_contiguous()
        ):
            raise ValueError(
                f"{name}: got {scale.dtype} of shape {tuple(scale.shape)} (contiguous="
                f"{scale.is_contiguous()}), expected contiguous {MX_SCALE_DTYPE} of shape {shape}"
            )


def scale_stride(scale: torch.Tensor) -> int:
    """The element stride between consecutive scales of a ``[]``, ``[rows, 1]`` or ``[1, N]``
    scale (0 for one scale): what a kernel steps its scale pointer by."""
    if scale.dim() == 0:
        return 0
    return scale.stride(0) if scale.shape[1] == 1 and scale.shape[0] != 1 else scale.stride(-1)


def dot_precision(dtype: torch.dtype) -> str | None:
    """``input_precision`` for ``tl.dot``: fp32 follows torch's TF32 setting for CUDA matmuls
    (see :func:`_fp32_matmul_uses_tf32`); 16-bit operands keep Triton's default."""
    if dtype != torch.float32:
        return None
    return "tf32" if not INTERPRET and _fp32_matmul_uses_tf32() else "ieee"


# M tiles per group in the tile order of the GEMMs (see :func:`_tile_coords`), as a constexpr:
# kernels may read only constexpr globals.
GROUP_M = tl.constexpr(tiling.GROUP_M)


def gemm_kind(dtype: torch.dtype, *, block_scaled: bool = False) -> str:
    """The kind of GEMM operands of ``dtype`` whose tile menu a GEMM picks from
    (:func:`tp_kernels.tiling.gemm_shapes`): ``"mxfp8"`` (``block_scaled``), ``"fp8"``,
    ``"fp32"`` or ``"16bit"``."""
    if block_scaled:
        return "mxfp8"
    if dtype in FP8_DTYPES:
        return "fp8"
    return "fp32" if dtype == torch.float32 else "16bit"


@functools.cache
def gemm_configs(kind: str) -> tuple[triton.Config, ...]:
    """The configs of the tile menu of ``kind`` (:func:`tp_kernels.tiling.gemm_shapes`), which
    :mod:`tp_kernels.kernels.tuning` chooses from per shape; one small fixed tile under the
    interpreter (:func:`tp_kernels.tiling.interpreter_shape`). Made once per kind: every call
    of a consumer asks for them."""
    if INTERPRET:
        blocks = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K"), tiling.interpreter_shape(kind)))
        return (triton.Config(blocks, num_warps=1),)
    return tuple(
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bm, bn, bk, w, st in tiling.gemm_shapes(kind)
    )


# Programs of a persistent launch in the interpreter: more than one, so that the tile loops and
# their striding over programs run in the CPU tests too.
_INTERPRETER_PROGRAMS = 2


# SMs that each rank's persistent launch leaves free when ranks share a GPU. On one device a
# device-to-device copy (the all-gather's copies, the reduce-scatter's pushes) is likely run by
# an SM kernel, not the copy engine, and the barrier and reduction are small kernels too: while
# every rank's persistent GEMM spins on progress words that those kernels raise, they need SMs
# that no GEMM program holds, or they starve until the deadline. Each rank takes at most
# ``SMs // ranks - 2``: its share, less one SM for its own copy kernel and one for the small
# kernels (its barrier, a peer's signal); all ranks' GEMMs together then leave at least 2 SMs per
# rank free (a program holds at most one SM), 4 of 132 for 2 ranks on an H100, 8 for 4 ranks,
# at a cost of 3-6% of the GEMM's SMs, on a setup that exists for testing, not for speed.
SHARED_DEVICE_FREE_SMS = 2


def programs_for(num_sms: int, ranks_on_device: int) -> int:
    """Programs of a persistent launch on a GPU of ``num_sms`` SMs that ``ranks_on_device`` ranks
    share: all of them for one rank, else at most its share less :data:`SHARED_DEVICE_FREE_SMS`
    (at least 1)."""
    if ranks_on_device <= 1:
        return num_sms
    return max(1, num_sms // ranks_on_device - SHARED_DEVICE_FREE_SMS)


# (device index, config generation) -> persistent_programs(device): the launchers call it on
# every call, and a changed setting bumps the generation.
_programs: dict[tuple[int, int], int] = {}


def persistent_programs(device: torch.device) -> int:
    """How many programs a persistent GEMM launches at most: one per SM (each loops over tiles),
    so every program is resident and none waits for a place behind one that spins; when ranks
    share the GPU (:func:`tp_kernels.config.shared_device_ranks`), this rank's share of the SMs
    less a few (:func:`programs_for`)."""
    if INTERPRET:
        return _INTERPRETER_PROGRAMS
    index = torch.device(device).index
    key = (torch.cuda.current_device() if index is None else index, config.generation())
    programs = _programs.get(key)
    if programs is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        ranks = config.shared_device_ranks(torch.cuda.device_count())
        programs = _programs[key] = programs_for(sms, ranks)
    return programs


def tma_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the GEMMs read local ``dtype`` operands with tensor descriptors on ``device``: on
    GPUs with TMA (sm_90 and newer), and in the interpreter (so CPU tests run the same code).
    Below sm_90 Triton lowers descriptors to plain loads that lose the pointers' alignment and
    with it ``cp.async``, so the pointer loads stay there. An fp32 GEMM without TF32 runs on the
    FMA units, bound by the math, and reading TMA's swizzled tiles there makes ptxas spill
    (kilobytes per thread in compile_check): it keeps the pointer loads too."""
    if INTERPRET:
        return True
    device = torch.device(device)
    if device.type != "cuda" or dot_precision(dtype) == "ieee":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def tma_layout(t: torch.Tensor) -> str:
    """How a GEMM reads the 2-D operand ``t`` [R, C] on a TMA-capable device.

    ``"rc"``: through a descriptor over ``t`` (row-major); ``"cr"``: through a descriptor over
    ``t.t()`` (``t`` is the transpose of a row-major [C, R], e.g. a Linear's ``weight.t()``), the
    loaded block transposed; ``"pointer"``: through its strides. TMA needs a 16-byte aligned base,
    a contiguous last dimension and a row stride that is a multiple of 16 bytes.
    """
    size = t.element_size()
    if t.data_ptr() % 16:
        return "pointer"
    if t.stride(1) == 1 and t.stride(0) * size % 16 == 0:
        return "rc"
    if t.stride(0) == 1 and t.stride(1) * size % 16 == 0:
        return "cr"
    return "pointer"


def tma_operand(t: torch.Tensor, layout: str) -> object:
    """What a GEMM kernel takes for operand ``t`` read with ``layout`` (see :func:`tma_layout`):
    a tensor descriptor (its block shape set by :func:`set_block_shape` before the launch), or
    ``t`` itself for pointer loads."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if layout == "pointer":
        return t
    view = t if layout == "rc" else t.t()
    return TensorDescriptor.from_tensor(view, [16, 16])


def set_block_shape(operand: object, layout: str, block_r: int, block_c: int) -> None:
    """Give a descriptor from :func:`tma_operand` the block [block_r, block_c] of its operand."""
    if layout == "rc":
        operand.block_shape = [block_r, block_c]
    elif layout == "cr":
        operand.block_shape = [block_c, block_r]


def check_world(rank: int, world_size: int, channel: int = 0) -> None:
    """Validate the rank/world/channel arguments the launchers take."""
    if world_size < 1:
        raise ValueError(f"world_size: got {world_size}, expected >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: got {rank}, expected 0 <= rank < world_size={world_size}")
    if channel < 0:
        raise ValueError(f"channel: got {channel}, expected >= 0")


def check_ptr_table(
    table: torch.Tensor, world_size: int, device: torch.device, *, argument: str
) -> None:
    """An address table must be an int64 tensor of shape [world_size] on the kernel's device."""
    if table.dtype != torch.int64 or table.dim() != 1 or table.shape[0] != world_size:
        raise ValueError(
            f"{argument}: got a {table.dtype} tensor of shape {tuple(table.shape)}, "
            f"expected int64 of shape ({world_size},) (one address per rank)"
        )
    if table.device != device or not table.is_contiguous():
        raise ValueError(
            f"{argument}: got a tensor on {table.device} (contiguous="
            f"{table.is_contiguous()}), expected a contiguous tensor on {device}"
        )


def check_tensor(
    t: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    *,
    argument: str,
) -> None:
    """A scratch tensor a launcher is given (the producer's counters) must have exactly this shape,
    dtype and device, and be contiguous."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ValueError(
            f"{argument}: got {t.dtype} of shape {tuple(t.shape)} on {t.device}, "
            f"expected {dtype} of shape {tuple(shape)} on {device}"
        )
    if not t.is_contiguous():
        raise ValueError(f"{argument}: must be contiguous, got strides {t.stride()}")


def timeout_ns(timeout_s: float) -> int:
    """A wait's deadline in nanoseconds."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: got {timeout_s}, expected a positive number of seconds")
    return int(timeout_s * 1e9)


def new_status(world_size: int, device: torch.device) -> torch.Tensor:
    """A zeroed timeout record for kernels on ``device``: int32 [W] that the host can read at any
    time without synchronizing. For CUDA it is pinned host memory, which kernels write directly
    (unified addressing); pass its address as ``status_addr``."""
    pinned = torch.device(device).type == "cuda"
    return torch.zeros(world_size, dtype=torch.int32, pin_memory=pinned)


def check_status(status: torch.Tensor, world_size: int) -> None:
    """``status`` must be a host tensor as :func:`new_status` makes it."""
    if status.dtype != torch.int32 or tuple(status.shape) != (world_size,):
        raise ValueError(
            f"status: got {status.dtype} of shape {tuple(status.shape)}, "
            f"expected torch.int32 of shape ({world_size},) (see new_status)"
        )
    if status.device.type != "cpu" or not status.is_contiguous():
        raise ValueError(
            f"status: got a tensor on {status.device}, expected contiguous host memory "
            "(pinned for CUDA kernels; see new_status)"
        )


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Launch on ``device`` (Triton launches on the current CUDA device and its stream)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


if INTERPRET:

    def _host_clock_ns():
        return tl.full((), time.monotonic_ns(), tl.int64)

    def _host_pause():
        time.sleep(20e-6)  # the interpreter polls from Python: leave the core to the peer

    @triton.jit
    def _poll_acquire(word_ptr, value, timeout_ns, status_ptr):
        """The interpreter's body of the poll below: the same words, the host's clock."""
        seen = tl.atomic_add(word_ptr, 0, sem="acquire", scope="sys")
        ok = seen == value
        if not ok:
            if tl.load(status_ptr, volatile=True) == 0:
                deadline = _host_clock_ns() + timeout_ns
                while (seen != value) & (_host_clock_ns() < deadline):
                    _host_pause()
                    seen = tl.atomic_add(word_ptr, 0, sem="acquire", scope="sys")
                ok = seen == value
        return ok.to(tl.int32)

    @triton.jit
    def _fence_proxy_async(dependency):
        """Nothing to order in the interpreter: its descriptor loads are plain loads."""
        pass

    @triton.jit
    def _cta_barrier(dependency):
        """Nothing to wait for in the interpreter: a program runs as one thread."""
        pass

    def _range_arg(x):
        """``x`` (a scalar tensor, or a Python int or constexpr) as what Python's ``range`` takes.

        Why: a ``for ... in range(...)`` with a tensor bound, start or step runs in the
        interpreter as Python's ``range``, which calls the tensor's ``__index__``. Triton
        3.6.0's interpreter defines it as ``int(data)`` of the tensor's numpy data, a 1-element
        *1-D* array, and NumPy >= 2.4 refuses that ("TypeError: only 0-dimensional arrays can be
        converted to Python scalars"; 3.7 squeezes the array first). A plain function, so it
        runs as Python; on a GPU :func:`_range_arg` is the identity and the kernels are the same.
        """
        return x.handle.data.item() if isinstance(x, tl.tensor) else x

else:
    # Every thread polls on its own (no barrier inside, so no thread can wait for a thread that
    # left): a word already at the value costs one load; otherwise read the peer's timeout
    # record once (a peer already given up on is not waited for again), then spin on an acquire
    # load until the word equals the value or %globaltimer says the deadline passed. ${:uid}
    # makes the labels unique where the poll is inlined several times.
    _POLL_PTX = tl.constexpr(
        """
        {
        .reg .pred %p<3>;
        .reg .b32 %v;
        .reg .u64 %t0, %t;
        mov.u32 $0, 1;
        ld.acquire.sys.global.b32 %v, [$1];
        setp.eq.b32 %p0, %v, $2;
        @%p0 bra DONE${:uid};
        ld.volatile.global.b32 %v, [$3];
        setp.ne.b32 %p1, %v, 0;
        @%p1 bra FAILED${:uid};
        mov.u64 %t0, %globaltimer;
        SPIN${:uid}:
        ld.acquire.sys.global.b32 %v, [$1];
        setp.eq.b32 %p0, %v, $2;
        @%p0 bra DONE${:uid};
        mov.u64 %t, %globaltimer;
        sub.u64 %t, %t, %t0;
        setp.lt.u64 %p2, %t, $4;
        @%p2 bra SPIN${:uid};
        FAILED${:uid}:
        mov.u32 $0, 0;
        DONE${:uid}:
        }
        """
    )

    @triton.jit
    def _poll_acquire(word_ptr, value, timeout_ns, status_ptr):
        """1 once ``*word_ptr == value`` (acquire, system scope); 0 at the deadline, or at once
        if ``*status_ptr`` already records a timeout."""
        return tl.inline_asm_elementwise(
            _POLL_PTX,
            "=r,l,r,l,l",
            [word_ptr, value, status_ptr, timeout_ns],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    @triton.jit
    def _fence_proxy_async(dependency):
        """``fence.proxy.async.global``: order this thread's earlier generic-proxy accesses (the
        acquire of a progress word) before its later async-proxy ones (TMA loads of the data the
        word announces). ``dependency`` only gives the asm an operand."""
        tl.inline_asm_elementwise(
            "fence.proxy.async.global; mov.u32 $0, $1;",
            "=r,r",
            [dependency],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    @triton.jit
    def _cta_barrier(dependency):
        """``bar.sync 0``: every thread of the program waits for all the others, so all their
        earlier stores precede any thread's later accesses. Not ``tl.debug_barrier()``: Triton's
        pipeliner leaves a loop holding one unpipelined (it cannot place a barrier that no value
        chains to among its stages); this asm, like any side effect, stays in order with the
        stores and atomics of the branch it is in. Every thread must reach it (a uniform
        branch). ``dependency`` only gives the asm an operand."""
        tl.inline_asm_elementwise(
            "bar.sync 0; mov.u32 $0, $1;",
            "=r,r",
            [dependency],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    @triton.jit
    def _range_arg(x):
        """The identity: a GPU kernel's ``range`` takes a tensor as it is (the interpreter's
        twin above exists for Triton 3.6.0's interpreter; inlined, the kernel is unchanged)."""
        return x


@triton.jit
def _wait_signal(word_ptr, timeout_ns, status_ptr, WAIT: tl.constexpr):
    """Block until ``*word_ptr`` is raised (``== RAISED``; acquire, system scope), at most
    ``timeout_ns``. Does not clear the word.

    On timeout store ``WAIT`` (which wait this was) into ``*status_ptr`` (the caller's record for
    this source), unless an earlier wait for the source already recorded its own: the first wait
    that timed out is the one the error names (later ones give up at once, see the poll)."""
    raised = tl.full((), RAISED, tl.int32)
    ok = _poll_acquire(word_ptr, raised, timeout_ns.to(tl.int64), status_ptr)
    if ok == 0:
        first = tl.load(status_ptr, volatile=True) == 0
        tl.store(status_ptr, WAIT, mask=first)


@triton.jit
def _round_to(x, DTYPE: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """``x`` (fp32) rounded to ``DTYPE``, to nearest with ties to even.

    ``BF16_BY_HAND`` is set for bf16 under the interpreter, which has two bf16 defects: its
    ``tl.dot`` of bf16 operands is wrong (the GEMMs upcast them to fp32 first) and its fp32 -> bf16
    cast truncates. The rounding is then done on the bits: add ``0x7FFF`` plus the lowest kept
    bit, keep the top half (a NaN whose payload lies only in the low 16 bits would come out as
    inf; torch's NaN does not).
    """
    if BF16_BY_HAND:
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _scale_epilogue(acc, a_scale, A_ROWS: tl.constexpr, b_scale_ptr, cols64, col_ok, stride_bsn):
    """A scaled GEMM's epilogue, in fp32: ``acc * a_scale[:, None] * b_scale[None, :]`` with
    ``a_scale`` a ``[BLOCK_M]`` vector (``A_ROWS``) or a scalar, and ``b_scale[n] =
    b_scale_ptr[cols64[n] * stride_bsn]`` (stride 0: one scale). The caller then rounds once to
    the output dtype; ``torch._scaled_mm`` without fast accumulation may round twice (see
    :mod:`tp_kernels.backends.scaled`), so the two agree within a rounding, not bit for bit."""
    b_scale = tl.load(b_scale_ptr + cols64 * stride_bsn, mask=col_ok, other=0.0)
    if A_ROWS:
        acc = acc * a_scale[:, None]
    else:
        acc = acc * a_scale
    return acc * b_scale[None, :]


@triton.jit
def _tile_coords(tile, tiles_per_shard, n_tiles, GROUP_M: tl.constexpr):
    """``(m_tile, col_tile)`` of output tile number ``tile``: shard by shard (``tiles_per_shard``
    M tiles of ``n_tiles`` column tiles each), and inside a shard in groups of ``GROUP_M`` M tiles
    that walk the column tiles together, column tile 0 of every M tile of the group first. A
    group reads ``GROUP_M`` row blocks and each column block once while they are in L2, where
    M-tile-major order would stream all of B through L2 for every M tile."""
    tiles_in_shard = tiles_per_shard * n_tiles
    shard = tile // tiles_in_shard
    t = tile % tiles_in_shard
    first_m = (t // (GROUP_M * n_tiles)) * GROUP_M
    group_rows = tl.minimum(tiles_per_shard - first_m, GROUP_M)
    in_group = t % (GROUP_M * n_tiles)
    m_tile = shard * tiles_per_shard + first_m + in_group % group_rows
    return m_tile, in_group // group_rows


@triton.jit
def _tile_span(m_tile, col_tile, tiles_per_block, m, N, BLOCK_M, BLOCK_N):
    """Where output tile ``(m_tile, col_tile)`` lies in its ``m``-row block of an ``N``-wide
    output: ``(row0, rows64, cols64, row_ok, col_ok)``, its first row within the block, its rows
    and columns as int64 (``W*m*K`` or ``W*m*N`` elements may pass 2**31) and their masks."""
    row0 = (m_tile % tiles_per_block) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    return row0, rows.to(tl.int64), cols.to(tl.int64), rows < m, cols < N


@triton.jit
def _load_block(x, r0, c0, R, C, stride_r, stride_c, LAYOUT: tl.constexpr, BLOCK_R, BLOCK_C):
    """The block ``X[r0 : r0 + BLOCK_R, c0 : c0 + BLOCK_C]`` of an operand ``X`` [R, C], zero
    outside ``X``. ``LAYOUT`` (see :func:`tma_layout`): ``"rc"``, ``x`` is a descriptor over
    ``X``; ``"cr"``, a descriptor over ``X``'s transpose (TMA copies the [C, R] block, the
    transpose is a view of shared memory); ``"pointer"``, ``x`` points at ``X`` and its element
    ``(i, j)`` is at ``i * stride_r + j * stride_c``."""
    if LAYOUT == "rc":
        return x.load([r0, c0])
    elif LAYOUT == "cr":
        return x.load([c0, r0]).T
    else:
        rows = r0 + tl.arange(0, BLOCK_R)
        cols = c0 + tl.arange(0, BLOCK_C)
        offsets = rows.to(tl.int64)[:, None] * stride_r + cols.to(tl.int64)[None, :] * stride_c
        return tl.load(x + offsets, mask=(rows < R)[:, None] & (cols < C)[None, :], other=0.0)


@triton.jit
def _accumulate(
    acc, a_blk, b, k0, col0, K, N, stride_bk, stride_bn,
    B_LAYOUT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BF16_BY_HAND: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One step of a GEMM's K-loop, shared by both GEMMs: ``acc += a_blk @ b[k0:k0+BLOCK_K,
    col0:col0+BLOCK_N]`` (``b`` read by :func:`_load_block`; under the interpreter bf16 blocks are
    upcast first, see the package docstring).

    An fp8 product is added into the fp32 ``acc`` once per K block (``max_num_imprecise_acc``
    of ``BLOCK_K``): on sm_90 Triton's default (2^30) keeps the tensor cores' reduced-precision
    fp8 accumulator across all of K, which is ``_scaled_mm``'s ``use_fast_accum=True``, and 0
    makes it leave wgmma for fp16 ``mma.sync`` (read in 3.7.1's PTX). The scaled GEMMs promise
    fp32 accumulation whatever ``fast_accum`` asks (docs/DESIGN.md); sm_100 accumulates in fp32
    anyway."""
    b_blk = _load_block(b, k0, col0, K, N, stride_bk, stride_bn, B_LAYOUT, BLOCK_K, BLOCK_N)
    if BF16_BY_HAND:
        a_blk = a_blk.to(tl.float32)
        b_blk = b_blk.to(tl.float32)
    if a_blk.dtype.is_fp8():
        return tl.dot(
            a_blk, b_blk, acc, input_precision=INPUT_PRECISION, max_num_imprecise_acc=BLOCK_K
        )
    return tl.dot(a_blk, b_blk, acc, input_precision=INPUT_PRECISION)


# Elements per e8m0 scale of an MXFP8 operand along K, as a constexpr (kernels read only those).
MX_BLOCK = tl.constexpr(tiling.MX_BLOCK)
# Triton 3.6's and 3.7's interpreters have no ``tl.dot_scaled`` (3.8's and 3.9's run it): the
# block-scaled K step then dequantizes both blocks to fp32 and runs an fp32 ``tl.dot`` (see
# :func:`_accumulate_mx`), so the CPU tests run the very call a GPU compiles wherever they can.
_MX_BY_HAND = tl.constexpr(INTERPRET and _triton_version() < (3, 8))


def block_scaled_mma(device: torch.device) -> bool:
    """Whether the GEMMs run block-scaled (MXFP8) operands on ``device``: on sm_100 and newer,
    whose ``tcgen05.mma`` takes the e8m0 scales itself (compile_check reads it in the PTX), and
    in the interpreter (the same kernels, emulated, for the CPU tests). Hopper has no
    block-scaled MMA: ``tl.dot_scaled`` would upcast to bf16 there, which no one has measured
    against torchao's own GEMM, so the callers run torchao's."""
    if INTERPRET:
        return True
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10


@triton.jit
def _block_scales(ptr, rows64, row_ok, stride_row, k0, K, BLOCK_K: tl.constexpr):
    """The e8m0 scale bytes ``[R, BLOCK_K / MX_BLOCK]`` of elements ``k0 .. k0 + BLOCK_K`` of
    the rows ``rows64`` (``[R]``, masked by ``row_ok``) of an MXFP8 operand whose row ``r`` has
    the scale of its K block ``kb`` at byte ``ptr[r * stride_row + kb]``; 0 (2^-127) outside the
    rows and past ``K``, where the data is zero or reaches only output the caller drops."""
    kb = k0 // MX_BLOCK + tl.arange(0, BLOCK_K // MX_BLOCK)
    mask = row_ok[:, None] & (kb < K // MX_BLOCK)[None, :]
    return tl.load(ptr + rows64[:, None] * stride_row + kb[None, :], mask=mask, other=0)


@triton.jit
def _dequantize_rows(x, scales):
    """``x [R, C]`` (e4m3) times ``2 ** (scales - 127)`` (``scales [R, C / MX_BLOCK]`` e8m0
    bytes, one per ``MX_BLOCK`` consecutive elements of a row), in fp32: exact, as torchao's
    dequantization is."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    factor = tl.exp2(scales.to(tl.float32) - 127.0)
    blocks = x.to(tl.float32).reshape(R, C // MX_BLOCK, MX_BLOCK) * factor[:, :, None]
    return blocks.reshape(R, C)


@triton.jit
def _accumulate_mx(
    acc, a_blk, a_scales, b, b_scale_ptr, k0, col0, cols64, col_ok, K, N, stride_bk, stride_bn,
    stride_bs, B_LAYOUT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One block-scaled (MXFP8) step of a GEMM's K-loop, shared by both GEMMs: ``acc +=
    dequant(a_blk) @ dequant(B[k0:k0+BLOCK_K, col0:col0+BLOCK_N])``, ``a_blk`` e4m3 with its
    e8m0 ``a_scales`` (:func:`_block_scales`), B e4m3 (read by :func:`_load_block`) whose
    column ``n`` has the scale of K block ``kb`` at byte ``b_scale_ptr[n * stride_bs + kb]``.

    One ``tl.dot_scaled``: on sm_100 one ``tcgen05.mma`` with block scales, accumulating in fp32
    (compile_check); emulated in the interpreter (:data:`_MX_BY_HAND`). Every product of two
    e4m3 values and two powers of two is exact in fp32, so either way the result differs from
    torchao's (dequantize, then one GEMM) only in the order of the fp32 sums."""
    b_blk = _load_block(b, k0, col0, K, N, stride_bk, stride_bn, B_LAYOUT, BLOCK_K, BLOCK_N)
    b_scales = _block_scales(b_scale_ptr, cols64, col_ok, stride_bs, k0, K, BLOCK_K)
    if _MX_BY_HAND:
        a_deq = _dequantize_rows(a_blk, a_scales)
        b_deq = _dequantize_rows(b_blk.T, b_scales).T
        return tl.dot(a_deq, b_deq, acc, input_precision="ieee")
    return tl.dot_scaled(a_blk, a_scales, "e4m3", b_blk, b_scales, "e4m3", acc)


@triton.jit
def _note_first_touch(trace_ptr, src, world_size):
    """Trace a tile start: ``ticket = trace[W]++``; ``trace[src] = min(trace[src], ticket)``.

    With ``trace = [INT32_MAX] * W + [0]`` beforehand, ``argsort(trace[:W])`` is the order in which
    the kernel first touched each source rank.
    """
    ticket = tl.atomic_add(trace_ptr + world_size, 1)
    tl.atomic_min(trace_ptr + src, ticket)


def new_trace(
    order_out: torch.Tensor | None, world_size: int, device: torch.device
) -> torch.Tensor | None:
    """The initial trace buffer of :func:`_note_first_touch` (int32 [W + 1]) when the caller asked
    for the order (``order_out``, int [W]), else ``None``."""
    if order_out is None:
        return None
    if tuple(order_out.shape) != (world_size,):
        raise ValueError(f"order_out: got shape {tuple(order_out.shape)}, expected ({world_size},)")
    trace = torch.full(
        (world_size + 1,), torch.iinfo(torch.int32).max, dtype=torch.int32, device=device
    )
    trace[world_size] = 0
    return trace


def store_order(
    trace: torch.Tensor | None, order_out: torch.Tensor | None, world_size: int
) -> None:
    """Write the first-touch order recorded in ``trace`` into ``order_out`` (int [W]), if asked."""
    if trace is not None and order_out is not None:
        order_out.copy_(torch.argsort(trace[:world_size], stable=True))
