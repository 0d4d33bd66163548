"""Two trees of tokenbus side by side in one run: the offline engine and end to end through Redis.

    .venv/bin/python -m benchmarks.harness.ab BASE_REV [--rounds 3] [--num-prompts 48] [--e2e]
    .venv/bin/python -m benchmarks.harness.ab HEAD --this-engine overlap=true --e2e   # one setting, on against off

BASE_REV (any git revision) is checked out into a temporary worktree; every round runs both trees, in
alternating order, each in a fresh child process whose imports come from its own tree (the engine through its
stable API, the client and `python -m worker` from that tree). Tokens must agree (greedy); the table gives
tok/s per round and the median ratio. Writes the section "ab" of docs/benchmarks.md unless --no-write.
--this-engine KEY=VALUE (repeatable) sets an engine setting for this tree only (offline as an Engine argument,
end to end as the worker's TOKENBUS_KEY), so with BASE_REV HEAD one tree runs against itself with and without it;
that run writes the section "ab-engine" of docs/overlap.md instead.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import cpu_name, parser
from bench.workload import chat_ids, workload
from benchmarks.harness.docs import write_section

ROOT = Path(__file__).resolve().parents[2]

OFFLINE = """
import json, sys, time
from worker import Engine, SamplingParams
w = json.load(open(sys.argv[1])); kw = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
e = Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=64, max_num_batched_tokens=512, **kw)
e.generate([w["prompts"][0]], SamplingParams(max_tokens=2, temperature=0.0))
params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in w["max_tokens"]]
t = time.perf_counter(); outs = e.generate(w["prompts"], params); s = time.perf_counter() - t
print(json.dumps({"seconds": s, "tokens": [o.token_ids for o in outs]}))
"""

E2E = """
import json, os, subprocess, sys, time
from producer import Client
w = json.load(open(sys.argv[1])); url = sys.argv[2]; ns = "ab-" + str(os.getpid())
env = dict(os.environ, PYTHONPATH=os.getcwd(), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
worker = subprocess.Popen([sys.executable, "-m", "worker", "--redis-url", url, "--namespace", ns, "--model",
    "smollm2-135m", "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "64",
    "--max-num-batched-tokens", "512", "--heartbeat-s", "1", "--log-level", "warning"],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
c = Client(url, namespace=ns)
try:
    c.wait(c.submit(prompt_token_ids=w["prompts"][0], max_tokens=2, temperature=0.0), timeout=600)
    reqs = [{"prompt_token_ids": p, "max_tokens": m, "temperature": 0.0, "ignore_eos": True}
            for p, m in zip(w["prompts"], w["max_tokens"])]
    t = time.perf_counter(); ids = c.submit_many(reqs)
    done = {j.id: j for j in c.as_completed(ids, timeout=3600)}; s = time.perf_counter() - t
    print(json.dumps({"seconds": s, "tokens": [done[i].result.token_ids for i in ids]}))
finally:
    worker.terminate(); worker.wait(60); c.close()
"""


def run_child(tree: Path, code: str, *args: str, extra_env: dict[str, str] | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               **(extra_env or {}))
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"child in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _setting(item: str) -> tuple[str, object]:
    key, sep, value = item.partition("=")
    if not sep:
        raise SystemExit(f"--this-engine wants KEY=VALUE, got {item!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main() -> None:
    ap = parser(__doc__, docs=True, rounds=3, prompts=48)
    ap.add_argument("base", help="git revision to compare this tree against")
    ap.add_argument("--e2e", action="store_true", help="also end to end through Redis (a worker per tree)")
    ap.add_argument("--this-engine", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine setting for this tree only (repeatable); VALUE is JSON, else a string")
    a = ap.parse_args()
    engine_kw = dict(_setting(item) for item in a.this_engine)
    from testbed.redis_server import RedisServer
    from worker.engine import loader

    tokenizer = loader.load_tokenizer(loader.resolve("smollm2-135m"))
    items = workload(a.num_prompts)
    prompts = chat_ids(tokenizer, items)
    max_tokens = [n for _, n in items]
    tmp = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    wl = tmp / "workload.json"
    wl.write_text(json.dumps({"prompts": prompts, "max_tokens": max_tokens}))
    same_tree = a.base == "HEAD" and bool(engine_kw)
    base = ROOT if same_tree else tmp / "base"
    if not same_tree:
        subprocess.run(["git", "worktree", "add", "--detach", str(base), a.base], cwd=ROOT, check=True,
                       capture_output=True)
    this = "this tree" + "".join(f" {k}={json.dumps(v)}" for k, v in engine_kw.items())
    trees = {("this tree, default" if same_tree else f"base {a.base}"): base, this: ROOT}
    kinds = [("offline", OFFLINE)] + ([("e2e", E2E)] if a.e2e else [])
    results: dict[tuple[str, str], list[float]] = {}
    tokens: dict[tuple[str, str], list] = {}
    total = sum(max_tokens)
    try:
        with RedisServer() as redis:
            for r in range(a.rounds):
                order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))
                for kind, code in kinds:
                    for label, tree in order:
                        mine = label == this and bool(engine_kw)
                        args = [redis.url] if kind == "e2e" else ([json.dumps(engine_kw)] if mine else [])
                        env = {f"TOKENBUS_{k.upper()}": v if isinstance(v, str) else json.dumps(v)
                               for k, v in engine_kw.items()} if mine and kind == "e2e" else None
                        out = run_child(tree, code, str(wl), *args, extra_env=env)
                        results.setdefault((kind, label), []).append(total / out["seconds"])
                        tokens.setdefault((kind, label), out["tokens"])
                        assert tokens[(kind, label)] == out["tokens"], f"{label} {kind}: tokens changed between rounds"
                        print(f"round {r + 1} {kind:8s} {label:24s} {total / out['seconds']:7.1f} tok/s", flush=True)
    finally:
        if not same_tree:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    labels = list(trees)
    flags = "".join(f" --this-engine {item}" for item in a.this_engine)
    lines = [f"`python -m benchmarks.harness.ab {a.base}{flags} --rounds {a.rounds} --num-prompts {a.num_prompts}"
             f"{' --e2e' if a.e2e else ''}` on {cpu_name()}: {a.num_prompts} prompts, {total} output tokens, greedy, "
             "each tree in its own process, order alternating by round.", "",
             "| run | " + " | ".join(labels) + " | ratio (this / base), median | same tokens |",
             "|---|" + "---|" * (len(labels) + 2)]
    for kind, _ in kinds:
        per = [results[(kind, label)] for label in labels]
        ratios = [t / b for b, t in zip(per[0], per[1], strict=True)]
        same = tokens[(kind, labels[0])] == tokens[(kind, labels[1])]
        cells = [" / ".join(f"{v:.1f}" for v in vals) + " tok/s" for vals in per]
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {statistics.median(ratios):.3f} "
                     f"({', '.join(f'{x:.2f}' for x in ratios)}) | {'yes' if same else 'NO'} |")
    print("\n".join(lines))
    if not a.no_write:
        if same_tree:  # the one setting's own page: overlap's is docs/overlap.md
            write_section("overlap.md", "ab-engine", "\n".join(lines[2:]))
        else:
            write_section("benchmarks.md", "ab", "\n".join(lines))


if __name__ == "__main__":
    main()
