"""Stages l and s of scripts/gpu_check: what the CUDA graphs take as inputs beyond the plain decode step
(worker/engine/cuda_graphs.py), on a random-weight checkpoint in SmolLM2-135M's shapes.

    l (LoRA, issue 36)     three rank-16 adapters and the base model mixed in one batch: greedy fp32 tokens with
                           graphs on against off (the adapter rows are static graph inputs, one graph per shape
                           for every mix), that the adapters change the tokens at all, and bf16 tok/s of the
                           mix against the base model alone
    s (cascade, issue 39)  16 rows behind a shared 1,024-token prefix (a prefix-cache hit): fp32 tokens with
                           cascade forced on against off, both with graphs on, and the cascade graphs replayed;
                           the bf16 decode step time with cascade auto against off

In the CPU smoke run the padded eager path (static_decode) stands in for the graphs, on tiny shapes.
"""

from __future__ import annotations

import statistics
import time

import torch

SHAPE = "SmolLM2-135M"


def _mode(ctx, graphs: bool) -> dict:
    # off the GPU no graphs: the padded path they replay against the eager one (gpu_check/graphs.py)
    return dict(static_decode=graphs) if ctx.smoke else dict(cuda_graphs=graphs)


def _engine(ctx, path: str, dtype: str, graphs: bool, **kwargs):
    from worker import Engine

    return Engine(path, device=ctx.device, dtype=dtype, kv_cache_gb=0.25 if ctx.smoke else 4,
                  cpu_kernels=False, **_mode(ctx, graphs), **kwargs)


def _agreement(got: list[list[int]], want: list[list[int]]) -> tuple[float, int, int]:
    """(share of tokens equal position by position, requests identical, tokens)."""
    pairs = list(zip(got, want, strict=True))
    total = sum(len(b) for _, b in pairs)
    same = sum(x == y for a, b in pairs for x, y in zip(a, b, strict=False))
    return same / max(total, 1), sum(a == b for a, b in pairs), total


def _free(ctx) -> None:
    if not ctx.smoke:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- (l) LoRA adapters under CUDA graphs

def stage_lora(ctx) -> None:
    import tempfile

    from transformers import AutoConfig

    from gpu_check.measure import checkpoint, row, sync
    from testbed.lora_adapters import write_random_adapter
    from worker import SamplingParams

    path = checkpoint(ctx, SHAPE)
    count, prompt_len, n_new = (4, 12, 4) if ctx.smoke else (16, 64, 32)
    gen = torch.Generator().manual_seed(36)
    prompts = [torch.randint(3, 49152, (prompt_len + i,), generator=gen).tolist() for i in range(count)]
    names = ["a0", "a1", "a2"]
    mix = [None if i % 4 == 0 else names[i % 4 - 1] for i in range(count)]
    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    config = AutoConfig.from_pretrained(path)
    options = dict(max_num_seqs=count, max_num_batched_tokens=2048, max_loras=3, max_lora_rank=16,
                   max_model_len=256)
    with tempfile.TemporaryDirectory(prefix="gpu-check-lora-") as tmp:
        adapters = {n: write_random_adapter(f"{tmp}/{n}", config, 16, seed) for seed, n in enumerate(names, 1)}
        runs = {}
        for graphs in (True, False):
            engine = _engine(ctx, path, "float32", graphs, **options)
            for name, adapter in adapters.items():
                engine.add_lora(name, adapter)
            runs[graphs] = [o.token_ids for o in engine.generate(prompts, params, loras=mix)]
            if graphs:
                base = [o.token_ids for o in engine.generate(prompts, params)]
                replays = sum(engine.runner.static.replays.values()) if engine.runner.static else 0
            del engine
            _free(ctx)
        share, identical, total = _agreement(runs[True], runs[False])
        label = "padded static decode vs eager" if ctx.smoke else "graphs on vs off"
        ctx.emit(row(f"LoRA float32 tokens, {label}, 3 adapters + base mixed ({count} x {n_new})",
                     f"{share:.2%} equal, {identical}/{count} requests identical", "all equal (fp32)",
                     share >= 0.99, f"{total} tokens; {replays} graph replays"
                     + ("" if share == 1 else "; below 100%: near-ties of random weights, or a graph input bug")))
        changed = sum(a != b for a, b, lora in zip(runs[True], base, mix, strict=True) if lora is not None)
        with_adapter = sum(lora is not None for lora in mix)
        ctx.emit(row("LoRA adapters change the greedy tokens (graphs on, vs the same prompts on the base)",
                     f"{changed}/{with_adapter} adapter requests differ", "all differ", changed == with_adapter,
                     "else the graph replays ignore the adapter rows"))
        # tok/s: the mix against the base model alone, bf16, graphs on, one engine
        engine = _engine(ctx, path, ctx.dtype, True, **options)
        for name, adapter in adapters.items():
            engine.add_lora(name, adapter)
        engine.generate(prompts, params, loras=mix)  # warm: every adapter resident, every variant compiled
        rates = {}
        for label, loras in (("base", None), ("mix", mix)):
            sync(ctx)
            started = time.perf_counter()
            engine.generate(prompts, params, loras=loras)
            sync(ctx)
            rates[label] = count * n_new / (time.perf_counter() - started)
        del engine
        _free(ctx)
    ctx.emit(row(f"LoRA tok/s, 3 adapters + base mixed vs base only ({ctx.dtype}, graphs on, {count} requests)",
                 f"{rates['mix']:,.0f} vs {rates['base']:,.0f} (x{rates['mix'] / rates['base']:.2f})", "reported",
                 None, "the CPU's figure: docs/adapters.md"))


