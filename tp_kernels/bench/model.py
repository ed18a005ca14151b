"""``python -m tp_kernels.bench model``: the cost model's schedules and a whole model's TP plan.

Without ``--model``: the schedule table. For every fused op of the forward pass of Llama-3
8B/70B/405B's sequence-parallel TP plan (the all-gather-matmuls of wq/wk/wv and w1/w3, the
matmul-reduce-scatters of wo and w2), at ``--tp`` GPUs of ``--gpu`` and each of ``--tokens``,
every schedule of :data:`tp_kernels.cost.SCHEDULES` with its predicted time and share of the
speed of light; rows where no fused schedule beats the unfused one (``reference``) are marked:
there ``auto`` rules fusion out.

With ``--model``: the plan. For every Linear of that model's TP layout (the layout of
:func:`tp_kernels.models.plans.llama_tp_plan`: one fused all-gather-matmul for wq/wk/wv and one
for w1/w3, a fused matmul-reduce-scatter for wo and for w2, the output projection gathered once),
with ``--batch`` x ``--seq`` tokens: the predicted compute and communication, the speed of
light, the unfused time and the best fused backend's, per forward op and per backward (the input
gradient goes through the other fused op; the weight gradient is a local GEMM). Then a block's
and the model's totals.

With ``--fp8``: the fp8 comparison (issue 27), on the schedule table's shapes (the forward fused
ops of Llama-3 8B/70B/405B at ``--tp`` and each of ``--tokens``): per call and per layer, the best
fused bf16 schedule, torchao's unfused fp8 path under PyTorch's styles (the all-gather moves the
bf16 input, then every gathered row is cast, then the fp8 GEMM; the GEMM, then NCCL's
reduce-scatter of bf16 partials; nothing overlapped) and the best fused fp8 schedule (each rank
casts its own rows, the packed fp8 rows travel; bf16 partials). The fp8 GEMM's efficiency is
assumed to be bf16's until a GPU measures it.

With ``--mxfp8``: the same comparison for MXFP8 (issue 36) on every GPU with MX tensor cores
(B200, GB200; or ``--gpu``): fused bf16, torchtitan's MXFP8 TP (its communication in bf16 under
PyTorch's styles: the gather, then the MX cast of every gathered row; the GEMM, then a bf16
reduce-scatter) and tp_kernels' MXFP8 path (each rank's rows cast, e4m3 bytes and e8m0 block
scales on the wire) on the best backend of :data:`SCALED_BACKENDS`. The MXFP8 GEMM's efficiency
is assumed bf16's.

``--param NAME=VALUE`` replaces a figure of the device (a field of
:class:`tp_kernels.cost.DeviceSpec`, e.g. the ones ``gpu_check`` fits). Nothing runs on a GPU:
these are :mod:`tp_kernels.cost`'s predictions.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from tp_kernels.bench.protocol import render_table
from tp_kernels.cost import DEVICES, SCHEDULES, DeviceSpec, op_cost, quantize_s

__all__ = [
    "MODELS",
    "Row",
    "ScaledRow",
    "block_prediction",
    "linear_rows",
    "main",
    "plan_rows",
    "render_scaled",
    "render_schedules",
    "scaled_rows",
    "schedule_rows",
    "with_params",
]

AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
FUSED = ("pipelined", "symm", "torch_symm_mem")
TOKENS = (2048, 8192)
# The device's single figures, by field name: "int" or "float" (sms is None on a CPU only).
_NUMERIC = {
    f.name: "int" if f.type.startswith("int") else "float"
    for f in dataclasses.fields(DeviceSpec)
    if f.type in ("float", "int", "int | None")
}
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


def _linears(cfg: dict, tp: int) -> list[tuple[str, int, tuple[int, ...], int]]:
    """``(name, K, widths per rank, calls per model)`` of the Linears: a column-parallel (AG)
    Linear's right-hand matrices' widths (wq, wk, wv; w1, w3), a row-parallel one's (wo, w2)
    input K per rank and its one output width N."""
    hd = cfg["dim"] // cfg["heads"]
    for what, size in (("heads", cfg["heads"]), ("kv heads", cfg["kv_heads"]),
                       ("FFN", cfg["ffn"]), ("vocabulary", cfg["vocab"])):  # fmt: skip
        if size % tp:
            raise ValueError(f"--tp {tp}: the model's {what} ({size}) do not divide by it")
    layers, kv = cfg["layers"], cfg["kv_heads"] * hd // tp
    return [
        ("attention.wq/wk/wv", cfg["dim"], (cfg["heads"] * hd // tp, kv, kv), layers),
        ("attention.wo", cfg["heads"] * hd // tp, (cfg["dim"],), layers),
        ("feed_forward.w1/w3", cfg["dim"], (cfg["ffn"] // tp,) * 2, layers),
        ("feed_forward.w2", cfg["ffn"] // tp, (cfg["dim"],), layers),
        ("output", cfg["dim"], (cfg["vocab"] // tp,), 1),
    ]


_ROWWISE = ("attention.wo", "feed_forward.w2")


def linear_rows(
    linears: Sequence[tuple[str, int, tuple[int, ...], int]],
    m: int,
    tp: int,
    dtype: str,
    device: DeviceSpec,
) -> list[Row]:
    """The forward and backward fused ops of ``linears`` (``(name, K, widths per rank, calls per
    model)``; ``attention.wo`` and ``feed_forward.w2`` are row-parallel), ``m`` rows per rank."""
    rows = []
    for name, k, widths, per_model in linears:
        n = sum(widths)
        forward = RS if name in _ROWWISE else AG
        backward = AG if forward == RS else RS
        for phase, op, (kk, nn) in (("forward", forward, (k, n)), ("backward", backward, (n, k))):
            ns = widths if phase == "forward" and op == AG else None
            cost = op_cost(op, m, kk, nn, tp, dtype, device, ns=ns)
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


def _forward_ops(tp: int, tokens: Sequence[int]):
    """``(model, tokens, linear, op, m, k, widths)`` of every forward fused op of every model at
    each token count, ``m`` the rows per rank."""
    for name, cfg in MODELS.items():
        for count in tokens:
            if count % tp:
                raise ValueError(f"{count} tokens do not divide by --tp {tp}")
            for linear, k, widths, _ in _linears(cfg, tp)[:4]:
                op = RS if linear in _ROWWISE else AG
                yield name, count, linear, op, count // tp, k, widths


def schedule_rows(
    device: DeviceSpec, tp: int, tokens: Sequence[int] = TOKENS, dtype: str = "bf16"
) -> dict[str, list[tuple]]:
    """Per op, one row per (model, tokens, forward fused op): ``(model, tokens, linear,
    "m x K x N", speed of light s, {schedule: s}, verdict)``; the verdict names the fastest
    fused schedule, or says that none beats ``reference``."""
    table: dict[str, list[tuple]] = {AG: [], RS: []}
    for name, count, linear, op, m, k, widths in _forward_ops(tp, tokens):
        n = sum(widths)
        cost = op_cost(op, m, k, n, tp, dtype, device, ns=widths if op == AG else None)
        times = cost.schedules_s
        fused = min((s for s in times if s != "reference"), key=times.__getitem__)
        verdict = (
            fused
            if times[fused] < times["reference"]
            else "NONE beats reference: auto rules fusion out"
        )
        table[op].append(
            (name, count, linear, f"{m}x{k}x{n}", cost.speed_of_light_s,
             cost.schedules_s, verdict)
        )  # fmt: skip
    return table


def render_schedules(table: dict[str, list[tuple]], device: DeviceSpec, tp: int) -> str:
    """The schedule table: per op, each schedule's ms and its share of the speed of light."""
    out = [
        f"cost model: every schedule of the forward fused ops of Llama-3 TP={tp} on {device.name},"
        " bf16; ms per call (share of the speed of light); modeled, not measured (its figures:"
        " below)"
    ]
    for op, rows in table.items():
        header = ("model", "tokens", "linear", "m x K x N /rank", "SoL ms", *SCHEDULES[op],
                  "fastest fused")  # fmt: skip
        cells = [
            (model, str(count), linear, shape, _ms(sol),
             *(f"{_ms(times[s])} ({sol / times[s]:.0%})" for s in SCHEDULES[op]), verdict)
            for model, count, linear, shape, sol, times, verdict in rows
        ]  # fmt: skip
        out += ["", f"{op}:", render_table(header, cells, left=4)]
    out.append("")
    out.append(f"device: {device.name}; its figures and their sources:")
    out.append(f"  peak_tflops = {device.peak_tflops}: {device.sources['peak_tflops']}")
    for name in _NUMERIC:
        out.append(f"  {name} = {getattr(device, name):g}: {device.sources[name]}")
    out.append("models: " + ", ".join(cfg["source"] for cfg in MODELS.values()))
    return "\n".join(out)


