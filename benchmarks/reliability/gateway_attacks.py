"""Issue #22's attacks on the gateway (webhooks, stuck batches, Redis fill, slow clients), measured on
127.0.0.1 against real processes: redis-server, `tokenbus-gateway serve`, `tasks` and `webhooks` (the light
stack of testbed/light_gateway.py, no model worker), with the production webhook deadline (10 s).
Prints the figures and writes docs/gateway-attacks.md; docs/reliability.md's gateway table quotes them.

    python -m benchmarks.reliability.gateway_attacks
"""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import time
from pathlib import Path

from bench.harness import parser
from gateway.webhooks.delivery import DeliveryFailed, deliver, parse_networks
from testbed import light_gateway as lg
from testbed.light_gateway import TrickleReceiver, chat_line, start_light_stack, stop_light_stack

ROOT = Path(__file__).resolve().parents[2]

WEBHOOK_TIMEOUT_S = 10.0  # the setting's default


def webhook_attempt() -> float:
    """Seconds one attempt lasts against a receiver trickling a byte every 2 s (the issue's attacker)."""
    with TrickleReceiver(every=2.0, total_s=130) as slow:
        t0 = time.monotonic()
        try:
            deliver(slow.url, [lg.WEBHOOK_SECRET], "msg_bench", "{}", timeout_s=WEBHOOK_TIMEOUT_S,
                    allowed=parse_networks("127.0.0.0/8"))
        except DeliveryFailed:
            pass
        return time.monotonic() - t0


def submit_during_slow_delivery(stack, tmp: Path) -> float:
    with TrickleReceiver(every=2.0, total_s=60) as slow:
        a = stack.batch("alice", [chat_line("a", "Hi")], tmp, webhook_url=slow.url)
        stack.openai("alice").batches.cancel(a.id)
        lg.wait_until(lambda: slow.active, 20, "the slow delivery", stack.all(), every=0.02)
        t0 = time.monotonic()
        b = stack.batch("bob", [chat_line("b", "Hi")], tmp)
        stack.wait_status("bob", b.id, ("in_progress",), timeout=60)
        took = time.monotonic() - t0
        stack.openai("bob").batches.cancel(b.id)
        return took


def queue_full(stack, tmp: Path) -> float:
    from producer import Client

    r = stack.r()
    Client(stack.redis.url).submit_many([{"prompt": "x", "max_tokens": 1}] * (lg.MAX_QUEUE_LEN - 1))
    try:
        t0 = time.monotonic()
        b = stack.batch("alice", [chat_line(f"q{i}", "Hi") for i in range(3)], tmp)
        stack.wait_status("alice", b.id, ("failed",), timeout=60)
        return time.monotonic() - t0
    finally:
        r.xtrim("{tokenbus}:q:default", maxlen=0)
        keys = list(r.scan_iter("{tokenbus}:job:*", count=5000))
        for i in range(0, len(keys), 1000):
            r.unlink(*keys[i:i + 1000])


def oom_ingest(stack, tmp: Path) -> dict[str, float]:
    r = stack.r()
    stack.pause("tasks")
    try:
        b = stack.batch("alice", [chat_line(f"o{i}", "Tell me about the sea. " * 40) for i in range(2000)], tmp)
        base = int(r.info("memory")["used_memory"])
        r.config_set("maxmemory", base + 1024 * 1024)
    finally:
        stack.resume("tasks")
    t0 = time.monotonic()
    try:
        done = stack.wait_status("alice", b.id, ("failed",), timeout=60)
        took = time.monotonic() - t0
        after = int(r.info("memory")["used_memory"])
    finally:
        r.config_set("maxmemory", 0)
    return {"s": took, "base_mb": base / 1e6, "after_mb": after / 1e6, "code": done.errors.data[0].code}


