"""Where the end-to-end time goes, in two trees side by side: engine steps or the serve path around them.

    .venv/bin/python -m benchmarks.e2e.serve_split BASE_REV [--rounds 2] [--num-prompts 32] [--tiny]

Wall-clock tok/s on a shared machine swings with its load; this splits each end-to-end run (producer -> Redis ->
`python -m worker` -> results, as bench_ab's) into what the load does not change in kind. The worker runs under a
small wrapper that times Engine.step and, between two signals the client sends around the measured window
(submit of the first job to the last result), reads every thread's CPU time from /proc (schedstat). It reports
the engine steps taken and their wall time, the main thread's CPU outside the steps (the serve loop), the CPU of
the intake, writer and housekeeper threads, Redis's CPU (INFO) and the client's. A serve-path regression shows
as more CPU per job outside the steps; equal step counts with slower steps point at the engine or the machine.
--tiny serves a tiny random-weight Llama (testbed/tiny_models.py) on random 24-token prompts, 8 tokens
each, so the serve path's share is far larger than with a real model. Writes the section "serve_split" of
docs/benchmarks.md unless --no-write.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import cpu_name, parser
from bench.workload import chat_ids, workload
from benchmarks.harness.docs import publish

ROOT = Path(__file__).resolve().parents[2]

# The worker under accounting: SIGUSR1 opens the window, SIGUSR2 closes it and writes $SPLIT_OUT.
WORKER = """
import json, os, runpy, signal, threading, time
from worker.engine import engine as E
acc = {"step_wall": 0.0, "step_cpu": 0.0, "steps": 0}
step = E.Engine.step
def timed(self, *a, **k):
    c, w = time.thread_time(), time.perf_counter()
    try:
        return step(self, *a, **k)
    finally:
        acc["step_cpu"] += time.thread_time() - c; acc["step_wall"] += time.perf_counter() - w; acc["steps"] += 1
E.Engine.step = timed
def snap():
    names, cpu = {t.native_id: t.name for t in threading.enumerate()}, {}
    for tid in os.listdir("/proc/self/task"):
        try:
            ns = int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0])
        except OSError:
            continue
        name = names.get(int(tid), "native")  # torch's and OpenMP's threads
        cpu[name] = cpu.get(name, 0.0) + ns / 1e9
    return {"cpu": cpu, **acc}
marks = {}
def opened(*_): marks["a"] = snap()
def closed(*_):
    a, b = marks["a"], snap()
    out = {k: b[k] - a[k] for k in acc}
    out["cpu"] = {n: v - a["cpu"].get(n, 0.0) for n, v in b["cpu"].items()}
    open(os.environ["SPLIT_OUT"], "w").write(json.dumps(out))
