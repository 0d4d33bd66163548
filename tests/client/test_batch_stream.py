"""The streaming submit's two halves against a real redis-server: SUBMIT_JOB with chunks in flight
(producer/submit_pipe.py) and the one-pass submit of a file validated already (the gateway's)."""

from __future__ import annotations

import json

import pytest

from producer import Client, InvalidBatch
from producer.batches import submit_batch
from producer.submit_pipe import SubmitPipe
from protocol.scripts import PendingJob


def lines(n: int, bad_at: int | None = None) -> str:
    out = []
    for i in range(n):
        body = {"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 4}
        if i == bad_at:
            body["temperature"] = -1
        out.append(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    return "\n".join(out) + "\n"


def entries(client: Client, batch_id: str) -> list[tuple[str, str]]:
    """(custom_id, request JSON) of every queued job of the batch, in input order."""
    stream = client.redis.xrange(client.keys.queue("bulk", batch_id))
    customs = [client.redis.hget(client.keys.job(f["job_id"]), "custom_id") for _, f in stream]
    return list(zip(customs, [f["request"] for _, f in stream], strict=True))


def test_a_validated_file_goes_in_one_pass_alike_and_a_changed_one_is_refused(redis_server, tmp_path):
    client = Client(redis_server.url, max_queue_len=0)
    path = tmp_path / "in.jsonl"
    path.write_text(lines(2500))
    submit_batch(client, path, batch_id="spooled")
    rec = submit_batch(client, path, batch_id="onepass", validated=("/v1/chat/completions", 2500))
    assert rec.total == 2500 and rec.status.value == "in_progress"
    assert entries(client, "onepass") == entries(client, "spooled") and len(entries(client, "spooled")) == 2500

    path.write_text(lines(2500, bad_at=2200))  # changed after its upload: the bad line is found part-way
    with pytest.raises(InvalidBatch, match="line 2201: body: temperature"):
        submit_batch(client, path, batch_id="changed", validated=("/v1/chat/completions", 2500))
    assert 0 < client.redis.xlen(client.keys.queue("bulk", "changed")) <= 2200  # the caller removes them
    path.write_text(lines(2400))
    with pytest.raises(InvalidBatch, match="has 2400 /v1/chat/completions requests, not 2500"):
        submit_batch(client, path, batch_id="shorter", validated=("/v1/chat/completions", 2500))
    # without `validated` a bad line refuses the file before anything is written
    path.write_text(lines(2500, bad_at=2200))
    with pytest.raises(InvalidBatch, match="1 of 2500 lines are invalid; nothing was submitted"):
        submit_batch(client, path, batch_id="refused")
    assert not client.redis.exists(client.keys.batch("refused"), client.keys.queue("bulk", "refused"))


def test_chunks_in_flight_survive_redis_forgetting_the_script(redis_server):
    client = Client(redis_server.url, max_queue_len=0)
    done: list[int] = []
    with SubmitPipe(client.redis, client.keys, 0, 60, chunk_size=50, depth=3, on_chunk=done.append) as pipe:
        for i in range(400):
            if i == 120:  # chunks in flight; the next EVALSHAs answer NOSCRIPT, as after a Redis restart
                client.redis.script_flush()
            pipe.add(PendingJob(f"j{i}", json.dumps({"prompt": f"p{i}"})))
        assert pipe.close() == 400
    assert sum(done) == 400
    stream = client.redis.xrange(client.keys.queue())
    assert [f["job_id"] for _, f in stream] == [f"j{i}" for i in range(400)]  # each once, in order
