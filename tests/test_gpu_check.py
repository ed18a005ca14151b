"""``python -m tp_kernels.bench.gpu_check`` on a CPU: its CPU mode end to end (the fp8 rows
included), a wrong result reported as FAIL (an fp8 row's by a scale 5% off), a path that cannot
run reported as FAIL, its arguments and its capture rows (its calibration:
tests/test_calibration.py; its fp8 GEMM timing: tests/gpu/test_gpu_kernels_script.py).

The end-to-end runs use worlds of 2 ranks and ``--quick`` (2 calls per row, tiny shapes); each
starts its own gloo ranks (~10 s on 2 cores). A wrong result comes from a world whose ranks run a
wrapped row (a test's patch, in the ranks); one run starts the check as ``python -m`` from the
source tree, the way it is meant to be started (the ranks must unpickle what the module sends them
when it runs as ``__main__``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tp_kernels.bench import driver
from tp_kernels.bench import fused_rows as fr
from tp_kernels.bench import gpu_check as gc
from tp_kernels.testing import LocalWorld, RankError
from tp_kernels.testing.numerics import FLOOR

ROOT = Path(__file__).resolve().parents[1]
QUICK_CPU = ["--device", "cpu", "--worlds", "2", "--quick"]


def _table_rows(out: str) -> dict[tuple[str, str, str], list[str]]:
    """``{(backend, op, dtype): cells}`` of every table row that names an op."""
    rows = {}
    for line in out.splitlines():
        cells = line.split()
        if len(cells) >= 6 and cells[1] in fr.OPS:
            rows[(cells[0], cells[1], cells[2])] = cells
    return rows


def test_cpu_mode_passes_every_check(capsys):
    status = gc.main(QUICK_CPU)
    out = capsys.readouterr().out
    assert status == 0, out
    rows = _table_rows(out)
    calls = str(2 * fr.QUICK_CASES["cpu"])  # forward and backward of each call
    fp8_calls = str(fr.QUICK_CASES["cpu"])  # forward only
    for label in ("pipelined", "symm", fr.TRITON_LABEL):
        for op in fr.OPS:
            for dtype in ("fp32", "fp16", "bf16", "fp8-rowwise", "fp8-tensorwise"):
                cells = rows[(label, op, dtype)]
                expected = fp8_calls if dtype.startswith("fp8") else calls
                assert cells[3] == expected and cells[5] == "ok", cells
                assert float(cells[4]) <= 1.0
    # A backend that cannot run on a CPU gets a row saying why, and does not fail the run.
    assert any(line.startswith("torch_symm_mem") and " n/a " in line for line in out.splitlines())
    # The first-contact facts come before any world runs.
    facts = out.index("== torch's symmetric memory, as torch_symm_mem will find it on cpu")
    assert facts < out.index("== world of 2 ranks (cpu)")
    schema = torch.ops.symm_mem.fused_all_gather_matmul.default._schema
    assert f"  torch.ops.symm_mem.fused_all_gather_matmul: {schema}" in out
    assert "  torch.ops.symm_mem.fused_matmul_reduce_scatter: symm_mem::fused_matmul_reduce_" in out
    assert "  has_multicast_support(cpu): n/a (cpu)" in out
    assert "  symmetric-memory backend for cpu: " in out
    assert "  TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES: " in out
    assert "== world of 2 ranks (cpu)" in out
    assert "cuBLAS timing skipped: --device cpu" in out
    # The capture rows: every backend's MLP step through the eager stand-in, replays checked.
    capture = out[out.index("== a TP MLP step captured and replayed") :]
    for label in ("symm", "reference", "pipelined", "auto"):
        (line,) = [line for line in capture.splitlines() if line.startswith(f"{label} ")]
        assert " ok " in line and "eager stand-in on cpu" in line, line
        assert "/3 " in line and " 3/3 " in line, line  # every replay equal, bit for bit
        if label != "auto":
            assert f" 4 on {label} " in line, line
    assert f"torch {torch.__version__}" in out
    assert out.rstrip().endswith("PASS: every check passed")


def _rank_row_with_a_wrong_all_gather(task: fr.RowTask) -> fr.RankRow:
    """``fr.rank_row``, with pipelined's ``all_gather_matmul`` off by 1000 in one element."""
    from tp_kernels.backends.choice import get_backend

    impl = get_backend("pipelined")
    original = impl.all_gather_matmul

    def wrong(*args, **kwargs):
        a, outs = original(*args, **kwargs)
        outs[0][0, 0] += 1000.0
        return a, outs

    impl.all_gather_matmul = wrong  # an instance attribute shadows the singleton's method
    try:
        return fr.rank_row(task)
    finally:
        del impl.all_gather_matmul


