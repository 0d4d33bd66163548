"""Batches uploaded through the gateway go out prefix-ordered (producer/prefix_order.py, as the CLI's do): the
upload keys each line as it streams in and keeps the order beside the validated requests; the submit task
enqueues the lines of one system prompt together; job ids, and so the output file, keep the input order.
Against the light stack (real Redis and gateway processes; jobs ended as a worker ends them)."""

from __future__ import annotations

import json

from testbed.light_gateway import chat_line

SYSTEMS = [f"You are shop {n}'s assistant. " + f"Rule {n}: answer in one line. " * 30 for n in "ABC"]


def interleaved(n: int) -> tuple[list[str], list[int]]:
    """n chat lines cycling through the three system prompts, and each line's system."""
    lines = []
    for i in range(n):
        line = json.loads(chat_line(f"c{i}", f"question {i}"))
        line["body"]["messages"].insert(0, {"role": "system", "content": SYSTEMS[i % 3]})
        lines.append(json.dumps(line))
    return lines, [i % 3 for i in range(n)]


def test_a_gateway_batch_is_enqueued_group_by_group_and_its_output_keeps_the_input_order(light_stack, tmp_path):
    lines, which = interleaved(13)
    b = light_stack.batch("alice", lines, tmp_path)
    light_stack.wait_status("alice", b.id, ("in_progress",))
    r = light_stack.r()
    queue = r.hget(f"{{tokenbus}}:job:{b.id}-0", "queue")
    job_ids = [f["job_id"] for _, f in r.xrange(queue)]
    index = [int(j.rsplit("-", 1)[1]) for j in job_ids]
    assert sorted(index) == list(range(13))
    assert [which[i] for i in index] == sorted(which), f"lines of one system prompt were not sent together: {index}"
    assert index == sorted(index, key=lambda i: (which[i], i)), "within a group, lines go in input order"
    for jid in job_ids:  # each job is its own input line
        i = int(jid.rsplit("-", 1)[1])
        assert r.hget(f"{{tokenbus}}:job:{jid}", "custom_id") == f"c{i}"
    for jid in job_ids:  # ended in the order sent, as a worker would end them
        light_stack.end_job(jid, text=f"answer {jid.rsplit('-', 1)[1]}")
    done = light_stack.wait_status("alice", b.id, ("completed",))
    out = [json.loads(x) for x in light_stack.openai().files.content(done.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in out] == [f"c{i}" for i in range(13)], "the output is in input order"
    assert all(x["response"]["body"]["choices"][0]["message"]["content"] == f"answer {i}" for i, x in enumerate(out))
