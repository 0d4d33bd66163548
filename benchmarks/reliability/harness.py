"""The reliability harness (benchmarks/reliability/worker_faults.py runs its scenarios on it): real `python -m worker`
processes, throwaway redis-servers on loopback ports, and the per-scenario tally of what happened to the jobs."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from producer import Client
from protocol import scripts
from protocol.keys import Keys
from protocol.models import TERMINAL_STATUSES
from testbed.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]

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

    def settle(self, row: Row, client: Client, good: list[str], ws: list[Worker],
               wait_for: list[str] | None = None) -> None:
        """Wait for every job of the scenario (restarting a worker that crashed), then count the good ones."""
        self.wait_all(client, wait_for or good, SCENARIO_TIMEOUT_S, tick=lambda: [w.check_exit() for w in ws])
        self.tally(row, client, good)
        row.restarts += sum(w.unexpected_exits for w in ws)

    @staticmethod
    def close(row: Row, client: Client, ws: list[Worker], started: float,
              rss_at_ready: list[float] | None = None) -> None:
        """A scenario's end: RSS growth (of workers that lived through it), a drained queue, time; stop all."""
        if rss_at_ready is not None and all(w.alive() for w in ws):
            row.rss_growth_mib = max(w.rss_mib() - r0 for w, r0 in zip(ws, rss_at_ready, strict=True))
        if not Harness.queue_drained(client):
            row.notes.append("queue NOT drained")
        row.seconds = time.monotonic() - started
        for w in ws:
            w.stop()


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
