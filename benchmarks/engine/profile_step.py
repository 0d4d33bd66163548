"""Where does an engine step's time go? The offline engine on the bench workload, each part timed.

The workload runs twice: first as the engine serves (a pure decode step's layers in one C++ call), step
times only; then through the per-layer path, which runs the same kernels with Python between them. For that
pass the script wraps (from outside, nothing in worker/ changes) the scheduler, the batch-tensor preparation, every
linear layer, the paged-attention kernels, RoPE, the norms, lm_head and the sampler with an exclusive-time
timer (CPU ops are synchronous, so wall time per call is the op's time). What is left of a step is Python:
the model's residual adds / SiLU·mul / views, the runner's row picking, the engine's stop checks and outputs.
Steps are split into pure decode steps and steps that also carry prefill tokens. Then, optionally, a
torch.profiler window over decode steps lists the top aten ops.

    .venv/bin/python -m benchmarks.engine.profile_step [--num-prompts 64] [--threads 2] [--torch-ops 20] [--no-write]
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

from bench.harness import parser
from bench.workload import workload
from benchmarks.harness.docs import write_section

CATEGORIES = [
    ("linear", "linear layers (qkv, o, gate_up, down)"),
    ("attention", "paged attention (decode + prefill kernels)"),
    ("kv_write", "KV-cache write"),
    ("lm_head", "lm_head (576 → 49152)"),
    ("sampling", "sampling (argmax, .tolist())"),
    ("norm", "RMSNorm (residual add included)"),
    ("silu_mul", "SiLU·mul"),
    ("rope", "RoPE"),
    ("embed", "embedding"),
    ("model_other", "other model tensor ops (splits, views, output buffers)"),
    ("prepare", "batch tensors (positions, slots, block tables)"),
    ("scheduler", "scheduler"),
    ("runner_other", "runner Python (sample rows, indexing)"),
    ("engine_other", "engine Python (append tokens, stop checks, outputs)"),
]


class ExclusiveTimer:
    """Per-category exclusive wall time: a wrapped call's time minus that of wrapped calls inside it."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # per open call: [child seconds]

    def wrap(self, category: str, fn):
        def timed(*args, **kwargs):
            self._stack.append([0.0])
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                children = self._stack.pop()[0]
                self.totals[category] += elapsed - children
                if self._stack:
                    self._stack[-1][0] += elapsed

        return timed

    def take(self) -> dict[str, float]:
        out, self.totals = dict(self.totals), defaultdict(float)
        return out


def record_batch_shape(engine) -> dict:
    """Wrap the scheduler so the returned dict always holds the current step's running sequences ("seqs")
    and prompt tokens ("prefill_tokens")."""
    shape: dict = {}
    schedule = engine.scheduler.schedule

    def schedule_and_record():
        batch = schedule()
        shape["seqs"] = len(batch.seqs)
        shape["prefill_tokens"] = sum(n for n in batch.num_new_tokens if n > 1)
        return batch

    engine.scheduler.schedule = schedule_and_record
    return shape


def instrument(engine, timer: ExclusiveTimer) -> None:
    """Wrap the engine's parts, each with its category's timer."""
    model, backend = engine.model, engine.backend
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            lin.forward = timer.wrap("linear", lin.forward)
    # instance attributes shadow the backend's methods: every module calls them through engine.backend
    parts = [
        ("norm", backend, "rms_norm"), ("norm", backend, "add_rms_norm"), ("silu_mul", backend, "silu_and_mul"),
        ("rope", backend, "rotary"), ("rope", model.rotary, "cos_sin"), ("embed", model.embed_tokens, "forward"),
        ("model_other", model, "forward"), ("lm_head", model, "compute_logits"), ("kv_write", backend, "write_kv"),
        ("attention", backend, "decode_attention"), ("attention", backend, "prefill_attention"),
        ("sampling", engine.runner, "sampler"), ("prepare", engine.runner, "_prepare"),
        ("runner_other", engine.runner, "run"), ("scheduler", engine.scheduler, "schedule"),
        ("engine_other", engine, "step"),
    ]
    for category, owner, name in parts:
        setattr(owner, name, timer.wrap(category, getattr(owner, name)))


