"""Stage t of scripts/gpu_check (issue 37, run alone: `scripts/gpu_check --stages t`): tensor parallelism on
2 GPUs. A tiny random-weight Llama (GQA, one KV head per rank) served with TP=2 over NCCL, CUDA graphs on
(they capture the all-reduces), against the same model at TP=1: greedy bf16 tokens, and tok/s of each.
On one GPU it says "skipped: 1 GPU". The CPU smoke run serves the same with gloo on the CPU in float32."""

from __future__ import annotations

import tempfile
import time

import torch


def stage_tensor_parallel(ctx) -> None:
    from gpu_check.measure import row
    from testbed.tiny_models import make_tiny_model
    from worker import Engine, SamplingParams

    gpus = torch.cuda.device_count() if not ctx.smoke else 2
    if gpus < 2:
        ctx.emit(row("TP=2 greedy tokens vs TP=1", f"skipped: {gpus} GPU", "2+ GPUs", None,
                     "tensor parallelism needs two devices"))
        return
    directory = make_tiny_model(tempfile.mkdtemp(prefix="gpu-check-tp-"), "llama", rope_scaling=None,
                                vocab_size=4096, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                                num_key_value_heads=2)
    options = dict(device=ctx.device, dtype=ctx.dtype, max_num_seqs=16, max_num_batched_tokens=512,
                   kv_cache_gb=0.05)
    prompts = [[(7 * i + j) % 4000 + 3 for j in range(20 + 3 * i)] for i in range(16)]
    params = SamplingParams(max_tokens=8 if ctx.smoke else 64, temperature=0.0, ignore_eos=True)
    results = {}
    for size in (1, 2):
        with Engine(directory, tensor_parallel_size=size, **options) as engine:
            engine.generate(prompts[:2], params)  # warm: the first steps compile and allocate
            started = time.perf_counter()
            outs = engine.generate(prompts, params)
            seconds = time.perf_counter() - started
            results[size] = ([o.token_ids for o in outs], sum(len(o.token_ids) for o in outs) / seconds)
    same = sum(a == b for a, b in zip(results[1][0], results[2][0], strict=True))
    ctx.emit(row("TP=2 greedy tokens vs TP=1 (tiny Llama, 16 requests)", f"{same}/16 equal", "most equal "
                 "(bf16: the all-reduce sums in another order)", same >= (16 if ctx.smoke else 12)))
    ctx.emit(row("tok/s TP=1 vs TP=2 (tiny model: collectives dominate)",
                 f"{results[1][1]:.0f} vs {results[2][1]:.0f}", "", None, "no target on a tiny model"))
