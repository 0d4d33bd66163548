"""The scale events of deploy/kubernetes/, with real processes and no cluster: 200 jobs wait with no worker and
the scaler's metric shows 200 (read from a real `tokenbus exporter` and summed as the ScaledObject's query sums
it); two workers start (scale-up); one gets SIGTERM mid-run (scale-down). Every job ends once, the metric
returns to 0, and while they run the intake cap keeps the backlog in the queue where the scaler sees it."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

from protocol import scripts
from protocol.keys import Keys
from testbed.polling import until
from tests.support.kubernetes import find, render
from tests.support.worker_runs import worker_args

ROOT = Path(__file__).resolve().parents[2]
K = Keys("tokenbus")
JOBS = 200
SEATS, LOOKAHEAD, MAX_WAITING = 4, 8, 1  # worker_args' 4 seats; without the cap a worker would hold 4 + 8
SAMPLE = re.compile(r'^(\w+)\{model="((?:[^"\\]|\\.)*)",priority="(\w+)"\} (\d+)$', re.M)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Exporter:
    """`tokenbus exporter` as a real process; `value(query)` sums what a ScaledObject's query sums."""

    def __init__(self, url: str, model: str) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen([sys.executable, "-c", "from producer.cli import main; raise SystemExit(main())",
                                      "--url", url, "exporter", "--model", model, "--port", str(self.port)],
                                     cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        until(lambda: self._scrape() is not None, 30, "the exporter to serve")

    def _scrape(self) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as reply:
                return reply.read().decode()
        except OSError:
            assert self.proc.poll() is None, f"the exporter exited: {self.proc.stderr.read().decode()}"
            return None

    def value(self, query: str) -> int:
        """The query's value: every sample of the metrics it names, for the model it selects, summed over
        priorities (one exporter: its max over exporters is the sample itself)."""
        names, (model,) = set(re.findall(r"(\w+)\{", query)), set(re.findall(r'model="([^"]*)"', query))
        text = self._scrape()
        assert text is not None
        return sum(int(n) for name, m, _p, n in SAMPLE.findall(text) if name in names and m == model)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(10) == 0


def _scaling_query(model: str) -> tuple[str, str, str]:
    """The ScaledObject's query (waiting + pending) and its two halves, each with `model` as the model."""
    (scaled, *_) = find(render("external-redis"), "ScaledObject")
    query = scaled["spec"]["triggers"][0]["metadata"]["query"]
    query = re.sub(r'model="[^"]*"', f'model="{model}"', query)
    return query, re.sub(r"\+ \w+\{[^}]*\}", "", query), re.sub(r"\w+\{[^}]*\} \+", "", query)


def test_zero_workers_then_two_then_one_drains(redis_server, serve_model_dir, worker_process, make_client):
    client = make_client()
    ids = client.submit_many([{"prompt": f"scale {i}", "max_tokens": 12, "ignore_eos": True, "temperature": 0.0}
                              for i in range(JOBS)])
    query, waiting, pending = _scaling_query(serve_model_dir)
    exporter = Exporter(redis_server.url, serve_model_dir)
    # 0 workers: every job waits, and the scaler's metric says so (the depth counter agrees)
    assert exporter.value(query) == exporter.value(waiting) == JOBS == client.info().waiting

    args = ("--intake-lookahead", str(LOOKAHEAD), "--intake-max-waiting", str(MAX_WAITING), "--drain-grace-s", "1")
    workers = [worker_process(*worker_args(redis_server.url, serve_model_dir, f"k8s-{i}", *args)) for i in (0, 1)]
    held: list[int] = []
    sampling = threading.Event()

    def sample() -> None:  # jobs held by the workers, as the scaler's metric sees them
        while not sampling.is_set():
            held.append(exporter.value(pending))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for w in workers:
        w.wait_for_event("job_finished", timeout=45, count=5)  # both are serving
    assert sum(j.status == "finished" for j in client.get_many(ids)) < JOBS, "SIGTERM must land mid-run"
    sampling.set()  # (a drained worker's handed-back jobs stay pending until the other one claims them)
    sampler.join(5)
    workers[0].proc.send_signal(signal.SIGTERM)  # the autoscaler removes one
    assert workers[0].wait(20) == 0
    events = [e["event"] for e in workers[0].events()]
    assert "drain_started" in events and events[-1] == "worker_stopped"

    jobs = {j.id: j for j in client.as_completed(ids, timeout=45)}
    assert all(j.status == "finished" for j in jobs.values()), [j.error for j in jobs.values() if j.error]
    assert Counter(f["job_id"] for _id, f in client.redis.xrange(K.events)) == Counter(ids), "each ended once"
    assert {j.worker for j in jobs.values()} == {"k8s-0", "k8s-1"}
    assert exporter.value(query) == 0 and scripts.queue_totals(redis_server.client(), K) == (0, 0)
    # intake_max_waiting: a worker holds its running jobs plus at most MAX_WAITING (+ the odd result being
    # written); without it, up to SEATS + LOOKAHEAD each
    print("peak held", max(held))
    assert held and max(held) <= 2 * (SEATS + MAX_WAITING) + 2 < 2 * (SEATS + LOOKAHEAD), max(held)
    exporter.stop()
    workers[1].proc.send_signal(signal.SIGTERM)
    assert workers[1].wait(20) == 0
