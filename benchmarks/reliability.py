"""Reliability figures: real `python -m worker` processes and a real redis-server, all on 127.0.0.1, abused.

    .venv/bin/python -m benchmarks.reliability            # the full run (minutes), writes docs/reliability.md
    .venv/bin/python -m benchmarks.reliability --quick    # smaller numbers, prints the table only
    .venv/bin/python -m benchmarks.reliability --only storm,cancel --model smollm2-135m

Scenarios (each on a fresh redis-server on a free loopback port; every process it starts is killed at exit):

- storm:  two workers, at least 20 SIGKILLs (the longest-running one, 0.5-3 s after it is ready; restarted
          at once) over at least 300 jobs (waves keep the queue busy until the last kill);
- redis:  two workers while redis-server (AOF, appendfsync always) is SIGKILLed and restarted 3 times;
- bad:    1,000 bad entries of every kind issue #13 names, mixed with 1,000 good jobs;
- cancel: 200 jobs, every other one cancelled at a random moment (queued or running).

Per scenario: good jobs, finished, lost (never ended), ended twice (two events), dead-lettered, worker
restarts (kills, plus any exit the harness did not cause), RSS growth of the workers that lived through the
whole run. The default model is a tiny random-weight Llama (tests/support/tiny_models.py) so a run takes minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from producer import Client
from protocol import scripts
from protocol.models import GROUP, TERMINAL_STATUSES, Keys
from tests.support.local_redis import RedisServer

ROOT = Path(__file__).resolve().parent.parent

K = Keys("tokenbus")
WORKER_READY_S = 240.0  # model load on a busy 2-core machine
SCENARIO_TIMEOUT_S = 900.0


@dataclass
class Row:
    scenario: str
    good: int = 0
    finished: int = 0
    lost: int = 0
    twice: int = 0
    dead: int = 0
    restarts: int = 0
    rss_growth_mib: float | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


class Worker:
    """One `python -m worker` process (JSON log in a file)."""

    def __init__(self, name: str, url: str, model: str, logdir: Path, extra: list[str]) -> None:
        self.name, self.url, self.model, self.logdir, self.extra = name, url, model, logdir, extra
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.unexpected_exits = 0
        self.ready_at: float | None = None
        self.log_path: Path | None = None

    def start(self) -> None:
        self.starts += 1
        self.log_path = self.logdir / f"{self.name}-{self.starts}.log"
        env = dict(os.environ, TOKENBUS_LOG_JSON="1", TOKENBUS_DEVICE="cpu", PYTHONUNBUFFERED="1")
        args = ["--redis-url", self.url, "--model", self.model, "--worker-name", self.name, "--lease-ms", "1500",
                "--heartbeat-s", "0.5", "--max-num-seqs", "8", "--intake-lookahead", "4",
                "--max-num-batched-tokens", "512", "--kv-cache-gb", "0.1", *self.extra]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "worker", *args], cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT)
        self.ready_at = None

    def poll_ready(self) -> bool:
        if self.ready_at is None and self.log_path and '"worker_ready"' in self.log_path.read_text(errors="replace"):
            self.ready_at = time.monotonic()
        return self.ready_at is not None

    def wait_ready(self, timeout: float = WORKER_READY_S) -> None:
        deadline = time.monotonic() + timeout
        while not self.poll_ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {self.name} not ready after {timeout} s:\n{self.tail()}")
            time.sleep(0.1)

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kb / 1024

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout: float = 60) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def check_exit(self) -> None:
        """Count an exit the harness did not cause (a crash) and start it again."""
        if self.proc is not None and self.proc.poll() is not None:
            self.unexpected_exits += 1
            print(f"  ! worker {self.name} exited by itself ({self.proc.returncode}); restarting", flush=True)
            self.start()


class Harness:
    def __init__(self, model: str, quick: bool, logdir: Path, seed: int) -> None:
        self.model, self.quick, self.logdir = model, quick, logdir
        self.rng = random.Random(seed)
        self.workers: list[Worker] = []
        self.servers: list[RedisServer] = []

    # ---- helpers ------------------------------------------------------------------------------------

    def server(self, appendonly: bool = False) -> RedisServer:
        srv = RedisServer(appendonly=appendonly).start()
        self.servers.append(srv)
        return srv

    def worker(self, name: str, url: str, *extra: str) -> Worker:
        w = Worker(name, url, self.model, self.logdir, list(extra))
        self.workers.append(w)
        w.start()
        return w

    def cleanup(self) -> None:
        for w in self.workers:
            w.kill()
        for srv in self.servers:
            srv.cleanup()
        self.workers, self.servers = [], []

    def good_requests(self, n: int, lo: int = 8, hi: int = 48, tag: str = "good") -> list[dict]:
        return [{"prompt": f"{tag} {i}: tell me about the number {self.rng.randint(0, 10**6)}",
                 "max_tokens": self.rng.randint(lo, hi), "ignore_eos": True, "temperature": 0.7}
                for i in range(n)]

    @staticmethod
    def wait_all(client: Client, ids: list[str], timeout: float, tick=None) -> None:
        deadline = time.monotonic() + timeout
        pending = set(ids)
        while pending and time.monotonic() < deadline:
            if tick is not None:
                tick()
            pending_list = list(pending)
            for jid, job in zip(pending_list, client.get_many(pending_list), strict=True):
                if job is not None and job.status in TERMINAL_STATUSES:
                    pending.discard(jid)
            time.sleep(0.5)

    @staticmethod
    def tally(row: Row, client: Client, good: list[str], expect: str = "finished") -> dict[str, int]:
        r = client.redis
        events = Counter(f["job_id"] for _id, f in r.xrange(K.events))
        dead = {f["job_id"] for _id, f in r.xrange(K.dead)}
        jobs = client.get_many(good)
        statuses = Counter(j.status.value if j is not None else "missing" for j in jobs)
        row.good = len(good)
        row.finished = statuses.get(expect, 0)
        row.lost = sum(1 for j in jobs if j is None or j.status not in TERMINAL_STATUSES)
        row.twice = sum(1 for jid in good if events[jid] > 1)
        row.dead = sum(1 for jid in good if jid in dead)
        failed = statuses.get("failed", 0)
        if failed:
            codes = Counter(j.error_code for j in jobs if j is not None and j.status.value == "failed")
            row.notes.append(f"good jobs failed: {dict(codes)}")
        return dict(statuses)

    @staticmethod
    def queue_drained(client: Client, timeout: float = 30) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if scripts.queue_totals(client.redis, K) == (0, 0):
                return True
            time.sleep(0.2)
        return False

    # ---- scenarios ----------------------------------------------------------------------------------

    def storm(self) -> Row:
        kills_wanted, min_jobs = (6, 100) if self.quick else (20, 300)
        row = Row(f"SIGKILL storm: {kills_wanted} kills, 2 workers")
        srv = self.server()
        client = Client(srv.url)
        # max_attempts 10: a job can meet several kills; the point is that none is lost or ended twice
        ws = [self.worker(f"storm-{i}", srv.url, "--max-attempts", "10") for i in range(2)]
        good = client.submit_many(self.good_requests(120, 16, 96, "storm"))
        for w in ws:
            w.wait_ready()
        started, kills = time.monotonic(), 0
        while kills < kills_wanted:
            assert time.monotonic() - started < SCENARIO_TIMEOUT_S, "storm timed out"
            for w in ws:
                w.check_exit()
                w.poll_ready()
            if scripts.queue_depth(client.redis, K) < 40 or len(good) < min_jobs:  # keep the workers busy
                good += client.submit_many(self.good_requests(60, 16, 96, "storm"))
            ready = [w for w in ws if w.alive() and w.ready_at is not None]
            if not ready:
                time.sleep(0.1)
                continue
            victim = min(ready, key=lambda w: w.ready_at)
            if time.monotonic() - victim.ready_at < self.rng.uniform(0.5, 3.0):
                time.sleep(0.05)
                continue
            running = sum(1 for j in client.get_many(good) if j and j.status.value == "running")
            victim.kill()
            kills += 1
            print(f"  kill {kills}/{kills_wanted}: {victim.name} (jobs running ~{running})", flush=True)
            victim.start()
        self.wait_all(client, good, SCENARIO_TIMEOUT_S, tick=lambda: [w.check_exit() for w in ws])
        self.tally(row, client, good)
        row.restarts = kills + sum(w.unexpected_exits for w in ws)
        row.notes.append(f"{kills} SIGKILLs; max_attempts 10")
        if row.dead:
            row.notes.append(
                "every SIGKILL costs each job its victim held one attempt, and the next worker reclaims those "
                "entries before any new one; killed 0.5-3 s after each restart, the same jobs (two workers' worth) "
                "were in flight at kill after kill until they reached max_attempts: failed `max_attempts` and "
                "dead-lettered by design (a job that keeps taking workers down must stop), none lost or run twice")
        if not self.queue_drained(client):
            row.notes.append("queue NOT drained")
        row.seconds = time.monotonic() - started
        for w in ws:
            w.stop()
        return row

    def redis_kills(self) -> Row:
        row = Row("Redis SIGKILL + AOF restart x3")
        n = 150 if self.quick else 300
        srv = self.server(appendonly=True)
        client = Client(srv.url)
        ws = [self.worker(f"aof-{i}", srv.url) for i in range(2)]
        for w in ws:
            w.wait_ready()
        rss0 = [w.rss_mib() for w in ws]
        started = time.monotonic()
        good = client.submit_many(self.good_requests(n, 16, 96, "aof"))
        for k in range(3):
            time.sleep(self.rng.uniform(2.0, 4.0))
            if scripts.queue_depth(client.redis, K) < 30:
                good += client.submit_many(self.good_requests(60, 16, 96, "aof"))
            srv.kill()
            down = self.rng.uniform(1.0, 3.0)  # longer than the 1.5 s lease, sometimes
            time.sleep(down)
            srv.restart()
            print(f"  redis kill {k + 1}/3, down {down:.1f} s", flush=True)
        self.wait_all(client, good, SCENARIO_TIMEOUT_S, tick=lambda: [w.check_exit() for w in ws])
        self.tally(row, client, good)
        row.restarts = sum(w.unexpected_exits for w in ws)
        row.rss_growth_mib = max(w.rss_mib() - r0 for w, r0 in zip(ws, rss0, strict=True)) if all(
            w.alive() for w in ws) else None
        if not self.queue_drained(client):
            row.notes.append("queue NOT drained")
        row.seconds = time.monotonic() - started
        for w in ws:
            w.stop()
        return row

    def bad_entries(self) -> Row:
        n_bad = n_good = 200 if self.quick else 1000
        row = Row(f"{n_bad:,} bad entries + {n_good:,} good")
        srv = self.server()
        client = Client(srv.url)
        r = client.redis
        raw = srv.client()  # bytes: for requests that are not UTF-8
        client.submit("creates the group", max_tokens=1)

        def submit_raw(job_id: str | bytes, request: str | bytes) -> None:
            scripts.script(scripts.SUBMIT_JOB)(keys=[K.job(job_id), K.queue(), K.registry("default")],
                                               args=[job_id, request, time.time(), 0, 3600, "", "", "default",
                                                     K.ns, GROUP], client=raw)

        def raw_job(template: str, request: str | bytes):
            def make(i: int) -> str:
                submit_raw(template.format(i), request)
                return template.format(i)
            return make

        def no_record(i: int) -> None:
            r.xadd(K.queue(), {"job_id": f"bad-norec-{i}", "request": '{"prompt": "x"}'})

        def not_a_hash(i: int) -> None:
            r.set(K.job(f"bad-type-{i}"), "x")
            r.xadd(K.queue(), {"job_id": f"bad-type-{i}", "request": '{"prompt": "x"}'})

        def no_job_id(i: int) -> None:
            r.xadd(K.queue(), {"garbage": str(i)})

        # each makes one bad entry and returns the id of its job record (None: no record to end)
        kinds = {
            "huge int": raw_job("bad-int-{}", '{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}"),
            "deep nesting": raw_job("bad-deep-{}", "[" * 50_000),
            "over 1 MiB": raw_job("bad-big-{}", json.dumps({"prompt": "x" * (1 << 20)})),
            "not UTF-8": raw_job("bad-utf8-{}", b'{"prompt": "\xff\xfe"}'),
            "lone surrogate": raw_job("bad-surr-{}", '{"prompt": "\\ud800"}'),
            "not JSON": raw_job("bad-json-{}", "{nope"),
            "unknown field": raw_job("bad-field-{}", '{"prompt": "x", "temprature": 1}'),
            "stop id past vocab": lambda i: client.submit("x", job_id=f"bad-stop-{i}", stop_token_ids=[10**9],
                                                          min_tokens=2, max_tokens=4),
            "prompt id past vocab": lambda i: client.submit(prompt_token_ids=[1, 10**9], job_id=f"bad-pid-{i}"),
            "wrong model": lambda i: client.submit("x", job_id=f"bad-model-{i}", model="gpt-99"),
            "invalid id": raw_job("bad id {}", '{"prompt": "x"}'),
            "id with newline": raw_job("bad-nl-{}\n", '{"prompt": "x"}'),
            "id with ':'": raw_job("bad:{}", '{"prompt": "x"}'),
            "no record": no_record,
            "record not a hash": not_a_hash,
            "no job_id": no_job_id,
        }
        names = list(kinds)
        good: list[str] = []
        bad_ids: list[str] = []
        for i in range(n_bad):
            jid = kinds[names[i % len(names)]](i)
            if jid is not None:
                bad_ids.append(jid)
            good += client.submit_many(self.good_requests(max(1, n_good // n_bad), 4, 12, "mixed"))
        ws = [self.worker(f"bad-{i}", srv.url) for i in range(2)]
        for w in ws:
            w.wait_ready()
        rss0 = [w.rss_mib() for w in ws]
        started = time.monotonic()
        self.wait_all(client, good + bad_ids, SCENARIO_TIMEOUT_S, tick=lambda: [w.check_exit() for w in ws])
        self.tally(row, client, good)
        bad_jobs = client.get_many(bad_ids)
        bad_ended = sum(1 for j in bad_jobs if j is not None and j.status.value == "failed")
        dead = r.xlen(K.dead)
        row.restarts = sum(w.unexpected_exits for w in ws)
        row.rss_growth_mib = max(w.rss_mib() - r0 for w, r0 in zip(ws, rss0, strict=True))
        row.notes.append(f"{n_bad} bad entries of {len(kinds)} kinds; {bad_ended}/{len(bad_ids)} bad jobs with a "
                         f"record ended failed with an event; {dead} dead letters")
        if not self.queue_drained(client):
            row.notes.append("queue NOT drained")
        row.seconds = time.monotonic() - started
        for w in ws:
            w.stop()
        return row

    def cancel(self) -> Row:
        n = 100 if self.quick else 200
        row = Row(f"cancel half of {n} jobs")
        srv = self.server()
        client = Client(srv.url)
        w = self.worker("cancel-0", srv.url)
        w.wait_ready()
        rss0 = w.rss_mib()
        started = time.monotonic()
        ids = client.submit_many(self.good_requests(n, 32, 240, "cancel"))
        doomed = ids[::2]
        remaining = doomed[:]
        self.rng.shuffle(remaining)
        outcome = Counter()
        while remaining:  # over the run: a running one when there is one (60 %), else any
            time.sleep(self.rng.uniform(0.05, 0.3))
            running = [j.id for j in client.get_many(remaining) if j is not None and j.status.value == "running"]
            jid = self.rng.choice(running) if running and self.rng.random() < 0.6 else remaining[0]
            remaining.remove(jid)
            outcome[client.cancel(jid)] += 1
        kept = [j for j in ids if j not in set(doomed)]
        self.wait_all(client, ids, SCENARIO_TIMEOUT_S, tick=w.check_exit)
        self.tally(row, client, kept)
        row.good = len(ids)
        jobs = {j.id: j for j in client.get_many(ids) if j is not None}
        cancelled = [jobs[j] for j in doomed if j in jobs and jobs[j].status.value == "cancelled"]
        partial = sum(1 for j in cancelled if j.result is not None and j.result.finish_reason == "abort")
        lost = sum(1 for j in ids if j not in jobs or jobs[j].status not in TERMINAL_STATUSES)
        events = Counter(f["job_id"] for _id, f in client.redis.xrange(K.events))
        row.lost = lost
        row.twice = sum(1 for j in ids if events[j] > 1)
        time.sleep(1.5)  # idle: the heartbeat must show an empty engine
        beat = json.loads(client.redis.get(K.worker("cancel-0")) or "{}")
        row.restarts = w.unexpected_exits
        row.rss_growth_mib = w.rss_mib() - rss0
        row.notes.append(f"finished {row.finished}/{len(kept)} kept; cancelled {len(cancelled)}/{len(doomed)} "
                         f"(asked: {dict(outcome)}; {partial} running ones with a partial result); idle heartbeat "
                         f"running={beat.get('running')} waiting={beat.get('waiting')}")
        row.finished = sum(1 for j in kept if j in jobs and jobs[j].status.value == "finished") + len(cancelled)
        if not self.queue_drained(client):
            row.notes.append("queue NOT drained")
        row.seconds = time.monotonic() - started
        w.stop()
        return row


def table(rows: list[Row]) -> str:
    lines = ["| scenario | good jobs | ended as asked | lost | ended twice | dead-lettered | worker restarts "
             "| RSS growth | time |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rss = "n/a (restarted)" if r.rss_growth_mib is None else f"{r.rss_growth_mib:+.0f} MiB"
        lines.append(f"| {r.scenario} | {r.good} | {r.finished} | {r.lost} | {r.twice} | {r.dead} | {r.restarts} "
                     f"| {rss} | {r.seconds:.0f} s |")
    return "\n".join(lines)


class LoadWatch:
    """The machine's 1-minute load average at the start and its peak (sampled every 5 s): the times above
    depend on what else runs there."""

    def __init__(self) -> None:
        import threading

        self.start = self.peak = os.getloadavg()[0]
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(5.0):
            self.peak = max(self.peak, os.getloadavg()[0])

    def stop(self) -> str:
        self._stop.set()
        return f"load average {self.start:.1f} at the start, {self.peak:.1f} at its peak"


def write_doc(rows: list[Row], args: argparse.Namespace, total_s: float, load: str) -> Path:
    notes = "\n".join(f"- **{r.scenario}**: " + "; ".join(r.notes) for r in rows if r.notes)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    doc = f"""# Reliability

