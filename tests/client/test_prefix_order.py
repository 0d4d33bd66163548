"""Batches ordered by prefix (producer/prefix_order.py): lines whose prompts start alike are enqueued
together, each keeping its input index (so its job id and its place in the output), against a real
redis-server."""

from __future__ import annotations

import json

import pytest

from producer import Client, prefix_order
from producer.batches import iter_batch_job_ids, submit_batch
from producer.prefix_order import PREFIX_CHARS, PrefixOrder, prefix_key
from protocol.models import JobRequest

SYSTEMS = [f"You are assistant {n}. " + f"Rule {n}: answer in one line. " * 40 for n in "ABC"]


def chat(system: str, user: str) -> JobRequest:
    return JobRequest(messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])


def test_keys_follow_how_the_prompt_starts():
    assert len(SYSTEMS[0]) > PREFIX_CHARS
    assert prefix_key(chat(SYSTEMS[0], "a")) == prefix_key(chat(SYSTEMS[0], "b"))  # past the prefix: alike
    assert prefix_key(chat(SYSTEMS[0], "a")) != prefix_key(chat(SYSTEMS[1], "a"))
    assert prefix_key(chat("short", "a")) != prefix_key(chat("short", "b"))  # the whole prompt is its prefix
    assert prefix_key(JobRequest(prompt=SYSTEMS[0] + "x")) == prefix_key(JobRequest(prompt=SYSTEMS[0] + "y"))
    assert prefix_key(JobRequest(prompt="x" * 9)) != prefix_key(chat("x" * 9, ""))
    ids = list(range(300))
    assert prefix_key(JobRequest(prompt_token_ids=ids + [1])) == prefix_key(JobRequest(prompt_token_ids=ids + [2]))
    assert prefix_key(JobRequest(prompt_token_ids=[1, 2])) != prefix_key(JobRequest(prompt_token_ids=[1, 3]))


def order_of(requests: list[JobRequest]) -> tuple[list[int], bool]:
    order = PrefixOrder()
    for r in requests:
        order.add(r, 10)
    return list(order.order()), order.reorders


def test_groups_in_order_of_their_first_line_each_in_input_order(monkeypatch):
    a, b, c = (chat(s, "q") for s in SYSTEMS)
    assert order_of([a, b, a, c, b, a]) == ([0, 2, 5, 1, 4, 3], True)
    assert order_of([a, a, b, c, c]) == ([0, 1, 2, 3, 4], False)  # grouped already: sent as it is
    monkeypatch.setattr(prefix_order, "MAX_GROUPS", 2)  # past the distinct keys remembered: one last group
    assert order_of([a, b, c, a, chat("d", "q"), b]) == ([0, 3, 1, 5, 2, 4], True)


def batch_lines(n: int) -> tuple[str, list[int]]:
    """n chat lines cycling through the three system prompts, and each line's system."""
    out, which = [], []
    for i in range(n):
        body = {"messages": [{"role": "system", "content": SYSTEMS[i % 3]}, {"role": "user", "content": f"q{i}"}],
                "max_tokens": 4}
        out.append(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
        which.append(i % 3)
    return "\n".join(out) + "\n", which


@pytest.mark.parametrize("n", [30, 301])
def test_a_batch_is_enqueued_group_by_group_and_keeps_its_input_indices(redis_server, tmp_path, n):
    client = Client(redis_server.url, max_queue_len=0)
    text, which = batch_lines(n)
    path = tmp_path / "in.jsonl"
    path.write_text(text)
    submit_batch(client, path, batch_id="pfx")
    stream = client.redis.xrange(client.keys.queue("bulk", "pfx"))
    job_ids = [f["job_id"] for _, f in stream]
    index = [int(j.rsplit("-", 1)[1]) for j in job_ids]
    assert sorted(index) == list(range(n))
    systems = [which[i] for i in index]
    assert systems == sorted(systems), "lines of one system prompt were not enqueued together"
    for group in range(3):  # within a group: input order
        mine = [i for i in index if which[i] == group]
        assert mine == sorted(mine)
    for jid in job_ids[:5] + job_ids[-5:]:  # each job is its own input line: its custom_id and request
        i = int(jid.rsplit("-", 1)[1])
        assert client.redis.hget(client.keys.job(jid), "custom_id") == f"c{i}"
        request = json.loads(next(f["request"] for _, f in stream if f["job_id"] == jid))
        assert request["messages"][1]["content"] == f"q{i}"
    listed = [j for chunk in iter_batch_job_ids(client, "pfx") for j in chunk]
    assert [int(j.rsplit("-", 1)[1]) for j in listed] == list(range(n))  # the output's order: the input's


def test_a_kept_order_loads_back_only_onto_the_spool_it_fits(tmp_path):
    """The gateway's upload keeps its lines' order beside their spool (PrefixOrder.save); the submit loads it
    back (load), and an order that does not fit that spool is refused, so the batch goes in input order."""
    a, b = (chat(s, "q") for s in SYSTEMS[:2])
    order = PrefixOrder()
    for r, size in zip([a, b, a, b, a], [10, 20, 10, 20, 15], strict=True):
        order.add(r, size)
    path = tmp_path / "f.requests.order"
    order.save(path)
    loaded = PrefixOrder.load(path, 5, 75)
    assert loaded is not None and list(loaded.order()) == [0, 2, 4, 1, 3] and loaded.reorders
    assert list(loaded.offsets) == [0, 10, 30, 40, 60]
    assert PrefixOrder.load(tmp_path / "none", 5, 75) is None  # an upload from before orders were kept
    assert PrefixOrder.load(path, 4, 75) is None  # another line count
    assert PrefixOrder.load(path, 5, 60) is None  # its last line starts past the spool's end
    path.write_bytes(path.read_bytes()[:-3])
    assert PrefixOrder.load(path, 5, 75) is None  # cut short
    path.write_bytes(b"not an order at all")
    assert PrefixOrder.load(path, 5, 75) is None
