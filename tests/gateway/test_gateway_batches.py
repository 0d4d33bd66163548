"""tokenbus-gateway batches through the official openai SDK: real Redis, worker (SmolLM2-135M), HTTP, RQ.

The output and error files must be exactly `tokenbus batch export` of the same batch, split as OpenAI
splits them, and the same file submitted with `tokenbus batch submit` must give the same answers.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.gateway_harness import MODEL, ROOT, chat_line, wait_until, write_jsonl


def cli(stack, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "producer", "--url", stack.redis.url, *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out


def answers(lines: list[str]) -> dict[str, object]:
    """custom_id -> what was generated (or "failed"): the part of a line that ids and times leave alone (and the
    prefix cache: a second run of the same prompts finds more of them cached)."""
    out = {}
    for line in map(json.loads, lines):
        body = (line["response"] or {}).get("body")
        if not body or "choices" not in body:
            out[line["custom_id"]] = "failed"
            continue
        out[line["custom_id"]] = (body["choices"], {k: v for k, v in body["usage"].items()
                                                    if k != "prompt_tokens_details"})
    return out


def test_batch_round_trip_equals_the_cli_export(gateway_stack, tmp_path):
    client = gateway_stack.openai("alice")
    src = write_jsonl(tmp_path / "in.jsonl", [
        chat_line("greet", "Say hello."), chat_line("sky", "Why is the sky blue?", max_tokens=5), "",
        chat_line("count", "Count to three.")])
    uploaded = client.files.create(file=src.open("rb"), purpose="batch")
    assert (uploaded.purpose, uploaded.bytes, uploaded.filename) == ("batch", src.stat().st_size, "in.jsonl")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "nightly"})
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 3
    assert batch.metadata == {"run": "nightly"} and batch.expires_at == batch.created_at + 24 * 3600

    done = gateway_stack.wait_batch(client, batch.id, timeout=240)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (3, 3, 0)
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    output = client.files.content(done.output_file_id).text.splitlines()
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"

    # `tokenbus batch export` of the same batch: the gateway's batch is the producer's batch.
    cli(gateway_stack, "batch", "export", batch.id, str(tmp_path / "export.jsonl"))
    exported = (tmp_path / "export.jsonl").read_text().splitlines()
    assert output == exported
    assert [json.loads(x)["custom_id"] for x in output] == ["greet", "sky", "count"]

    # The same file through `tokenbus batch submit`: the same answers (greedy decoding).
    cli_id = cli(gateway_stack, "batch", "submit", str(src), "--wait").stdout.split()[0]
    cli(gateway_stack, "batch", "export", cli_id, str(tmp_path / "cli.jsonl"))
    assert answers(output) == answers((tmp_path / "cli.jsonl").read_text().splitlines())
    body = json.loads(output[0])["response"]["body"]
    assert body["model"] == MODEL and body["choices"][0]["message"]["content"]


def test_cancel_mid_batch(gateway_stack, tmp_path):
    client = gateway_stack.openai("alice")
    lines = [chat_line(f"short-{i}", "Hi", max_tokens=2) for i in range(2)]
    lines += [chat_line(f"long-{i}", f"Tell a long story number {i}.", max_tokens=64, ignore_eos=True)
              for i in range(14)]
    uploaded = client.files.create(file=write_jsonl(tmp_path / "long.jsonl", lines).open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, 120,
               "a first finished request", list(gateway_stack.procs.values()), every=0.1)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    done = gateway_stack.wait_batch(client, batch.id, timeout=120)
    assert done.status == "cancelled" and done.cancelled_at >= done.cancelling_at
    counts = done.request_counts
    assert counts.total == 16 and counts.completed >= 2 and counts.failed >= 1
    assert counts.completed + counts.failed == 16
    output = client.files.content(done.output_file_id).text.splitlines()
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert len(output) == counts.completed and len(errors) == counts.failed
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}  # OpenAI's code for them
    assert {"short-0", "short-1"} <= {json.loads(x)["custom_id"] for x in output}
    # An ended batch cannot be cancelled again: 409 in OpenAI's error shape.
    with gateway_stack.http("alice") as http:
        again = http.post(f"/v1/batches/{batch.id}/cancel")
    assert again.status_code == 409 and again.json()["error"]["code"] == "batch_not_cancellable"


def test_list_batches_with_cursor_pagination(gateway_stack, tmp_path):
    client = gateway_stack.openai("carol")  # carol's list holds only what this test makes
    src = write_jsonl(tmp_path / "one.jsonl", [chat_line("only", "Hi", max_tokens=1)])
    file_id = client.files.create(file=src.open("rb"), purpose="batch").id
    made = [client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"n": str(i)}).id for i in range(3)]
    newest_first = made[::-1]

    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == newest_first[:2] and page.has_more
    with gateway_stack.http("carol") as http:
        raw = http.get("/v1/batches", params={"limit": 2}).json()
        assert (raw["object"], raw["first_id"], raw["last_id"]) == ("list", newest_first[0], newest_first[1])
        rest = http.get("/v1/batches", params={"limit": 2, "after": raw["last_id"]}).json()
        assert [b["id"] for b in rest["data"]] == newest_first[2:] and rest["has_more"] is False
        bad = http.get("/v1/batches", params={"after": "batch_unknown"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"
        assert http.get("/v1/batches", params={"limit": 0}).status_code == 400
    assert [b.id for b in client.batches.list(limit=2)] == newest_first  # the SDK follows the cursor
    for bid in made:
        gateway_stack.wait_batch(client, bid)


def test_batch_past_its_window_ends_expired_with_partial_output(gateway_stack, tmp_path):
    client = gateway_stack.openai("bob")
    lines = [chat_line("quick", "Hi", max_tokens=1)]
    lines += [chat_line(f"slow-{i}", "Write a poem.", max_tokens=64, ignore_eos=True) for i in range(12)]
    uploaded = client.files.create(file=write_jsonl(tmp_path / "slow.jsonl", lines).open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, 120,
               "a first finished request", list(gateway_stack.procs.values()), every=0.1)
    # As if 24 hours had passed: the watcher cancels what is left and the batch ends expired.
    gateway_stack.redis.client().hset(f"{{tokenbus}}:gw:batch:{batch.id}", "expires_at", 1.0)
    done = gateway_stack.wait_batch(client, batch.id, timeout=120)
    assert done.status == "expired" and done.expired_at and done.cancelled_at is None
    assert done.request_counts.completed >= 1 and done.request_counts.failed >= 1
    output = [json.loads(x)["custom_id"] for x in client.files.content(done.output_file_id).text.splitlines()]
    assert "quick" in output and len(output) == done.request_counts.completed
