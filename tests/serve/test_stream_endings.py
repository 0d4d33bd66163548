"""Every job that asked for a stream ends its token stream with one chunk marked done, however it ends, so a
reader waiting on the token stream alone never waits forever (docs/protocol.md, "How a token stream ends"):
finished, failed before it ran (model_mismatch, invalid_request, max_attempts), cancelled while queued, cancelled
while running. A job whose record is gone (expired, deleted) ends a Client.stream with JobNotFound. The serve
loop in-process with a tiny real engine, on a real redis-server."""

from __future__ import annotations

import json
import time

import pytest

from protocol.errors import JobNotFound
from protocol.keys import Keys
from tests.serve.test_serve_loop import submit_raw

K = Keys("tokenbus")


def chunks(r, job_id: str) -> list[dict]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _id, f in r.xrange(K.tokens(job_id))]


def read_until_done(r, job_id: str, timeout: float = 60) -> list[dict]:
    """What a reader in any language does: XREAD BLOCK the token stream until the chunk marked done."""
    last, got = "0-0", []
    deadline = time.monotonic() + timeout
    while not got or got[-1]["done"] != "1":
        assert time.monotonic() < deadline, f"{job_id}: no done chunk after {timeout} s ({got})"
        for _key, entries in r.xread({K.tokens(job_id): last}, block=200) or []:
            for entry_id, fields in entries:
                last = entry_id
                got.append({k.decode(): v.decode() for k, v in fields.items()})
    return got


def test_every_streamed_job_ends_with_one_done_chunk(serve_engine, serve, make_client, redis_server):
    r = redis_server.client()
    client = make_client()
    params = dict(max_tokens=6, temperature=0.0, ignore_eos=True, stream=True)
    queued = client.submit("cancelled before any worker", **params)
    assert client.cancel(queued) == "cancelled"
    mismatch = client.submit("another model", model="gpt-4o-mini", **params)
    submit_raw(r, "bad-request", json.dumps({"prompt": "x", "stream": True, "bogus": 1}))
    gave_up = client.submit("crashed its workers", **params)
    r.hset(K.job(gave_up), "attempts", 2)
    finished = client.submit("runs to the end", **params)
    running = client.submit("cancelled mid-run", **(params | {"max_tokens": 900}))
    serve(serve_engine, max_attempts=2)

    deadline = time.monotonic() + 120
    while not client.get(running).first_token_at:
        assert time.monotonic() < deadline, "the long job never started"
        time.sleep(0.02)
    assert client.cancel(running) == "cancelling"

    ends = {"cancelled": [queued, running], "failed": [mismatch, "bad-request", gave_up], "finished": [finished]}
    for status, ids in ends.items():
        for job_id in ids:
            got = read_until_done(r, job_id)
            job = client.wait(job_id, timeout=60)
            assert job.status == status, job
            assert [c["done"] for c in chunks(r, job_id)].count("1") == 1, f"{job_id}: one done chunk, the last"
            tokens = [t for c in got for t in json.loads(c["token_ids"])]
            assert tokens == (job.result.token_ids if job.result else []), job_id
            last = got[-1]
            assert int(last["offset"]) + len(json.loads(last["token_ids"])) == len(tokens), "contiguous to the end"
            assert "".join(c["text"] for c in got) == (job.result.text if job.result else "")
            assert 0 < r.ttl(K.tokens(job_id)) <= 604800
            streamed = list(client.stream(job_id, timeout=10))
            assert streamed[-1].done and [t for c in streamed for t in c.token_ids] == tokens
    assert client.get(mismatch).error_code == "model_mismatch"
    assert client.get("bad-request").error_code == "invalid_request"
    assert client.get(gave_up).error_code == "max_attempts"
    assert 0 < len(client.get(running).result.token_ids) < 900


def test_a_stream_whose_record_is_gone_ends_the_reader(serve_engine, serve, make_client, redis_server):
    r = redis_server.client()
    client = make_client()
    gone = client.submit("its record expires while it waits", max_tokens=3, stream=True)
    r.delete(K.job(gone))
    serve(serve_engine)
    with pytest.raises(JobNotFound):
        list(client.stream(gone, timeout=30))
    deadline = time.monotonic() + 30
    while not r.xlen(K.dead):
        assert time.monotonic() < deadline, "the worker dead-letters an entry with no record"
        time.sleep(0.05)
    assert not r.exists(K.tokens(gone)), "nothing is written under a job that has no record"