class _WorldWithAWrongBackend(LocalWorld):
    """A real world whose ranks run :func:`_rank_row_with_a_wrong_all_gather` for every row."""

    def run(self, fn, *args, **kwargs):
        wrong = _rank_row_with_a_wrong_all_gather if fn is fr.rank_row else fn
        return super().run(wrong, *args, **kwargs)


def test_a_wrong_result_is_reported_as_fail(monkeypatch, capsys):
    monkeypatch.setattr(driver, "LocalWorld", _WorldWithAWrongBackend)
    argv = [*QUICK_CPU, "--backends", "pipelined", "symm", "--dtypes", "bf16", "--skip-capture"]
    assert gc.main(argv) == 1
    out = capsys.readouterr().out
    rows = _table_rows(out)
    # all_gather_matmul's outputs are wrong; matmul_reduce_scatter's backward gathers with them.
    for op in fr.OPS:
        assert rows[("pipelined", op, "bf16")][5] == "FAIL", rows
        assert float(rows[("pipelined", op, "bf16")][4]) > 1.0
        assert rows[("symm", op, "bf16")][5] == "ok", rows
    assert "FAIL: 2 failed or skipped" in out


def _rank_row_with_wrong_scales(task: fr.RowTask) -> fr.RankRow:
    """``fr.rank_row``, with two scales 5% off as the public scaled ops hand them on: row 0's
    row-wise scale in the all-gather's packed rows, and the reduce-scatter's tensor-wise
    ``b_scale``. The other two fp8 kinds of row are untouched."""
    from tp_kernels.ops import scaled

    pack_rows, reduce_scatter_scaled = scaled.pack_rows, scaled.reduce_scatter_scaled

    def wrong_pack(data, scale):
        scale = scale.clone()
        scale[0] *= 1.05
        return pack_rows(data, scale)

    def wrong_reduce_scatter(impl, group, a, a_scale, b, b_scale, **kwargs):
        if b_scale.dim() == 0:
            b_scale = b_scale * 1.05
        return reduce_scatter_scaled(impl, group, a, a_scale, b, b_scale, **kwargs)

    scaled.pack_rows, scaled.reduce_scatter_scaled = wrong_pack, wrong_reduce_scatter
    try:
        return fr.rank_row(task)
    finally:
        scaled.pack_rows, scaled.reduce_scatter_scaled = pack_rows, reduce_scatter_scaled


class _WorldWithWrongScales(LocalWorld):
    def run(self, fn, *args, **kwargs):
        wrong = _rank_row_with_wrong_scales if fn is fr.rank_row else fn
        return super().run(wrong, *args, **kwargs)


def test_an_fp8_row_with_a_wrong_scale_fails(monkeypatch, capsys):
    """The fp8 rows can fail: a scale 5% off (the rows allow two bf16 roundings, 0.8%, plus an
    fp32 accumulation bound that is tiny at K <= 64) fails exactly the rows whose calls it
    touches, on the torch path and through the Triton kernels' epilogues."""
    monkeypatch.setattr(driver, "LocalWorld", _WorldWithWrongScales)
    argv = [*QUICK_CPU, "--backends", "pipelined", fr.TRITON_LABEL, "--skip-capture"]
    assert gc.main([*argv, "--dtypes", "fp8-rowwise", "fp8-tensorwise"]) == 1
    rows = _table_rows(capsys.readouterr().out)
    for label in ("pipelined", fr.TRITON_LABEL):
        broken = {(fr.AG, "fp8-rowwise"), (fr.RS, "fp8-tensorwise")}
        for op in fr.OPS:
            for dtype in ("fp8-rowwise", "fp8-tensorwise"):
                cells = rows[(label, op, dtype)]
                if (op, dtype) in broken:
                    assert cells[5] == "FAIL" and float(cells[4]) > 1.0, cells
                else:
                    assert cells[5] == "ok" and float(cells[4]) <= 1.0, cells


def test_fp8_rows_say_why_where_scaled_mm_cannot_run():
    """A device whose ``torch._scaled_mm`` refuses the scaling (a GPU without fp8 GEMMs): the
    row reads n/a with torch's reason, not a failure and not a pass."""
    task = fr.RowTask("symm", "symm", fr.AG, "fp8-rowwise", (), "cpu", seed=0)
    why = "torch._scaled_mm cannot run row-wise on cuda:0: RuntimeError: needs sm_89"
    row = fr._verdict(task, [fr.RankRow(-1.0, "-", 0, [], unavailable=why)] * 2, 0.1)
    assert (row.result, row.detail, row.failed) == ("n/a", why, False)
    # On this CPU both scalings run.
    from tp_kernels.testing import fp8_cases

    assert fp8_cases.unavailable_reason(torch.device("cpu"), rowwise=True) is None
    assert fp8_cases.unavailable_reason(torch.device("cpu"), rowwise=False) is None


