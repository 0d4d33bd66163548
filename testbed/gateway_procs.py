"""A gateway deployment's real processes, for the tests, the benchmarks and anything else that stands one up: a
child process with its log (Proc), polling until a state is reached with the processes' logs on failure
(wait_until), a started deployment with API clients as one of its keys (Deployment), batch-file lines, and a
loopback HTTP receiver for webhooks. No pytest: the tests' fixtures (tests/support/gateway_harness.py) build on it.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from testbed.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
KEYS = {"alice": "sk-alice-" + "a" * 24, "bob": "sk-bob-" + "b0" * 12, "carol": "sk-carol-" + "c" * 24,
        "dave": "sk-dave-" + "d" * 24}  # dave's completions queue as default (key_priorities)
WEBHOOK_SECRET = "whsec_" + base64.b64encode(b"tokenbus-gateway-test-secret-32b").decode()


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


def stop_all(procs: list[Proc]) -> None:
    """SIGTERM every process first, then wait on each: their shutdowns (a worker's drain, an RQ worker's
    second) overlap instead of adding up. A stopped (SIGSTOP) process is continued so it can see the TERM."""
    for p in procs:
        if p.proc.poll() is None:
            os.kill(p.proc.pid, signal.SIGCONT)
            p.proc.terminate()
    for p in procs:
        p.stop()  # a second SIGTERM to one still running: a worker then ends its drain at once (teardown)


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
    """A started gateway deployment (tests/support/gateway_harness.py's, light_gateway.py's, ui_stack.py's): its
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
