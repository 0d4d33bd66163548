"""The tokenbus engine offline: Engine.generate on every request of a workload at once (all arrive at t=0, so
TTFT includes waiting for a seat). What `tokenbus bench engine` runs, and system (5) of
benchmarks/e2e/compare.py."""

from __future__ import annotations

import time

from bench.harness import DEFAULT_MODEL, Timed


def engine_settings(pairs: list[str]) -> dict[str, object]:
    """--engine KEY=VALUE (repeatable): an Engine argument for the offline engine, TOKENBUS_KEY for a worker.
    "true"/"false" and numbers are typed; anything else stays a string."""
    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine takes KEY=VALUE (an EngineConfig field), got {pair!r}")
        out[key.replace("-", "_")] = {"true": True, "false": False}.get(value.lower(), _number(value))
    return out


def _number(text: str) -> object:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def engine_offline(prompt_ids: list[list[int]], max_tokens: list[int], max_num_seqs: int = 64,
                   max_num_batched_tokens: int = 512, model: str = DEFAULT_MODEL, **settings: object) -> Timed:
    """One timed Engine.generate after a two-token warm-up; `settings` are further Engine arguments."""
    from worker import Engine, SamplingParams

    engine = Engine(model, device="cpu", dtype="float32", max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, **settings)
    engine.generate([prompt_ids[0]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    start = time.perf_counter()
    outs = engine.generate(prompt_ids, params)
    seconds = time.perf_counter() - start
    stats = engine.stats()
    if engine.overlap is not None:
        engine.overlap.close()
    return Timed(seconds, [o.token_ids for o in outs],
                 ttfts=[o.first_token_time - o.arrival_time for o in outs],
                 latencies=[o.finish_time - o.arrival_time for o in outs],
                 extra={"steps": str(stats.steps), "preemptions": str(stats.preemptions)})
