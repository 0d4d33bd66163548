"""Structured output's cost: a JSON-schema batch against the same batch unconstrained at equal output lengths.

The constrained batch runs first once (greedy) to fix each job's output length; the unconstrained twin then
asks each job for exactly that many tokens (ignore_eos, max_tokens = that length), so both generate the same
number of tokens from the same prompts in the same engine. Rounds alternate the order (C U, U C, ...) so drift
and warm-up fall on both. Grammars are compiled and cached in the first pass; the cold compile time of each
schema is reported apart. Prints a table and writes it to docs/benchmarks.md (section "structured").

    .venv/bin/python -m benchmarks.engine.structured [--num-prompts 32] [--rounds 4] [--device cpu] [--no-write]
"""

from __future__ import annotations

import os
import statistics
import time

from bench.harness import parser

OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS = [
    OBJ | {"properties": {"name": {"type": "string", "maxLength": 24},
                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                          "city": {"type": "string", "maxLength": 24}},
           "required": ["name", "age", "city"]},
    OBJ | {"properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                          "topics": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 16}},
                          "score": {"type": "number", "minimum": 0, "maximum": 1}},
           "required": ["sentiment", "topics", "score"]},
    OBJ | {"properties": {"book": OBJ | {"properties": {"title": {"type": "string", "maxLength": 40},
                                                      "author": {"type": "string", "maxLength": 32},
                                                      "year": {"type": "integer"}},
                                        "required": ["title", "author", "year"]},
                          "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5}},
           "required": ["book", "tags"]},
]
ASKS = ["a person you admire", "the review 'a slow but moving film'", "a classic novel"]


def jobs(n: int, max_tokens: int):
    from worker.engine.sampling_params import SamplingParams

    prompts, params = [], []
    for i in range(n):
        k = i % len(SCHEMAS)
        prompts.append([{"role": "user", "content": f"Describe {ASKS[k]} (example {i}) as JSON."}])
        params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, response_format={
            "type": "json_schema", "json_schema": {"name": f"s{k}", "schema": SCHEMAS[k]}}))
    return prompts, params


def main() -> None:
    ap = parser(__doc__, docs=True, prompts=32, max_tokens=96, rounds=4, device="cpu", dtype="float32")
    args = ap.parse_args()

    from worker.engine.engine import Engine
    from worker.engine.sampling_params import SamplingParams

    load_before = os.getloadavg()
    engine = Engine("smollm2-135m", device=args.device, dtype=args.dtype, max_num_seqs=max(64, args.num_prompts))
    prompts, constrained = jobs(args.num_prompts, args.max_tokens)

    # cold compile of each schema (LLTokenizer built on the first), off the engine thread as in serving
    compile_ms = []
    for p in constrained[:len(SCHEMAS)]:
        started = time.perf_counter()
        engine.guided._compile(p.grammar)
        compile_ms.append((time.perf_counter() - started) * 1000)

    first = engine.generate(prompts, constrained)  # warm-up; fixes each job's output length
    lengths = [len(o.token_ids) for o in first]
    finish = [o.finish_reason for o in first]
    unconstrained = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    tokens = sum(lengths)

    # time spent in the mask (fill + apply) during the constrained runs
    mask_s = [0.0]
    apply = engine.guided.apply

    def timed_apply(logits, seqs):
        started = time.perf_counter()
        apply(logits, seqs)
        mask_s[0] += time.perf_counter() - started

    engine.guided.apply = timed_apply
    seconds: dict[str, list[float]] = {"json_schema": [], "unconstrained": []}
    mask_per_run = []
    for r in range(args.rounds):
        order = ["json_schema", "unconstrained"] if r % 2 == 0 else ["unconstrained", "json_schema"]
        for name in order:
            mask_s[0] = 0.0
            started = time.perf_counter()
            outs = engine.generate(prompts, constrained if name == "json_schema" else unconstrained)
            seconds[name].append(time.perf_counter() - started)
            assert [len(o.token_ids) for o in outs] == lengths, "output lengths differ between runs"
            if name == "json_schema":
                mask_per_run.append(mask_s[0])
            print(f"  round {r} {name}: {tokens / seconds[name][-1]:.1f} tok/s", flush=True)
    load_after = os.getloadavg()

    med = {k: statistics.median(v) for k, v in seconds.items()}
    ratios = [u / c for c, u in zip(seconds["json_schema"], seconds["unconstrained"], strict=True)]
    lines = [
        "## Structured output (JSON schema vs unconstrained)",
        "",
        f"`benchmarks/engine/structured.py --num-prompts {args.num_prompts} --max-tokens {args.max_tokens} "
        f"--rounds {args.rounds} --device {args.device}` at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{engine.device.type}, {args.dtype}, greedy. {args.num_prompts} chat prompts, {len(SCHEMAS)} JSON "
        f"schemas (nested object, enum + array + bounded number, flat object); {tokens} output tokens per run "
        f"({finish.count('stop')} of {len(finish)} constrained outputs ended with `stop`). The unconstrained twin "
        "generates exactly the same number of tokens per job (ignore_eos). Rounds alternate the order.",
        "",
        "| run | median s | tok/s (median) | per round tok/s |",
        "|---|---|---|---|",
    ]
    for name in ("unconstrained", "json_schema"):
        per = ", ".join(f"{tokens / s:.1f}" for s in seconds[name])
        lines.append(f"| {name} | {med[name]:.2f} | {tokens / med[name]:.1f} | {per} |")
    lines += [
        "",
        f"**json_schema / unconstrained throughput = {statistics.median(ratios):.3f}** (median of rounds; "
        f"per round {', '.join(f'{x:.3f}' for x in ratios)}; target ≥ 0.9).",
        f"Mask time (llguidance fill + applying it to the rows) per constrained run: median "
        f"{statistics.median(mask_per_run) * 1000:.0f} ms of {med['json_schema'] * 1000:.0f} ms. Cold compile per "
        f"schema: {', '.join(f'{ms:.1f}' for ms in compile_ms)} ms (the first includes building the tokenizer "
        "table once per engine). Load average (1/5/15 min) before "
        f"{'/'.join(f'{x:.2f}' for x in load_before)}, after {'/'.join(f'{x:.2f}' for x in load_after)}.",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        from benchmarks.harness.docs import write_section

        marker = "structured" if args.device == "cpu" else f"structured-{engine.device.type}"
        print("wrote", write_section("benchmarks.md", marker, body))


if __name__ == "__main__":
    main()
