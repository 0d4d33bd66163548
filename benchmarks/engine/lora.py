"""LoRA adapters' cost in the offline engine, two figures:

1. mixed: the chat workload with its rows spread over 4 adapters (row i under adapter i % 4) against the same
   workload on the base model, in one engine (max_loras 4), rounds alternating the order. Target: mixed tok/s
   >= 0.8x base.
2. many: 100 adapters registered, 8 resident (max_loras 8; max_cpu_loras --cpu-loras, 0 = all registered: a
   slot load is then a copy from host memory, never a disk read), each row under a random one of the 100:
   tok/s, slot loads and disk reads per round.

Adapters are random (testbed/lora_adapters.py) at --rank on q/k/v/o and gate/up/down of every layer, written
once under --adapters-dir. Prints a table and writes it to docs/adapters.md (section "speed").

    .venv/bin/python -m benchmarks.engine.lora [--model smollm2-135m] [--num-prompts 64] [--max-tokens 128]
        [--rounds 3] [--rank 16] [--registered 100] [--resident 8] [--cpu-loras 0] [--device cpu] [--no-write]
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time

from bench.harness import DEFAULT_MODEL, machine, markdown_table, parser, write_json


def timed(engine, prompts, params, loras) -> tuple[float, int]:
    started = time.perf_counter()
    outs = engine.generate(prompts, params, loras=loras)
    return time.perf_counter() - started, sum(len(o.token_ids) for o in outs)


def main() -> None:
    ap = parser(__doc__, model=DEFAULT_MODEL, prompts=64, max_tokens=128, rounds=3, docs=True, device="cpu",
                dtype="float32", rank=16, mixed_adapters=4, registered=100, resident=8, cpu_loras=0,
                adapters_dir=os.path.join(tempfile.gettempdir(), "tokenbus-lora-bench"))
    args = ap.parse_args()

    from bench.workload import chat_ids, workload
    from testbed.lora_adapters import write_random_adapter
    from worker.engine import loader
    from worker.engine.engine import Engine
    from worker.engine.sampling_params import SamplingParams

    source = loader.resolve(args.model)
    config = loader.load_config(source)
    paths = [write_random_adapter(os.path.join(args.adapters_dir, f"{source.name}-r{args.rank}-{i}"), config,
                                  args.rank, seed=i) for i in range(max(args.registered, args.mixed_adapters))]
    items = workload(args.num_prompts, max_tokens=args.max_tokens)
    common = dict(device=args.device, dtype=args.dtype, max_lora_rank=args.rank, max_num_seqs=args.num_prompts)
    rows, figures = [], {}

    # 1. the batch over 4 adapters against the same batch on the base model
    engine = Engine(args.model, max_loras=args.mixed_adapters, **common)
    names = [f"a{i}" for i in range(args.mixed_adapters)]
    for name, path in zip(names, paths, strict=False):
        engine.add_lora(name, path)
    prompts = chat_ids(engine.tokenizer, items)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in items]
    mixed = [names[i % len(names)] for i in range(len(items))]
    timed(engine, prompts[:4], params[:4], mixed[:4])  # warm-up: every adapter loaded once
    runs: dict[str, list[float]] = {"base": [], "mixed": []}
    for r in range(args.rounds):
        for kind in (("base", "mixed") if r % 2 == 0 else ("mixed", "base")):
            seconds, tokens = timed(engine, prompts, params, mixed if kind == "mixed" else None)
            runs[kind].append(tokens / seconds)
            print(f"  round {r} {kind}: {runs[kind][-1]:.1f} tok/s", flush=True)
    base, mix = statistics.median(runs["base"]), statistics.median(runs["mixed"])
    rows.append(f"| base model | 0 | {base:.1f} | — | — |")
    rows.append(f"| {args.mixed_adapters} adapters, rows spread | {args.mixed_adapters} | {mix:.1f} | "
                f"{engine.stats().lora_loads} | {mix / base:.2f}x |")
    figures["mixed"] = {"base_tok_s": runs["base"], "mixed_tok_s": runs["mixed"], "ratio": mix / base}
    del engine

    # 2. many adapters registered, a few resident
    host = args.cpu_loras or args.registered
    engine = Engine(args.model, max_loras=args.resident, max_cpu_loras=host, **common)
    for i, path in enumerate(paths[: args.registered]):
        engine.add_lora(f"m{i}", path)
    rng = random.Random(0)
    many, loads, reads = [], [], []
    for _ in range(args.rounds):
        choice = [f"m{rng.randrange(args.registered)}" for _ in items]
        before = engine.stats()
        seconds, tokens = timed(engine, prompts, params, choice)
        after = engine.stats()
        many.append(tokens / seconds)
        loads.append(after.lora_loads - before.lora_loads)
        reads.append(after.lora_disk_reads - before.lora_disk_reads)
        print(f"  many: {many[-1]:.1f} tok/s, {loads[-1]} loads, {reads[-1]} disk reads", flush=True)
    rows.append(f"| {args.registered} registered, {args.resident} resident, {host} in host memory | {args.resident} | "
                f"{statistics.median(many):.1f} | {statistics.median(loads):.0f} (disk reads "
                f"{statistics.median(reads):.0f}) | {statistics.median(many) / base:.2f}x |")
    figures["many"] = {"tok_s": many, "loads": loads, "disk_reads": reads}

    body = "\n".join([
        "## Speed",
        "",
        f"`python -m benchmarks.engine.lora --model {args.model} --num-prompts {args.num_prompts} --max-tokens "
        f"{args.max_tokens} --rounds {args.rounds} --rank {args.rank} --registered {args.registered} --resident "
        f"{args.resident} --cpu-loras {args.cpu_loras} --device {args.device}` at "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine()}. The chat workload (greedy, EOS "
        f"ignored), rank-{args.rank} adapters on all seven linears of every layer; medians of {args.rounds} rounds "
        "(loads: per round).",
        "",
        *markdown_table(["run", "slots", "tok/s", "slot loads", "vs base"], rows),
    ])
    write_json(args.json, figures)
    if not args.no_write:
        from benchmarks.harness.docs import publish

        publish(body, "adapters.md", "speed", True)
    else:
        print(body)


if __name__ == "__main__":
    main()