def test_fp8_cases_are_valid_scaled_shapes():
    """K (and N, for cuBLASLt) multiples of 16, and some not multiples of a 64-wide tile."""
    for cases in (fr.GPU_FP8_CASES, fr.CPU_FP8_CASES):
        ks = [c.shard[-1] for c in cases[fr.AG]] + [c.k for c in cases[fr.RS]]
        ns = [n for c in cases[fr.AG] for n in c.ns] + [c.n for c in cases[fr.RS]]
        assert all(k % 16 == 0 for k in ks) and all(n % 16 == 0 for n in ns), (ks, ns)
        assert all(c.k_step % 16 == 0 for c in cases[fr.RS])
    assert any(k % 64 for k in ks) and any(n % 64 for n in ns)
    assert len(fr.GPU_FP8_CASES[fr.AG]) >= fr.QUICK_CASES["cuda"]


def test_it_runs_as_a_module():
    """``python -m``, as it is meant to be started: the ranks unpickle what the module sends them
    when it runs as ``__main__``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tp_kernels.bench.gpu_check", *QUICK_CPU]
    cmd += ["--backends", "pipelined", "--dtypes", "bf16", "--skip-capture"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _table_rows(proc.stdout)
    assert all(rows[("pipelined", op, "bf16")][5] == "ok" for op in fr.OPS), rows


def test_symm_triton_rows_fail_where_its_kernels_cannot_run(monkeypatch, capsys):
    """The ranks' Triton is not in its interpreter, so on a CPU symm's Triton path cannot run:
    its rows must say so and fail. (Before, gpu_check turned the path on through the
    environment after the setting had been read, and the rows passed on symm's torch path.)"""
    rank_env = driver.Ranks.env

    def without_interpreter(self, *args, **kwargs):
        return {**rank_env(self, *args, **kwargs), "TRITON_INTERPRET": "0"}

    monkeypatch.setattr(driver.Ranks, "env", without_interpreter)
    argv = [*QUICK_CPU, "--backends", fr.TRITON_LABEL, "--dtypes", "fp32", "--skip-capture"]
    assert gc.main(argv) == 1
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.startswith(f"{fr.TRITON_LABEL} ")]
    assert " FAIL " in line and "required, but not available" in line, line
    assert "TRITON_INTERPRET=1" in out, out


class _WorldWithBrokenTriton:
    """Stands in for LocalWorld: every backend is available and passes, except that symm's
    Triton path raises on every rank, as it does while its kernels and launchers disagree."""

    runs: list[str] = []

    def __init__(self, world_size: int, **_: object) -> None:
        self.world_size = world_size

    def run(self, fn, *args, timeout_s=None):
        if fn is fr.rank_backends:
            return [{"pipelined": "ok", "symm": "ok", fr.TRITON_LABEL: "ok"}] * self.world_size
        task = args[0]
        self.runs.append(task.label)
        if task.label == fr.TRITON_LABEL:
            raise RankError(
                "rank_row failed in a local world of 2 ranks\n--- rank 0 raised:\nTraceback "
                "(most recent call last):\n  ...\nTypeError: ag_matmul_consumer() got an "
                "unexpected keyword argument 'group_name'\n--- rank 1 raised:\nTraceback (most "
                "recent call last):\n  ...\nTypeError: ag_matmul_consumer() got an unexpected "
                "keyword argument 'group_name'"
            )
        row = fr.RankRow(0.25, "call 1 out[0], rank 0", 2 * len(task.cases), [])
        return [row] * self.world_size

    def close(self) -> None:
        pass


def test_a_backend_that_raises_fails_its_row_and_skips_the_rest(monkeypatch, capsys):
    monkeypatch.setattr(driver, "LocalWorld", _WorldWithBrokenTriton)
    assert gc.main([*QUICK_CPU, "--dtypes", "fp32", "bf16", "--skip-capture"]) == 1
    out = capsys.readouterr().out
    rows = _table_rows(out)
    first = rows[(fr.TRITON_LABEL, fr.AG, "fp32")]
    assert first[3:6] == ["-", "-", "FAIL"], first
    assert "raised: rank 0: TypeError: ag_matmul_consumer() got an unexpected keyword" in out
    # The world's symm state is unknown after that: the path's other rows are skipped.
    later = [rows[(fr.TRITON_LABEL, op, d)] for op in fr.OPS for d in ("fp32", "bf16")][1:]
    assert all(" ".join(cells[3:6]) == "- - skipped" for cells in later), later
    assert _WorldWithBrokenTriton.runs.count(fr.TRITON_LABEL) == 1
    for label in ("pipelined", "symm"):
        assert all(rows[(label, op, "bf16")][5] == "ok" for op in fr.OPS)
    assert "FAIL: 4 failed or skipped" in out


