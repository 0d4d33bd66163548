"""A gateway batch line from upload to the worker is JSON-parsed and validated once per process: in the HTTP
process as the upload streams in, not at all in the task process (the submit streams the requests the upload
kept), once in the worker's intake.

The real path, in one process against a real redis-server: the app under TestClient (POST /v1/files, POST
/v1/batches), the RQ submit task run by the tasks process's RQ worker (TasksWorker), then the worker's Intake
admitting what SUBMIT_JOBS wrote. Each stage counts the JSON parses of text holding the lines' marker (json.loads and
pydantic's parser, wherever called) and every JobRequest validation.
"""

from __future__ import annotations

import json
import queue
from collections import Counter
from typing import Any

import pydantic_core
import pytest
from fastapi.testclient import TestClient

import producer.batch_file
from gateway import tasks
from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway.tasks_worker import TasksWorker
from protocol.models import JobRequest
from worker.serve.completion import CompletionWriter
from worker.serve.intake import Intake, IntakeBudget
from worker.serve.job_queue import JobQueue
from worker.serve.leases import Leases

KEY = "sk-line-" + "l" * 24
MARK = "line-marker-7f3a"
LINES = 12


class Tally:
    """Parses of the marked lines and JobRequest validations, by stage."""

    def __init__(self) -> None:
        self.stage = "none"
        self.parses: Counter[str] = Counter()
        self.validations: Counter[str] = Counter()

    def parsed(self, text: Any) -> None:
        raw = text.decode("utf-8", "replace") if isinstance(text, bytes | bytearray) else str(text)
        if MARK in raw:
            self.parses[self.stage] += 1


class CountingValidator:
    """JobRequest's own validator, counting each validation (from a dict, JSON or strings)."""

    def __init__(self, inner: Any, tally: Tally) -> None:
        self.inner, self.tally = inner, tally

    def validate_python(self, *args: Any, **kwargs: Any) -> Any:
        self.tally.validations[self.tally.stage] += 1
        return self.inner.validate_python(*args, **kwargs)

    def validate_json(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        self.tally.validations[self.tally.stage] += 1
        self.tally.parsed(data)
        return self.inner.validate_json(data, *args, **kwargs)

    def validate_strings(self, *args: Any, **kwargs: Any) -> Any:
        self.tally.validations[self.tally.stage] += 1
        return self.inner.validate_strings(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def tally(monkeypatch) -> Tally:
    t = Tally()
    real_loads, real_from_json = json.loads, pydantic_core.from_json

    def loads(s: Any, *args: Any, **kwargs: Any) -> Any:
        t.parsed(s)
        return real_loads(s, *args, **kwargs)

    def from_json(data: Any, *args: Any, **kwargs: Any) -> Any:
        t.parsed(data)
        return real_from_json(data, *args, **kwargs)

    monkeypatch.setattr(json, "loads", loads)
    monkeypatch.setattr(pydantic_core, "from_json", from_json)
    monkeypatch.setattr(producer.batch_file, "_from_json", from_json)  # bound at its import
    monkeypatch.setattr(JobRequest, "__pydantic_validator__", CountingValidator(JobRequest.__pydantic_validator__, t))
    return t


def batch_file() -> bytes:
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": f"{MARK} question {i}"}], "max_tokens": 3}}
             for i in range(LINES)]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def test_a_batch_line_is_parsed_and_validated_once_per_process(redis_server, tmp_path, tally):
    settings = GatewaySettings(api_keys=KEY, redis_url=redis_server.url, files_dir=tmp_path / "files",
                               ui_enabled=False)
    headers = {"authorization": f"Bearer {KEY}"}
    with TestClient(create_app(settings)) as http:
        ctx = http.app.state.ctx
        tally.stage = "http"
        upload = http.post("/v1/files", headers=headers, data={"purpose": "batch"},
                           files={"file": ("in.jsonl", batch_file(), "application/jsonl")})
        assert upload.status_code == 200, upload.text
        batch = http.post("/v1/batches", headers=headers, json={
            "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        assert batch.status_code == 200, batch.text
        batch_id = batch.json()["id"]

        tally.stage = "task"
        tasks.set_context(ctx)
        try:
            assert TasksWorker([ctx.queue], connection=ctx.rq_redis).work(burst=True)
        finally:
            tasks.set_context(None)
        assert ctx.queue.fetch_job(f"submit-{batch_id}").return_value() == "submitted"

        tally.stage = "worker"
        jobs = JobQueue(redis_server.client(), settings.namespace, "worker-a", 60)
        leases, inbox = Leases(), queue.Queue()
        intake = Intake(jobs, leases, IntakeBudget(LINES), inbox, CompletionWriter(jobs, leases),
                        model_names={"m"}, lease_ms=60_000, max_attempts=3, stream_tokens=False)
        for entry in jobs.read_new(LINES, None):
            intake._admit(entry, backoff=None)
        tally.stage = "none"
        started = [inbox.get_nowait() for _ in range(inbox.qsize())]

    assert sorted(s.job_id for s in started) == sorted(f"{batch_id}-{i}" for i in range(LINES))
    assert all(s.request.priority == "bulk" and MARK in s.request.messages[0].content for s in started)
    per_line = {stage: (tally.parses[stage] / LINES, tally.validations[stage] / LINES)
                for stage in ("http", "task", "worker")}
    # (parses, validations) per line in each process
    assert per_line == {"http": (1, 1), "task": (0, 0), "worker": (1, 1)}, (tally.parses, tally.validations)
