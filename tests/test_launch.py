"""The local-world harness itself: results come back in rank order, failures name their rank."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tp_kernels.testing import LocalWorld, RankError


def _rank_and_sum() -> tuple[int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank_1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    return dist.get_rank()


def _hang_on_rank_0() -> None:
    if dist.get_rank() == 0:
        time.sleep(60)


def _unpicklable_on_rank_1() -> torch.Tensor:
    x = torch.ones(2, requires_grad=True)
    return x * 2 if dist.get_rank() == 1 else x.detach()  # a non-leaf that requires grad


def test_results_in_rank_order(worlds):
    assert worlds(3).run(_rank_and_sum) == [(0, 6.0), (1, 6.0), (2, 6.0)]


def test_failure_names_rank_and_traceback(worlds):
    with pytest.raises(RankError, match=r"(?s)rank 1 raised:.*ValueError: rank one refuses"):
        worlds(2).run(_fail_on_rank_1)
    # the world restarts on the next call
    assert worlds(2).run(_rank_and_sum) == [(0, 3.0), (1, 3.0)]


def test_hang_hits_the_deadline(capfd):
    """A hung rank is stopped at the deadline, and prints its stack first (where it hung)."""
    with LocalWorld(2, timeout_s=30) as world:
        start = time.monotonic()
        with pytest.raises(RankError, match=r"ranks \[0\] gave no answer within 3 s \(hung\)"):
            world.run(_hang_on_rank_0, timeout_s=3)
        assert time.monotonic() - start < 20
    assert "in _hang_on_rank_0" in capfd.readouterr().err


def test_unpicklable_result_is_reported_at_once(worlds):
    """A rank whose result cannot be pickled reports so at once, instead of leaving the call to
    its deadline (the queue's feeder thread only logged the pickling error)."""
    start = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank 1 raised:.*cannot be pickled.*requires_grad"):
        worlds(2).run(_unpicklable_on_rank_1, timeout_s=60)
    assert time.monotonic() - start < 30