Measured by `benchmarks/reliability.py` (model `{args.model_label}`, seed {args.seed}) on {time.strftime('%Y-%m-%d')},
{os.cpu_count()} cores ({cpu}; {load}); {total_s / 60:.1f} minutes in all. Everything runs on 127.0.0.1: a fresh
redis-server per scenario and real `python -m worker` processes (max_num_seqs 8, intake_lookahead 4,
lease 1.5 s, CPU).

{table(rows)}

The bad entries are 1,000 in all, spread evenly over 16 kinds: a 5,000-digit integer, 50,000-deep nesting,
a request over 1 MiB, bytes that are not UTF-8, a lone surrogate, not JSON, an unknown field, a stop token id
and a prompt token id past the vocabulary, another model, an invalid id, an id ending in a newline, an id
with ':' (each of these three with a record), an entry without a record, a record key that is not a hash,
and an entry without `job_id`.

- *good jobs*: valid jobs submitted by the Python client (the cancel row: all 200, half of them cancelled);
  *ended as asked*: finished (cancel row: finished if kept, cancelled if cancelled);
  *lost*: never reached a final status; *ended twice*: more than one event in `{{ns}}:events`;
  *dead-lettered*: good jobs in `{{ns}}:dead`; *worker restarts*: SIGKILLs by the harness plus any exit it
  did not cause; *RSS growth*: of the workers that ran the whole scenario, from ready to the end.