def killed_submit(stack, tmp: Path) -> float:
    r = stack.r()
    lines = [chat_line(f"k{i}", "Say something long enough " * 4) for i in range(4000)]
    for _ in range(5):
        stack.pause("tasks")
        b = stack.batch("carol", lines, tmp)
        stack.resume("tasks")
        deadline = time.monotonic() + 20
        while not r.exists(f"{{tokenbus}}:gw:submit-lease:{b.id}") and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(stack.procs["tasks"].proc.pid, signal.SIGKILL)
        stack.procs["tasks"].proc.wait(10)
        killed_at = time.monotonic()
        stack.start("tasks")
        if not r.hget(f"{{tokenbus}}:gw:batch:{b.id}", "submitted_at"):
            stack.wait_status("carol", b.id, ("failed",), timeout=60)
            return time.monotonic() - killed_at
    raise RuntimeError("the submit always finished before the kill")


def slowloris(stack) -> float:
    host, port = stack.base_url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    s.settimeout(0.2)
    t0 = time.monotonic()
    s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
    for i in range(200):
        try:
            s.sendall(f"x-{i}: y\r\n".encode())
            if s.recv(100) == b"":
                break
        except TimeoutError:
            continue
        except OSError:
            break
    s.close()
    return time.monotonic() - t0


def main() -> None:
    parser(__doc__, docs=True).parse_args()
    figures: dict[str, object] = {"webhook_attempt_s": webhook_attempt()}
    lg.ENV["TOKENBUS_GATEWAY_WEBHOOK_TIMEOUT_S"] = str(WEBHOOK_TIMEOUT_S)
    lg.ENV["TOKENBUS_GATEWAY_HEADER_TIMEOUT_S"] = "10"
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        stack = start_light_stack(tmp)
        try:
            figures["submit_during_slow_delivery_s"] = submit_during_slow_delivery(stack, tmp)
            figures["queue_full_to_failed_s"] = queue_full(stack, tmp)
            figures["oom"] = oom_ingest(stack, tmp)
            figures["killed_submit_to_failed_s"] = killed_submit(stack, tmp)
            figures["slowloris_closed_after_s"] = slowloris(stack)
        finally:
            stop_light_stack(stack)
    print(json.dumps(figures, indent=2))
    f, oom = figures, figures["oom"]
    rows = [
        ("receiver trickling a byte every 2 s",
         f"one attempt lasts {f['webhook_attempt_s']:.1f} s (was 120 s: RQ's job timeout)"),
        ("another tenant's submit while such a delivery is held",
         f"in_progress after {f['submit_during_slow_delivery_s']:.1f} s (was 120 s)"),
        ("submit hits QueueFull",
         f"`failed` (`queue_full`) {f['queue_full_to_failed_s']:.1f} s after create (was `validating` forever)"),
        ("Redis at maxmemory during a 2,000-line ingest",
         f"`failed` (`{oom['code']}`) in {oom['s']:.1f} s; Redis {oom['base_mb']:.1f} MB before, "
         f"{oom['after_mb']:.1f} MB after"),
        ("tasks process SIGKILLed mid-submit",
         f"`failed` (`submit_failed`) {f['killed_submit_to_failed_s']:.1f} s after the kill"),
        ("headers trickled one line per 0.2 s", f"connection closed after {f['slowloris_closed_after_s']:.1f} s "
                                                "(was never)"),
    ]
    table = "\n".join(f"| {a} | {b} |" for a, b in rows)
    doc = ROOT / "docs" / "gateway-attacks.md"
    doc.write_text(f"""# Gateway attacks, measured

`python -m benchmarks.reliability.gateway_attacks` on 127.0.0.1 (redis-server 7, `tokenbus-gateway serve`, `tasks`,
`webhooks`; no model worker; a 2-core machine shared with other work). Webhook deadline 10 s (the default),
header deadline 10 s (the default), submit lease 2 s and watcher scan 0.3 s (the test settings).

| attack | figure |
|---|---|
{table}
""")
    print(f"wrote {doc.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
