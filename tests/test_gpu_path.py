"""Rules of the GPU path that a CPU can check: what the CUDA launches and the symm backend do
without a device (TF32 setting, specialization, launch device, graph capture, deferred timeout
errors). The protocol itself runs in test_kernels.py and test_symm_backend.py (interpreter), the
PTX in test_compile_check.py."""

from __future__ import annotations

import os

# The ranks import this module; the interpreter must be chosen before triton is first imported.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _processes import run_without_interpreter  # noqa: E402

from tp_kernels import PeerTimeoutError, config, signals  # noqa: E402
from tp_kernels.backends import symm as symm_backend  # noqa: E402


def test_fp32_precision_set_the_new_way_is_read_without_raising():
    """torch >= 2.9: once a user sets ``fp32_precision``, reading ``allow_tf32`` raises; the
    kernels' choice of tl.dot precision must follow the new setting instead."""
    done = run_without_interpreter(
        """
        import torch
        from tp_kernels import kernels
        matmul = torch.backends.cuda.matmul
        if not hasattr(matmul, "fp32_precision"):
            print("no fp32_precision"); raise SystemExit
        for setting, want in (("tf32", "tf32"), ("ieee", "ieee")):
            matmul.fp32_precision = setting
            print(setting, kernels.dot_precision(torch.float32) == want)
        print("fp16", kernels.dot_precision(torch.float16))
        """
    )
    assert done.returncode == 0, done.stderr
    if "no fp32_precision" not in done.stdout:
        assert done.stdout.split() == ["tf32", "True", "ieee", "True", "fp16", "None"]


