"""Shared fixtures: one local world of gloo ranks per world size, reused by every test.

A test asks for ``worlds`` and calls ``worlds(n).run(fn, *args)``: ``fn`` (a module-level function
of the test module) runs on each of ``n`` ranks, and the per-rank results come back in rank order.
A failure on any rank fails the test with that rank's traceback; a hang fails it at the deadline.
"""

from __future__ import annotations

import os

# Every kernel in this CPU suite runs in Triton's interpreter, and Triton fixes that when it is
# first imported (its own @jit helpers, tl.cdiv among them, are made then): torchao imports it, so
# a module that imports torchao (test_fp8) collected before a kernel test module would otherwise
# leave those helpers compiled-only. Set before any test module is collected.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tp_kernels.testing import LocalWorld

# Every run in a test gets this deadline; the slowest (torch.compile) take ~60 s on 2 cores.
RUN_TIMEOUT_S = float(os.environ.get("TP_KERNELS_TEST_TIMEOUT", "240"))


class Worlds:
    def __init__(self) -> None:
        self._worlds: dict[int, LocalWorld] = {}

    def __call__(self, world_size: int) -> LocalWorld:
        if world_size not in self._worlds:
            self._worlds[world_size] = LocalWorld(world_size, timeout_s=RUN_TIMEOUT_S)
        return self._worlds[world_size]

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()


@pytest.fixture(scope="session")
def worlds():
    pool = Worlds()
    yield pool
    pool.close()
