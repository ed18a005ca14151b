"""Multi-rank testing on one machine, for tp_kernels' own tests and for yours.

:class:`LocalWorld` starts ``world_size`` local processes joined in one process group (gloo on a
CPU) once, and then runs any module-level function on every rank::

    from tp_kernels.testing import LocalWorld

    def check(n):                      # runs on every rank
        import torch.distributed as dist
        return dist.get_rank() * n

    with LocalWorld(2) as world:
        assert world.run(check, 10) == [0, 10]

Every :meth:`LocalWorld.run` has a deadline; a rank that raises, dies or hangs fails the call with
:class:`RankError`, naming the rank and carrying its traceback. ``run(..., may_exit=True)`` lets a
fault-injection test kill a rank on purpose (its result is ``None``).
"""

from tp_kernels.testing.world import LocalWorld, RankError, free_port

__all__ = ["LocalWorld", "RankError", "free_port"]
