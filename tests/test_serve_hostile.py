"""Hostile jobs against a real worker (issue #13): in-process Server threads with a tiny real Engine on a
real redis-server, and `python -m worker` processes. Each bad job must end alone, with a final status and
an event, without costing its neighbours anything."""

from __future__ import annotations

import json
import time
from collections import Counter

from producer import Client, scripts
from producer.protocol import GROUP, Keys

K = Keys("tokenbus")


def submit_raw(r, job_id: str | bytes, request: str | bytes, ttl: int = 600) -> None:
    """A record + entry as a client in another language might write them: no validation at all."""
    code, _ = scripts.script(scripts.SUBMIT_JOB)(keys=[K.job(job_id), K.jobs],
                                                 args=[job_id, request, time.time(), 0, ttl, "", ""], client=r)
    assert int(code) == 1


def events_per_job(r) -> Counter:
    return Counter(f[b"job_id"].decode("utf-8", "replace") for _id, f in r.xrange(K.events))


def dead_letters(r) -> dict[str, str]:
    return {f[b"job_id"].decode("utf-8", "replace"): f[b"reason"].decode() for _id, f in r.xrange(K.dead)}


def assert_queue_empty(r, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while r.xlen(K.jobs) or r.xpending(K.jobs, GROUP)["pending"]:
        assert time.monotonic() < deadline, (r.xlen(K.jobs), r.xpending(K.jobs, GROUP))
        time.sleep(0.05)


def test_undecodable_entries_fail_alone_and_never_wedge_a_read(serve_engine, serve, redis_server):
    r = redis_server.client()
    client = Client(redis_server.url)
    client.submit("creates the group", max_tokens=1)
    bad = {
        "huge-int": ('{"prompt": "hi", "max_tokens": ' + "1" * 5000 + "}", "Exceeds the limit (4300 digits)"),
        "deep": ("[" * 100_000, "nested too deeply"),
        "too-big": (json.dumps({"prompt": "x" * (1 << 20)}), "more than the limit of 1048576"),
        "surrogate": ('{"prompt": "\\ud800"}', "lone surrogate"),
        "not-utf8": (b'{"prompt": "caf\xe9 \xff"}', "not valid UTF-8"),
        "has space": (json.dumps({"prompt": "hi"}), "malformed entry: job_id 'has space'"),
        "newline\n": (json.dumps({"prompt": "hi"}), "malformed entry: job_id 'newline\\n'"),
    }
    good = []
    for i, (job_id, (raw, _)) in enumerate(bad.items()):
        submit_raw(r, job_id, raw)
        good.append(client.submit(f"good {i}", max_tokens=3, temperature=0.0))
    # a valid id whose key is not a record: the start script fails with WRONGTYPE
    r.set(K.job("wrong-type"), "not a hash")
    r.xadd(K.jobs, {"job_id": "wrong-type", "request": json.dumps({"prompt": "hi"})})
    good.append(client.submit("after the wrong type", max_tokens=3, temperature=0.0))
    handle = serve(serve_engine)  # capacity 20: the whole queue arrives in one or two reads

    jobs = {j.id: j for j in client.as_completed(good + list(bad), timeout=120)}
    assert all(jobs[g].status == "finished" and jobs[g].attempts == 1 for g in good)
    for job_id, (_, expect) in bad.items():
        job = jobs[job_id]
        assert job.status == "failed" and job.error_code == "invalid_request", job
        assert expect in job.error, (job_id, job.error)
        assert 0 < r.ttl(K.job(job_id)) <= 600, "an ended record expires"
    assert jobs["not-utf8"].request == {"prompt": "caf\ufffd \ufffd"}, "the record reads back (U+FFFD)"
    dead = dead_letters(r)
    assert "WRONGTYPE" in dead["wrong-type"] and r.get(K.job("wrong-type")) == b"not a hash"
    assert "malformed entry" in dead["has space"] and "malformed entry" in dead["newline\n"]
    ended = events_per_job(r)
    assert all(ended[j] == 1 for j in [*good, *bad]), ended
    assert_queue_empty(r)
    assert handle.server.intake.is_alive() and handle.stop() == 0