@dataclass(frozen=True)
class ScaledRow:
    """One forward fused op of a scaled comparison (fp8 or MXFP8): seconds per call of the best
    fused bf16 schedule (``bf16_backend``), the unfused scaled path that gathers bf16 and casts
    after (``unfused_s``: torchao's Float8Linear, or torchtitan's MXFP8 TP, under PyTorch's
    styles), and the best fused scaled schedule (``fused_backend``), each with its casts;
    ``sol_s``: the scaled call's speed of light."""

    model: str
    tokens: int
    linear: str
    op: str
    m: int
    k: int
    n: int
    bf16_fused_s: float
    bf16_backend: str
    unfused_s: float
    fused_s: float
    fused_backend: str
    sol_s: float


def scaled_rows(
    device: DeviceSpec, tp: int, tokens: Sequence[int] = TOKENS, dtype: str = "fp8"
) -> list[ScaledRow]:
    """The ``dtype`` ("fp8" or "mxfp8") comparison on :func:`schedule_rows`' shapes. The input's
    cast (:func:`tp_kernels.cost.quantize_s`) is counted where it runs: the fused all-gather
    casts the rank's ``m`` rows before they travel, the unfused path the ``W*m`` gathered rows
    after the bf16 gather; a reduce-scatter's ``W*m`` local rows are cast in both. The scaled
    path takes the best of :data:`SCALED_BACKENDS` for ``dtype``. Left out, as the same in
    both paths: the weights' casts, and for fp8 the row-parallel Linear's all-reduce of its
    input's row amaxes (``K`` is sharded there: docs/DESIGN.md's fp8 section; MX blocks never
    span ranks)."""
    rows = []
    for name, count, linear, op, m, k, widths in _forward_ops(tp, tokens):
        n = sum(widths)
        ns = widths if op == AG else None
        bf16 = op_cost(op, m, k, n, tp, "bf16", device, ns=ns).backends_s
        fused = op_cost(op, m, k, n, tp, dtype, device, ns=ns)
        wire = "bf16" if op == AG else None
        unfused = op_cost(op, m, k, n, tp, dtype, device, ns=ns, wire=wire).backends_s
        cast_fused = quantize_s(m if op == AG else tp * m, k, device, dtype)
        cast_unfused = quantize_s(tp * m, k, device, dtype)
        bf16_best = min(FUSED, key=bf16.__getitem__)
        best = min(SCALED_BACKENDS[dtype], key=fused.backends_s.__getitem__)
        rows.append(
            ScaledRow(name, count, linear, op, m, k, n, bf16[bf16_best], bf16_best,
                      unfused["reference"] + cast_unfused,
                      fused.backends_s[best] + cast_fused, best,
                      fused.speed_of_light_s + cast_fused)
        )  # fmt: skip
    return rows


