"""A whole gateway deployment for tests, as real processes: redis-server, a worker on the real SmolLM2-135M
(CPU), `python -m gateway serve` (uvicorn on a free port), `python -m gateway tasks`
(RQ worker + batch watcher) and `python -m gateway webhooks` (deliveries); plus a webhook
receiver thread. One per test session (gateway_stack).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from testbed.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"
KEYS = {"alice": "sk-alice-" + "a" * 24, "bob": "sk-bob-" + "b" * 24, "carol": "sk-carol-" + "c" * 24,
        "dave": "sk-dave-" + "d" * 24}  # dave's completions queue as default (key_priorities)
WEBHOOK_SECRET = "whsec_" + base64.b64encode(b"tokenbus-gateway-test-secret-32b").decode()
MAX_UPLOAD = 256 * 1024  # small limits, so the 413 tests send little
MAX_BODY = 64 * 1024


class Proc:
    """A child process with its output in a log file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name, self.log_path = name, log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")  # closed in stop()
        self.proc = subprocess.Popen([sys.executable, *args], cwd=str(ROOT), env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def wait_until(predicate, timeout: float, what: str, procs: list[Proc] = (), every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        for p in procs:
            p.check_alive()
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.tail()}" for p in procs)
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{logs}")
        time.sleep(every)


def healthy(base_url: str) -> bool:
    """The gateway at base_url answers its /healthz."""
    try:
        return httpx.get(base_url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass(kw_only=True)
class Deployment:
    """A started gateway deployment (this module's, tests/support/light_gateway.py's, ui_stack.py's): its
    redis-server, its URL and processes, and API clients as one of the KEYS."""

    redis: RedisServer
    base_url: str
    procs: dict[str, Proc] = field(default_factory=dict)
    timeout: float = 120  # the API clients'

    def all(self) -> list[Proc]:
        return list(self.procs.values())

    def openai(self, who: str = "alice", **kwargs: Any):
        from openai import OpenAI

        return OpenAI(api_key=KEYS[who], base_url=self.base_url + "/v1", max_retries=0, timeout=self.timeout,
                      **kwargs)

    def http(self, who: str | None = "alice") -> httpx.Client:
        headers = {"authorization": f"Bearer {KEYS[who]}"} if who else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=self.timeout)


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


def start_stack(tmp: Path) -> Stack:
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
            "-m", "worker", "--model", MODEL, "--worker-name", "gw-worker", "--max-num-seqs", "8",
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
    for p in stack.procs.values():
        p.stop()
    stack.redis.cleanup()


_STACK = Shared(start_stack, stop_stack, "gateway")


@pytest.fixture
def gateway_stack(tmp_path_factory) -> Stack:
    """The running deployment, started by the first test that asks and shared by the tests after it."""
    return _STACK.get(tmp_path_factory)


def release_gateway_stack(nextitem: pytest.Item | None) -> None:
    """conftest's pytest_runtest_teardown: stop the deployment once the next test does not use it, so its
    worker (a model in memory) does not idle through the rest of the suite. A later user restarts it."""
    if nextitem is None or "gateway_stack" not in getattr(nextitem, "fixturenames", ()):
        _STACK.release()


# ---- batch files ---------------------------------------------------------------------------------------------

def chat_line(cid: str, text: str, **body: Any) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 6,
            "temperature": 0.0} | body
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- webhook receiver ----------------------------------------------------------------------------------------

class LoopbackReceiver:
    """An HTTP server thread on 127.0.0.1 (a context manager) whose POSTs go to on_post(handler)."""

    path = "/hook"

    def __init__(self) -> None:
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                receiver.on_post(self)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{self.path}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def on_post(self, handler: BaseHTTPRequestHandler) -> None:
        raise NotImplementedError

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


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