def main() -> None:
    ap = parser(__doc__, prompts=64, max_tokens=256, docs=True, max_num_seqs=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--torch-ops", type=int, default=15, help="top aten ops over a decode window (0 = off)")
    ap.add_argument("--linear-batches", default="1,8,16,32,64",
                    help="batch sizes for the linear-layer comparison ('' = off)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from worker import Engine, SamplingParams

    engine = Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=512)
    items = workload(args.num_prompts, max_tokens=args.max_tokens)
    engine.generate([items[0][0]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up

    shape = record_batch_shape(engine)

    # First as it serves: a pure decode step's layers are one C++ call, whose parts cannot be timed apart.
    fused_by_batch: dict[int, list[float]] = defaultdict(list)  # decode batch size -> step seconds

    def fused_step(wall: float) -> None:
        if not shape["prefill_tokens"]:
            fused_by_batch[shape["seqs"]].append(wall)

    fused_total, fused_tokens = _run(engine, items, fused_step, "fused")

    # Then the per-layer path, every part wrapped: it runs the same kernels, with Python between them.
    fused_layers, engine.backend.fused = engine.backend.fused, None
    timer = ExclusiveTimer()
    instrument(engine, timer)
    kinds = {"decode": defaultdict(float), "mixed": defaultdict(float)}
    steps = {"decode": 0, "mixed": 0}
    step_wall = {"decode": 0.0, "mixed": 0.0}
    by_batch: dict[int, list[float]] = defaultdict(list)  # decode batch size -> step seconds

    def timed_step(wall: float) -> None:
        kind = "mixed" if shape["prefill_tokens"] else "decode"
        steps[kind] += 1
        step_wall[kind] += wall
        for cat, sec in timer.take().items():
            kinds[kind][cat] += sec
        if kind == "decode":
            by_batch[shape["seqs"]].append(wall)

    total, tokens = _run(engine, items, timed_step, "layers")

    engine.backend.fused = fused_layers  # the aten ops as served
    ops_table = torch_ops(engine, items, args.torch_ops) if args.torch_ops else ""
    batches = [int(b) for b in args.linear_batches.split(",") if b]
    linear_table = linear_paths(engine.model, batches) if batches else ""
    fused = (fused_total, fused_tokens, fused_by_batch)
    text = render(args, kinds, steps, step_wall, by_batch, tokens, total, fused, ops_table, linear_table)
    print(text)
    if not args.no_write:
        print("\nwritten to", write_section("benchmarks.md", "profile", text))


def _run(engine, items, on_step, prefix: str) -> tuple[float, int]:
    """The workload through engine.step(), on_step(wall seconds) after each; (seconds, tokens)."""
    from worker import SamplingParams

    for i, (messages, m) in enumerate(items):
        engine.add_request(f"{prefix}{i}", messages, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        on_step(time.perf_counter() - t)
        tokens += len(engine.deltas)
    return time.perf_counter() - start, tokens


def torch_ops(engine, items, top: int) -> str:
    """torch.profiler over 20 decode steps with 16 running sequences: the top aten ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    from worker import SamplingParams

    for i, (messages, _) in enumerate(items[:16]):
        engine.add_request(f"ops{i}", messages, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    for _ in range(8):  # past the prefill
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    whole = sum(e.self_cpu_time_total for e in prof.key_averages()) or 1
    lines = ["| aten op | calls per step | self ms per step | share |", "|---|---:|---:|---:|"]
    for e in rows:
        lines.append(f"| `{e.key}` | {e.count / 20:.0f} | {e.self_cpu_time_total / 20 / 1000:.2f} | "
                     f"{e.self_cpu_time_total / whole:.1%} |")
    return "\n".join(lines)


def _dense_weight(module) -> torch.Tensor:
    """An nn.Linear's weight; for a CpuLinear (its weights are prepacked, opaque) a random one of the same
    shape, which costs the same to multiply."""
    if isinstance(getattr(module, "weight", None), torch.Tensor):
        return module.weight.detach()
    return torch.randn(module.out_features, module.in_features)


def linear_paths(model, batches: list[int], repeats: int = 5) -> str:
    """The model's own weights through several GEMM paths: what the linear layers cost per step each way."""
    import torch.nn.functional as F

    from worker.engine.backends.cpu_linear import PANEL_MAX_ROWS

    modules = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                     layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    modules.append(model.lm_head)
    engine_path = type(model.lm_head).__name__
    weights = [_dense_weight(m) for m in modules]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    paths = {"F.linear fp32 (PyTorch's default BLAS)": (lambda x, w: F.linear(x, w), weights, torch.float32)}
    if torch.backends.mkldnn.is_available():
        onednn = [(w.to_mkldnn(), torch.zeros(w.shape[0]).to_mkldnn()) for w in weights]
        paths["oneDNN fp32, mkldnn_linear with dense↔oneDNN conversions"] = (
            lambda x, w: torch._C._nn.mkldnn_linear(x.to_mkldnn(), w[0], w[1]).to_dense(), onednn, torch.float32)
        if hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
            paths["oneDNN fp32, prepacked weight, dense input (_linear_pointwise: CpuLinear above "
                  f"{PANEL_MAX_ROWS} rows)"] = (
                lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), packed, torch.float32)
    from tokenbus_kernels import cpu
    from worker.engine.backends.cpu_linear import pack_panels

    if (ext := cpu.extension()) is not None:
        panels = [(pack_panels(w), w.shape[0]) for w in weights]
        paths[f"C++ panel kernel, fp32 (panel_linear_cpu: CpuLinear up to {PANEL_MAX_ROWS} rows)"] = (
            lambda x, w: ext.panel_linear_cpu(x, w[0], w[1], None), panels, torch.float32)
    paths["F.linear, bf16 weights and activations"] = (
        lambda x, w: F.linear(x, w), [w.to(torch.bfloat16) for w in weights], torch.bfloat16)
    in_dims = [w.shape[1] for w in weights]
    lines = ["| GEMM path | " + " | ".join(f"batch {b}: ms" for b in batches) + " |",
             "|---|" + "---:|" * len(batches)]
    # the paths take turns within each repeat (this machine's speed drifts within minutes), median per cell
    times: dict[tuple[str, int], list[float]] = {(name, b): [] for name in paths for b in batches}
    with torch.inference_mode():
        for b in batches:
            inputs = {name: {d: torch.randn(b, d, dtype=dtype) for d in set(in_dims)}
                      for name, (_, _, dtype) in paths.items()}
            for _ in range(repeats):
                for name, (fn, ws, _) in paths.items():
                    t = time.perf_counter()
                    for w, d in zip(ws, in_dims, strict=True):
                        fn(inputs[name][d], w)
                    times[name, b].append(time.perf_counter() - t)
    for name in paths:
        lines.append(f"| {name} | " + " | ".join(f"{statistics.median(times[name, b]) * 1000:.1f}" for b in batches)
                     + " |")
    lines.append("")
    lines.append(f"All 120 layer linears + lm_head of one step ({nbytes / 1e6:.0f} MB of fp32 weights), "
                 f"the paths in turns, median of {repeats}; the engine's linear layers are `{engine_path}`.")
    return "\n".join(lines)


def render(args, kinds, steps, step_wall, by_batch, tokens, total, fused, ops_table, linear_table) -> str:
    fused_total, fused_tokens, fused_by_batch = fused
    lines = [
        "## Where an engine step's time goes (CPU)", "",
        f"`benchmarks/engine/profile_step.py`: the offline engine on the bench workload ({args.num_prompts} prompts, "
        f"max_tokens up to {args.max_tokens}, greedy, EOS ignored), max_num_seqs {args.max_num_seqs}, "
        f"max_num_batched_tokens 512, {args.threads} threads; run {time.strftime('%Y-%m-%d %H:%M')}.", "",
        f"As it serves, a pure decode step's 30 layers are one C++ call (`worker/models/cpu_decode.py`): "
        f"{fused_tokens} tokens in {fused_total:.1f} s ({fused_tokens / fused_total:.1f} tok/s). Its parts "
        "cannot be timed apart, so the table below comes from a second pass with the per-layer path, which "
        f"runs the same kernels with Python between them: {tokens} tokens in {total:.1f} s "
        f"({tokens / total:.1f} tok/s), {steps['decode']} decode steps and {steps['mixed']} steps with "
        "prefill. Exclusive wall time per part, wrapped from outside the engine (about 300 wrapped calls a "
        "step at ~1 µs each: well under 1 ms).", "",
        "| part (per-layer path) | decode step: ms | share | prefill/mixed step: ms | share |",
        "|---|---:|---:|---:|---:|",
    ]
    for cat, label in CATEGORIES:
        cells = []
        for kind in ("decode", "mixed"):
            n = max(steps[kind], 1)
            whole = step_wall[kind] or 1
            sec = kinds[kind].get(cat, 0.0)
            cells += [f"{sec / n * 1000:.2f}", f"{sec / whole:.1%}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    cells = []
    for kind in ("decode", "mixed"):
        n = max(steps[kind], 1)
        cells += [f"{step_wall[kind] / n * 1000:.2f}", "100%"]
    lines.append("| **whole step** | " + " | ".join(f"**{c}**" for c in cells) + " |")
    lines += ["", "Decode steps by batch size (long tail: the last requests decode in small batches), as served "
              "(fused) and through the per-layer path (timed):", "",
              "| running sequences | steps | ms per step, fused | per-layer | tok/s in these steps, fused | "
              "share of decode time, fused |", "|---:|---:|---:|---:|---:|---:|"]
    buckets = [(1, 1), (2, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 10_000)]
    decode_total = sum(sum(v) for v in fused_by_batch.values()) or 1

    def bucket(table: dict[int, list[float]], lo: int, hi: int) -> tuple[list[float], int]:
        walls = [w for b, ws in table.items() if lo <= b <= hi for w in ws]
        return walls, sum(b * len(ws) for b, ws in table.items() if lo <= b <= hi)

    for lo, hi in buckets:
        walls, toks = bucket(fused_by_batch, lo, hi)
        layer_walls, _ = bucket(by_batch, lo, hi)
        if walls:
            label = str(lo) if lo == hi else f"{lo}–{hi}"
            per_layer = f"{sum(layer_walls) / len(layer_walls) * 1000:.1f}" if layer_walls else "–"
            lines.append(f"| {label} | {len(walls)} | {sum(walls) / len(walls) * 1000:.1f} | {per_layer} | "
                         f"{toks / sum(walls):.0f} | {sum(walls) / decode_total:.0%} |")
    if ops_table:
        lines += ["", "Top aten ops by self CPU time as served (torch.profiler, 20 decode steps with 16 sequences; "
                  "the fused layers' kernels show as one op):", "",
                  ops_table]
    if linear_table:
        lines += ["", "The linear layers through other GEMM paths (the model's weights, random activations):", "",
                  linear_table]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
