"""Redis bytes per queued batch job, by request size: what gateway.batches.capacity's estimate must cover.

Submits batches of N lines (the gateway's own path: producer.batches.submit_batch on an OpenAI batch file)
into a fresh redis-server and reads INFO used_memory before and after; nothing runs them. Prints a table,
fits bytes/job = a + b x line bytes, and writes docs/gateway-redis-bytes.md.

    python -m benchmarks.queue.redis_bytes [--lines 5000]
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from bench.harness import parser
from gateway.batches.capacity import BODY_FACTOR, JOB_OVERHEAD_BYTES, estimate
from producer import Client, batches
from testbed.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
WORDS = [40, 200, 800, 3000]  # prompt characters: lines of roughly 200 B to 3 KB


def line(i: int, chars: int) -> str:
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": ("word " * chars)[:chars]}],
            "max_tokens": 64, "temperature": 0.0}
    return json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})


def measure(n: int) -> list[dict[str, float]]:
    rows = []
    with RedisServer() as srv, tempfile.TemporaryDirectory() as tmp:
        r = srv.client()
        client = Client(srv.url, max_queue_len=0)
        for k, chars in enumerate(WORDS):
            path = Path(tmp) / f"in-{chars}.jsonl"
            path.write_text("\n".join(line(i, chars) for i in range(n)) + "\n")
            size = path.stat().st_size
            before = int(r.info("memory")["used_memory"])
            # an id as long as the gateway's (batch_ + 32 hex): ids are in every job's key, entry and record
            batches.submit_batch(client, path, batch_id=f"batch_{k:032x}")
            grew = int(r.info("memory")["used_memory"]) - before
            rows.append({"line_bytes": size / n, "bytes_per_job": grew / n, "file_mb": size / 1e6,
                         "redis_mb": grew / 1e6, "estimate_mb": estimate(n, size) / 1e6})
    return rows


def fit(rows: list[dict[str, float]]) -> tuple[float, float]:
    xs, ys = [r["line_bytes"] for r in rows], [r["bytes_per_job"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--lines", type=int, default=5000)
    a = p.parse_args()
    rows = measure(a.lines)
    a0, b0 = fit(rows)
    head = "| line bytes | Redis bytes / job | file MB | Redis MB | estimate MB | estimate / measured |"
    table = [head, "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        table.append(f"| {r['line_bytes']:.0f} | {r['bytes_per_job']:.0f} | {r['file_mb']:.2f} | {r['redis_mb']:.2f} "
                     f"| {r['estimate_mb']:.2f} | {r['estimate_mb'] / r['redis_mb']:.2f} |")
    text = "\n".join(table)
    print(text)
    print(f"fit: bytes/job = {a0:.0f} + {b0:.2f} x line bytes; estimate uses {JOB_OVERHEAD_BYTES} + {BODY_FACTOR} x")
    doc = ROOT / "docs" / "gateway-redis-bytes.md"
    doc.write_text(f"""# Redis bytes per queued batch job

Measured by `python -m benchmarks.queue.redis_bytes --lines {a.lines}`: batches of {a.lines} OpenAI batch lines
submitted the gateway's way (`producer.batches.submit_batch`) into a fresh redis-server 7, nothing running
them; INFO `used_memory` before and after. A queued job holds its request once (its stream entry; the
job record holds short fields only: docs/protocol.md) plus fixed bookkeeping; batch ids as long as the gateway's.

{text}

Fit: bytes per job = {a0:.0f} + {b0:.2f} x line bytes. The gateway's estimate (gateway/batches/capacity.py,
checked before a batch is queued) is {JOB_OVERHEAD_BYTES} + {BODY_FACTOR} x line bytes, above every row.
A running or ended job keeps its record (with the result) until result_ttl; the estimate covers the
queued state, which is what a flood of batches fills.
""")
    print(f"wrote {doc.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
