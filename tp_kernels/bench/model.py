"""``python -m tp_kernels.bench model``: the cost model's plan for a whole model's TP layout.

For every Linear of the sequence-parallel TP plan of a Llama-3 model (the layout of
:func:`tp_kernels.models.plans.llama_tp_plan`: one fused all-gather-matmul for wq/wk/wv and one for
w1/w3, a fused matmul-reduce-scatter for wo and for w2, the output projection gathered once), on
``--tp`` GPUs of ``--gpu``, with ``--batch`` x ``--seq`` tokens: the predicted compute and
communication, the speed of light, the unfused time (``reference``: collective, then matmul) and
the best fused backend's, per forward op and per backward (the input gradient goes through the
other fused op; the weight gradient is a local GEMM). Then a block's and the model's totals.
Nothing runs on a GPU: these are :mod:`tp_kernels.cost`'s predictions.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from tp_kernels.bench.protocol import render_table
from tp_kernels.cost import DEVICES, DeviceSpec, op_cost

__all__ = ["MODELS", "Row", "block_prediction", "linear_rows", "main", "plan_rows"]

AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
FUSED = ("pipelined", "symm", "torch_symm_mem")
_HF = "https://huggingface.co/meta-llama"

# dim, heads, kv heads, FFN hidden, vocabulary, layers: the models' config.json files.
MODELS: dict[str, dict] = {
    "llama3-8b": dict(dim=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, layers=32,
                      source=f"{_HF}/Meta-Llama-3-8B/blob/main/config.json"),
    "llama3-70b": dict(dim=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256, layers=80,
                       source=f"{_HF}/Meta-Llama-3-70B/blob/main/config.json"),
    "llama3-405b": dict(dim=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256, layers=126,
                        source=f"{_HF}/Llama-3.1-405B/blob/main/config.json"),
}  # fmt: skip


@dataclass(frozen=True)
class Row:
    """One fused op of the plan: which Linear, which pass, its per-rank GEMM and the model's times
    (seconds) for one call; ``per_model`` is how many calls one step of the whole model makes."""

    linear: str
    phase: str
    op: str
    m: int
    k: int
    n: int
    per_model: int
    compute_s: float
    comm_s: float
    sol_s: float
    reference_s: float
    fused_s: float
    fused_backend: str
    backends_s: dict[str, float]


def _linears(cfg: dict, tp: int) -> list[tuple[str, int, int, int]]:
    """``(name, K, N per rank, calls per model)`` of the column-parallel (AG) Linears; the
    row-parallel ones are listed as their input K per rank and N."""
    hd = cfg["dim"] // cfg["heads"]
    qkv = (cfg["heads"] + 2 * cfg["kv_heads"]) * hd
    for what, size in (("heads", cfg["heads"]), ("kv heads", cfg["kv_heads"]),
                       ("FFN", cfg["ffn"]), ("vocabulary", cfg["vocab"])):  # fmt: skip
        if size % tp:
            raise ValueError(f"--tp {tp}: the model's {what} ({size}) do not divide by it")
    layers = cfg["layers"]
    return [
        ("attention.wq/wk/wv", cfg["dim"], qkv // tp, layers),
        ("attention.wo", cfg["heads"] * hd // tp, cfg["dim"], layers),
        ("feed_forward.w1/w3", cfg["dim"], 2 * cfg["ffn"] // tp, layers),
        ("feed_forward.w2", cfg["ffn"] // tp, cfg["dim"], layers),
        ("output", cfg["dim"], cfg["vocab"] // tp, 1),
    ]


def linear_rows(
    linears: Sequence[tuple[str, int, int, int]], m: int, tp: int, dtype: str, device: DeviceSpec
) -> list[Row]:
    """The forward and backward fused ops of ``linears`` (``(name, K, N per rank, calls per
    model)``; ``attention.wo`` and ``feed_forward.w2`` are row-parallel), ``m`` rows per rank."""
    rows = []
    for name, k, n, per_model in linears:
        forward = RS if name in ("attention.wo", "feed_forward.w2") else AG
        backward = AG if forward == RS else RS
        for phase, op, (kk, nn) in (("forward", forward, (k, n)), ("backward", backward, (n, k))):
            cost = op_cost(op, m, kk, nn, tp, dtype, device)
            best = min(FUSED, key=lambda b: cost.backends_s[b])
            rows.append(
                Row(
                    name,
                    phase,
                    op,
                    m,
                    kk,
                    nn,
                    per_model,
                    cost.compute_s,
                    cost.comm_s,
                    cost.speed_of_light_s,
                    cost.backends_s["reference"],
                    cost.backends_s[best],
                    best,
                    cost.backends_s,
                )  # fmt: skip
            )
    return rows


def plan_rows(
    model: str, device: DeviceSpec, tp: int, tokens: int, dtype: str = "bf16"
) -> list[Row]:
    """The forward and backward fused ops of every Linear of ``model``'s plan, with times."""
    if tokens % tp:
        raise ValueError(f"batch x seq = {tokens} tokens do not divide by --tp {tp}")
    return linear_rows(_linears(MODELS[model], tp), tokens // tp, tp, dtype, device)


def block_prediction(
    cfg: dict, tp: int, tokens: int, dtype: str, device: DeviceSpec
) -> dict[str, float]:
    """Seconds of one block's Linears for one training step (forward, backward, weight-gradient
    GEMMs) per backend, and ``"roof"``: their compute alone. ``cfg`` holds ``dim``, ``heads``,
    ``kv_heads`` and ``ffn``; attention's own math and the norms are not modeled."""
    linears = [row for row in _linears({**cfg, "vocab": tp, "layers": 1}, tp) if row[0] != "output"]
    rows = linear_rows(linears, tokens // tp, tp, dtype, device)
    weight_grads = sum(r.compute_s for r in rows if r.phase == "forward")
    times = {b: sum(r.backends_s[b] for r in rows) + weight_grads for b in rows[0].backends_s}
    times["roof"] = sum(r.compute_s for r in rows) + weight_grads
    return times


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def render(rows: Sequence[Row], model: str, device: DeviceSpec, tp: int, tokens: int) -> str:
    """The per-op table, then the block's and the model's totals for one training step."""
    header = ("linear", "pass", "op", "m x K x N /rank", "compute", "comm", "SoL", "unfused",
              "fused", "backend", "speedup", "of SoL")  # fmt: skip
    cells = []
    for r in rows:
        cells.append(
            (r.linear, r.phase, "AG+mm" if r.op == AG else "mm+RS", f"{r.m}x{r.k}x{r.n}",
             _ms(r.compute_s), _ms(r.comm_s), _ms(r.sol_s), _ms(r.reference_s), _ms(r.fused_s),
             r.fused_backend, f"{r.reference_s / r.fused_s:.2f}x", f"{r.sol_s / r.fused_s:.0%}")
        )  # fmt: skip
    text = render_table(header, cells, left=4)
    block = [r for r in rows if r.per_model > 1]
    cfg = MODELS[model]
    out = [
        f"cost model: {model} TP={tp} on {device.name}, {tokens} tokens per step ("
        f"{tokens // tp} per rank), bf16; times in ms per call; nothing measured",
        text,
    ]
    # The weight gradients are local GEMMs: the same flops as the forward, nothing to overlap.
    for what, chosen, weight in (
        ("one block (forward + backward)", block, lambda r: 1),
        (f"the model ({cfg['layers']} blocks + output)", rows, lambda r: r.per_model),
    ):
        wg = sum(r.compute_s * weight(r) for r in chosen if r.phase == "forward")
        unfused = sum(r.reference_s * weight(r) for r in chosen) + wg
        fused = sum(r.fused_s * weight(r) for r in chosen) + wg
        sol = sum(r.sol_s * weight(r) for r in chosen) + wg
        out.append(
            f"{what}: unfused {unfused * 1e3:.2f} ms, fused {fused * 1e3:.2f} ms "
            f"({unfused / fused:.2f}x), speed of light {sol * 1e3:.2f} ms (fused at "
            f"{sol / fused:.0%} of it); weight gradients {wg * 1e3:.2f} ms of local GEMMs"
        )
    out.append(f"device: {device.source}")
    out.append(f"model: {cfg['source']}")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m tp_kernels.bench model``."""
    p = argparse.ArgumentParser(
        prog="python -m tp_kernels.bench model",
        description="Print the cost model's plan for a Llama-3 model's TP layout on a GPU.",
    )
    p.add_argument("--gpu", choices=sorted(DEVICES), default="h100")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel degree (GPUs)")
    p.add_argument("--model", choices=sorted(MODELS), default="llama3-70b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192)
    args = p.parse_args(argv)
    if args.tp < 1 or args.batch < 1 or args.seq < 1:
        p.error(f"--tp, --batch, --seq: got {args.tp}, {args.batch}, {args.seq}; expected >= 1")
    device = DEVICES[args.gpu]
    tokens = args.batch * args.seq
    try:
        rows = plan_rows(args.model, device, args.tp, tokens)
    except ValueError as exc:
        p.error(str(exc))
    print(render(rows, args.model, device, args.tp, tokens))
    return 0
