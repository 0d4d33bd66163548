"""Issue #22 attack 6 at the engine: does a tenant's costly grammar slow another tenant's request?

One engine (SmolLM2-135M, CPU, float32). A 10-token request alone, then the same request while an attack
request runs beside it: `regex: "a{100000}"` with n = 4, built with SamplingParams.model_construct so it
skips the submit check (which now refuses it: max_repeat) and reaches the engine as it did before. Three
rows, measured side by side in one run: alone; attack with the engine's mask budget (LIMITS.mask_budget_ms:
the attack fails alone, grammar_too_costly); attack with the budget off (what the engine did before).

    python -m benchmarks.reliability.grammar_attack   # writes docs/bench_grammar_attack.md
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

from bench.harness import parser
from protocol.constraints import LIMITS
from worker import Engine, SamplingParams
from worker.engine.guided import GrammarTooCostly

PROMPT = [{"role": "user", "content": "Say hello to the new colleague."}]
ROUNDS = 2
OUT = Path(__file__).resolve().parents[2] / "docs" / "bench_grammar_attack.md"


def victim_seconds(engine: Engine, attack: bool, tag: str) -> tuple[tuple[float, float], str]:
    """(wall s, process CPU s) of the 10-token request from its add to its end; and how the attack ended.
    CPU time (every thread of the process: the model's, the masks', the grammar pool's) is what the attack
    adds whatever else loads the machine; wall time is what the tenant sees on a quiet one."""
    attack_end = "none"
    if attack:
        engine.guided._compiled.clear()  # compile the attack's grammar afresh, as a new one would be
        params = SamplingParams.model_construct(regex="a{100000}", n=4, max_tokens=40, temperature=1.0)
        engine.add_request(f"attack-{tag}", PROMPT, params)
    start, cpu = time.perf_counter(), time.process_time()
    engine.add_request(f"victim-{tag}", PROMPT, SamplingParams(max_tokens=10, ignore_eos=True, temperature=0))
    took = None
    while took is None and engine.has_unfinished_requests():
        try:
            finished = engine.step()
        except GrammarTooCostly as err:  # the serve loop fails that job alone (grammar_too_costly): the same
            engine.abort(err.request_id)
            attack_end = "grammar_too_costly (at a step)"
            continue
        for out in finished:
            if out.request_id == f"victim-{tag}":
                took = (time.perf_counter() - start, time.process_time() - cpu)
            elif out.request_id == f"attack-{tag}":
                attack_end = out.finish_reason
        if f"attack-{tag}" in engine.rejected:
            attack_end = engine.rejected[f"attack-{tag}"].code + " (at compile)"
    engine.abort(f"attack-{tag}")
    return took, attack_end


def main() -> None:
    parser(__doc__, docs=True).parse_args()
    engine = Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=8, kv_cache_gb=0.25)
    engine.generate([PROMPT], SamplingParams(max_tokens=2))  # warm-up
    rows = {"alone": [], "attack, mask budget on (now)": [], "attack, mask budget off (before)": []}
    ends = {}
    for r in range(ROUNDS):
        rows["alone"].append(victim_seconds(engine, False, f"a{r}")[0])
        engine.guided.limits = LIMITS
        t, ends["attack, mask budget on (now)"] = victim_seconds(engine, True, f"b{r}")
        rows["attack, mask budget on (now)"].append(t)
        engine.guided.limits = dataclasses.replace(LIMITS, mask_budget_ms=1e9)
        t, ends["attack, mask budget off (before)"] = victim_seconds(engine, True, f"c{r}")
        rows["attack, mask budget off (before)"].append(t)
    alone = [statistics.median(t[k] for t in rows["alone"]) for k in (0, 1)]
    lines = ["# A costly grammar beside a 10-token request (issue #22, attack 6)", "",
             f"`python -m benchmarks.reliability.grammar_attack` on {time.strftime('%Y-%m-%d')}: SmolLM2-135M, CPU "
             f"float32, {ROUNDS} rounds side by side (medians). The attack (`regex: \"a{{100000}}\"`, n = 4) "
             "skips the submit check, which refuses it now (max_repeat). The machine is shared (2 cores, load "
             "average well above 2), so wall seconds are long and noisy; the CPU seconds of the process (all "
             "its threads) are what the attack adds to the other request's life.", "",
             "| run | wall (s) | x alone | CPU (s) | x alone | the attack ended |", "|---|---:|---:|---:|---:|---|"]
    for name, times in rows.items():
        wall, cpu = (statistics.median(t[k] for t in times) for k in (0, 1))
        lines.append(f"| {name} | {wall:.2f} | {wall / alone[0]:.1f} | {cpu:.2f} | {cpu / alone[1]:.1f} | "
                     f"{ends.get(name, '-')} |")
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.write_text(text)


if __name__ == "__main__":
    main()