SCALED_BACKENDS = {"fp8": FUSED, "mxfp8": ("reference", "pipelined", "symm")}
"""The backends whose best time a scaled comparison gives for tp_kernels' path: fp8's fused
schedules; MXFP8's the three that run block scales on Blackwell (:func:`tp_kernels.cost.op_cost`;
torch_symm_mem refuses them), ``reference`` among them: its NCCL gather of the MX rows cast
before it is tp_kernels' path too."""
# Per scaled dtype: the names of the unfused path and of tp_kernels' (columns), and the
# caption's lines after the first.
_NAMES = {"fp8": ("torchao", "fused"), "mxfp8": ("titan", "wire")}
_CAPTIONS = {
    "fp8": (
        "  bf16 fused: the best fused bf16 schedule; fp8 torchao: PyTorch's styles with "
        "Float8Linear, unfused (AG: bf16 gather,",
        "  cast of the W*m rows, fp8 GEMM; RS: fp8 GEMM, bf16 reduce-scatter); fp8 fused: the "
        "best fused fp8 schedule (AG: each",
        "  rank's m rows cast, K + 16 bytes a row on the wire; RS: bf16 partials); vs: torchao's "
        "or bf16's time / fp8 fused's",
    ),
    "mxfp8": (
        "  bf16 fused: the best fused bf16 schedule; mxfp8 titan: torchtitan's MXFP8 TP, "
        "communication in high precision under",
        "  PyTorch's styles, unfused (AG: bf16 gather, MX cast of the W*m rows, MXFP8 GEMM; RS: "
        "the casts, MXFP8 GEMM, bf16",
        "  reduce-scatter); mxfp8 wire: tp_kernels' MXFP8 path on the best backend of block "
        "scales: reference (NCCL,",
        "  then the GEMM), pipelined or symm (its GEMMs with the scales in the MMA, at bf16's "
        "efficiency: assumed); AG: each rank's m rows cast, K + K/32",
        "  bytes a row padded to 16 on the wire; RS: bf16 partials; vs: titan's or bf16's time / "
        "mxfp8 wire's",
    ),
}
_NOT_MODELED = {
    "fp8": "the weights' casts and the row-parallel Linears' all-reduce of row amaxes (the same "
    "in both fp8 paths), attention's own math",
    "mxfp8": "the weights' casts (the same in both paths; neither all-reduces an amax: MX "
    "blocks never span ranks), symm's torch schedule of block scales (where the GPU has no block-"
    "scaled MMA), attention's own math",
}


