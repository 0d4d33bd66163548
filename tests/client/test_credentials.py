"""Credentials never printed or logged (#13 item 8): the CLI and the worker against a real redis-server that
requires a password, told a wrong one, none, or pointed at a server that is down. Each says which it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.redaction import redact_url, scrub
from testbed.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "s3cret-Pa55word"
WRONG = "wr0ng-Pa55word"


@pytest.fixture
def locked_server():
    with RedisServer(password=PASSWORD) as srv:
        yield srv


def cli(url: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "producer", "--url", url, *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=60)


@pytest.mark.parametrize("url, shown", [
    ("redis://user:s3cr%40t@host:6379/0", "redis://user:***@host:6379/0"),
    ("redis://:pw@h/0", "redis://:***@h/0"),
    ("redis://pw@h", "redis://***@h"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("redis://h/0?password=abc&db=1", "redis://h/0?password=***&db=1"),
    ("rediss://u:p@h:badport/0", "rediss://***@h:badport/0"),
    ("unix:///tmp/r.sock?password=x", "unix:///tmp/r.sock?password=***"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown
    secret = {"user:s3cr%40t": "s3cr@t", ":pw": "pw", "pw@": "pw", "abc": "abc", ":p@": "p", "=x": "x"}
    for marker, value in secret.items():
        if marker in url:
            assert value not in scrub(f"error from {url} ({value})", url)


def test_cli_says_auth_failure_without_printing_the_password(locked_server):
    port = locked_server.port
    wrong = cli(f"redis://:{WRONG}@127.0.0.1:{port}/0", "info")
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr
    assert "refused the credentials" in wrong.stderr and "Is redis-server running" not in wrong.stderr
    assert WRONG not in wrong.stderr + wrong.stdout and f"redis://:***@127.0.0.1:{port}/0" in wrong.stderr
    missing = cli(f"redis://127.0.0.1:{port}/0", "info")
    assert missing.returncode == 1 and "refused the credentials" in missing.stderr
    assert "The URL gives no password" in missing.stderr
    good = cli(locked_server.url, "info")
    assert good.returncode == 0 and "queue depth" in good.stdout


def test_cli_says_unreachable_without_printing_the_password():
    url = f"redis://user:{PASSWORD}@127.0.0.1:{free_port()}/0"  # nothing listens there
    down = cli(url, "submit", "hi")
    assert down.returncode == 1 and "cannot reach Redis" in down.stderr and "refused the credentials" not in down.stderr
    assert PASSWORD not in down.stderr + down.stdout
    bad = cli(f"nope://user:{PASSWORD}@host/0", "info")
    assert bad.returncode == 1 and "bad Redis URL" in bad.stderr and PASSWORD not in bad.stderr


def test_worker_logs_auth_failure_without_the_password(locked_server, serve_model_dir, worker_process):
    url = f"redis://:{WRONG}@127.0.0.1:{locked_server.port}/0"
    w = worker_process("--redis-url", url, "--model", serve_model_dir, "--kv-cache-gb", "0.05",
                       "--cpu-kernels", "false")
    event = w.wait_for_event("redis_auth_failed", timeout=240)
    assert "TOKENBUS_REDIS_URL" in event["fix"]
    started = next(e for e in w.events() if e.get("event") == "worker_starting")
    assert started["redis"] == f"redis://:***@127.0.0.1:{locked_server.port}/0"
    assert not any(e.get("event") == "redis_unavailable" for e in w.events()), "auth is not an outage"
    w.kill()
    assert WRONG not in w.log_path.read_text()
