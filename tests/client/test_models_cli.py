"""`tokenbus models list|add|remove|default` and `tokenbus info` per model, on a real redis-server; a batch file
naming an undeclared model refused whole by the CLI; the worker's per-model gauges."""

from __future__ import annotations

import json

import pytest

from producer.cli import main
from protocol.keys import Keys
from protocol.records import ModelInfo
from tests.support.log_setup import plain_tracebacks

K = Keys("tokenbus")


@pytest.fixture(autouse=True)
def _logging_back():
    """main() points structlog at this test's captured stderr: the tests after it get the suite's set-up back."""
    yield
    plain_tracebacks()


def run(capsys, url: str, *args: str) -> tuple[int, str, str]:
    code = main(["--url", url, *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_models_add_list_default_remove_and_info_flags_a_model_nobody_serves(redis_server, capsys, tmp_path):
    url = redis_server.url
    assert run(capsys, url, "models", "add", "llama", "--alias", "chat", "--context-length", "4096")[0] == 0
    assert run(capsys, url, "models", "add", "embedder", "--kind", "embed")[0] == 0
    code, out, _ = run(capsys, url, "models", "list", "--json")
    listed = {m["id"]: m for m in json.loads(out)}
    assert listed["llama"]["names"] == ["llama", "chat"] and listed["llama"]["default"]
    assert listed["embedder"]["kind"] == "embed" and listed["llama"]["context_length"] == 4096
    assert run(capsys, url, "models", "default", "embedder") == (0, "embedder\n", "")

    assert run(capsys, url, "submit", "hi", "--model", "chat")[0] == 0
    code, out, _ = run(capsys, url, "info")
    line = next(x for x in out.splitlines() if x.strip().startswith("llama"))
    assert "depth=1" in line and "workers=0" in line and "UNSERVED" in line
    assert "UNSERVED" not in next(x for x in out.splitlines() if x.strip().startswith("embedder"))

    code, _, err = run(capsys, url, "submit", "hi", "--model", "gpt-4o")
    assert code == 1 and "'gpt-4o' is not declared" in err and "'embedder', 'llama'" in err
    batch = tmp_path / "in.jsonl"
    batch.write_text("\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                           "body": {"model": m, "prompt": "x"}})
                               for i, m in enumerate(["llama", "gpt-4o"])) + "\n")
    code, _, err = run(capsys, url, "batch", "submit", str(batch))
    assert code == 1 and "'gpt-4o' is not declared" in err
    assert redis_server.client().xlen(K.for_model("llama").queue("bulk", "x")) == 0

    code, _, err = run(capsys, url, "models", "remove", "chat")
    assert code == 1 and "1 jobs in its queues" in err
    assert run(capsys, url, "models", "remove", "chat", "--force")[0] == 0
    assert [m["id"] for m in json.loads(run(capsys, url, "models", "list", "--json")[1])] == ["embedder"]


def test_the_worker_gauges_every_models_jobs_and_drops_a_retired_one():
    from prometheus_client import generate_latest

    from worker.serve.metrics import WorkerMetrics

    m = WorkerMetrics(model="a", worker="w")
    m.observe_models([ModelInfo(id="a", by_priority={"interactive": 0, "default": 3, "bulk": 5}, pending=2,
                                workers=1, queue_depth=8),
                      ModelInfo(id="b", by_priority={"bulk": 4}, queue_depth=4, unserved=True)])
    text = generate_latest(m.registry).decode()
    assert 'tokenbus_model_jobs{model="a",priority="bulk"} 5.0' in text
    assert 'tokenbus_model_unserved{model="b"} 1.0' in text and 'tokenbus_model_workers{model="a"} 1.0' in text
    m.observe_models([ModelInfo(id="a")])
    assert 'model="b"' not in generate_latest(m.registry).decode()
