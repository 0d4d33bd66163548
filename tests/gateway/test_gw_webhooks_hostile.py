"""Issue #22, webhooks under attack: a trickling receiver, DNS rebinding, CGNAT/metadata addresses, one secret
for every tenant, and deliveries sharing a worker with submits."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from gateway.webhooks.delivery import DeliveryFailed, address_problem, deliver, parse_networks
from testbed.light_gateway import WEBHOOK_SECRET, TrickleReceiver, chat_line, listener, wait_until

SECRETS = [WEBHOOK_SECRET]


def test_one_deadline_covers_connect_headers_and_body():
    """A receiver trickling a byte every 0.3 s used to hold an attempt for minutes (the timeout was per read)."""
    with TrickleReceiver(every=0.2, total_s=20) as slow:
        t0 = time.monotonic()
        with pytest.raises(DeliveryFailed, match="did not answer within"):
            deliver(slow.url, SECRETS, "msg_1", "{}", timeout_s=0.6, allowed=parse_networks("127.0.0.0/8"))
        took = time.monotonic() - t0
    assert took < 1.0, f"one attempt took {took:.2f} s against a deadline of 0.6 s"


def test_resolved_once_and_connected_to_the_checked_address():
    """DNS rebinding: the name resolves to an allowed address for the check, then to another (loopback) for
    the connect. 127.0.0.2 stands for the public address (allow-listed), so nothing leaves the box."""
    checked = socket.socket()
    checked.bind(("127.0.0.2", 0))
    port = checked.getsockname()[1]
    checked.listen(4)
    target, _ = listener(port)  # 127.0.0.1, same port: where a second lookup would send the signed POST
    answers, calls = ["127.0.0.2", "127.0.0.1"], []

    def rebinding(host, port_, *args, **kwargs):
        addr = answers[min(len(calls), 1)]
        calls.append(addr)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (addr, port_))]

    def answer_once() -> None:
        conn, _ = checked.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 204 No Content\r\n\r\n")
        conn.close()

    server = threading.Thread(target=answer_once, daemon=True)
    server.start()
    real = socket.getaddrinfo
    socket.getaddrinfo = rebinding  # also what any library resolving again behind our back would call
    try:
        status = deliver(f"http://rebind.example:{port}/hook", SECRETS, "msg_2", "{}", timeout_s=2.0,
                         allowed=parse_networks("127.0.0.2/32"), resolve=rebinding)
    finally:
        socket.getaddrinfo = real
    server.join(5)
    try:
        target.accept()[0].close()
        reached = True
    except TimeoutError:
        reached = False
    checked.close()
    target.close()
    assert status == 204 and calls == ["127.0.0.2"], f"resolved {len(calls)} times: {calls}"
    assert not reached, "a signed POST reached the rebinding target"


@pytest.mark.parametrize("addr", ["100.64.0.1", "100.100.100.200", "100.127.255.254", "169.254.169.254",
                                  "127.0.0.1", "10.0.0.1", "192.168.1.1", "::1", "::ffff:127.0.0.1", "fd00::1",
                                  "0.0.0.0", "224.0.0.1"])
def test_only_globally_routable_addresses(addr):
    assert address_problem(addr, ()) is not None
    with pytest.raises(DeliveryFailed, match="not a globally routable"):
        deliver("http://victim.example/hook", SECRETS, "m", "{}", timeout_s=0.5,
                resolve=lambda h, p, **_: [(socket.AF_INET6 if ":" in addr else socket.AF_INET,
                                            socket.SOCK_STREAM, 6, "", (addr, p))])


def test_allow_list_and_mixed_answers():
    assert address_problem("8.8.8.8", ()) is None
    assert address_problem("10.1.2.3", parse_networks("10.1.0.0/16")) is None
    assert address_problem("10.2.0.1", parse_networks("10.1.0.0/16")) is not None
    mixed = lambda h, p, **_: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, p))  # noqa: E731
                               for a in ("8.8.8.8", "127.0.0.1")]
    with pytest.raises(DeliveryFailed, match="127.0.0.1"):
        deliver("http://rr.example/hook", SECRETS, "m", "{}", timeout_s=0.5, resolve=mixed)


def test_slow_receiver_delays_no_submit_and_each_key_has_its_own_secret(light_stack, tmp_path):
    from tests.support.gateway_harness import WebhookReceiver

    stack = light_stack
    with TrickleReceiver(every=0.4, total_s=20) as slow, WebhookReceiver(fail_first=0) as hooks:
        a = stack.batch("alice", [chat_line("a", "Hi")], tmp_path, webhook_url=slow.url)
        stack.openai("alice").batches.cancel(a.id)
        wait_until(lambda: slow.active, 10, "the trickling delivery to start", stack.all(), every=0.02)
        # While a delivery is held by the slow receiver, another tenant's batch is submitted at once.
        t0 = time.monotonic()
        b = stack.batch("bob", [chat_line("b", "Hi")], tmp_path, webhook_url=hooks.url)
        stack.wait_status("bob", b.id, ("in_progress",), timeout=10)
        submit_s = time.monotonic() - t0
        assert slow.active or slow.connections[-1]["closed"] > t0 + submit_s - 0.5
        stack.openai("bob").batches.cancel(b.id)
        wait_until(lambda: hooks.delivered(), 15, "bob's delivery", stack.all(), every=0.05)
        # The attempt at the slow receiver was cut at the 1.5 s deadline (+ the receiver noticing the close).
        wait_until(lambda: slow.connections, 15, "the slow attempt to end", stack.all(), every=0.05)
        held = [c["closed"] - c["opened"] for c in slow.connections]
    assert submit_s < 5, f"bob's submit waited {submit_s:.1f} s behind alice's webhook"
    assert max(held) < 1.5 + 1.5, f"attempts held the connection {held} s"

    with stack.http("alice") as ha, stack.http("bob") as hb, stack.http(None) as anon:
        sa, sb = ha.get("/v1/webhook_secret").json(), hb.get("/v1/webhook_secret").json()
        assert anon.get("/v1/webhook_secret").status_code == 401
    assert sa["secret"] != sb["secret"] and WEBHOOK_SECRET not in (sa["secret"], sb["secret"])
    attempt = hooks.delivered()[0]
    event = Webhook(sb["secret"]).verify(attempt["body"], attempt["headers"])
    assert event["data"]["id"] == b.id
    for other in (sa["secret"], WEBHOOK_SECRET):  # alice can no longer forge (or verify) bob's events
        with pytest.raises(WebhookVerificationError):
            Webhook(other).verify(attempt["body"], attempt["headers"])


def test_literal_private_webhook_url_refused_at_create(light_stack, tmp_path):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        light_stack.batch("carol", [chat_line("c", "Hi")], tmp_path, webhook_url="http://100.100.100.200/latest")
    assert err.value.param == "webhook_url" and err.value.code == "webhook_url_not_public"