def render_scaled(rows: Sequence[ScaledRow], device: DeviceSpec, tp: int, dtype: str) -> str:
    """The ``dtype`` comparison: per forward call, then per layer (the four forward fused ops)."""
    slow_name, own_name = _NAMES[dtype]
    unfused, own = f"{dtype} {slow_name}", f"{dtype} {own_name}"
    out = [
        f"cost model (MODELED, nothing measured): {dtype} against bf16, the forward fused ops of "
        f"Llama-3 TP={tp} on {device.name}; ms per call",
        *_CAPTIONS[dtype],
    ]
    vs_unfused = f"vs {slow_name}"
    header = ("model", "tokens", "linear", "op", "m x K x N /rank", "bf16 fused", "backend",
              unfused, own, "backend", f"{dtype} SoL", vs_unfused,
              "vs bf16")  # fmt: skip
    cells = [
        (r.model, str(r.tokens), r.linear, "AG+mm" if r.op == AG else "mm+RS",
         f"{r.m}x{r.k}x{r.n}", _ms(r.bf16_fused_s), r.bf16_backend, _ms(r.unfused_s),
         _ms(r.fused_s), r.fused_backend, _ms(r.sol_s),
         f"{r.unfused_s / r.fused_s:.2f}x", f"{r.bf16_fused_s / r.fused_s:.2f}x")
        for r in rows
    ]  # fmt: skip
    out += ["", render_table(header, cells, left=5)]
    layers: dict[tuple[str, int], list[ScaledRow]] = {}
    for r in rows:
        layers.setdefault((r.model, r.tokens), []).append(r)
    header = ("model", "tokens", "bf16 fused", unfused, own, vs_unfused,
              "vs bf16")  # fmt: skip
    cells = []
    for (name, count), group in layers.items():
        bf16, slow, fused = (
            sum(getattr(r, f) for r in group) for f in ("bf16_fused_s", "unfused_s", "fused_s")
        )
        cells.append((name, str(count), _ms(bf16), _ms(slow), _ms(fused),
                      f"{slow / fused:.2f}x", f"{bf16 / fused:.2f}x"))  # fmt: skip
    out += ["", "per layer (forward: wq/wk/wv, wo, w1/w3, w2), ms:", render_table(header, cells)]
    peak = device.peak_tflops
    out += [
        "",
        f"device: {device.name}: dense {dtype} {peak[dtype]:g} and bf16 {peak['bf16']:g} "
        f"TFLOP/s, HBM {device.hbm_gb_s:g} GB/s, NVLink {device.link_gb_s:g} GB/s per "
        f"direction: {device.source}",
        f"{dtype}: {device.sources[dtype]}; gemm_efficiency = {device.gemm_efficiency:g} for "
        f"both dtypes; not modeled: {_NOT_MODELED[dtype]}",
        "models: " + ", ".join(cfg["source"] for cfg in MODELS.values()),
    ]
    return "\n".join(out)


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
        f"{tokens // tp} per rank), bf16; times in ms per call; modeled, not measured (its "
        "figures: below)",
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


