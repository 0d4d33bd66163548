"""The dashboard's browser test deployment: a real redis-server, a real worker on a tiny random-weight Llama
(fast on the CPU), `python -m gateway serve` and `... tasks` as processes; and Debian's chromium driven by
Playwright (never `playwright install`: scripts/setup_browser installs the system package)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from testbed.redis_server import RedisServer, free_port
from tests.support.gateway_harness import KEYS, Deployment, Proc, healthy, stop_all, wait_until

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
WORKER = "ui-worker"


@dataclass(kw_only=True)
class UiStack(Deployment):
    model: str  # the worker's model: batch lines and requests name it


def start_ui_stack(tmp: Path) -> UiStack:
    from testbed.tiny_models import make_tiny_model

    srv = RedisServer().start()
    port = free_port()
    model = str(tmp / "tiny")
    stack = UiStack(redis=srv, base_url=f"http://127.0.0.1:{port}", model=model)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENBUS_REDIS_URL=srv.url, TOKENBUS_LOG_JSON="1",
               TOKENBUS_DEVICE="cpu", HF_HUB_OFFLINE="1", TOKENBUS_GATEWAY_API_KEYS=",".join(KEYS.values()),
               TOKENBUS_GATEWAY_UI_READONLY_KEYS=KEYS["bob"], TOKENBUS_GATEWAY_UI_OPERATOR_KEYS=KEYS["alice"],
               TOKENBUS_GATEWAY_PORT=str(port),
               TOKENBUS_GATEWAY_FILES_DIR=str(tmp / "files"), TOKENBUS_GATEWAY_WATCH_INTERVAL_S="0.3")
    try:
        # the gateway needs no model: it starts while the model is written
        stack.procs["gateway"] = Proc("gateway", ["-m", "gateway", "serve"], env, tmp)
        stack.procs["tasks"] = Proc("tasks", ["-m", "gateway", "tasks"], env, tmp)
        # a long context, so a job can run long enough to be watched streaming and then cancelled
        make_tiny_model(model, "llama", rope_scaling=None, max_position_embeddings=4096)
        # PyTorch reference kernels: no C++ build to wait for (or to share a build lock with other suites)
        stack.procs["worker"] = Proc("worker", [
            "-m", "worker", "--model", model, "--worker-name", WORKER, "--max-num-seqs", "8",
            "--max-num-batched-tokens", "512", "--kv-cache-gb", "0.05", "--heartbeat-s", "0.5",
            "--cpu-kernels", "false"], env, tmp)
        wait_until(lambda: healthy(stack.base_url), 60, "the gateway's /healthz", stack.all(), every=0.1)
        r = srv.client()
        wait_until(lambda: r.exists("rq:workers"), 60, "the RQ worker", stack.all(), every=0.1)
        wait_until(lambda: r.exists(f"{{tokenbus}}:worker:{WORKER}"), 180, "the worker's heartbeat", stack.all(), 0.1)
    except BaseException:
        stop_ui_stack(stack)
        raise
    return stack


def stop_ui_stack(stack: UiStack) -> None:
    stop_all(stack.all())
    stack.redis.cleanup()


def launch_chromium(playwright):
    if not shutil.which(CHROMIUM) and not os.path.exists(CHROMIUM):
        pytest.fail("Debian's chromium is missing: run scripts/setup_browser (apt-get install chromium "
                    "chromium-driver); .ci/run does")
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
