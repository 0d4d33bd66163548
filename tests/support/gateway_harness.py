"""A whole gateway deployment for tests, as real processes: redis-server, a worker on the real SmolLM2-135M
(CPU), `python -m gateway serve` (uvicorn on a free port), `python -m gateway tasks`
(RQ worker + batch watcher) and `python -m gateway webhooks` (deliveries); plus a webhook
receiver thread. One per test session (gateway_stack).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from testbed.gateway_procs import (  # noqa: F401  (the tests import them from here)
    KEYS,
    MODEL,
    ROOT,
    WEBHOOK_SECRET,
    Deployment,
    LoopbackReceiver,
    Proc,
    chat_line,
    healthy,
    stop_all,
    wait_until,
    write_jsonl,
)
from testbed.redis_server import RedisServer, free_port

MAX_UPLOAD = 256 * 1024  # small limits, so the 413 tests send little
MAX_BODY = 64 * 1024


class Shared:
    """A deployment started by the first test that asks for it and shared by the tests after it; release()
    stops it (a later user starts it again)."""

    def __init__(self, start: Any, stop: Any, name: str) -> None:
        self.start, self.stop, self.name = start, stop, name
        self.deployment: Any = None

    def get(self, tmp_path_factory: pytest.TempPathFactory) -> Any:
        if self.deployment is None:
            self.deployment = self.start(tmp_path_factory.mktemp(self.name))
        for p in self.deployment.procs.values():
            p.check_alive()
        return self.deployment

    def release(self) -> None:
        if self.deployment is not None:
            self.stop(self.deployment)
            self.deployment = None


@dataclass(kw_only=True)
class Stack(Deployment):
    files_dir: Path

    def producer(self):
        from producer import Client

        return Client(self.redis.url)

    def wait_batch(self, client, batch_id: str, statuses=("completed", "failed", "cancelled", "expired"),
                   timeout: float = 180):
        def done():
            b = client.batches.retrieve(batch_id)
            return b if b.status in statuses else None

        return wait_until(done, timeout, f"batch {batch_id} to reach {statuses}", list(self.procs.values()),
                          every=0.2)


EMBED_MODEL = "all-minilm-l6-v2"  # the embedding stack's worker (the built-in default embedding model)


def start_stack(tmp: Path, model: str = MODEL) -> Stack:
    srv = RedisServer().start()
    port = free_port()
    stack = Stack(redis=srv, base_url=f"http://127.0.0.1:{port}", files_dir=tmp / "files")
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENBUS_REDIS_URL=srv.url, TOKENBUS_LOG_JSON="1",
               TOKENBUS_DEVICE="cpu", HF_HUB_OFFLINE="1",
               TOKENBUS_GATEWAY_API_KEYS=",".join(KEYS.values()), TOKENBUS_GATEWAY_PORT=str(port),
               TOKENBUS_GATEWAY_FILES_DIR=str(stack.files_dir), TOKENBUS_GATEWAY_MAX_UPLOAD_BYTES=str(MAX_UPLOAD),
               TOKENBUS_GATEWAY_MAX_BODY_BYTES=str(MAX_BODY), TOKENBUS_GATEWAY_WEBHOOK_SECRET=WEBHOOK_SECRET,
               TOKENBUS_GATEWAY_WEBHOOK_RETRY_INTERVALS="2,2,2,2",
               TOKENBUS_GATEWAY_WEBHOOK_ALLOW_NETWORKS="127.0.0.0/8",
               TOKENBUS_GATEWAY_WATCH_INTERVAL_S="0.5", TOKENBUS_GATEWAY_COMPLETION_TIMEOUT_S="120",
               TOKENBUS_GATEWAY_KEY_PRIORITIES=f"{KEYS['dave']}=default", TOKENBUS_GATEWAY_MAX_STREAMS_PER_KEY="16",
               TOKENBUS_GATEWAY_MAX_REQUESTS_PER_KEY="24", TOKENBUS_GATEWAY_MAX_QUEUED_TOKENS_PER_KEY="100000")
    try:
        stack.procs["worker"] = Proc("worker", [
            "-m", "worker", "--model", model, "--worker-name", "gw-worker", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "512", "--kv-cache-gb", "0.25", "--heartbeat-s", "0.5"], env, tmp)
        stack.procs["gateway"] = Proc("gateway", ["-m", "gateway", "serve"], env, tmp)
        stack.procs["tasks"] = Proc("tasks", ["-m", "gateway", "tasks"], env, tmp)
        stack.procs["webhooks"] = Proc("webhooks", ["-m", "gateway", "webhooks"], env, tmp)
        procs = list(stack.procs.values())
        wait_until(lambda: healthy(stack.base_url), 60, "the gateway's /healthz", procs, every=0.1)
        r = srv.client()
        wait_until(lambda: r.exists("{tokenbus}:worker:gw-worker"), 300, "the worker's heartbeat", procs, every=0.2)
        wait_until(lambda: r.scard("rq:workers") >= 2, 60, "the RQ workers", procs, every=0.1)
    except BaseException:
        stop_stack(stack)
        raise
    return stack


def stop_stack(stack: Stack) -> None:
    stop_all(stack.all())
    stack.redis.cleanup()


_STACK = Shared(start_stack, stop_stack, "gateway")
_EMBED_STACK = Shared(lambda tmp: start_stack(tmp, EMBED_MODEL), stop_stack, "gateway-embed")


@pytest.fixture
def gateway_stack(tmp_path_factory) -> Stack:
    """The running deployment, started by the first test that asks and shared by the tests after it."""
    return _STACK.get(tmp_path_factory)


@pytest.fixture
def embed_gateway_stack(tmp_path_factory) -> Stack:
    """The same deployment with its worker on all-MiniLM-L6-v2 (embeddings), shared the same way."""
    return _EMBED_STACK.get(tmp_path_factory)


def release_gateway_stack(nextitem: pytest.Item | None) -> None:
    """conftest's pytest_runtest_teardown: stop the deployment once the next test does not use it, so its
    worker (a model in memory) does not idle through the rest of the suite. A later user restarts it."""
    for stack, fixture in ((_STACK, "gateway_stack"), (_EMBED_STACK, "embed_gateway_stack")):
        if nextitem is None or fixture not in getattr(nextitem, "fixturenames", ()):
            stack.release()


class WebhookReceiver(LoopbackReceiver):
    """Answers 500 to the first `fail_first` attempts of each webhook-id, then 200."""

    path = "/hooks/tokenbus"

    def __init__(self, fail_first: int = 2) -> None:
        self.fail_first = fail_first
        self.attempts: list[dict[str, Any]] = []  # every request: headers, body, answered status
        super().__init__()

    def on_post(self, handler: BaseHTTPRequestHandler) -> None:
        body = handler.rfile.read(int(handler.headers.get("content-length", 0)))
        with self.lock:
            msg_id = handler.headers.get("webhook-id")
            seen = sum(1 for a in self.attempts if a["headers"].get("webhook-id") == msg_id)
            status = 500 if seen < self.fail_first else 200
            self.attempts.append({"headers": {k.lower(): v for k, v in handler.headers.items()},
                                  "body": body, "status": status, "at": time.time()})
        handler.send_response(status)
        handler.send_header("content-length", "0")
        handler.end_headers()

    def delivered(self) -> list[dict[str, Any]]:
        with self.lock:
            return [a for a in self.attempts if a["status"] == 200]