def _param(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    if not sep or name not in _NUMERIC:
        raise argparse.ArgumentTypeError(
            f"expected NAME=VALUE with NAME one of {list(_NUMERIC)}, got {text!r}"
        )
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: expected a number, got {value!r}") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"{name}: expected a positive number, got {value!r}")
    return name, number


def with_params(device: DeviceSpec, params: Sequence[tuple[str, float]]) -> DeviceSpec:
    """``device`` with the figures of ``params`` replaced, each marked as given on the command
    line in ``sources``."""
    if not params:
        return device
    values = {n: int(v) if _NUMERIC[n] == "int" else v for n, v in params}
    sources = {**device.sources, **{n: "given with --param" for n in values}}
    return dataclasses.replace(device, **values, sources=sources)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m tp_kernels.bench model``."""
    p = argparse.ArgumentParser(
        prog="python -m tp_kernels.bench model",
        description="Print the cost model's schedules for Llama-3's fused ops, or with --model "
        "its plan for one model's TP layout on a GPU.",
    )
    p.add_argument(
        "--gpu",
        choices=sorted(DEVICES),
        default=None,
        help="the GPU (default h100; with --mxfp8 every GPU with MX tensor cores)",
    )
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel degree (GPUs)")
    p.add_argument("--model", choices=sorted(MODELS), default=None, help="print this plan")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS),
                   help="tokens per step of the schedule table (default: 2048 8192)")  # fmt: skip
    p.add_argument("--batch", type=int, default=1, help="with --model")
    p.add_argument("--seq", type=int, default=8192, help="with --model")
    p.add_argument("--fp8", action="store_true",
                   help="print the fp8 comparison (fused fp8, torchao's unfused fp8, fused bf16) "
                   "on the schedule table's shapes")  # fmt: skip
    p.add_argument("--mxfp8", action="store_true",
                   help="print the MXFP8 comparison (fused MXFP8, torchtitan's MXFP8 TP with "
                   "bf16 communication, fused bf16) on the schedule table's shapes")  # fmt: skip
    p.add_argument("--param", type=_param, action="append", default=[], metavar="NAME=VALUE",
                   help="replace a figure of the device, repeatable")  # fmt: skip
    args = p.parse_args(argv)
    if min(args.tp, args.batch, args.seq, *args.tokens) < 1:
        p.error(
            f"--tp, --batch, --seq, --tokens: got {args.tp}, {args.batch}, {args.seq}, "
            f"{args.tokens}; expected >= 1"
        )
    if args.fp8 and args.mxfp8:
        p.error("--fp8, --mxfp8: one comparison at a time")
    scaled = "fp8" if args.fp8 else "mxfp8" if args.mxfp8 else None
    if scaled is not None and args.model is not None:
        p.error(f"--{scaled} compares on the schedule table's shapes; leave out --model")
    if args.gpu is not None:
        names = [args.gpu]
    elif scaled == "mxfp8":
        names = [name for name, spec in DEVICES.items() if "mxfp8" in spec.peak_tflops]
    else:
        names = ["h100"]
    devices = [with_params(DEVICES[name], args.param) for name in names]
    device = devices[0]
    if scaled is not None and scaled not in device.peak_tflops:
        native = " (MX block scales are native on Blackwell only; torchao emulates them)"
        p.error(f"--{scaled}: {device.name} has no {scaled} tensor cores in the model"
                + (native if scaled == "mxfp8" else ""))  # fmt: skip
    try:
        if scaled is not None:
            tables = [render_scaled(scaled_rows(d, args.tp, args.tokens, scaled), d, args.tp,
                                    scaled) for d in devices]  # fmt: skip
            print("\n\n".join(tables))
            return 0
        if args.model is None:
            print(render_schedules(schedule_rows(device, args.tp, args.tokens), device, args.tp))
            return 0
        tokens = args.batch * args.seq
        rows = plan_rows(args.model, device, args.tp, tokens)
    except ValueError as exc:
        p.error(str(exc))
    print(render(rows, args.model, device, args.tp, tokens))
    return 0
