"""Fixtures every layer shares. tests/ is a package, so pytest puts the repository root first on sys.path and
the tests import this checkout's code (also when run from a worktree beside an editable install)."""

import os
import sys
from pathlib import Path

import pytest

# pytest-xdist runs several test processes on a machine's few cores (scripts/test: three, beside the interpreted
# kernel suites): an intra-op thread pool per process sized to every core oversubscribes them, and each parallel
# region then waits for its descheduled threads (a 400-token Hugging Face generate took 33 s at 2 threads beside
# other work, 3.7 s at 1). One thread per test process, and per worker process a test starts (inherited).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)

from testbed.redis_server import RedisServer
from tests.support.log_setup import plain_tracebacks

plain_tracebacks()

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("protocol", "client", "gateway", "engine", "kernels", "serve", "deploy")


def pytest_collection_modifyitems(config, items):
    """Each test carries its layer's marker (its folder), so `pytest -m engine` runs one layer."""
    for item in items:
        parts = Path(str(item.fspath)).relative_to(ROOT / "tests").parts
        if parts and parts[0] in LAYERS:
            item.add_marker(getattr(pytest.mark, parts[0]))


@pytest.fixture
def redis_server():
    """A fresh real redis-server per test (RedisServer: .url, .client(), .stop(), .restart(), .kill())."""
    with RedisServer() as srv:
        yield srv


# ---- serve loop (tests/test_serve*.py) -------------------------------------------------------------------

import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import redis  # noqa: E402


@pytest.fixture(scope="session")
def serve_model_dir(tmp_path_factory):
    """A tiny random-weight Llama checkpoint (SmolLM2 tokenizer) for fast serve-loop tests."""
    from testbed.tiny_models import make_tiny_model

    # plain RoPE: the serve tests exercise the loop, not the rope variants (test_engine_families does)
    return make_tiny_model(str(tmp_path_factory.mktemp("serve-tiny")), "llama", rope_scaling=None)


@pytest.fixture(scope="module")
def serve_engine(serve_model_dir):
    """One tiny Engine per test module; each Server leaves it empty when it stops."""
    from worker import Engine

    return Engine(serve_model_dir, device="cpu", dtype="float32", block_size=16, max_num_seqs=16,
                  max_num_batched_tokens=256, kv_cache_gb=0.05)


@pytest.fixture
def steps_break_on_breaks_jobs(serve_engine, monkeypatch):
    """Fault injection on the real engine: any step whose batch holds a job whose id starts with "breaks-"
    raises, as an unattributed kernel fault would (the serve loop has to find the job that causes it)."""
    real_step = serve_engine.step

    def step():
        if any(rid.startswith("breaks-") for rid in serve_engine.requests):
            raise RuntimeError("simulated kernel fault")
        return real_step()

    monkeypatch.setattr(serve_engine, "step", step)


@pytest.fixture
def make_client(redis_server):
    """make_client(**Client kwargs) -> a producer Client on the test's redis_server."""
    from producer.client import Client

    clients = []

    def make(url: str | None = None, **kwargs) -> Client:
        # socket timeout above the Client's own XREAD BLOCKs (redis-py's default is 5 s)
        r = redis.Redis.from_url(url or redis_server.url, decode_responses=True, socket_timeout=30)
        clients.append(Client(redis_client=r, **kwargs))
        return clients[-1]

    yield make
    for c in clients:
        c.close()


class ServeThread:
    """A Server running its loop in a thread of the test process (no signals: stop() drains it)."""

    def __init__(self, server) -> None:
        self.server = server
        self.exit_code: int | None = None
        self.thread = threading.Thread(target=self._run, name=f"serve-{server.jobs.consumer}", daemon=True)

    def _run(self) -> None:
        self.exit_code = self.server.run()

    def stop(self, timeout: float = 60) -> int | None:
        self.server.request_stop("test")
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "serve loop did not stop"
        return self.exit_code


@pytest.fixture
def serve(redis_server):
    """serve(engine, **settings) -> ServeThread: a started in-process worker on the test's redis_server."""
    from worker.serve.server import Server
    from worker.settings import WorkerSettings

    started: list[ServeThread] = []

    def start(engine, url: str | None = None, metrics=None, **overrides) -> ServeThread:
        values = dict(redis_url=url or redis_server.url, model=engine.model_name, lease_ms=2000,
                      heartbeat_s=0.5, drain_grace_s=10, max_num_seqs=engine.max_num_seqs,
                      worker_name=f"test-worker-{len(started)}")
        values.update(overrides)
        settings = WorkerSettings(**values)
        client = redis.Redis.from_url(settings.redis_url, socket_timeout=10, socket_connect_timeout=2)
        handle = ServeThread(Server(settings, engine, client, metrics))
        handle.thread.start()
        started.append(handle)
        return handle

    yield start
    for handle in started:
        if handle.thread.is_alive():
            handle.stop()


class WorkerProcess:
    """`python -m worker ...` as a real child process, its JSON log in a file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.log_path = log_path
        self.log_file = open(log_path, "w")  # closed in wait() / kill()
        self.proc = subprocess.Popen([sys.executable, "-m", "worker", *args], cwd=str(ROOT), env=env,
                                     stdout=self.log_file, stderr=subprocess.STDOUT)

    def events(self) -> list[dict]:
        import json

        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def wait_for_event(self, name: str, timeout: float = 60, count: int = 1) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [e for e in self.events() if e.get("event") == name]
            if len(hits) >= count:
                return hits[count - 1]
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise AssertionError(f"worker exited ({code}) before {name!r}:\n{self.tail()}")
            time.sleep(0.05)
        raise AssertionError(f"no {name!r} event after {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.log_file.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log_file.close()


@pytest.fixture
def worker_process(tmp_path):
    """worker_process(*cli args) -> WorkerProcess (JSON logs, CPU); every one is killed at teardown."""
    procs: list[WorkerProcess] = []

    def start(*args: str) -> WorkerProcess:
        env = dict(os.environ, TOKENBUS_LOG_JSON="1", TOKENBUS_DEVICE="cpu", PYTHONUNBUFFERED="1")
        wp = WorkerProcess(list(args), tmp_path / f"worker-{len(procs)}.log", env)
        procs.append(wp)
        return wp

    yield start
    for wp in procs:
        wp.kill()


# ---- the gateway (tests/test_gateway_*.py): one deployment of real processes per session ------------------

from tests.support.gateway_harness import embed_gateway_stack, gateway_stack, release_gateway_stack  # noqa: E402, F401


def pytest_runtest_teardown(item, nextitem):
    release_gateway_stack(nextitem)


# ---- every engine test: the block manager's invariants -----------------------------------------------------


@pytest.fixture(autouse=True)
def block_manager_invariants(request):
    """After each test, every Engine it used: ref counts equal what the live block tables hold (no leaked
    or negative count, no block free twice); with nothing left to run, every block is free or cached."""
    yield
    for name in request.fixturenames:
        try:
            value = request.getfixturevalue(name)
        except Exception:  # a fixture that failed to set up: its own error is the report
            continue
        manager = getattr(value, "block_manager", None)
        scheduler = getattr(value, "scheduler", None)
        if manager is None or scheduler is None:
            continue
        manager.check_invariants(list(scheduler.running))
        if not value.has_unfinished_requests():
            assert manager.num_free == manager.num_blocks, f"{name}: KV blocks leaked"
