"""Structural comparison of module results: values, types, DTensor placements and shapes.

The tests compare a model parallelized with tp_kernels against the same model parallelized with
PyTorch. :func:`compare` walks two results side by side (tensors, DTensors, tuples, lists, dicts,
plain values) and returns one readable line per difference instead of stopping at the first, so a
multi-rank test can collect every mismatch of every case and report them together.

Collectives: with ``full=True`` a DTensor pair is also compared through ``full_tensor()``, a
collective. It is only called when both sides are DTensors with equal placements and global shape,
facts that are the same on every rank, so every rank makes the same calls in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["EXACT", "Tol", "compare", "compare_state_dicts", "kind"]


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


def _values(name: str, got: torch.Tensor, want: torch.Tensor, tol: Tol) -> list[str]:
    # float64 holds every fp32/bf16 value exactly, so the difference itself adds no rounding.
    g = got.detach().to(torch.float64)
    w = want.detach().to(torch.float64)
    diff = (g - w).abs()
    # A NaN difference compares False: NaN == NaN passes, NaN against a number is caught below.
    bad = (diff > tol.atol + tol.rtol * w.abs()) | (g.isnan() ^ w.isnan())
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


def _local(name: str, got: torch.Tensor, want: torch.Tensor, tol: Tol) -> list[str]:
    if got.shape != want.shape:
        return [f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"]
    return _values(name, got, want, tol)


def _dtensor(name: str, got: DTensor, want: DTensor, tol: Tol, full: bool) -> list[str]:
    out = []
    if got.placements != want.placements:
        out.append(f"{name}: placements {got.placements} != {want.placements}")
    if got.shape != want.shape:
        out.append(f"{name}: global shape {tuple(got.shape)} != {tuple(want.shape)}")
    if got.device_mesh != want.device_mesh:
        out.append(f"{name}: device_mesh {got.device_mesh} != {want.device_mesh}")
    out += _local(f"{name} (local)", got.to_local(), want.to_local(), tol)
    # Only rank-invariant facts decide whether to run the collective (see the module docstring).
    if full and got.placements == want.placements and got.shape == want.shape:
        out += _values(f"{name} (full)", got.full_tensor(), want.full_tensor(), tol)
    return out


def compare(name: str, got: Any, want: Any, tol: Tol = EXACT, *, full: bool = False) -> list[str]:
    """Every difference between ``got`` and ``want``, one line each, prefixed with ``name``.

    Compared: the :func:`kind` of every leaf; for tensors dtype, shape, ``requires_grad``,
    ``Parameter``-ness and values within ``tol``; for DTensors also placements, global shape and
    device mesh, the local tensor as above, and with ``full=True`` the full tensor's values.
    Tuples, lists and dicts are compared element by element (lengths and keys first).
    """
    if kind(got) != kind(want):
        return [f"{name}: type {kind(got)} != {kind(want)}"]
    if isinstance(got, DTensor):
        return _common(name, got, want) + _dtensor(name, got, want, tol, full)
    if isinstance(got, torch.Tensor):
        return _common(name, got, want) + _local(name, got, want, tol)
    if isinstance(got, (tuple, list)):
        if len(got) != len(want):
            return [f"{name}: length {len(got)} != {len(want)}"]
        out = []
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            out += compare(f"{name}[{i}]", g, w, tol, full=full)
        return out
    if isinstance(got, Mapping):
        if list(got) != list(want):
            return [f"{name}: keys {list(got)} != {list(want)}"]
        out = []
        for key in got:
            out += compare(f"{name}[{key!r}]", got[key], want[key], tol, full=full)
        return out
    return [] if got == want else [f"{name}: {got!r} != {want!r}"]


def compare_state_dicts(name: str, got: nn.Module, want: nn.Module, tol: Tol = EXACT) -> list[str]:
    """Differences between two modules' ``state_dict()``: keys in order, kinds, placements and
    full values."""
    return compare(name, got.state_dict(), want.state_dict(), tol, full=True)