def test_call_varying_scalars_are_never_specialized():
    """Triton compiles a new variant for an int argument equal to 1 or a multiple of 16 unless
    it is in ``do_not_specialize``: rank, channel, the status address and the deadline must not
    be, or rank 1 would compile a kernel of its own (and an address's alignment pick one)."""
    done = run_without_interpreter(
        """
        from tp_kernels import kernels
        from tp_kernels.kernels import ag_matmul, matmul_rs
        kernels_ = [ag_matmul._barrier_kernel,
                    ag_matmul._ag_matmul_kernel, matmul_rs._matmul_rs_kernel,
                    matmul_rs._reduce_slots_kernel]
        for k in kernels_:
            for p in k.params:
                if p.name in kernels.VARYING_ARGS:
                    print(k.__name__, p.name, p.do_not_specialize)
        """
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    seen = [line for line in lines if line]
    # Every varying argument of every kernel (the consumer waits on local words: no channel; the
    # producer waits for nothing: no status, no deadline).
    assert len(seen) == 4 + 3 + 2 + 4, seen
    assert all(line.endswith(" True") for line in seen), seen


def test_kernels_launch_on_the_operands_device(monkeypatch):
    from tp_kernels import kernels

    entered = []

    class Recorder:
        def __init__(self, device):
            entered.append(device)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", Recorder)
    with kernels.on_device(torch.device("cuda", 3)):
        pass
    with kernels.on_device(torch.device("cpu")):
        pass
    assert entered == [torch.device("cuda", 3)]


class _Group:
    group_name = "tp"


def test_capture_without_state_is_refused_before_anything_runs(monkeypatch):
    """Under CUDA graph capture a call that would have to make the group's state (a collective
    allocation) is refused, on CUDA, before it allocates, signals or launches anything, naming
    the bytes to reserve."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)

    def no_state(*args):
        raise AssertionError("touched the group's state")

    monkeypatch.setattr(symm_backend, "_state", no_state)
    with pytest.raises(
        RuntimeError, match=r"cannot be captured in a CUDA graph now: no call on this group"
    ) as info:
        symm_backend._begin(
            _Group(), torch.device("cuda", 0), symm_backend._AG, torch.float16, (8, 4, 0), 64
        )
    assert "tp_kernels.reserve(group, nbytes=256)" in str(info.value), info.value


def test_capture_is_taken_when_the_state_holds_the_call(monkeypatch):
    """The symm backend captures a call whose workspaces and state the warmup (or
    tp_kernels.reserve) made large enough; one that needs more is refused before anything
    runs (before the capture-safe protocol, every capture was refused)."""
    import types

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "capture stream")
    group, cuda = _Group(), torch.device("cuda", 0)
    state = symm_backend._GroupState.__new__(symm_backend._GroupState)
    state.data = types.SimpleNamespace(nbytes=2 * 1024)
    state.words = state.copier = state.pusher = object()
    state.staging = torch.empty(1024, dtype=torch.uint8)
    state.status = None
    state.last_stream = "the warmup's stream"
    monkeypatch.setitem(symm_backend._states, group, {str(cuda): state})
    assert symm_backend._usable_state(group, cuda, "a test call", need_half=1024) is state
    # A capture may not wait for work outside it (the warmup's stream).
    assert state.last_stream == "capture stream"
    with pytest.raises(RuntimeError, match=r"holds 1024 bytes per call and this call needs 2048"):
        symm_backend._usable_state(group, cuda, "a test call", need_half=2048)


def _recorded_timeout_raises_at_next_call() -> dict:
    """Rank 0 finds a timeout that a kernel recorded for rank 1 and raises at its next call,
    without communicating: rank 1 does not call at all."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    report: dict = {}
    try:
        config.SYMM_TRITON.set(True)
        a = torch.ones(4, 8)
        bs = [torch.ones(8, 3)]
        symm_backend.BACKEND.all_gather_matmul(a, bs, group, return_a=False)  # sets up
        dist.barrier()
        if rank == 0:
            status, _, _ = symm_backend._state(group, torch.device("cpu")).kernel_state()
            status[1] = signals.WAIT_CHUNK  # what a wait for rank 1's chunk stores at its deadline
            report["unraised"] = symm_backend.unraised_timeouts()
            try:
                symm_backend.BACKEND.all_gather_matmul(a, bs, group, return_a=False)
            except PeerTimeoutError as exc:
                report |= {"error": str(exc), "peers": exc.peers}
            try:
                symm_backend.BACKEND.all_gather_matmul(a, bs, group, return_a=False)
            except PeerTimeoutError as exc:
                report["next"] = str(exc)
            report["after_raise"] = symm_backend.unraised_timeouts()
        dist.barrier()
    finally:
        config.SYMM_TRITON.reset()
        dist.destroy_process_group(group)
    return report


def test_recorded_timeout_is_raised_at_the_next_call(worlds):
    report = worlds(2).run(_recorded_timeout_raises_at_next_call)[0]
    assert report["peers"] == [1], report
    assert "for rank(s) [1] (rank 1: a chunk of its shard" in report["error"], report["error"]
    assert "is broken by an earlier failed wait" in report["next"], report
    # Until raised, the record is what the exit report prints; once raised, it is not repeated.
    assert len(report["unraised"]) == 1 and "rank(s) [1]" in report["unraised"][0], report
    assert report["after_raise"] == [], report


def test_triton_older_than_the_kernels_support_is_named(monkeypatch):
    """torch 2.7-2.9's CUDA wheels pin Triton 3.3-3.5, which the kernels do not support:
    available_backends() must say so for symm instead of "ok" followed by a crash."""
    from tp_kernels import kernels

    assert kernels.triton_unsupported_reason("3.6.0") is None
    assert kernels.triton_unsupported_reason("3.9.0+git1234") is None
    assert "Triton 3.5.1 is older than 3.6" in kernels.triton_unsupported_reason("3.5.1")
    monkeypatch.setattr(kernels, "triton_unsupported_reason", lambda: "Triton 3.4.0 is older")
    monkeypatch.setattr(config.SYMM_TRITON, "get", lambda: True)
    why = symm_backend.BACKEND.unavailable_reason(None, torch.device("cpu"))
    assert why == "Triton 3.4.0 is older", why


def _launch_arguments() -> list[dict]:
    """Four all-gather calls on the Triton path with a transposed weight (a Linear's ``w.t()``):
    what the consumer launcher was given each time."""
    from tp_kernels import kernels

    seen = []
    made, launch = kernels.AgMatmulConsumer.__init__, kernels.AgMatmulConsumer.launch

    def record_operands(self, a, bs, outs, **kwargs):
        seen.append(
            {
                "b_is_w_t": [b.stride() == (1, b.shape[0]) for b in bs],
                "b_is_the_weight": [b.data_ptr() == w.data_ptr() for b, w in zip(bs, weights)],
            }
        )
        made(self, a, bs, outs, **kwargs)

    def record_words(self, **kwargs):
        seen[-1] |= {
            "progress": kwargs["progress"].data_ptr(),
            "status": kwargs["status"].data_ptr(),
        }
        launch(self, **kwargs)

    weights = [torch.randn(6, 8), torch.randn(3, 8)]  # [N, K] each, as Linear weights
    config.SYMM_TRITON.set(True)
    kernels.AgMatmulConsumer.__init__ = record_operands
    kernels.AgMatmulConsumer.launch = record_words
    try:
        for _ in range(4):
            symm_backend.BACKEND.all_gather_matmul(
                torch.randn(4, 8), [w.t() for w in weights], dist.group.WORLD, return_a=False
            )
    finally:
        kernels.AgMatmulConsumer.__init__, kernels.AgMatmulConsumer.launch = made, launch
        config.SYMM_TRITON.reset()
    return seen


def test_triton_path_makes_no_per_call_tables_or_weight_copies(worlds):
    """The host side of a call builds nothing on the device: the progress words and the status
    are made once and every call uses the same ones (the start barrier clears the words: no
    per-call row or value); the weight goes in as it is (its strides), not copied."""
    for seen in worlds(2).run(_launch_arguments):
        assert len(seen) == 4
        assert len({s["progress"] for s in seen}) == 1, seen
        assert len({s["status"] for s in seen}) == 1
        assert all(s["b_is_w_t"] == [True, True] for s in seen), seen
        assert all(s["b_is_the_weight"] == [True, True] for s in seen), seen
