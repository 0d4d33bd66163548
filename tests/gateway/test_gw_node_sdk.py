"""The official Node SDK's round trip (tests/gateway/node/roundtrip.mjs) against the light stack, while a thread
here ends the queued jobs as a worker would. `npm install openai@6` runs once into a cache directory
(TOKENBUS_NODE_CACHE, default ~/.cache/tokenbus/node-openai6; nothing is committed); without node the test is
skipped, saying so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from testbed.light_gateway import KEYS, LightStack

NODE_SDK = "openai@6"  # 7.x wants node 22; 6.x runs on node 18 and later
SCRIPT = Path(__file__).with_name("node") / "roundtrip.mjs"
PERSON_TEXT = '{"name": "Ann", "age": 30}'
USAGE = {"prompt_tokens": 30, "completion_tokens": 5, "total_tokens": 35, "cached_tokens": 16}


def node_sdk_dir() -> Path:
    """A directory whose node_modules holds the Node SDK (installed here the first time)."""
    cache = Path(os.environ.get("TOKENBUS_NODE_CACHE", Path.home() / ".cache" / "tokenbus" / "node-openai6"))
    if not (cache / "node_modules" / "openai" / "package.json").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "package.json").write_text('{"name": "tokenbus-node-sdk-test", "private": true}\n')
        done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent", NODE_SDK], cwd=cache,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"npm install {NODE_SDK} failed (is the npm registry reachable?): " \
                                     f"{done.stderr[-2000:]}"
    return cache


def end_queued_jobs(stack: LightStack, stop: threading.Event) -> None:
    """A stand-in worker: end every queued job (the text valid JSON, so a json_schema answer validates); a batch
    whose metadata says hold keeps its jobs, expire has its window closed, and a line `bad...` fails the first
    time (its retry batch, retry_of set, finishes it)."""
    r = stack.r()
    while not stop.is_set():
        for key in r.scan_iter("{tokenbus}:job:*", count=1000):
            if key.count(":") != 2 or r.type(key) != "hash" or r.hget(key, "status") != "queued":
                continue
            job_id = key.rsplit(":", 1)[1]
            batch_id, custom_id = r.hmget(key, "batch_id", "custom_id")
            gw = r.hgetall(f"{{tokenbus}}:gw:batch:{batch_id}") if batch_id else {}
            metadata = json.loads(gw.get("metadata") or "{}")
            if metadata.get("expire"):
                r.hset(f"{{tokenbus}}:gw:batch:{batch_id}", "expires_at", time.time() - 1)
            if metadata.get("hold"):
                continue
            fail = (custom_id or "").startswith("bad") and not gw.get("retry_of")
            stack.end_job(job_id, error_code="worker_error" if fail else None, text=PERSON_TEXT, usage=USAGE)
        stop.wait(0.05)


def test_node_sdk_round_trip(light_stack, tmp_path):
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed: the Node SDK round trip needs them (apt-get install nodejs npm)")
    sdk = node_sdk_dir()
    script = sdk / SCRIPT.name  # beside its node_modules, where an ES module finds its imports
    shutil.copyfile(SCRIPT, script)
    stop = threading.Event()
    worker = threading.Thread(target=end_queued_jobs, args=(light_stack, stop), daemon=True)
    worker.start()
    try:
        env = dict(os.environ, TOKENBUS_BASE_URL=light_stack.base_url, TOKENBUS_API_KEY=KEYS["dave"])
        run = subprocess.run(["node", str(script)], cwd=sdk, env=env, capture_output=True, text=True, timeout=180)
    finally:
        stop.set()
        worker.join(5)
    assert run.returncode == 0, f"node round trip failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["ok"] and summary["events"] == 4
