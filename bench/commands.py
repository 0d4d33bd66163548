"""The subcommands of `tokenbus bench`, one function each: the flags it adds (beyond the shared model, workload,
rounds and output flags) and what it runs. Each prints one table: a row per round, then the median round."""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench.harness import Row, Timed, machine, markdown_table, p50_p99, percentile, redis_url, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM_COLUMNS = ["round", "tok/s", "requests/s", "TTFT p50 / p99 (s)", "latency p50 / p99 (s)", "steps"]


def engine_flags(ap: argparse.ArgumentParser) -> None:
    """What sizes the engine: its batch, its threads, its settings (the worker's flags spelled the same)."""
    ap.add_argument("--workload", choices=("chat", "shared"), default="chat",
                    help="chat: 64 chat prompts, outputs long-tailed 8..max; shared: one ~1,000-token instruction "
                         "shared by every request (bench/workload.py)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine setting (repeatable), e.g. overlap=true, kv_cache_dtype=int8, quantization=w8a8")


def prepared(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    """The workload's prompt ids (the model's chat template) and output lengths; sets the thread count."""
    import torch

    from bench.workload import chat_ids, shared_prefix_workload, workload
    from worker.engine import loader

    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    make = shared_prefix_workload if args.workload == "shared" else workload
    items = make(args.num_prompts, max_tokens=args.max_tokens)
    return chat_ids(loader.load_tokenizer(loader.resolve(args.model)), items), [m for _, m in items]


def system_line(label: str, t: Timed) -> str:
    return (f"| {label} | {t.tok_s:.1f} | {len(t.outputs) / t.seconds:.2f} | {p50_p99(t.ttfts)} | "
            f"{p50_p99(t.latencies)} | {t.extra.get('steps', '–')} |")


def figures(row: Row) -> dict[str, object]:
    """--json: the median round's figures at the top level (what benchmarks/harness/ab.py pairs), every round
    below them."""
    t = row.run
    return {"tok/s": t.tok_s, "requests/s": len(t.outputs) / t.seconds, "ttft_p50_s": percentile(t.ttfts, 50),
            "latency_p50_s": percentile(t.latencies, 50), "latency_p99_s": percentile(t.latencies, 99),
            "runs": row.runs}


def rounds_table(row: Row, args: argparse.Namespace, prompt_ids: list[list[int]], column: str = "",
                 cells: list[str] | None = None) -> str:
    """Every round and the median one (with `column`: one more cell per round), under a line naming the
    workload, the model and the machine."""
    runs, labels = [*row.runs, row.run], [*(str(i + 1) for i in range(len(row.runs))), "**median**"]
    extra = [f" {c} |" for c in [*cells, cells[row.runs.index(row.run)]]] if column else [""] * len(runs)
    lines = [system_line(label, t) + cell for label, t, cell in zip(labels, runs, extra, strict=True)]
    head = (f"{row.name}: {len(prompt_ids)} {args.workload} prompts ({sum(map(len, prompt_ids))} prompt tokens), "
            f"outputs up to {args.max_tokens} tokens ({row.run.tokens} in all), greedy, EOS ignored; {args.model} "
            f"fp32 on the CPU, {args.threads} torch threads, max_num_seqs {args.max_num_seqs}; {machine()}; "
            f"{time.strftime('%Y-%m-%d %H:%M')}.")
    return "\n".join([head, "", *markdown_table(SYSTEM_COLUMNS + ([column] if column else []), lines)])


def run_engine(args: argparse.Namespace) -> str:
    from bench.engine import engine_offline, engine_settings

    prompt_ids, max_tokens = prepared(args)
    settings = engine_settings(args.engine)
    row = Row("engine", "tokenbus engine, offline")
    for i in range(args.rounds):
        row.runs.append(engine_offline(prompt_ids, max_tokens, args.max_num_seqs, args.max_num_batched_tokens,
                                       args.model, **settings))
        print(f"round {i + 1}: {row.runs[-1].tok_s:.1f} tok/s", flush=True)
    write_json(args.json, figures(row))
    return rounds_table(row, args, prompt_ids)


def run_e2e(args: argparse.Namespace) -> str:
    import tempfile

    from bench.e2e import run_e2e as e2e_once
    from bench.engine import engine_settings

    prompt_ids, max_tokens = prepared(args)
    settings = engine_settings(args.engine)
    row = Row("e2e", "tokenbus end to end (producer → Redis → worker)")
    logs = tempfile.mkdtemp(prefix="bench-e2e-")
    with redis_url(args.redis_url) as url:
        for i in range(args.rounds):
            row.runs.append(e2e_once(url, prompt_ids, max_tokens, args.threads, f"{logs}/worker-{i + 1}.log",
                                     args.max_num_seqs, args.max_num_batched_tokens, model=args.model,
                                     settings=settings))
            print(f"round {i + 1}: {row.runs[-1].tok_s:.1f} tok/s (worker logs in {logs})", flush=True)
    write_json(args.json, figures(row))
    outside = [t.extra["time outside engine steps"] for t in row.runs]
    return rounds_table(row, args, prompt_ids, "time outside engine steps", outside)


def queue_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--prompt-bytes", type=int, default=200, help="bytes of each job's prompt")
    ap.add_argument("--output-tokens", type=int, default=64, help="tokens (and 4x bytes of text) in each result")
    ap.add_argument("--read-count", type=int, default=64, help="entries per READ and endings per result pipeline")


def run_queue(args: argparse.Namespace) -> str:
    from bench.queue import run

    rounds: list[list[tuple[str, dict]]] = []
    with redis_url(args.redis_url) as url:
        for i in range(args.rounds):
            rounds.append(run(url, args.jobs, args.prompt_bytes, args.read_count, args.output_tokens))
            print(f"round {i + 1}: Redis CPU {sum(ph['cpu'] for _, ph in rounds[-1]) * 1e6:.1f} µs per job's "
                  "whole life", flush=True)
    phases = {name: [dict(ph) for n, ph in (r for rnd in rounds for r in rnd) if n == name] for name, _ in rounds[0]}
    median = {name: {k: statistics.median(ph[k] for ph in runs) for k in runs[0]} for name, runs in phases.items()}
    cpu = sum(ph["cpu"] for ph in median.values())
    write_json(args.json, {"redis_cpu_us_per_job": cpu * 1e6, "jobs_per_redis_core_s": 1 / cpu,
                           "commands_per_job": sum(ph["all"] for ph in median.values()), "phases": median})
    lines, mem = [], 0.0
    for name, ph in median.items():
        mem += ph["mem"]
        lines.append(f"| {name} | {ph['cpu'] * 1e6:.1f} | {ph['all']:.2f} | {ph['scripts']:.2f} | {mem:,.0f} | "
                     f"{1e6 / ph['wall_us']:,.0f} |")
    head = (f"{args.jobs:,} jobs ({args.prompt_bytes}-byte prompts, {args.output_tokens}-token results), no model; "
            f"medians of {args.rounds} rounds; {machine()}.")
    return "\n".join([head, "", *markdown_table(
        ["phase", "Redis CPU µs / job", "commands / job", "script calls / job", "Redis bytes / job after it",
         "client jobs/s"], lines), "",
        f"One Redis core carries about {1 / cpu:,.0f} jobs/s of whole lives like these (plan for half)."])


def embed_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--threads", type=int, default=None, help="torch threads of every system (default: torch's)")
    ap.add_argument("--st-batch-sizes", default="16,32,64,128,256",
                    help="SentenceTransformer.encode's batch sizes; its best stands for it")
    ap.add_argument("--inputs-per-job", type=int, default=64, help="inputs of each end-to-end embedding job")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--systems", default="st,offline,e2e,vllm", help="which systems, comma-separated")
    ap.add_argument("--vllm-python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"))


def run_embed(args: argparse.Namespace) -> str:
    import tempfile

    import torch

    from bench import embed
    from worker.engine import loader

    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    model_dir = loader.resolve(args.model).directory
    texts = embed.inputs(args.num_prompts)
    counts = embed.token_counts(model_dir, texts, 256 if args.model == "all-minilm-l6-v2" else 512)
    systems = args.systems.split(",")
    settings = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    rows: dict[str, Row] = {key: Row(key, name) for key, name in (
        ("st", "SentenceTransformer.encode (best batch size)"), ("offline", "tokenbus engine, offline"),
        ("e2e", "tokenbus end to end (Client → Redis → worker → vectors)"), ("vllm", "vLLM CPU (LLM.embed)"))
        if key in systems}
    logs = tempfile.mkdtemp(prefix="bench-embed-")
    st_rates: dict[int, float] = {}
    with redis_url(args.redis_url) as url:
        for i in range(args.rounds):  # the systems take turns each round, so drift falls on all of them
            if "st" in rows:
                run, st_rates = embed.sentence_transformers(model_dir, texts, counts,
                                                            [int(b) for b in args.st_batch_sizes.split(",")],
                                                            args.threads)
                rows["st"].runs.append(run)
            if "offline" in rows:
                rows["offline"].runs.append(embed.offline(args.model, texts, counts, settings))
            if "e2e" in rows:
                rows["e2e"].runs.append(embed.end_to_end(url, args.model, texts, counts, args.threads,
                                                         f"{logs}/worker-{i + 1}.log", args.inputs_per_job, flags))
            if "vllm" in rows:
                got = embed.vllm(args.vllm_python, model_dir, texts, counts, args.threads)
                if isinstance(got, str):
                    rows["vllm"].note = got
                else:
                    rows["vllm"].runs.append(got)
            print(f"round {i + 1}: " + ", ".join(f"{k} {r.runs[-1].tok_s:,.0f} tok/s" for k, r in rows.items()
                                                  if r.runs), flush=True)
    base = rows["st"].tok_s if "st" in rows and rows["st"].runs else 0.0
    write_json(args.json, {k: {"tok/s": r.tok_s, "rounds": r.rates()} for k, r in rows.items()}
               | {"st_by_batch_size": st_rates})
    lines = [f"| {r.name} | {r.tok_s:,.0f} | " + (f"{r.tok_s / base:.2f}x" if base and r.runs else "–")
             + f" | {r.note or ' / '.join(f'{x:,.0f}' for x in r.rates())} |" for r in rows.values()]
    head = (f"{len(texts):,} inputs of mixed length ({sum(counts):,} tokens), {args.model} fp32 on the CPU, "
            f"{args.threads} torch threads, median of {args.rounds} rounds; e2e: {args.inputs_per_job} inputs a job; "
            f"{machine()}; {time.strftime('%Y-%m-%d %H:%M')}.")
    st_line = "SentenceTransformer by batch size: " + ", ".join(f"{b}: {v:,.0f}" for b, v in st_rates.items())
    return "\n".join([head, "", *markdown_table(["system", "tok/s", "vs SentenceTransformer", "each round"], lines),
                      "", st_line if st_rates else ""])
