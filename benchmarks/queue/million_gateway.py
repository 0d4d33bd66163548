"""The gateway route of benchmarks/queue/million.py: `tokenbus-gateway serve` and `tasks` on a private
redis-server, a batch file uploaded (POST /v1/files), made a batch (POST /v1/batches) and submitted by the
tasks process, every job then ended (FINISH_JOB) and the batch's finalisation into its output file timed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import redis

from benchmarks.queue.million_probe import cpu_s, finish_all, hwm_mb, redis_bytes, redis_cpu, step
from protocol.keys import Keys
from testbed.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-bench-" + "m" * 24


class Gateway:
    """`tokenbus-gateway serve` and `tasks` on a private redis-server, limits opened for a million lines."""

    def __init__(self, srv: RedisServer, tmp: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = dict(
            os.environ,
            PYTHONPATH=str(ROOT),
            TOKENBUS_REDIS_URL=srv.url,
            TOKENBUS_LOG_JSON="1",
            TOKENBUS_GATEWAY_API_KEYS=KEY,
            TOKENBUS_GATEWAY_PORT=str(port),
            TOKENBUS_GATEWAY_FILES_DIR=str(tmp / "files"),
            TOKENBUS_GATEWAY_MAX_UPLOAD_BYTES=str(4 << 30),
            TOKENBUS_GATEWAY_MAX_REQUESTS_PER_FILE="10000000",
            TOKENBUS_GATEWAY_MAX_QUEUED_REQUESTS_PER_KEY="10000000",
            TOKENBUS_GATEWAY_MAX_QUEUED_TOKENS_PER_KEY="100000000000",
            TOKENBUS_GATEWAY_MAX_QUEUED_BYTES_PER_KEY=str(64 << 30),
            TOKENBUS_GATEWAY_MAX_QUEUED_BYTES=str(64 << 30),
            TOKENBUS_GATEWAY_WATCH_INTERVAL_S="0.5",
            TOKENBUS_GATEWAY_MIN_BODY_RATE="1024",
        )
        self.logs = [open(tmp / f"{name}.log", "w") for name in ("serve", "tasks")]  # noqa: SIM115
        self.procs = {
            name: subprocess.Popen(
                [sys.executable, "-m", "gateway", name], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
            for name, log in zip(("serve", "tasks"), self.logs, strict=True)
        }
        self.http = httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {KEY}"}, timeout=3600)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start: see its log")
            time.sleep(0.2)

    def cpu(self) -> dict[str, float]:
        return {name: cpu_s(p.pid) for name, p in self.procs.items()}

    def peaks(self) -> dict[str, float]:
        return {name: hwm_mb(p.pid) for name, p in self.procs.items()}

    def post(self, path: str, **kwargs: Any) -> dict:
        """POST to the gateway; its JSON answer (an HTTP error raises)."""
        return self.http.post(path, **kwargs).raise_for_status().json()

    def batch(self, batch_id: str) -> dict:
        return self.http.get(f"/v1/batches/{batch_id}").raise_for_status().json()

    def wait(self, batch_id: str, until, timeout: float = 7200) -> dict:
        deadline = time.monotonic() + timeout
        while not until(b := self.batch(batch_id)):
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"gateway {name} exited ({p.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch {batch_id} stuck: {b}")
            time.sleep(0.25)
        return b

    def close(self) -> None:
        for p in self.procs.values():
            p.terminate()
            p.wait(30)
        for log in self.logs:
            log.close()


def gateway_route(path: Path, n: int, tmp: Path) -> dict:
    out: dict = {}
    with RedisServer() as srv:
        r, keys = redis.Redis.from_url(srv.url), Keys()
        gw = Gateway(srv, tmp)
        try:
            out["idle_rss_mb"] = gw.peaks()
            cpu0 = gw.cpu()
            t0 = time.perf_counter()
            with path.open("rb") as f:
                meta = gw.post("/v1/files", data={"purpose": "batch"},
                               files={"file": (path.name, f, "application/jsonl")})
            secs = time.perf_counter() - t0
            cpu1 = gw.cpu()
            out["upload"] = step(n, secs, cpu1["serve"] - cpu0["serve"])
            print(f"gateway upload: {n / secs:,.0f} lines/s", flush=True)
            before, rcpu = int(r.info("memory")["used_memory"]), redis_cpu(r)
            t0 = time.perf_counter()
            batch = gw.post("/v1/batches", json={"input_file_id": meta["id"], "endpoint": "/v1/chat/completions",
                                                 "completion_window": "24h"})
            gw.wait(batch["id"], lambda b: b["status"] != "validating")
            secs = time.perf_counter() - t0
            cpu2 = gw.cpu()
            out["submit"] = step(n, secs, cpu2["tasks"] - cpu1["tasks"], redis_cpu(r) - rcpu)
            out["redis"] = redis_bytes(r, keys, batch["id"], before, n)
            print(f"gateway submit: {n / secs:,.0f} lines/s, {out['redis']['bytes_per_job']:.0f} B/job", flush=True)
            out["finish_s"] = finish_all(r, keys, batch["id"], n)
            cpu3 = gw.cpu()
            t0 = time.perf_counter()
            done = gw.wait(batch["id"], lambda b: b["status"] in ("completed", "failed", "cancelled", "expired"))
            secs = time.perf_counter() - t0
            out["finalize"] = step(n, secs, gw.cpu()["tasks"] - cpu3["tasks"], status=done["status"])
            t0 = time.perf_counter()
            lines = 0
            with gw.http.stream("GET", f"/v1/files/{done['output_file_id']}/content") as resp:
                for _ in resp.iter_lines():
                    lines += 1
            out["download"] = {"seconds": time.perf_counter() - t0, "lines": lines}
            print(f"gateway finalize: {n / secs:,.0f} lines/s; output {lines} lines", flush=True)
            out["peak_rss_mb"] = gw.peaks()
        finally:
            gw.close()
    return out
