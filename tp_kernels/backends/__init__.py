"""Backend registry (filled in by the fused-ops work)."""

from __future__ import annotations

BACKEND_NAMES = ("auto", "reference", "pipelined", "symm")


def check_backend_name(name: str, *, argument: str = "backend") -> str:
    if name not in BACKEND_NAMES:
        raise ValueError(f"{argument}: unknown backend {name!r}; expected one of {BACKEND_NAMES}")
    return name