signal.signal(signal.SIGUSR1, opened); signal.signal(signal.SIGUSR2, closed)
runpy.run_module("worker", run_name="__main__", alter_sys=True)
"""

CLIENT = """
import json, os, signal, subprocess, sys, time
import redis
from producer import Client
w = json.load(open(sys.argv[1])); url, model, wrapper, out = sys.argv[2:6]; ns = "split-" + str(os.getpid())
env = dict(os.environ, PYTHONPATH=os.getcwd(), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", SPLIT_OUT=out)
worker = subprocess.Popen([sys.executable, wrapper, "--redis-url", url, "--namespace", ns, "--model", model,
    "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "64", "--max-num-batched-tokens", "512",
    "--heartbeat-s", "1", "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=open(out + ".err", "w"), env=env)
c, r = Client(url, namespace=ns), redis.Redis.from_url(url)
def redis_cpu():
    i = r.info("cpu"); return i["used_cpu_user"] + i["used_cpu_sys"]
try:
    warm = c.submit(prompt_token_ids=w["prompts"][0], max_tokens=2, temperature=0.0)
    while c.get(warm).status not in ("finished", "failed", "cancelled"):
        if worker.poll() is not None:
            sys.exit("worker exited: " + open(out + ".err").read()[-3000:])
        time.sleep(0.5)
    reqs = [{"prompt_token_ids": p, "max_tokens": m, "temperature": 0.0, "ignore_eos": True}
            for p, m in zip(w["prompts"], w["max_tokens"])]
    worker.send_signal(signal.SIGUSR1); time.sleep(0.2)
    r0, c0 = redis_cpu(), time.process_time()
    t = time.perf_counter(); ids = c.submit_many(reqs)
    done = {j.id: j for j in c.as_completed(ids, timeout=3600)}; s = time.perf_counter() - t
    client, redis_s = time.process_time() - c0, redis_cpu() - r0
    worker.send_signal(signal.SIGUSR2)
    for _ in range(100):
        if os.path.exists(out): break
        time.sleep(0.1)
    print(json.dumps({"seconds": s, "client_cpu": client, "redis_cpu": redis_s,
                      "tokens": [done[i].result.token_ids for i in ids]}))
finally:
    worker.terminate(); worker.wait(120); c.close()
"""

SERVE_THREADS = ("tokenbus-intake", "tokenbus-writer", "tokenbus-housekeeper")


def run_child(tree: Path, tmp: Path, wl: Path, url: str, model: str, tag: str) -> dict:
    out = tmp / f"{tag}.json"
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, str(wl), url, model, str(tmp / "split_worker.py"), str(out)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=5400,
    )
    if done.returncode != 0:
        raise RuntimeError(f"child in {tree} failed:\n{done.stderr[-3000:]}")
    res = json.loads(done.stdout.strip().splitlines()[-1])
    split = json.loads(out.read_text())
    cpu = split["cpu"]
    res.update(
        steps=split["steps"],
        step_wall=split["step_wall"],
        outside=cpu.get("MainThread", 0.0) - split["step_cpu"],
        serve_threads=sum(cpu.get(n, 0.0) for n in SERVE_THREADS),
    )
    return res


def main() -> None:
    ap = parser(__doc__, docs=True, rounds=2, prompts=32)
    ap.add_argument("base", help="git revision to compare this tree against")
    ap.add_argument("--tiny", action="store_true", help="a tiny random-weight Llama (the serve path's share grows)")
    a = ap.parse_args()
    from testbed.redis_server import RedisServer

    tmp = Path(tempfile.mkdtemp(prefix="bench-split-"))
    (tmp / "split_worker.py").write_text(WORKER)  # not worker.py: it would shadow the package
    if a.tiny:
        from testbed.tiny_models import make_tiny_model

        model = make_tiny_model(str(tmp / "tiny-llama"))
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 10000) for _ in range(24)] for _ in range(a.num_prompts)]
        max_tokens = [8] * a.num_prompts
    else:
        from worker.engine import loader

        model = "smollm2-135m"
        tokenizer = loader.load_tokenizer(loader.resolve(model))
        items = workload(a.num_prompts)
        prompts = chat_ids(tokenizer, items)
        max_tokens = [n for _, n in items]
    wl = tmp / "workload.json"
    wl.write_text(json.dumps({"prompts": prompts, "max_tokens": max_tokens}))
    base = tmp / "base"
    subprocess.run(["git", "worktree", "add", "--detach", str(base), a.base], cwd=ROOT, check=True, capture_output=True)
    trees = {f"base {a.base}": base, "this tree": ROOT}
    runs: dict[str, list[dict]] = {}
    total = sum(max_tokens)
    try:
        for r in range(a.rounds):
            for label, tree in list(trees.items()) if r % 2 == 0 else list(reversed(trees.items())):
                with RedisServer() as redis:  # one each: Redis's CPU is this run's alone
                    res = run_child(tree, tmp, wl, redis.url, model, f"r{r}-{label.split()[0]}")
                runs.setdefault(label, []).append(res)
                print(
                    f"round {r + 1} {label:16s} {total / res['seconds']:7.1f} tok/s, {res['steps']} steps, "
                    f"outside the steps {res['outside']:.3f} s, serve threads {res['serve_threads']:.3f} s, "
                    f"redis {res['redis_cpu']:.3f} s, client {res['client_cpu']:.3f} s",
                    flush=True,
                )
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    same = runs[f"base {a.base}"][0]["tokens"] == runs["this tree"][0]["tokens"]
    lines = [
        f"`python -m benchmarks.e2e.serve_split {a.base} --rounds {a.rounds} --num-prompts {a.num_prompts}"
        f"{' --tiny' if a.tiny else ''}` on {cpu_name()}: {a.num_prompts} jobs, {total} output tokens, "
        f"{'a tiny random-weight Llama' if a.tiny else model}; medians over the rounds (order alternating); "
        "CPU seconds inside the measured window; same tokens: " + ("yes" if same else "NO") + ".",
        "",
        "| tree | tok/s (wall) | engine steps | step wall s | main thread outside steps, CPU s | intake + "
        "writer + housekeeper, CPU s | Redis CPU s | client CPU s | serve path CPU per job, ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, rs in runs.items():
        med = {
            k: statistics.median(x[k] for x in rs)
            for k in ("steps", "step_wall", "outside", "serve_threads", "redis_cpu", "client_cpu")
        }
        per_job = statistics.median(
            (x["outside"] + x["serve_threads"] + x["redis_cpu"] + x["client_cpu"]) / a.num_prompts * 1000 for x in rs
        )
        rates = " / ".join(f"{total / x['seconds']:.1f}" for x in rs)
        lines.append(
            f"| {label} | {rates} | {med['steps']:.0f} | "
            f"{med['step_wall']:.2f} | {med['outside']:.3f} | {med['serve_threads']:.3f} | "
            f"{med['redis_cpu']:.3f} | {med['client_cpu']:.3f} | {per_job:.2f} |"
        )
    publish("\n".join(lines), "benchmarks.md", "serve_split", not a.no_write)


if __name__ == "__main__":
    main()