# ---------------------------------------------------------------- (s) cascade attention under CUDA graphs

def _shared_prefix_workload(ctx) -> tuple[list[int], list[list[int]]]:
    prefix_len, count = (40, 4) if ctx.smoke else (1024, 16)
    gen = torch.Generator().manual_seed(39)
    prefix = torch.randint(3, 49152, (prefix_len,), generator=gen).tolist()
    return prefix, [prefix + torch.randint(3, 49152, (8 + i,), generator=gen).tolist() for i in range(count)]


def _decode_steps(ctx, engine, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], float]:
    """Greedy tokens of prompts, and the median decode step time (ms) once every prompt is in."""
    from gpu_check.measure import sync
    from worker import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    outputs, times = {}, []
    while engine.has_unfinished_requests():
        sync(ctx)
        t = time.perf_counter()
        finished = engine.step()
        sync(ctx)
        times.append(time.perf_counter() - t)
        outputs.update({o.request_id: o.token_ids for o in finished})
    return [outputs[f"s{i}"] for i in range(len(prompts))], 1000 * statistics.median(times[2:steps])


def stage_cascade(ctx) -> None:
    from gpu_check.measure import checkpoint, row
    from worker import SamplingParams

    path = checkpoint(ctx, SHAPE)
    prefix, prompts = _shared_prefix_workload(ctx)
    steps = 4 if ctx.smoke else 24
    options = dict(max_num_seqs=len(prompts), max_num_batched_tokens=4096, max_model_len=None if ctx.smoke else 2048)
    results = {}
    for dtype, modes in (("float32", ("on", "off")), (ctx.dtype, ("auto", "off"))):
        for mode in modes:
            if (dtype, mode) in results:
                continue
            engine = _engine(ctx, path, dtype, True, cascade_attention=mode, **options)
            engine.generate([prefix], SamplingParams(max_tokens=1, temperature=0.0))  # the prefix, cached
            tokens, step_ms = _decode_steps(ctx, engine, prompts, steps)
            static = engine.runner.static
            results[(dtype, mode)] = (tokens, step_ms, engine.stats().cascade_steps,
                                      static.replays["cascade"] if static else 0)
            del engine
            _free(ctx)
    (on, _, on_steps, on_replays), (off, _, _, _) = results[("float32", "on")], results[("float32", "off")]
    share, identical, total = _agreement(on, off)
    graphs = "padded static decode" if ctx.smoke else "graphs on"
    ctx.emit(row(f"cascade forced on vs off, float32 tokens, {graphs} ({len(prompts)} rows behind a "
                 f"{len(prefix)}-token shared prefix)", f"{share:.2%} equal, {identical}/{len(prompts)} identical",
                 "all equal (fp32); cascade graphs replayed", share >= 0.99 and (ctx.smoke or on_replays > 0),
                 f"{total} tokens; {on_steps} cascaded steps, {on_replays} cascade graph replays"))
    auto, off_ms = results[(ctx.dtype, "auto")], results.get((ctx.dtype, "off"), results[("float32", "off")])[1]
    ctx.emit(row(f"decode step, cascade auto vs off ({ctx.dtype}, {graphs}, {len(prompts)} rows, "
                 f"{len(prefix)}-token prefix)", f"{auto[1]:.2f} ms vs {off_ms:.2f} ms (x{off_ms / auto[1]:.2f})",
                 "auto faster", None if ctx.smoke else auto[1] < off_ms,
                 f"{auto[2]} cascaded steps, {auto[3]} cascade graph replays"))