def test_no_cuda_device_says_what_cpu_mode_does(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as other test modules leave it
    assert gc.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no CUDA device") and "`--device cpu` runs" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--worlds", "1"],
        ["--worlds", str(gc.MAX_WORLD + 1)],
        ["--dtypes", "fp64"],
        ["--device", "cpu", "--backends", "no_such_backend"],
        ["--timeout-s", "0"],
    ],
)
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as exit_info:
        gc.main(argv)
    assert exit_info.value.code == 2


def test_first_contact_facts_on_cuda(monkeypatch, capsys):
    """What a first GPU run prints before anything runs, on a board that reports multicast with
    the CUDA backend selected; the ranks get the overlapping-devices variable."""
    from torch.distributed import _symmetric_memory as symm_mem

    from tp_kernels import symmetric_memory

    asked = []

    def has_multicast_support(device_type, index):
        asked.append((device_type, index))
        return True

    monkeypatch.setattr(symm_mem._SymmetricMemory, "has_multicast_support", has_multicast_support)
    monkeypatch.setattr(symmetric_memory, "_symm_mem_backend", lambda module, device: "CUDA")
    monkeypatch.delenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", raising=False)
    gc.print_first_contact_facts(driver.Ranks("cuda", 120.0, 60.0))
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "== torch's symmetric memory, as torch_symm_mem will find it on cuda:0"
    rs_schema = torch.ops.symm_mem.fused_matmul_reduce_scatter.default._schema
    assert f"  torch.ops.symm_mem.fused_matmul_reduce_scatter: {rs_schema}" in lines
    assert "  has_multicast_support(cuda:0): True" in lines
    assert asked == [(symm_mem.DeviceType.CUDA, 0)]
    assert "  symmetric-memory backend for cuda:0: 'CUDA'" in lines
    assert "  TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES: unset" in lines
    assert "  the ranks' environment sets TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1" in lines
    assert not [line for line in lines if "CUDA_DEVICE_MAX_CONNECTIONS" in line], lines
    # --cuda-max-connections 1: one hardware queue per rank, said before anything runs.
    gc.print_first_contact_facts(driver.Ranks("cuda", 120.0, 60.0, 1))
    lines = capsys.readouterr().out.splitlines()
    assert "  the ranks' environment sets CUDA_DEVICE_MAX_CONNECTIONS=1" in lines
    assert gc.parse_args(["--cuda-max-connections", "1"]).cuda_max_connections == 1
    assert gc.parse_args([]).cuda_max_connections is None


def test_a_fact_that_cannot_be_read_says_why(monkeypatch):
    from tp_kernels import symmetric_memory
    from tp_kernels.backends import torch_symm_mem

    def broken(module, device):
        raise RuntimeError("no allocator")

    monkeypatch.setattr(symmetric_memory, "_symm_mem_backend", broken)
    facts = dict(torch_symm_mem.first_contact_facts(torch.device("cpu")))
    assert facts["symmetric-memory backend for cpu"] == "unreadable (RuntimeError: no allocator)"


def test_rank_errors_are_summarized_per_rank():
    text = (
        "rank_row failed in a local world of 3 ranks\n"
        "--- rank 0 raised:\nTraceback (most recent call last):\n  ...\nTypeError: bad launch\n"
        "--- rank 2 raised:\nTraceback (most recent call last):\n  ...\nTypeError: bad launch\n"
        "--- ranks [1] gave no answer within 60 s (hung)"
    )
    assert driver.summarize_rank_error(text) == (
        "rank 0: TypeError: bad launch; ranks [1] gave no answer within 60 s (hung)"
    )


def _replay_that_ignores_its_inputs(backend: str) -> list:
    """One capture row's rank part, with a "graph" whose replay does nothing."""
    from tp_kernels.bench import capture_check

    task = capture_check.CaptureTask(
        backend, "fp32", "cpu", 2, 4, 16, 24, replays=3, timed=1, floor=FLOOR[torch.float32]
    )
    replay = capture_check._EagerStandIn.replay
    capture_check._EagerStandIn.replay = lambda self: None
    try:
        return [task, capture_check.capture_rank(task)]
    finally:
        capture_check._EagerStandIn.replay = replay


def test_a_replay_that_ignores_its_new_inputs_fails_its_capture_row(worlds):
    """The capture rows' check can fail: a replay that recomputes nothing returns the previous
    results, which differ from the eager step on the new inputs."""
    from tp_kernels.bench import capture_check

    results = worlds(2).run(_replay_that_ignores_its_inputs, "reference")
    task = results[0][0]
    row = capture_check._verdict(task, [r[1] for r in results], "cpu")
    assert row.result == "FAIL", row
    assert "a replay differs from its eager step" in row.detail, row
    assert "2 replays returned the previous replay's y" in row.detail, row
