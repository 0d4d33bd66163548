"""e2e/compare.py --workload shared: the shared-prefix benchmark, end to end through Redis.

Workload (bench/workload.py: shared_prefix_workload): every request is one ~1,000-token system instruction plus
a distinct short question, output lengths long-tailed, greedy, EOS ignored. Systems, taking turns round
after round (the order rotates) so the machine's drift falls on each of them alike:

  (P1) tokenbus end to end, prefix caching on (the default)
  (P2) tokenbus end to end, prefix caching off
  (P3) vLLM's CPU build, prefix caching on (skipped with a note when .venv-vllm is missing)
  (U1) / (U2) tokenbus end to end on the unshared chat workload (workload), caching on / off:
       the cost of caching where nothing much is shared

The load average is read before every run and printed next to its numbers: the machine is shared.
Writes the section `shared` of docs/benchmarks.md and docs/shared_prefix.png.
"""

from __future__ import annotations

import os
import statistics
import time

from bench.e2e import run_e2e
from bench.harness import Timed, cpu_name, rotated
from bench.workload import chat_ids, shared_prefix_workload, workload
from benchmarks.harness.docs import DOCS, write_section
from benchmarks.harness.vllm import run_vllm

NAMES = {
    "P1": "tokenbus e2e, prefix caching on",
    "P2": "tokenbus e2e, prefix caching off",
    "P3": "vLLM CPU build, prefix caching on",
    "U1": "unshared chat workload: tokenbus e2e, caching on",
    "U2": "unshared chat workload: tokenbus e2e, caching off",
}


def run_shared(args, tokenizer, source, redis_url: str, work: str) -> None:
    shared = shared_prefix_workload(args.num_prompts, max_tokens=args.max_tokens)
    s_ids, s_max = chat_ids(tokenizer, shared), [m for _, m in shared]
    plain = workload(args.unshared_prompts, max_tokens=args.max_tokens)
    u_ids, u_max = chat_ids(tokenizer, plain), [m for _, m in plain]
    common = os.path.commonprefix(s_ids)
    print(f"shared: {len(s_ids)} requests, prompt tokens {sum(map(len, s_ids))} ({len(common)} shared by all), "
          f"output tokens {sum(s_max)}; unshared: {len(u_ids)} requests, output tokens {sum(u_max)}; "
          f"threads {args.threads}; logs in {work}", flush=True)
    log = os.path.join(work, "worker.log")
    turns = {
        "P1": lambda: run_e2e(redis_url, s_ids, s_max, args.threads, log, prefix_caching=True),
        "P2": lambda: run_e2e(redis_url, s_ids, s_max, args.threads, log, prefix_caching=False),
        "P3": lambda: run_vllm(args.vllm_python, source.directory, s_ids, s_max, args.threads, work,
                               args.vllm_eager, prefix_caching=True),
        "U1": lambda: run_e2e(redis_url, u_ids, u_max, args.threads, log, prefix_caching=True),
        "U2": lambda: run_e2e(redis_url, u_ids, u_max, args.threads, log, prefix_caching=False),
    }
    for key in [k for k in args.shared_skip.split(",") if k]:
        turns.pop(key, None)
    runs: dict[str, list[tuple[Timed, float]]] = {k: [] for k in turns}
    notes: dict[str, str] = {}
    for round_index in range(args.rounds):
        order = rotated(list(turns), round_index)
        print(f"round {round_index + 1} of {args.rounds}: order {', '.join(order)}", flush=True)
        for key in order:
            if key in notes:
                continue
            load = os.getloadavg()[0]
            try:
                got = turns[key]()
            except Exception as err:  # one broken system must not lose the others' numbers
                got = f"{type(err).__name__}: {err}"
            if isinstance(got, Timed):
                runs[key].append((got, load))
                rate = sum(map(len, got.outputs)) / got.seconds
                print(f"  ({key}) {NAMES[key]}: {got.seconds:.1f} s = {rate:.1f} tok/s, load {load:.1f} "
                      f"{got.extra.get('prefix-cache token hit rate', '')}", flush=True)
            else:
                notes[key] = got
                print(f"  ({key}) skipped: {got}", flush=True)
    text = report(args, runs, notes, s_ids, s_max, u_ids, len(common))
    print()
    print(text)
    if not args.no_write:
        plot(runs)
        print("\nwritten to", write_section("benchmarks.md", "shared", text))


