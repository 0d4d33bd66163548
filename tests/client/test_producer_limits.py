"""Hostile input on the producer side (issue #13), against a real redis-server: ids that would collide in
the key layout or exceed the id limit once derived, requests too large to decode, and a batch that would
adopt another job's result. Nothing invalid may be written."""

from __future__ import annotations

import json
import time

import pytest
import redis

from producer import Client, InvalidBatch, InvalidJob
from protocol import scripts
from protocol.models import (
    GROUP,
    MAX_COUNT,
    MAX_REQUEST_BYTES,
    check_job_id,
    is_valid_id,
    parse_request,
)


@pytest.fixture
def client(redis_server):
    with Client(redis_server.url) as c:
        yield c


def nothing_written(c: Client) -> bool:
    return c.redis.keys(f"{c.keys.prefix}:job:*") == [] and c.redis.keys(f"{c.keys.prefix}:batch:*") == []


def chat_line(cid: str, **body) -> str:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | body
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})


@pytest.mark.parametrize("bad", ["abc\n", "a:b", "V:tokens", "C:jobs", "", "-x", "a" * 201, "a b", "é"])
def test_invalid_ids_are_refused(client, bad):
    assert not is_valid_id(bad)
    with pytest.raises(InvalidJob, match="invalid job id"):
        check_job_id(bad)
    with pytest.raises(InvalidJob, match="invalid job id"):
        client.submit("x", job_id=bad)
    assert nothing_written(client)


def test_job_id_cannot_take_another_jobs_token_stream(client):
    client.submit("mine", job_id="V", stream=True)
    with pytest.raises(InvalidJob, match="no ':'"):
        client.submit("hijack", job_id="V:tokens")
    assert client.redis.type(client.keys.tokens("V")) == "none"


def test_batch_id_too_long_for_its_job_ids(client):
    lines = [chat_line(f"r{i}") for i in range(11)]
    with pytest.raises(InvalidJob, match="use a batch id of at most 197 characters"):
        client.submit_batch(lines, batch_id="b" * 198)
    with pytest.raises(InvalidJob, match="invalid batch id"):
        client.submit_batch(lines, batch_id="b" * 201)
    assert nothing_written(client)
    rec = client.submit_batch(lines[:10], batch_id="b" * 198)  # b...b-9: exactly 200 characters
    assert rec.total == 10 and client.get("b" * 198 + "-9").status == "queued"


def test_batch_does_not_adopt_an_existing_job(client):
    client.submit("someone else's job", job_id="mine-0")
    with pytest.raises(InvalidBatch, match="'mine-0'.*nothing was submitted"):
        client.submit_batch([chat_line("a"), chat_line("b")], batch_id="mine")
    assert client.redis.exists(client.keys.batch("mine")) == 0
    assert client.redis.exists(client.keys.job("mine-1")) == 0
    assert client.get("mine-0").batch_id is None


def test_submit_script_refuses_a_taken_id_and_never_resets_a_key(client):
    client.submit("plain", job_id="x-0")
    submit = scripts.script(scripts.SUBMIT_JOB)
    k = client.keys
    # a batch job whose id is a plain job's: refused with the owner's batch ('' = none)
    assert submit(keys=[k.job("x-0"), k.queue("default", "x"), k.registry("default")],
                  args=["x-0", '{"prompt": "b"}', time.time(), 0, 60, "x", "c", "default", k.layout, GROUP],
                  client=client.redis) == [-2, ""]
    # a key without a status field (a half-written record, or someone else's hash) is never overwritten
    client.redis.hset(client.keys.job("odd"), "note", "not a job")
    assert submit(keys=[k.job("odd"), k.queue(), k.registry("default")],
                  args=["odd", '{"prompt": "o"}', time.time(), 0, 60, "", "", "default", k.layout, GROUP],
                  client=client.redis) == [0, ""]
    assert client.redis.hgetall(client.keys.job("odd")) == {"note": "not a job"}
    assert scripts.queue_totals(client.redis, k) == (1, 0)
    # a priority the protocol does not have: refused, nothing written
    with pytest.raises(redis.ResponseError, match="priority must be one of interactive, default, bulk"):
        submit(keys=[k.job("p"), k.queue(), k.registry("default")],
               args=["p", '{"prompt": "p"}', time.time(), 0, 60, "", "", "urgent", k.layout, GROUP],
               client=client.redis)
    # the queue follows the priority (and model) in ARGV: KEYS 2-3 of the release before models are ignored
    assert submit(keys=[k.job("p"), k.queue(), k.registry("default")],
                  args=["p", '{"prompt": "p"}', time.time(), 0, 60, "", "", "bulk", k.layout, GROUP],
                  client=client.redis)[0] == 1
    assert client.redis.hget(k.job("p"), "queue") == k.queue("bulk")
    assert scripts.queue_totals(client.redis, k) == (2, 0)


@pytest.mark.parametrize("fields, expect", [
    ({"max_tokens": 10**5000}, "max_tokens: Input should be less than or equal to 2147483647 (got an integer"),
    ({"min_tokens": MAX_COUNT + 1}, "min_tokens"),
    ({"top_k": 2**40}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"stop_token_ids": [2**31]}, "token ids must be <= 2147483647"),
    ({"prompt": "x" * MAX_REQUEST_BYTES}, "more than the limit of 1048576"),
    ({"prompt": "lone \ud800 surrogate"}, "not valid Unicode"),
    ({"metadata": {"deep": [[[[[[[[[[]]]]]]]]]]}}, "metadata.deep: Input should be a valid string"),
])
def test_requests_past_the_size_bounds_are_refused(client, fields, expect):
    fields = {"prompt": "x"} | fields
    with pytest.raises(InvalidJob) as err:
        client.submit(**fields)
    assert expect in str(err.value)
    assert nothing_written(client)


def test_batch_lines_that_cannot_be_decoded_name_their_line(client):
    lines = [chat_line("ok"), '{"custom_id": "big", "body": {"max_tokens": ' + "9" * 5000 + "}}",
             "[" * 100_000, chat_line("long", messages=[{"role": "user", "content": "y" * MAX_REQUEST_BYTES}])]
    with pytest.raises(InvalidBatch) as err:
        client.submit_batch(lines)
    assert [n for n, _ in err.value.line_errors] == [2, 3, 4]
    assert "digits" in err.value.line_errors[0][1] and "nested too deeply" in err.value.line_errors[1][1]
    assert "1048576" in err.value.line_errors[2][1]
    assert nothing_written(client)


@pytest.mark.parametrize("raw, expect", [
    ('{"prompt": "x", "max_tokens": ' + "1" * 5000 + "}", "not valid JSON (Exceeds the limit"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
    ('{"prompt": "\\ud800"}', "lone surrogate"),
    ('{"prompt": "' + "x" * MAX_REQUEST_BYTES + '"}', "more than the limit"),
])
def test_parse_request_turns_every_decoding_error_into_invalid_job(raw, expect):
    with pytest.raises(InvalidJob, match="invalid job") as err:
        parse_request(raw)
    assert expect in str(err.value)
