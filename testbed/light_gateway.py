"""A gateway deployment without a model worker, for the attack tests (tests/gateway/test_gw_*.py) and
benchmarks/reliability/gateway_attacks.py: a real redis-server, `python -m gateway serve`, `... tasks` and
`... webhooks` as processes, with short deadlines so every attack ends in seconds. Jobs that must end are
ended the way a worker ends them (protocol.scripts.start_job / finish_job: the real Lua), so no model has to
load.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from testbed.gateway_procs import (
    KEYS,
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

__all__ = ["KEYS", "WEBHOOK_SECRET", "chat_line", "write_jsonl", "wait_until", "LightStack", "TrickleReceiver"]

MAX_QUEUE_LEN = 6000
ENV = {  # short deadlines: each attack resolves in a few seconds
    "TOKENBUS_GATEWAY_WEBHOOK_TIMEOUT_S": "1.5", "TOKENBUS_GATEWAY_WEBHOOK_RETRY_INTERVALS": "1,1",
    "TOKENBUS_GATEWAY_WEBHOOK_ALLOW_NETWORKS": "127.0.0.0/8", "TOKENBUS_GATEWAY_WATCH_INTERVAL_S": "0.3",
    "TOKENBUS_GATEWAY_SUBMIT_LEASE_S": "2", "TOKENBUS_GATEWAY_HEADER_TIMEOUT_S": "1",
    "TOKENBUS_GATEWAY_BODY_GRACE_S": "1", "TOKENBUS_GATEWAY_MIN_BODY_RATE": "1024",
    "TOKENBUS_GATEWAY_MAX_UPLOAD_BYTES": str(4 * 1024 * 1024), "TOKENBUS_GATEWAY_MAX_TOKENS_LIMIT": "4096",
    "TOKENBUS_GATEWAY_TASKS_RESTART_BACKOFF_S": "0.3,0.3,0.3,0.3", "TOKENBUS_GATEWAY_MIN_OUTPUT_EXPIRES_S": "1",
}


@dataclass(kw_only=True)
class LightStack(Deployment):
    env: dict[str, str]
    log_dir: Path
    timeout: float = 30

    def start(self, name: str) -> Proc:
        cmd = {"gateway": "serve", "tasks": "tasks", "webhooks": "webhooks"}[name]
        self.procs[name] = Proc(f"{name}-{time.monotonic_ns()}", ["-m", "gateway", cmd], self.env,
                                self.log_dir)
        return self.procs[name]

    def r(self):
        return self.redis.client(decode_responses=True)

    def upload(self, who: str, lines: list[str], tmp: Path) -> str:
        """A batch input file of these lines uploaded as `who`: its id."""
        src = write_jsonl(tmp / f"in-{time.monotonic_ns()}.jsonl", lines)
        return self.openai(who).files.create(file=src.open("rb"), purpose="batch").id

    def create(self, who: str, file_id: str, **extra: Any):
        """A batch of an uploaded file, as `who` (extra: more fields of the create's body)."""
        return self.openai(who).batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                               completion_window="24h", **({"extra_body": extra} if extra else {}))

    def batch(self, who: str, lines: list[str], tmp: Path, **extra: Any):
        return self.create(who, self.upload(who, lines, tmp), **extra)

    def wait_status(self, who: str, batch_id: str, statuses: tuple[str, ...], timeout: float = 20):
        client = self.openai(who)

        def done():
            b = client.batches.retrieve(batch_id)
            return b if b.status in statuses else None

        return wait_until(done, timeout, f"batch {batch_id} to reach {statuses}", self.all(), every=0.1)

    def forget_kept(self) -> None:
        """Empty every key's ledger (results and sessions kept, files and ended batches' records held), as if
        they had all gone: a test of the byte limits then starts from what its own calls hold, not from what
        earlier tests on this stack left (open batches' reservations stay: they end with their batches)."""
        r = self.r()
        for ledger in list(r.scan_iter("{tokenbus}:gw:kept-bytes:*")):
            r.delete(ledger)

    def restart_gateway(self, settings: dict[str, str | None]) -> None:
        """Stop `gateway serve`, change its settings (None: unset) and start it again, as an operator would."""
        self.procs["gateway"].stop()
        for name, value in settings.items():
            if value is None:
                self.env.pop(name, None)
            else:
                self.env[name] = value
        self.start("gateway")
        wait_until(lambda: healthy(self.base_url), 60, "the restarted gateway's /healthz", self.all(), every=0.1)

    def pause(self, name: str) -> None:
        os.kill(self.procs[name].proc.pid, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        os.kill(self.procs[name].proc.pid, signal.SIGCONT)

    def end_job(self, job_id: str, *, error_code: str | None = None, text: str = "ok", error: str = "",
                result: dict[str, Any] | None = None, usage: dict[str, int] | None = None) -> None:
        """End a queued job as a worker would (start_job then finish_job: the worker's own Lua), with `result`
        (a JobResult's fields) or a short one saying `text`, with `usage` (prompt_tokens, completion_tokens,
        total_tokens, cached_tokens)."""
        from protocol import scripts
        from protocol.keys import Keys

        r, keys = self.r(), Keys("tokenbus")
        entry, queue = r.hmget(keys.job(job_id), "entry_id", "queue")
        status, _ = scripts.start_job(r, keys, job_id, entry, "test-worker", queue=queue)
        assert status == "running", status
        if error_code:
            scripts.finish_job(r, keys, job_id, "failed", entry_id=entry, queue=queue, error_code=error_code,
                               error=error or f"the test worker says {error_code}")
        else:
            scripts.finish_job(r, keys, job_id, "finished", entry_id=entry, queue=queue,
                               result=result or {"text": text, "finish_reason": "stop", "model": "smollm2-135m",
                                                 "usage": usage or {}})


def start_light_stack(tmp: Path, settings: dict[str, str] | None = None) -> LightStack:
    """The stack, its processes' environment being ENV with `settings` (TOKENBUS_GATEWAY_* values) over it."""
    srv = RedisServer().start()
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENBUS_REDIS_URL=srv.url, TOKENBUS_LOG_JSON="1",
               TOKENBUS_GATEWAY_API_KEYS=",".join(KEYS.values()), TOKENBUS_GATEWAY_PORT=str(port),
               TOKENBUS_GATEWAY_FILES_DIR=str(tmp / "files"), TOKENBUS_GATEWAY_WEBHOOK_SECRET=WEBHOOK_SECRET,
               **(ENV | (settings or {})))
    stack = LightStack(redis=srv, base_url=f"http://127.0.0.1:{port}", env=env, log_dir=tmp)
    # The queue's limit, read once by each producer Client: low enough that a test can fill the queue.
    srv.client().hset("{tokenbus}:config", "max_queue_len", MAX_QUEUE_LEN)
    try:
        for name in ("gateway", "tasks", "webhooks"):
            stack.start(name)
        wait_until(lambda: healthy(stack.base_url), 60, "the gateway's /healthz", stack.all(), every=0.1)
        r = srv.client()
        wait_until(lambda: r.scard("rq:workers") >= 2, 60, "the two RQ workers", stack.all(), every=0.1)
    except BaseException:
        stop_light_stack(stack)
        raise
    return stack


