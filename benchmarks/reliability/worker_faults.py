"""Reliability figures: real `python -m worker` processes and a real redis-server, all on 127.0.0.1, abused.

    .venv/bin/python -m benchmarks.reliability.worker_faults          # the full run (minutes); docs/reliability.md
    .venv/bin/python -m benchmarks.reliability.worker_faults --quick  # smaller numbers, prints the table only
    .venv/bin/python -m benchmarks.reliability.worker_faults --only storm,cancel --model smollm2-135m

Scenarios (each on a fresh redis-server on a free loopback port; every process it starts is killed at exit):

- storm:  two workers, at least 20 SIGKILLs (the longest-running one, 0.5-3 s after it is ready; restarted
          at once) over at least 300 jobs (waves keep the queue busy until the last kill);
- redis:  two workers while redis-server (AOF, appendfsync always) is SIGKILLed and restarted 3 times;
- bad:    1,000 bad entries of every kind issue #13 names, mixed with 1,000 good jobs;
- cancel: 200 jobs, every other one cancelled at a random moment (queued or running).

Per scenario: good jobs, finished, lost (never ended), ended twice (two events), dead-lettered, worker
restarts (kills, plus any exit the harness did not cause), RSS growth of the workers that lived through the
whole run. The default model is a tiny random-weight Llama (testbed/tiny_models.py) so a run takes minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.harness import parser
from benchmarks.reliability.harness import ROOT, SCENARIO_TIMEOUT_S, Harness, K, LoadWatch, Row, table
from producer import Client
from protocol import scripts
from protocol.models import GROUP, TERMINAL_STATUSES


class Scenarios(Harness):
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
        row.restarts = kills
        self.settle(row, client, good, ws)
        row.notes.append(f"{kills} SIGKILLs; max_attempts 10")
        if row.dead:
            row.notes.append(
                "every SIGKILL costs each job its victim held one attempt, and the next worker reclaims those "
                "entries before any new one; killed 0.5-3 s after each restart, the same jobs (two workers' worth) "
                "were in flight at kill after kill until they reached max_attempts: failed `max_attempts` and "
                "dead-lettered by design (a job that keeps taking workers down must stop), none lost or run twice")
        self.close(row, client, ws, started)
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
        self.settle(row, client, good, ws)
        self.close(row, client, ws, started, rss0)
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
                                                     K.layout, GROUP], client=raw)

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
        self.settle(row, client, good, ws, wait_for=good + bad_ids)
        bad_jobs = client.get_many(bad_ids)
        bad_ended = sum(1 for j in bad_jobs if j is not None and j.status.value == "failed")
        dead = r.xlen(K.dead)
        row.notes.append(f"{n_bad} bad entries of {len(kinds)} kinds; {bad_ended}/{len(bad_ids)} bad jobs with a "
                         f"record ended failed with an event; {dead} dead letters")
        self.close(row, client, ws, started, rss0)
        return row

    def cancel(self) -> Row:
        n = 100 if self.quick else 200
        row = Row(f"cancel half of {n} jobs")
        srv = self.server()
        client = Client(srv.url)
        w = self.worker("cancel-0", srv.url)
        w.wait_ready()
        rss0 = [w.rss_mib()]
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
        self.settle(row, client, kept, [w], wait_for=ids)
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
        row.notes.append(f"finished {row.finished}/{len(kept)} kept; cancelled {len(cancelled)}/{len(doomed)} "
                         f"(asked: {dict(outcome)}; {partial} running ones with a partial result); idle heartbeat "
                         f"running={beat.get('running')} waiting={beat.get('waiting')}")
        row.finished = sum(1 for j in kept if j in jobs and jobs[j].status.value == "finished") + len(cancelled)
        self.close(row, client, [w], started, rss0)
        return row


def write_doc(rows: list[Row], args: argparse.Namespace, total_s: float, load: str) -> Path:
    notes = "\n".join(f"- **{r.scenario}**: " + "; ".join(r.notes) for r in rows if r.notes)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    doc = f"""# Reliability

Measured by `benchmarks/reliability/worker_faults.py` (model `{args.model_label}`, seed {args.seed}) on
{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores ({cpu}; {load}); {total_s / 60:.1f} minutes in all. Everything
runs on 127.0.0.1: a fresh redis-server per scenario and real `python -m worker` processes (max_num_seqs 8,
intake_lookahead 4, lease 1.5 s, CPU).

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

Reproduce: `.venv/bin/python -m benchmarks.reliability.worker_faults` (`--quick` for a smaller run that writes nothing).
"""
    out = ROOT / "docs" / "reliability.md"
    out.write_text(doc)
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, model="", docs=True)  # --model "": a tiny random-weight Llama, built once
    p.add_argument("--quick", action="store_true", help="smaller numbers; prints the table, writes no doc")
    p.add_argument("--only", default="storm,redis,bad,cancel", help="comma-separated scenarios")
    p.add_argument("--seed", type=int, default=13)
    args = p.parse_args(argv)
    logdir = Path(tempfile.mkdtemp(prefix="tokenbus-reliability-"))
    if not args.model:
        from testbed.tiny_models import make_tiny_model

        cache = Path(os.environ.get("TOKENBUS_CACHE_DIR") or Path.home() / ".cache" / "tokenbus")
        args.model = make_tiny_model(str(cache / "reliability-tiny-llama"), "llama", rope_scaling=None)
        args.model_label = "tiny random-weight Llama (2 layers, SmolLM2 tokenizer)"
    else:
        args.model_label = args.model
    harness = Scenarios(args.model, args.quick, logdir, args.seed)
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
    if not args.quick and not args.no_write:
        print(f"wrote {write_doc(rows, args, total, load.stop())}")
    bad = any(r.lost or r.twice for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
