"""Issue #22's minor items: /healthz leaks no Redis error text, /openapi.json needs a key, slow headers and
slow bodies are cut, a non-UTF-8 file is reported as such, a huge max_tokens is refused up front."""

from __future__ import annotations

import os
import socket
import time

import httpx
import openai
import pytest

from testbed.light_gateway import chat_line, wait_until
from testbed.redis_server import free_port
from tests.support.gateway_harness import KEYS, Proc


def test_healthz_hides_the_redis_error(tmp_path):
    port, dead = free_port(), free_port()
    env = dict(os.environ, TOKENBUS_REDIS_URL=f"redis://127.0.0.1:{dead}/0", TOKENBUS_GATEWAY_API_KEYS=KEYS["alice"],
               TOKENBUS_GATEWAY_PORT=str(port), TOKENBUS_GATEWAY_FILES_DIR=str(tmp_path / "f"), TOKENBUS_LOG_JSON="1")
    proc = Proc("gateway-no-redis", ["-m", "gateway", "serve"], env, tmp_path)
    try:
        def answer():
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
            except httpx.HTTPError:
                return None

        resp = wait_until(answer, 60, "the gateway to answer", [proc], every=0.1)
    finally:
        proc.stop()
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "redis_unavailable"
    assert str(dead) not in resp.text and "127.0.0.1" not in resp.text and "refused" not in resp.text.lower()
    assert str(dead) in proc.tail(), "the operator still finds the reason in the log"


def test_openapi_needs_a_key(light_stack):
    with light_stack.http(None) as anon, light_stack.http("alice") as alice:
        assert anon.get("/openapi.json").status_code == 401
        resp = alice.get("/openapi.json")
    assert resp.status_code == 200 and "/v1/batches" in resp.json()["paths"]


def _connect(stack) -> socket.socket:
    host, port = stack.base_url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    s.settimeout(0.1)
    return s


def _closed(s: socket.socket) -> bytes | None:
    """What the server sent before closing, or None while it keeps the connection open."""
    try:
        data = s.recv(65536)
    except TimeoutError:
        return None
    except ConnectionResetError:
        return b""
    if not data:
        return b""
    rest = data
    while chunk := s.recv(65536):
        rest += chunk
    return rest


def _trickle(s, piece) -> tuple[bytes | None, float]:
    """Send piece(i) every 0.1 s, 40 at most, until the gateway answers or closes (b""): (that, seconds)."""
    t0 = time.monotonic()
    for i in range(40):  # bounded: the gateway's deadlines are 1-2 s
        try:
            s.sendall(piece(i))
        except OSError:
            return b"", time.monotonic() - t0
        if (answer := _closed(s)) is not None:
            return answer, time.monotonic() - t0
        time.sleep(0.1)
    return None, time.monotonic() - t0


def test_slowloris_headers_are_cut(light_stack):
    s = _connect(light_stack)
    s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
    closed, took = _trickle(s, lambda i: f"x-slow-{i}: y\r\n".encode())  # the header deadline is 1 s
    s.close()
    assert closed is not None, "the connection was still open after 8 s of trickled headers"
    assert took < 1.0 + 1.0, f"closed after {took:.1f} s"


def test_slow_body_gets_408(light_stack):
    s = _connect(light_stack)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEYS['alice']}\r\n"
            "content-type: application/json\r\ncontent-length: 100000\r\n\r\n").encode()
    s.sendall(head)
    # grace 1 s, then 1 KiB/s wanted: 10 bytes every 0.1 s falls behind
    answer, took = _trickle(s, lambda i: b"x" * 10)
    s.close()
    assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
    assert took < 1.0 + 1.5, f"answered after {took:.1f} s"


def test_non_utf8_file_is_reported_as_such(light_stack):
    client = light_stack.openai("alice")
    data = (chat_line("a", "Hi") + "\n" + chat_line("b", "cafX")).encode().replace(b"cafX", b"caf\xe9")  # Latin-1
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("latin1.jsonl", data), purpose="batch")
    message = err.value.body["message"]
    assert "not UTF-8" in message and "line 2" in message and "of 0 lines" not in message


def test_huge_max_tokens_is_refused_up_front(light_stack):
    client = light_stack.openai("alice")
    data = "\n".join([chat_line("a", "Hi"), chat_line("b", "Hi", max_tokens=10**9)]).encode()
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("huge.jsonl", data), purpose="batch")
    assert "line 2: max_tokens 1000000000 is above this gateway's limit of 4096" in err.value.body["message"]
    r = light_stack.r()
    before = len(r.keys("{tokenbus}:job:*"))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=10**9)
    assert err.value.param == "max_tokens" and err.value.code == "max_tokens_too_large"
    assert len(r.keys("{tokenbus}:job:*")) == before, "no job was queued"
