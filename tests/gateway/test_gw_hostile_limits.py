"""Issue #34, per-key limits that could be walked around: simultaneous batch creates against the queued-requests
quota (5), a completion that times out (6), and a key's first call against max_tokens_per_key (13). A second
`gateway serve` on the light stack's Redis with tight limits (the light stack's own keep their defaults)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from protocol import scripts
from protocol.keys import Keys
from testbed.gateway_procs import KEYS, Proc, healthy
from testbed.light_gateway import LightStack, chat_line, wait_until, write_jsonl
from testbed.redis_server import free_port

TIGHT = {"TOKENBUS_GATEWAY_MAX_QUEUED_REQUESTS_PER_KEY": "10", "TOKENBUS_GATEWAY_MAX_REQUESTS_PER_KEY": "2",
         "TOKENBUS_GATEWAY_COMPLETION_TIMEOUT_S": "1.5", "TOKENBUS_GATEWAY_MAX_TOKENS_PER_KEY": "10000"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


@pytest.fixture
def tight(light_stack: LightStack, tmp_path) -> Iterator[str]:
    """The base URL of a gateway with TIGHT limits beside the light stack's."""
    port = free_port()
    proc = Proc("gateway-tight", ["-m", "gateway", "serve"],
                dict(light_stack.env, TOKENBUS_GATEWAY_PORT=str(port), **TIGHT), tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(url), 60, "the tight gateway's /healthz", [proc], every=0.1)
        yield url
    finally:
        proc.stop()


def _client(url: str, who: str = "carol") -> httpx.Client:
    return httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEYS[who]}"}, timeout=30)


def test_simultaneous_creates_cannot_pass_the_queued_requests_quota_together(light_stack, tight, tmp_path):
    src = write_jsonl(tmp_path / "five.jsonl", [chat_line(f"q{i}", "Hi") for i in range(5)])
    with _client(tight) as c:
        fid = c.post("/v1/files", files={"file": src.open("rb")}, data={"purpose": "batch"}).json()["id"]

    def create(_: int) -> httpx.Response:
        with _client(tight) as c:
            return c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h"})

    # The submit task paused: a batch it ended meanwhile (queue_full behind earlier tests' jobs on this shared
    # stack) would rightly free its room and let a third through, as one full CI run saw.
    light_stack.pause("tasks")
    # Redis frozen while the 24 arrive: once it thaws, their reads are all answered before any of their writes
    # (what a loaded Redis does to a check made apart from its write)
    os.kill(light_stack.redis.proc.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(24) as pool:
            pending = [pool.submit(create, i) for i in range(24)]
            time.sleep(1.5)
            os.kill(light_stack.redis.proc.pid, signal.SIGCONT)
            answers = [p.result() for p in pending]
    finally:
        os.kill(light_stack.redis.proc.pid, signal.SIGCONT)
        light_stack.resume("tasks")
    admitted = [a.json()["id"] for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert len(admitted) == 2 and len(refused) == 22, [a.status_code for a in answers]  # 2 x 5 = the limit 10
    assert all(a.json()["error"]["code"] == "quota_exceeded" for a in refused)
    with _client(tight) as c:
        for bid in admitted:
            c.post(f"/v1/batches/{bid}/cancel")


def _key_jobs(r, job_ids: list[str]) -> dict[str, str]:
    return {j: r.hget(Keys("tokenbus").job(j), "status") for j in job_ids}


def test_a_timed_out_completion_cancels_its_job_and_holds_its_slot_until_it_ended(light_stack, tight):
    r = light_stack.r()
    ids: list[str] = []
    with _client(tight) as c:
        for _ in range(3):  # on the old code each left its job queued: 3 jobs against a limit of 2
            resp = c.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 504 and "cancelled" in resp.json()["error"]["message"], resp.text
            ids.append(resp.headers["x-tokenbus-job-id"])
        assert set(_key_jobs(r, ids).values()) == {"cancelled"}, _key_jobs(r, ids)

        # A job a worker is running when its call times out is only `cancelling`: its slot stays taken.
        started = threading.Event()
        running: list[str] = []

        def start_when_queued() -> None:
            keys = Keys("tokenbus")
            while not started.is_set():
                for k in r.scan_iter(keys.job("*"), count=1000):
                    if r.hget(k, "status") == "queued" and k.rsplit(":", 1)[-1] not in ids and "-" not in k:
                        job_id = k.rsplit(":", 1)[-1]
                        entry, queue = r.hmget(k, "entry_id", "queue")
                        scripts.start_job(r, keys, job_id, entry, "test-worker", queue=queue)
                        running.append(job_id)
                        started.set()
                        return
                time.sleep(0.02)

        t = threading.Thread(target=start_when_queued, daemon=True)
        t.start()
        first = c.post("/v1/chat/completions", json=CHAT)
        t.join(5)
        assert first.status_code == 504 and running == [first.headers["x-tokenbus-job-id"]]
        assert r.hget(Keys("tokenbus").job(running[0]), "status") == "running"  # cancel asked, the worker runs on

        with ThreadPoolExecutor(2) as pool:  # slot 2 is free, slot 1 is still the running job's
            answers = list(pool.map(lambda _: c.post("/v1/chat/completions", json=CHAT), range(2)))
        codes = sorted(a.status_code for a in answers)
        assert codes == [429, 504], codes
        # The worker stops the job: the slot comes back (the canceller polls every 0.5 s).
        keys = Keys("tokenbus")
        entry, queue = r.hmget(keys.job(running[0]), "entry_id", "queue")
        scripts.finish_job(r, keys, running[0], "cancelled", entry_id=entry, queue=queue)
        time.sleep(1.0)
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda _: c.post("/v1/chat/completions", json=CHAT), range(2)))
        assert sorted(a.status_code for a in answers) == [504, 504], [a.text for a in answers]


def test_a_keys_first_call_is_checked_against_max_tokens_per_key(light_stack, tight):
    r = light_stack.r()
    before = len(r.keys("{tokenbus}:job:*"))
    with _client(tight, "bob") as c:  # bob has nothing in flight: his first call
        resp = c.post("/v1/chat/completions", json=CHAT | {"max_tokens": 4096, "n": 3})  # 12,288 > 10,000
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["code"] == "tokens_per_key_exceeded" and "max_tokens_per_key = 10000" in error["message"]
    assert len(r.keys("{tokenbus}:job:*")) == before, "nothing was queued"