def stop_light_stack(stack: LightStack) -> None:
    stop_all(stack.all())
    stack.redis.cleanup()


class TrickleReceiver(LoopbackReceiver):
    """A webhook receiver that answers one byte of its status line every `every` seconds (a slow receiver
    holding each attempt as long as the sender lets it). Records when each connection opened/closed."""

    def __init__(self, every: float = 0.5, total_s: float = 30) -> None:
        self.every, self.total_s = every, total_s
        self.connections: list[dict[str, float]] = []  # ended ones
        self.active = 0  # connections being answered now
        super().__init__()

    def on_post(self, handler: BaseHTTPRequestHandler) -> None:
        opened = time.monotonic()
        with self.lock:
            self.active += 1
        handler.rfile.read(int(handler.headers.get("content-length", 0)))
        answer = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
        deadline = opened + self.total_s
        try:
            for byte in answer:  # bounded: the answer has ~40 bytes, and total_s caps it
                if time.monotonic() > deadline:
                    break
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
                time.sleep(self.every)
        except OSError:  # the sender gave up and closed: what we measure
            pass
        with self.lock:
            self.active -= 1
            self.connections.append({"opened": opened, "closed": time.monotonic()})
        handler.close_connection = True


def listener(port: int = 0) -> tuple[socket.socket, int]:
    """A bare loopback listener (what a rebinding attack would reach); its accept() shows any connection."""
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen(8)
    s.settimeout(0.05)
    return s, s.getsockname()[1]
