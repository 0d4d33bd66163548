"""Files (streamed upload and download, validation by line number, 413) and API keys (401, isolation)."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from tests.support.gateway_harness import KEYS, MAX_BODY, MAX_UPLOAD, MODEL, ROOT, chat_line, write_jsonl

ERROR_FIELDS = {"message", "type", "param", "code"}


def test_file_upload_download_delete_streams_many_chunks(gateway_stack, tmp_path):
    client = gateway_stack.openai("alice")
    # ~200 KB of lines: many chunks on the way in and out, lines split across chunk boundaries.
    lines = [chat_line(f"req-{i:05d}", "x" * (i % 97) + " hello", max_tokens=1) for i in range(900)]
    src = write_jsonl(tmp_path / "big.jsonl", lines)
    assert 150_000 < src.stat().st_size < MAX_UPLOAD
    meta = client.files.create(file=("big.jsonl", src.read_bytes(), "application/jsonl"), purpose="batch")
    assert client.files.retrieve(meta.id).bytes == src.stat().st_size
    assert client.files.content(meta.id).content == src.read_bytes()
    assert meta.id in [f.id for f in client.files.list()]
    assert client.files.delete(meta.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(meta.id)
    assert not any(p.name == meta.id for p in gateway_stack.files_dir.rglob("*")), "the content is gone too"


def test_malformed_file_is_accepted_and_its_batch_fails_naming_each_line(gateway_stack, tmp_path):
    """OpenAI's way (issue #22): the upload is accepted; a batch of it fails in `validating`, errors.data
    naming each bad line, with the line numbers `tokenbus batch submit` gives."""
    client = gateway_stack.openai("bob")
    src = write_jsonl(tmp_path / "bad.jsonl", [
        chat_line("ok-1", "hi"),                                                          # 1
        "{not json",                                                                      # 2
        "",                                                                               # 3 blank: fine
        chat_line("ok-2", "hi", temperature=-1),                                          # 4
        chat_line("ok-1", "again"),                                                       # 5 duplicate id
        json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                    "body": {"model": MODEL, "prompt": "x"}}),                            # 6 other endpoint
    ])
    uploaded = client.files.create(file=src.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = gateway_stack.wait_batch(client, batch.id, timeout=30)
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    errors = {e.line: e for e in done.errors.data}
    assert sorted(errors) == [2, 4, 5, 6]
    assert errors[2].code == "invalid_json_line" and errors[5].code == "duplicate_custom_id"
    assert errors[6].code == "mismatched_url" and "body: temperature" in errors[4].message
    assert "custom_id 'ok-1' already used on line 1" in errors[5].message
    # The same numbers as `tokenbus batch submit` gives for the file.
    cli = subprocess.run([sys.executable, "-m", "producer", "--url", gateway_stack.redis.url, "batch", "submit",
                          str(src)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert [ln.split(":")[0].strip() for ln in cli.stderr.splitlines() if ln.strip().startswith("line ")] == [
        "line 2", "line 4", "line 5", "line 6"]
    with pytest.raises(openai.BadRequestError, match="purpose must be one of batch"):
        client.files.create(file=("a.jsonl", chat_line("a", "hi").encode()), purpose="fine-tune")


def test_oversize_requests_get_413(gateway_stack):
    client = gateway_stack.openai("alice")
    big = b"x" * (MAX_UPLOAD + 1)
    with pytest.raises(openai.APIStatusError) as err:
        client.files.create(file=("big.jsonl", big), purpose="batch")
    assert err.value.status_code == 413 and err.value.code == "request_too_large"
    with gateway_stack.http("alice") as http:
        # Without a Content-Length (chunked): refused while counting the bytes as they arrive.
        def chunks():
            boundary = b"--b0undary\r\n"
            yield boundary + b'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            yield boundary + b'Content-Disposition: form-data; name="file"; filename="f.jsonl"\r\n\r\n'
            for _ in range(MAX_UPLOAD // 8192 + 2):
                yield b"y" * 8192
        resp = http.post("/v1/files", content=chunks(), headers={"content-type": "multipart/form-data; "
                                                                                  "boundary=b0undary"})
        assert resp.status_code == 413 and set(resp.json()["error"]) == ERROR_FIELDS
        long_message = [{"role": "user", "content": "z" * (MAX_BODY + 10)}]
        resp = http.post("/v1/chat/completions", json={"model": MODEL, "messages": long_message})
        assert resp.status_code == 413
        assert http.get("/v1/batches").status_code == 200  # and the gateway goes on serving
    assert not list(gateway_stack.files_dir.rglob(".*.part")), "refused uploads leave no part files"


def test_missing_or_wrong_key_is_401(gateway_stack):
    with gateway_stack.http(None) as http:
        for method, url in (("GET", "/v1/batches"), ("POST", "/v1/chat/completions"), ("POST", "/v1/files"),
                            ("GET", "/v1/files/file-x/content"), ("GET", "/v1/jobs/x")):
            resp = http.request(method, url)
            assert resp.status_code == 401, (method, url)
            assert set(resp.json()["error"]) == ERROR_FIELDS and resp.json()["error"]["code"] == "invalid_api_key"
        resp = http.get("/v1/batches", headers={"authorization": "Bearer " + KEYS["alice"] + "x"})
        assert resp.status_code == 401 and "Incorrect API key" in resp.json()["error"]["message"]
        assert http.get("/healthz").status_code == 200  # the health check needs no key
    with pytest.raises(openai.AuthenticationError):
        gateway_stack.openai("alice").with_options(api_key="sk-nope").batches.list()


def test_each_key_sees_only_its_own_files_batches_and_jobs(gateway_stack, tmp_path):
    alice, bob = gateway_stack.openai("alice"), gateway_stack.openai("bob")
    src = write_jsonl(tmp_path / "one.jsonl", [chat_line("only", "Hi", max_tokens=1)])
    file_id = alice.files.create(file=src.open("rb"), purpose="batch").id
    batch = alice.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    job_id = alice.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1).headers["x-tokenbus-job-id"]

    for call in (lambda: bob.files.retrieve(file_id), lambda: bob.files.content(file_id),
                 lambda: bob.files.delete(file_id), lambda: bob.batches.retrieve(batch.id),
                 lambda: bob.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.status_code == 404 and err.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):  # bob cannot start a batch from alice's file either
        bob.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.id not in [b.id for b in bob.batches.list()]
    assert file_id not in [f.id for f in bob.files.list()]
    with gateway_stack.http("bob") as http:
        assert http.get(f"/v1/jobs/{job_id}").status_code == 404
        assert http.get(f"/v1/jobs/{batch.id}-0").status_code == 404  # a job of alice's batch
        assert http.get(f"/v1/jobs/{job_id}:tokens").status_code == 404  # not another key's type
    with gateway_stack.http("alice") as http:
        assert http.get(f"/v1/jobs/{job_id}").json()["status"] == "finished"
        assert http.get(f"/v1/jobs/{batch.id}-0").json()["batch_id"] == batch.id
    done = gateway_stack.wait_batch(alice, batch.id)
    assert done.status == "completed"
    with pytest.raises(openai.NotFoundError):
        bob.files.content(done.output_file_id)

