"""Structural comparison of module results: values, types, DTensor placements and shapes.

The tests compare a model parallelized with tp_kernels against the same model parallelized with
PyTorch. :func:`compare` walks two results side by side (tensors, DTensors, tuples, lists, dicts,
plain values) and returns one readable line per difference instead of stopping at the first, so a
multi-rank test can collect every mismatch of every case and report them together.

Values are compared in one of two ways. Without a ``truth``: elementwise within a :class:`Tol`
(``EXACT`` by default). With a ``truth`` (the reference computation rerun in float64 on the same
dtype-rounded weights and inputs, the same structure as ``want``), by the project's rule of
tp_kernels/testing/numerics.py: per tensor, ``max|got - truth| <= 2 * max|want - truth| +
FLOOR[dtype] * max|truth|``. ``got`` may round differently from ``want`` (a fused op sums in another
order) but may not be more than twice as far from the exact result. The floors are that module's and
hold for the same reason: a fused boundary rounds each of the W <= 4 partial sums of a
reduce-scatter to the dtype before adding them (fp32 2e-6 ~ 16 ulps: those W half-ulp roundings plus
accumulation-order noise; bf16 2e-2 ~ W * 0.5 * 2^-7), which the reference's own error need not
show, for instance where PyTorch's result happens to be exact. They are scaled by the largest truth
value of the tensor, not by the magnitude of the summed terms: a whole model has no cheap ``|x| @
|y|``. Kinds, placements, shapes and strides are always compared ``got`` against ``want`` exactly.

Collectives: with ``full=True`` a DTensor pair is also compared through ``full_tensor()``, a
collective. It is only called when both sides (and the truth, if given) are DTensors with equal
placements and global shape, facts that are the same on every rank, so every rank makes the same
calls in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tp_kernels.testing.numerics import FLOOR

__all__ = ["EXACT", "Tol", "TruthError", "compare", "kind", "truth_error"]


class Tol(NamedTuple):
    """Elementwise bound ``|got - want| <= atol + rtol * |want|`` (both 0: bitwise equal)."""

    rtol: float = 0.0
    atol: float = 0.0


EXACT = Tol(0.0, 0.0)


def kind(value: Any) -> str:
    """The category a drop-in replacement must preserve: ``"DTensor"``, ``"Tensor"`` or a type name.

    Tensor subclasses that are not DTensors (a ``Parameter``, the ``AsyncCollectiveTensor`` that
    PyTorch's styles return from an async redistribute) count as ``"Tensor"``: they are
    interchangeable for the caller, and a fused path may legitimately return a plain tensor there.
    """
    if isinstance(value, DTensor):
        return "DTensor"
    if isinstance(value, torch.Tensor):
        return "Tensor"
    return type(value).__name__


class TruthError(NamedTuple):
    """How far ``got`` and ``want`` are from ``truth`` (max abs errors) and the bound ``got`` must
    stay within: ``bound = 2 * want + FLOOR[dtype] * max|truth|``."""

    got: float
    want: float
    bound: float


def truth_error(got: torch.Tensor, want: torch.Tensor, truth: torch.Tensor) -> TruthError:
    """The rule of the module docstring for one tensor; ``got``/``want`` in one floating dtype,
    ``truth`` (float64) of the same shape. NaN differences count as 0: :func:`compare` reports a
    NaN that only one of ``got`` and ``want`` has."""
    g, w, t = (x.detach().to(torch.float64) for x in (got, want, truth))
    err_got = float((g - t).abs().nan_to_num(0).max()) if g.numel() else 0.0
    err_want = float((w - t).abs().nan_to_num(0).max()) if w.numel() else 0.0
    scale = float(t.abs().nan_to_num(0).max()) if t.numel() else 0.0
    return TruthError(err_got, err_want, 2.0 * err_want + FLOOR[got.dtype] * scale)


def _values(
    name: str, got: torch.Tensor, want: torch.Tensor, tol: Tol, truth: torch.Tensor | None
) -> list[str]:
    # float64 holds every fp32/bf16 value exactly, so the difference itself adds no rounding.
    g = got.detach().to(torch.float64)
    w = want.detach().to(torch.float64)
    # A NaN difference compares False: NaN == NaN passes, NaN against a number is caught here.
    nan_mismatch = g.isnan() ^ w.isnan()
    if truth is not None and got.is_floating_point():
        if truth.shape != want.shape:
            return [f"{name}: truth shape {tuple(truth.shape)} != {tuple(want.shape)}"]
        out = [f"{name}: NaN in one side only"] if bool(nan_mismatch.any()) else []
        err = truth_error(got, want, truth)
        if not err.got <= err.bound:
            out.append(
                f"{name}: max |got - truth| {err.got:.3g} > bound {err.bound:.3g} "
                f"(max |want - truth| {err.want:.3g}, floor {FLOOR[got.dtype]:g} x max |truth|)"
            )
        return out
    diff = (g - w).abs()
    bad = (diff > tol.atol + tol.rtol * w.abs()) | nan_mismatch
    if not bool(bad.any()):
        return []
    first = tuple(int(i) for i in bad.nonzero()[0])
    return [
        f"{name}: {int(bad.sum())} of {bad.numel()} values differ beyond "
        f"rtol={tol.rtol:g}, atol={tol.atol:g} (max |diff| {float(diff.nan_to_num(0).max()):.3g}; "
        f"first at {first}: got {float(g[first]):.8g}, want {float(w[first]):.8g})"
    ]


def _common(name: str, got: torch.Tensor, want: torch.Tensor) -> list[str]:
    out = []
    for attr in ("dtype", "requires_grad"):
        g, w = getattr(got, attr), getattr(want, attr)
        if g != w:
            out.append(f"{name}: {attr} {g} != {w}")
    g, w = isinstance(got, nn.Parameter), isinstance(want, nn.Parameter)
    if g != w:
        out.append(f"{name}: is a Parameter {g} != {w}")
    return out


def _layout(t: torch.Tensor) -> tuple[int, ...]:
    # A dim of size 1 may have any stride: it never changes which element an index reaches.
    return tuple(st for sz, st in zip(t.shape, t.stride()) if sz != 1)


def _local(
    name: str, got: torch.Tensor, want: torch.Tensor, tol: Tol, truth: torch.Tensor | None
) -> list[str]:
    if got.shape != want.shape:
        return [f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"]
    # Callers .view() results (HF's logits.view(-1, vocab), MoE routers): the memory layout is
    # part of the drop-in contract.
    strides = (
        []
        if _layout(got) == _layout(want)
        else [f"{name}: strides {got.stride()} != {want.stride()}"]
    )
    return strides + _values(name, got, want, tol, truth)


def _dtensor(
    name: str, got: DTensor, want: DTensor, tol: Tol, truth: DTensor | None, full: bool
) -> list[str]:
    out = []
    if got.placements != want.placements:
        out.append(f"{name}: placements {got.placements} != {want.placements}")
    if got.shape != want.shape:
        out.append(f"{name}: global shape {tuple(got.shape)} != {tuple(want.shape)}")
    if got.device_mesh != want.device_mesh:
        out.append(f"{name}: device_mesh {got.device_mesh} != {want.device_mesh}")
    # The truth is the reference rerun: laid out otherwise, it is no truth for these values.
    if truth is not None and (truth.placements, truth.shape) != (want.placements, want.shape):
        return out + [
            f"{name}: truth placements {truth.placements} / shape {tuple(truth.shape)} != "
            f"{want.placements} / {tuple(want.shape)}"
        ]
    local_truth = None if truth is None else truth.to_local()
    out += _local(f"{name} (local)", got.to_local(), want.to_local(), tol, local_truth)
    # Only rank-invariant facts decide whether to run the collective (see the module docstring).
    if full and got.placements == want.placements and got.shape == want.shape:
        full_truth = None if truth is None else truth.full_tensor()
        out += _values(f"{name} (full)", got.full_tensor(), want.full_tensor(), tol, full_truth)
    return out


# The walk's "no truth given" (None is a value a truth can hold: a missing gradient).
_NO_TRUTH: Any = object()


def compare(
    name: str,
    got: Any,
    want: Any,
    tol: Tol = EXACT,
    *,
    truth: Any = None,
    full: bool = False,
) -> list[str]:
    """Every difference between ``got`` and ``want``, one line each, prefixed with ``name``.

    Compared: the :func:`kind` of every leaf; for tensors dtype, shape, strides (dims of size 1
    aside), ``requires_grad``, ``Parameter``-ness and values; for DTensors also placements,
    global shape and device mesh, the local tensor as above, and with ``full=True`` the full
    tensor's values. Values are within ``tol`` of ``want`` elementwise or, given ``truth``
    (``want``'s structure, in float64), obey the rule of the module docstring, per tensor
    (non-floating tensors: equal to ``want``).
    Tuples, lists and dicts are compared element by element (lengths and keys first).
    """
    if truth is not None and tol != EXACT:
        raise ValueError(f"compare: tol={tol} and a truth given; the truth rule takes no tol")
    return _walk(name, got, want, tol, _NO_TRUTH if truth is None else truth, full)


def _walk(name: str, got: Any, want: Any, tol: Tol, truth: Any, full: bool) -> list[str]:
    if kind(got) != kind(want):
        return [f"{name}: type {kind(got)} != {kind(want)}"]
    has_truth = truth is not _NO_TRUTH
    if has_truth and kind(truth) != kind(want):
        return [f"{name}: truth type {kind(truth)} != {kind(want)}"]
    if isinstance(got, DTensor):
        return _common(name, got, want) + _dtensor(
            name, got, want, tol, truth if has_truth else None, full
        )
    if isinstance(got, torch.Tensor):
        return _common(name, got, want) + _local(name, got, want, tol, truth if has_truth else None)
    if isinstance(got, (tuple, list)):
        if len(got) != len(want):
            return [f"{name}: length {len(got)} != {len(want)}"]
        if has_truth and len(truth) != len(want):
            return [f"{name}: truth length {len(truth)} != {len(want)}"]
        truths = truth if has_truth else [_NO_TRUTH] * len(want)
        out = []
        for i, (g, w, t) in enumerate(zip(got, want, truths, strict=True)):
            out += _walk(f"{name}[{i}]", g, w, tol, t, full)
        return out
    if isinstance(got, Mapping):
        if list(got) != list(want):
            return [f"{name}: keys {list(got)} != {list(want)}"]
        if has_truth and list(truth) != list(want):
            return [f"{name}: truth keys {list(truth)} != {list(want)}"]
        out = []
        for key in got:
            t = truth[key] if has_truth else _NO_TRUTH
            out += _walk(f"{name}[{key!r}]", got[key], want[key], tol, t, full)
        return out
    return [] if got == want else [f"{name}: {got!r} != {want!r}"]