{notes}

Reproduce: `.venv/bin/python -m benchmarks.reliability` (`--quick` for a smaller run that writes nothing).
"""
    out = ROOT / "docs" / "reliability.md"
    out.write_text(doc)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller numbers; prints the table, writes no doc")
    p.add_argument("--model", default="", help="worker model (default: a tiny random-weight Llama, built once)")
    p.add_argument("--only", default="storm,redis,bad,cancel", help="comma-separated scenarios")
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--no-doc", action="store_true", help="do not write docs/reliability.md")
    args = p.parse_args(argv)
    logdir = Path(tempfile.mkdtemp(prefix="tokenbus-reliability-"))
    if not args.model:
        from tests.support.tiny_models import make_tiny_model

        cache = Path(os.environ.get("TOKENBUS_CACHE_DIR") or Path.home() / ".cache" / "tokenbus")
        args.model = make_tiny_model(str(cache / "reliability-tiny-llama"), "llama", rope_scaling=None)
        args.model_label = "tiny random-weight Llama (2 layers, SmolLM2 tokenizer)"
    else:
        args.model_label = args.model
    harness = Harness(args.model, args.quick, logdir, args.seed)
    scenarios = {"storm": harness.storm, "redis": harness.redis_kills, "bad": harness.bad_entries,
                 "cancel": harness.cancel}
    rows: list[Row] = []
    started = time.monotonic()
    load = LoadWatch()
    print(f"logs in {logdir}", flush=True)
    try:
        for name in args.only.split(","):
            print(f"== {name}", flush=True)
            try:
                rows.append(scenarios[name]())
            finally:
                harness.cleanup()
            print(table(rows[-1:]), "\n  " + "\n  ".join(rows[-1].notes), flush=True)
    finally:
        harness.cleanup()
    total = time.monotonic() - started
    print("\n" + table(rows))
    if not args.quick and not args.no_doc:
        print(f"wrote {write_doc(rows, args, total, load.stop())}")
    bad = any(r.lost or r.twice for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