def _rate(t: Timed) -> float:
    return sum(map(len, t.outputs)) / t.seconds


def report(args, runs, notes, s_ids, s_max, u_ids, common: int) -> str:
    med = {k: statistics.median(_rate(t) for t, _ in v) for k, v in runs.items() if v}
    lines = ["## Shared prefix (CPU): prefix caching end to end", "",
             f"Workload: {len(s_ids)} requests, each one system instruction ({common} tokens shared by every "
             f"prompt, SmolLM2's chat template around it) plus a distinct short question "
             f"({sum(map(len, s_ids))} prompt tokens in all), output lengths long-tailed 8–{args.max_tokens} "
             f"({sum(s_max)} tokens), greedy, EOS ignored; the unshared rows run the chat workload of the "
             f"section above ({len(u_ids)} requests). SmolLM2-135M fp32, {args.threads} threads each, one "
             f"system at a time, {cpu_name()} ({os.cpu_count()} cores, shared with other work: the 1-minute "
             f"load average before each run is listed); {args.rounds} rounds in rotating order, each row its "
             f"median round; run {time.strftime('%Y-%m-%d %H:%M')} with "
             f"`benchmarks/e2e/compare.py --workload shared`.", "",
             "| system | median tok/s | tok/s per round | load avg per round | p50 latency s | notes |",
             "|---|---|---|---|---|---|"]
    for key, name in NAMES.items():
        if key in notes and not runs.get(key):
            lines.append(f"| ({key}) {name} | skipped | | | | {notes[key][:200]} |")
            continue
        if not runs.get(key):
            continue
        rs = runs[key]
        best = min(rs, key=lambda r: abs(_rate(r[0]) - med[key]))[0]
        p50 = statistics.median(best.latencies) if best.latencies else None
        extra = ", ".join(f"{k} {v}" for k, v in best.extra.items())
        lines.append(f"| ({key}) {name} | {med[key]:.1f} | {', '.join(f'{_rate(t):.1f}' for t, _ in rs)} | "
                     f"{', '.join(f'{load:.1f}' for _, load in rs)} | "
                     f"{'' if p50 is None else f'{p50:.1f}'} | {extra} |")
    lines.append("")
    for a, b, target in (("P1", "P3", 1.2), ("P1", "P2", 2.5), ("U1", "U2", 1.0)):
        if a in med and b in med:
            ratio = med[a] / med[b]
            paired = [f"{_rate(x[0]) / _rate(y[0]):.2f}" for x, y in zip(runs[a], runs[b], strict=False)]
            lines.append(f"- ({a}) / ({b}) = {ratio:.2f} (target ≥ {target}) — "
                         f"{'met' if ratio >= target * (0.97 if target == 1.0 else 1) else 'NOT met'}; "
                         f"round by round {', '.join(paired)}")
        else:
            lines.append(f"- ({a}) / ({b}): not measured")
    lines += ["- (U1) / (U2) is judged with 3 % slack (≥ 0.97 counts as met): one system's rounds differ by "
              "more than that.",
              "- tok/s: output tokens over the wall time from the first submit to the last result read back "
              "(each worker warmed with one job first; vLLM's time is its LLM.generate call, no Redis).",
              "", "![shared prefix](shared_prefix.png)"]
    return "\n".join(lines)


def plot(runs) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in NAMES if runs.get(k)]
    values = [statistics.median(_rate(t) for t, _ in runs[k]) for k in keys]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(keys) + 1.4), dpi=120)
    colors = ["#d62728" if k in ("P1", "U1") else "#7f7f7f" for k in keys]
    bars = ax.barh([f"({k}) {NAMES[k]}" for k in keys], values, color=colors)
    for bar, v in zip(bars, values, strict=True):
        ax.text(bar.get_width() + max(values) * 0.01, bar.get_y() + bar.get_height() / 2, f"{v:.0f} tok/s",
                va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(values) * 1.3)
    ax.set_xlabel("output tokens per second, median round (higher is better)")
    ax.set_title("Shared ~1,000-token instruction + short question per request")
    fig.tight_layout()
    path = os.path.join(DOCS, "shared_prefix.png")
    fig.savefig(path)
    plt.close(fig)
    return path
