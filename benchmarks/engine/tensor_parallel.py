"""Tensor parallelism on this CPU: the offline engine at TP=1 against TP=2 (gloo, the follower a second
process), in one run, on the same cores.

The model is a random-weight Llama-shaped checkpoint (SmolLM2's vocabulary; --hidden, --layers, --heads,
--kv-heads, --intermediate size it; built once under --work) or --model, a safetensors checkpoint of a native
family. Each TP size serves the same --num-prompts prompts of --prompt-len tokens, --max-tokens each, greedy,
after a warm-up request, --rounds times (the median round shown). TP=1 uses every core (or OMP_NUM_THREADS);
TP=2 gives each rank half of them, so both use the same cores (the table says how many).

Where a step's time goes, on rank 0, per step: collectives (the layers' all-reduces, the embedding's, the
logits' gather: each waits for the slower rank, so an imbalance shows here), broadcast (the step's header and
its inputs, sent once per step), and compute (the rest of the step: the shard's kernels, scheduling, sampling).
There is no target on 2 cores: a small model's step is short next to gloo's round trips.

    python -m benchmarks.engine.tensor_parallel [--num-prompts 16] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import os
import time

import torch

from bench.harness import machine, markdown_table, parser, write_json
from testbed.tiny_models import make_tiny_model
from worker import Engine, SamplingParams

SIZES = (1, 2)


def checkpoint(args) -> str:
    if args.model:
        return args.model
    directory = os.path.join(args.work, f"llama-h{args.hidden}-l{args.layers}-q{args.heads}-kv{args.kv_heads}")
    return make_tiny_model(directory, "llama", rope_scaling=None, hidden_size=args.hidden,
                           num_hidden_layers=args.layers, num_attention_heads=args.heads,
                           num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
                           max_position_embeddings=4096)


def one_round(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    group = engine.parallel.group if engine.parallel else None
    channel = engine.parallel.channel if engine.parallel else None
    before = (sum(group.seconds.values()), channel.broadcast_s) if group else (0.0, 0.0)
    steps = engine.steps
    started = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - started
    steps = engine.steps - steps
    collectives = broadcast = 0.0
    if group:
        broadcast = channel.broadcast_s - before[1]
        collectives = sum(group.seconds.values()) - before[0] - broadcast
    tokens = sum(len(o.token_ids) for o in outs)
    return dict(tokens=[o.token_ids for o in outs], tok_s=tokens / wall, steps=steps, step_ms=1e3 * wall / steps,
                collectives_ms=1e3 * collectives / steps, broadcast_ms=1e3 * broadcast / steps,
                compute_ms=1e3 * (wall - collectives - broadcast) / steps)


def main() -> None:
    ap = parser(__doc__, model="", prompts=16, max_tokens=64, rounds=3, prompt_len=128, hidden=768, layers=6,
                heads=12, kv_heads=4, intermediate=2048, work="/tmp/tokenbus-bench-tp")
    args = ap.parse_args()
    directory = checkpoint(args)
    cores = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 40000, (args.num_prompts, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    options = dict(device="cpu", dtype="float32", max_num_seqs=max(args.num_prompts, 1),
                   max_num_batched_tokens=max(2048, args.num_prompts), kv_cache_gb=0.5)
    results = {}
    for size in SIZES:
        torch.set_num_threads(cores)  # TP=1: every core; TP=2 shares them out per rank (launch.py)
        with Engine(directory, tensor_parallel_size=size, **options) as engine:
            threads = torch.get_num_threads()
            engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            rounds = [one_round(engine, prompts, params) for _ in range(args.rounds)]
            median = sorted(rounds, key=lambda r: r["tok_s"])[len(rounds) // 2]
            results[size] = dict(median, cores=threads * size, threads_per_rank=threads,
                                 weight_mib=[round(b / 2**20, 1) for b in engine.weight_bytes],
                                 tok_s_rounds=[round(r["tok_s"], 1) for r in rounds])
    reference = results[1]["tokens"]
    rows = []
    for size, r in results.items():
        equal = sum(a == b for a, b in zip(r["tokens"], reference, strict=True))
        rows.append(f"| {size} | {r['cores']} ({r['threads_per_rank']} per rank) | {r['tok_s']:.1f} | {r['steps']} "
                    f"| {r['step_ms']:.2f} | {r['compute_ms']:.2f} | {r['collectives_ms']:.2f} "
                    f"| {r['broadcast_ms']:.2f} | {r['weight_mib']} | {equal}/{len(reference)} |")
    print(f"\n{machine()}; model {directory}; {args.num_prompts} prompts x {args.prompt_len} tokens, "
          f"{args.max_tokens} new each; median of {args.rounds} rounds (tok/s per round: "
          + ", ".join(f"TP={s}: {r['tok_s_rounds']}" for s, r in results.items()) + ")\n")
    columns = ["TP", "cores", "tok/s", "steps", "ms/step", "compute ms/step", "collectives ms/step",
               "broadcast ms/step", "weights MiB per rank", "tokens = TP=1"]
    print("\n".join(markdown_table(columns, rows)))
    write_json(args.json, {str(s): {k: v for k, v in r.items() if k != "tokens"} for s, r in results.items()})


if __name__ == "__main__":
    main()
