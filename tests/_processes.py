"""Run Python code in a fresh interpreter, where the kernels are built for a GPU (not the
interpreter the test session chose with TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def run_without_interpreter(code: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess:
    """``python -c code`` (dedented) without TRITON_INTERPRET; stdout and stderr captured."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
