"""torchtitan's own parallelize functions, running tp_kernels' fused sequence-parallel boundaries.

**torchtitan 0.2.x** (tested with 0.2.2). Each model family's ``parallelize_*`` function
(``torchtitan/models/<family>/infra/parallelize.py``: llama3, llama4, qwen3, deepseek_v3, gpt_oss;
and the experiments that import the styles the same way, e.g. ``transformers_modeling_backend``,
``rl/unified``) builds its plan from the classes its module imported from
``torch.distributed.tensor.parallel``. :func:`patched` rebinds those module globals to tp_kernels'
classes of the same names (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
``PrepareModuleInput``, ``PrepareModuleOutput``, ``PrepareModuleInputOutput``) for the duration of
a ``with`` block, and restores PyTorch's afterwards::

    from tp_kernels.integrations import torchtitan as tpk_titan

    with tpk_titan.patched():
        parallelize_llama(model, parallel_dims, job_config)   # or apply_tp(model, tp_mesh, ...)

Only the plan is built inside the block: the hooks it installs stay after it, so the forward and
backward may run anywhere. Functions that other modules import from a patched one (simple_fsdp,
vlm and flux reuse llama3's ``apply_tp``) look the names up in the patched module, so they follow.
The float8 styles that ``apply_tp`` imports from torchao inside the function when
``enable_float8_tensorwise_tp`` is set (``Float8ColwiseParallel``, ``Float8RowwiseParallel``,
``PrepareFloat8ModuleInput``) are rebound in their own module,
``torchao.float8.float8_tensor_parallel``, to :mod:`tp_kernels.float8_tensor_parallel`'s (when
torchao is installed), so that import finds tp_kernels' classes; the rowwise recipes use the
plain styles, which fuse Float8Linear too. Not rebound: ``parallelize_module`` (tp_kernels'
styles run inside PyTorch's; rebinding it would only add tp_kernels' 1-D mesh check to the
expert-parallel calls that share the name). :func:`patch` / :func:`unpatch` do the same without
a block.

**torchtitan 0.3.x** (tested with 0.3.0) builds dense models from per-module sharding configs
and calls no style class; its fused path, ``tp_gemm_backend="dist_gemm"``, runs modules of
``torchtitan.models.common.dist_gemm`` that call three autograd Functions of
``torchtitan/distributed/linear.py`` by their module-global names (``AllGatherLinear``,
``AllGatherLinearMulti``, ``LinearReduceScatter``), built on ``torch.ops.symm_mem`` and so CUDA
only. There :func:`patched` rebinds those three names to tp_kernels' Functions of the same
contract (:mod:`tp_kernels.integrations._torchtitan_linear`), so the path runs tp_kernels' fused
ops on any backend and any process group, CPU included. The fused modules look the names up
each time their forward runs, so the block must hold the forward and, under activation
checkpointing, the backward too (it runs the blocks' forwards again; outside the block they would
call torchtitan's own Functions); a training script simply calls :func:`patch` once::

    tpk_titan.patch()   # then build and train as usual, with tp_gemm_backend="dist_gemm"

    with tpk_titan.patched():   # or around each step
        loss_fn(model(tokens), labels).backward()

FP8 on 0.3: torchtitan's float8 converter makes the fused modules' children (``wqkv``, ``w1``,
``w3``, ``w2``) Float8Linears, whose ``.weight`` torchtitan's fused forwards multiply in high
precision (fp8 silently not applied). :func:`patched` therefore binds the three names to routers
(:class:`tp_kernels.integrations._torchtitan_linear.Routed`) and wraps the forwards of
``AllGatherFusedQKVLinear`` and ``AllGatherFusedFeedForward``: a call whose weights all belong to
fusable Float8Linear children runs :mod:`tp_kernels.float8`'s fused fp8 ops, one whose weights
all belong to fusable MXFP8Linear children (torchtitan's MXFP8 converter; emulated off sm_100)
:mod:`tp_kernels.mxfp8`'s, any other the bf16 Functions (a low-precision Linear or call that
cannot fuse counted as a fallback and logged). The float8 converter also
turns ``RowParallelLinear`` (attention's ``wo``) into a plain Float8Linear, after which torchtitan
declares the stock attention contract around the still-fused QKV, which gathers its input twice:
that run fails patched or not; convert with ``filter_fqns=["attention.wo"]`` (``wo`` then runs
the bf16 fused op). See docs/torchtitan.md.

The version (``torchtitan.__version__``) picks the path; a checkout without one (``0.0.0``) is
taken as 0.3 when it has ``dist_gemm``.

Patching rebinds module attributes, which is process-wide: while any ``patched()`` block (or a
:func:`patch` without its :func:`unpatch`) is open, every thread sees tp_kernels' classes. Nested
and concurrent blocks are counted under a lock; the last one out restores PyTorch's names.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import pathlib
import re
import threading
from collections.abc import Iterator
from types import ModuleType

from torch.distributed.tensor import parallel as _torch_tp

from tp_kernels import styles as _tpk_styles

__all__ = [
    "patch",
    "patched",
    "unpatch",
]

logger = logging.getLogger("tp_kernels")

# PyTorch's class -> tp_kernels' class of the same name.
_STYLES = {
    getattr(_torch_tp, name): getattr(_tpk_styles, name)
    for name in _tpk_styles.STYLE_NAMES
    if getattr(_torch_tp, name) is not getattr(_tpk_styles, name)  # re-exports need no patch
}
_IMPORT_LINE = "from torch.distributed.tensor.parallel import"
# torchao's float8 TP styles, imported by name inside torchtitan 0.2.x's apply_tp.
TORCHAO_FLOAT8_TP_MODULE = "torchao.float8.float8_tensor_parallel"
# torchtitan 0.3: the module whose fused linears call these Functions, rebound to tp_kernels'.
DIST_GEMM_MODULE = "torchtitan.models.common.dist_gemm"
DIST_GEMM_FUNCTIONS = ("AllGatherLinear", "AllGatherLinearMulti", "LinearReduceScatter")
# torchtitan 0.3: the fused modules whose children torchtitan's float8 or MXFP8 converter may make
# Float8Linears or MXFP8Linears; their forwards are wrapped so the calls above can find those
# children.
DIST_GEMM_OWNERS = ("AllGatherFusedQKVLinear", "AllGatherFusedFeedForward")


def _is_torch_style(value: object) -> bool:
    # A class test first: module globals hold unhashable values too.
    return isinstance(value, type) and value in _STYLES


def _torchtitan() -> ModuleType:
    try:
        import torchtitan
    except ImportError as e:
        raise ImportError(
            "tp_kernels.integrations.torchtitan needs torchtitan installed "
            "(tested: pip install torchtitan==0.2.2 --no-deps, plus the small deps its imports "
            f"need; see docs/torchtitan.md): {e}"
        ) from e
    return torchtitan


def _version(torchtitan: ModuleType) -> str:
    return f"torchtitan {getattr(torchtitan, '__version__', '(unknown version)')}"


def _uses_dist_gemm(torchtitan: ModuleType) -> bool:
    """True for torchtitan 0.3+ (fused linears to rebind), False for 0.2.x (style classes)."""
    found = re.match(r"(\d+)\.(\d+)", str(getattr(torchtitan, "__version__", "")))
    major_minor = (int(found[1]), int(found[2])) if found else (0, 0)
    if major_minor != (0, 0):
        return major_minor >= (0, 3)
    try:  # a source checkout: no release number to go by, so by what it has
        return importlib.util.find_spec(DIST_GEMM_MODULE) is not None
    except ModuleNotFoundError:  # a parent package (torchtitan.models.common) is missing
        return False


def _dist_gemm_targets() -> list[tuple[object, str, object]]:
    """``(dist_gemm module, name, tp_kernels' router to its Function)`` for each Function
    torchtitan 0.3's fused linears call, and ``(class, "forward", wrapped forward)`` for each
    fused module whose children may be Float8Linears or MXFP8Linears."""
    try:
        module = importlib.import_module(DIST_GEMM_MODULE)
    except ImportError as e:
        raise RuntimeError(
            f"{_version(_torchtitan())}: cannot import {DIST_GEMM_MODULE}, whose fused linears "
            f"patched() rebinds on torchtitan 0.3+ ({type(e).__name__}: {e})"
        ) from e
    missing = [name for name in DIST_GEMM_FUNCTIONS + DIST_GEMM_OWNERS if not hasattr(module, name)]
    if missing:
        raise RuntimeError(
            f"{_version(_torchtitan())}: {DIST_GEMM_MODULE} has no {missing}; patched() "
            f"rebinds {list(DIST_GEMM_FUNCTIONS)}, the Functions of torchtitan 0.3.0's "
            f"distributed/linear.py that its fused linears call, and wraps the forwards of "
            f"{list(DIST_GEMM_OWNERS)}"
        )
    from tp_kernels.integrations import _torchtitan_linear

    routed = _torchtitan_linear.Routed
    return [
        (module, name, routed(getattr(_torchtitan_linear, name))) for name in DIST_GEMM_FUNCTIONS
    ] + [
        (cls, "forward", _torchtitan_linear.owned_forward(cls.__dict__["forward"]))
        for cls in (getattr(module, name) for name in DIST_GEMM_OWNERS)
    ]


def _style_modules() -> tuple[list[ModuleType], dict[str, str]]:
    """torchtitan's modules that import PyTorch's style classes by name, imported; and the
    ``{module: why}`` of those whose import failed (an experiment whose own deps are missing)."""
    torchtitan = _torchtitan()
    root = pathlib.Path(torchtitan.__file__).parent
    found, skipped = [], {}
    # Reading the sources finds every family, including ones added in later 0.2 releases; only
    # the modules that import the styles get imported.
    for path in sorted(root.rglob("*.py")):
        if "tests" in path.parts or _IMPORT_LINE not in path.read_text(errors="replace"):
            continue
        name = ".".join(("torchtitan", *path.relative_to(root).with_suffix("").parts))
        try:
            module = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 (any failure of an unrelated experiment)
            skipped[name] = f"{type(e).__name__}: {e}"
            continue
        if any(_is_torch_style(value) for value in vars(module).values()):
            found.append(module)
    return found, skipped


_lock = threading.Lock()
_depth = 0
# (module, global name, PyTorch's object) for every name rebound by the outermost patch()
_rebound: list[tuple[object, str, object]] = []


def _style_targets() -> list[tuple[ModuleType, str, object]]:
    """``(module, global name, tp_kernels' class)`` for every global of torchtitan 0.2.x's
    parallelize modules that holds one of PyTorch's style classes."""
    modules, skipped = _style_modules()
    for name, why in skipped.items():
        logger.info("tp_kernels.integrations.torchtitan: not patched %s (%s)", name, why)
    if not modules:
        torchtitan = _torchtitan()
        raise RuntimeError(
            f"{_version(torchtitan)} (at {pathlib.Path(torchtitan.__file__).parent}): no "
            f"module imports PyTorch's tensor-parallel styles, so there is nothing to "
            f"patch. patched() supports torchtitan 0.2.x, whose "
            f"models/<family>/infra/parallelize.py build plans from those classes, and 0.3.x, "
            f"whose {DIST_GEMM_MODULE} fused linears (tp_gemm_backend='dist_gemm') it "
            f"rebinds (see tp_kernels' docs/torchtitan.md)"
        )
    return [
        (module, attr, _STYLES[value])
        for module in modules
        for attr, value in list(vars(module).items())
        if _is_torch_style(value)
    ] + _torchao_float8_targets()


def _torchao_float8_targets() -> list[tuple[ModuleType, str, object]]:
    """``(torchao's float8 TP module, name, tp_kernels' class)`` for each float8 style, or none
    without torchao (then ``apply_tp`` cannot take its float8 path either)."""
    if importlib.util.find_spec("torchao") is None:
        return []
    module = importlib.import_module(TORCHAO_FLOAT8_TP_MODULE)
    from tp_kernels import float8_tensor_parallel

    return [
        (module, name, getattr(float8_tensor_parallel, name))
        for name in float8_tensor_parallel.__all__
    ]


def patch() -> list[str]:
    """Rebind torchtitan's names to tp_kernels': on 0.2.x PyTorch's style classes in its
    parallelize modules, on 0.3.x the three Functions of its ``dist_gemm`` fused linears.

    Returns the patched module names. Counted: each call needs one :func:`unpatch`. Raises
    ``RuntimeError`` (naming the installed version) when there is nothing to rebind, and
    ``ImportError`` when torchtitan is not installed.
    """
    global _depth
    with _lock:
        if _depth == 0:
            torchtitan = _torchtitan()
            targets = _dist_gemm_targets() if _uses_dist_gemm(torchtitan) else _style_targets()
            for module, attr, ours in targets:
                _rebound.append((module, attr, getattr(module, attr)))
                setattr(module, attr, ours)
        _depth += 1
        return sorted({t.__name__ for t, _, _ in _rebound if isinstance(t, ModuleType)})


def unpatch() -> None:
    """Undo one :func:`patch`; the last one restores every name PyTorch's object had."""
    global _depth
    with _lock:
        if _depth == 0:
            raise RuntimeError("tp_kernels.integrations.torchtitan.unpatch() without a patch()")
        _depth -= 1
        if _depth == 0:
            for module, attr, original in _rebound:
                setattr(module, attr, original)
            _rebound.clear()


@contextlib.contextmanager
def patched() -> Iterator[list[str]]:
    """``with patched() as modules:`` torchtitan 0.2.x's parallelize functions build their plans
    from tp_kernels' styles, or torchtitan 0.3.x's ``dist_gemm`` linears run tp_kernels' fused
    ops; torchtitan's own names are restored on exit (see the module docstring)."""
    modules = patch()
    try:
        yield modules
    finally:
        unpatch()
