"""compose.yaml and the recipes of docs/deployment.md, checked without a Docker engine.

No Docker daemon or GPU here, so: the compose file goes through Compose's variable interpolation (below,
as the Compose spec defines it) and then a strict Compose-spec parser (the `compose-spec` package); the
Redis service's exact command runs in a real redis-server (auth, the ACL user under the real producer and
worker code, AOF, the healthcheck, the documented TLS recipe). The Dockerfile: tests/deploy/test_dockerfile.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import yaml

from protocol.records import DeadLetter, Heartbeat
from testbed.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_TEXT = (ROOT / "compose.yaml").read_text()
DOCKERFILE = (ROOT / "Dockerfile").read_text()
DEPLOY_DOC = (ROOT / "docs" / "deployment.md").read_text()
ENV = {"REDIS_PASSWORD": "a1" * 12, "TOKENBUS_REDIS_PASSWORD": "b2" * 12, "TOKENBUS_GATEWAY_REDIS_PASSWORD": "c3" * 12,
       "TOKENBUS_GATEWAY_API_KEYS": "sk-d4d4d4d4d4d4d4d4,sk-e5e5e5e5e5e5e5e5"}
BIN = Path(sys.executable).parent


# ---- Compose's interpolation: $$, $VAR, ${VAR}, ${VAR:-d}, ${VAR-d}, ${VAR:?e}, ${VAR?e}, ${VAR:+a} -----

class MissingVariable(ValueError):
    pass


_VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_]\w*)(?:(:?[-?+])([^}]*))?\}|([A-Za-z_]\w*))")


def interpolate(text: str, env: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        dollar, name, op, arg, bare = m.groups()
        if dollar:
            return "$"
        if bare:
            return env.get(bare, "")
        value = env.get(name)
        if op is None:
            return value or ""
        unset = (not value) if op.startswith(":") else value is None
        if op.endswith("-"):
            return arg if unset else value
        if op.endswith("?"):
            if unset:
                raise MissingVariable(f"{name}: {arg}")
            return value
        return "" if unset else arg

    return _VAR.sub(sub, text)


def load_compose(text: str, **env: str) -> dict:
    def walk(node):
        if isinstance(node, str):
            return interpolate(node, ENV | env)
        if isinstance(node, list):
            return [walk(x) for x in node]
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return node

    return walk(yaml.safe_load(text))  # PyYAML applies the `<<: *worker` merges, as Compose does


def validate(data: dict) -> None:
    """The compose-spec parser: unknown keys, wrong types, bad durations/ports/devices raise ValueError."""
    compose_spec = pytest.importorskip("compose_spec", reason="pip install compose-spec")
    compose_spec.PyCompose.from_json(json.dumps(data)).to_spec()


def doc_block(marker: str) -> str:
    m = re.search(rf"<!-- {re.escape(marker)} -->\n```\w+\n(.*?)```", DEPLOY_DOC, re.S)
    assert m, f"docs/deployment.md lost its block marked <!-- {marker} -->"
    return m.group(1)


def seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration))


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose(COMPOSE_TEXT)


# ---- compose.yaml ------------------------------------------------------------------------------------

def uncomment_service(name: str) -> str:
    """compose.yaml with the commented recipe `name` (its `  # name:` line and the commented lines indented
    under it) made live, the other recipes left commented."""
    lines, out, inside = COMPOSE_TEXT.splitlines(), [], False
    for line in lines:
        if line == f"  # {name}:":
            inside = True
        elif inside and not line.startswith("  #   "):
            inside = False
        out.append("  " + line[4:] if inside else line)
    return "\n".join(out) + "\n"


def test_compose_file_passes_the_compose_spec_parser(compose):
    validate(compose)
    # The commented recipe for a second GPU stays valid and differs from `worker` only in its GPU.
    multi = load_compose(uncomment_service("worker-gpu1"))
    validate(multi)
    gpu1 = multi["services"]["worker-gpu1"]
    assert gpu1["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["1"]
    assert {k: v for k, v in gpu1.items() if k != "deploy"} == {
        k: v for k, v in compose["services"]["worker"].items() if k != "deploy"}
    # ... and the parser does catch mistakes (a typo'd key, a bad duration).
    for broken in (COMPOSE_TEXT.replace("stop_grace_period: 90s", "stop_grace_perod: 90s"),
                   COMPOSE_TEXT.replace("interval: 5s", "interval: 5 sec")):
        with pytest.raises(ValueError):
            validate(load_compose(broken))


def test_the_tensor_parallel_example_reserves_two_gpus_for_one_tp2_worker(monkeypatch):
    """The commented worker-tp2 recipe: valid, two GPUs reserved, and its environment (the worker's, merged)
    parses as a TP=2 worker of the model it names."""
    from worker.settings import WorkerSettings

    uncommented = load_compose(uncomment_service("worker-tp2"))
    validate(uncommented)
    tp2 = uncommented["services"]["worker-tp2"]
    (reservation,) = tp2["deploy"]["resources"]["reservations"]["devices"]
    assert len(reservation["device_ids"]) == 2 and reservation["capabilities"] == ["gpu"]
    env = tp2["environment"]
    assert env["TOKENBUS_TENSOR_PARALLEL_SIZE"] == "2" and "TOKENBUS_REDIS_URL" in env and tp2["shm_size"]
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    settings = WorkerSettings()
    assert settings.engine.tensor_parallel_size == 2 and settings.engine.model == env["TOKENBUS_MODEL"]


def test_two_worker_services_serve_two_models_each_on_its_own_gpu(compose, monkeypatch):
    """worker (TOKENBUS_MODEL, GPU 0) and worker-model-b (another model and served name, GPU 1, behind the
    second-model profile): their environments parse as workers of different models on different GPUs."""
    from worker.settings import WorkerSettings

    a, b = compose["services"]["worker"], compose["services"]["worker-model-b"]
    assert b["profiles"] == ["second-model"] and "profiles" not in a
    gpus = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for s in (a, b)]
    assert gpus == [["0"], ["1"]]
    settings = []
    for service in (a, b):
        for name in ("TOKENBUS_MODEL", "TOKENBUS_SERVED_MODEL_NAME"):
            monkeypatch.delenv(name, raising=False)
        for name, value in service["environment"].items():
            monkeypatch.setenv(name, str(value))
        settings.append(WorkerSettings())
    assert settings[0].engine.model != settings[1].engine.model
    assert settings[0].served_model_name == [] and settings[1].served_model_name == ["qwen2.5-0.5b"]
    assert settings[0].redis_url == settings[1].redis_url and settings[0].namespace == settings[1].namespace


def test_compose_refuses_to_start_without_the_passwords():
    for name in ENV:
        with pytest.raises(MissingVariable, match=f"{name}: set {name} in .env"):
            load_compose(COMPOSE_TEXT, **{name: ""})


def test_docker_compose_config_when_the_plugin_exists(tmp_path):
    if shutil.which("docker") is None or subprocess.run(["docker", "compose", "version"],
                                                        capture_output=True).returncode != 0:
        pytest.skip("no `docker compose` plugin here (the compose-spec parser checks the file instead)")
    (tmp_path / "compose.tls.yaml").write_text(doc_block("file: compose.tls.yaml"))
    for files in (["compose.yaml"], ["compose.yaml", str(tmp_path / "compose.tls.yaml")]):
        args = [a for f in files for a in ("-f", f)]
        out = subprocess.run(["docker", "compose", *args, "config", "--quiet"], cwd=ROOT, capture_output=True,
                             env=ENV | {"PATH": "/usr/bin:/bin:/usr/local/bin"}, text=True)
        assert out.returncode == 0, out.stderr


def redis_options(command: list[str]) -> dict[str, list[str]]:
    opts: dict[str, list[str]] = {}
    name = None
    for arg in command[1:]:
        if arg.startswith("--"):
            name = arg[2:]
            opts[name] = []
        else:
            opts[name].append(arg)
    return opts


def test_redis_service_persists_and_never_evicts(compose):
    redis_svc = compose["services"]["redis"]
    assert re.fullmatch(r"redis:7(\.\d+)*(-alpine)?", redis_svc["image"])
    opts = redis_options(redis_svc["command"])
    assert opts["appendonly"] == ["yes"] and opts["appendfsync"] == ["everysec"]
    assert opts["maxmemory-policy"] == ["noeviction"]
    assert opts["requirepass"] == [ENV["REDIS_PASSWORD"]]
    assert "redis-data:/data" in redis_svc["volumes"] and "redis-data" in compose["volumes"]
    assert "redis-cli ping" in redis_svc["healthcheck"]["test"][1]
    assert redis_svc["restart"] == "unless-stopped"


def test_worker_service_gets_one_gpu_drains_and_configures_the_worker(compose, monkeypatch):
    from worker.settings import ENGINE_FIELDS, WorkerSettings

    w = compose["services"]["worker"]
    assert w["build"]["dockerfile"] == "Dockerfile"
    (device,) = w["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}
    assert w["depends_on"]["redis"]["condition"] == "service_healthy"
    assert w["restart"] == "unless-stopped" and w["stop_signal"] == "SIGTERM"
    env = w["environment"]
    assert f"hf-cache:{env['HF_HOME']}" in w["volumes"] and "hf-cache" in compose["volumes"]
    # Every TOKENBUS_ variable is a real setting (pydantic-settings would silently ignore a typo) ...
    unknown = {k for k in env if k.startswith("TOKENBUS_")} - {
        f"TOKENBUS_{f.upper()}" for f in (*WorkerSettings.model_fields, *ENGINE_FIELDS)}
    assert not unknown, f"not WorkerSettings fields: {unknown}"
    # ... and the worker parses them as meant.
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s = WorkerSettings()
    assert s.redis_url == f"redis://tokenbus:{ENV['TOKENBUS_REDIS_PASSWORD']}@redis:6379/0"
    assert (s.engine.device, s.engine.dtype, s.engine.model) == ("cuda", "bfloat16", "smollm2-135m")
    # The metrics port is the one exposed, the one the image exposes and its HEALTHCHECK probes.
    assert w["expose"] == [str(s.metrics_port)]
    assert re.search(rf"(?m)^EXPOSE {s.metrics_port}$", DOCKERFILE)
    # Docker must not SIGKILL a worker that is still inside its drain.
    assert seconds(w["stop_grace_period"]) >= s.drain_grace_s + 15


# ---- Redis with the compose command ------------------------------------------------------------------

class LocalRedis:
    """redis-server with a compose command, on a free loopback port in tmp_path (never 6379)."""

    def __init__(self, command: list[str], tmp: Path, port_flag: str = "--port", tls_dir: str = ""):
        self.port = free_port()
        self.args = [a.replace("/tls/", tls_dir) if tls_dir else a for a in command]
        self.args += [port_flag, str(self.port), "--bind", "127.0.0.1", "--dir", str(tmp),
                      "--logfile", str(tmp / "redis.log")]
        self.tmp = tmp
        self.proc = None

    def start(self, ping) -> LocalRedis:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if ping():
                    return self
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                time.sleep(0.05)
        log = (self.tmp / "redis.log").read_text() if (self.tmp / "redis.log").exists() else ""
        self.kill()
        raise RuntimeError(f"redis-server {self.args} did not start:\n{log[-2000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def healthcheck_rc(test: list[str], port: int, password: str, tls_dir: str = "") -> int:
    cmd = test[1].replace("redis-cli", f"redis-cli -p {port}")
    cmd = cmd.replace("/tls/", tls_dir) if tls_dir else cmd
    return subprocess.run(["sh", "-c", cmd], env={"PATH": "/usr/bin:/bin", "REDISCLI_AUTH": password},
                          capture_output=True, timeout=30).returncode


@pytest.fixture
def compose_redis(compose, tmp_path):
    srv = LocalRedis(compose["services"]["redis"]["command"], tmp_path)
    admin = redis.Redis(port=srv.port, password=ENV["REDIS_PASSWORD"], socket_timeout=5)
    srv.start(admin.ping)
    yield srv, admin
    admin.close()
    srv.kill()


def app_url(port: int, **env: str) -> str:
    worker_env = load_compose(COMPOSE_TEXT, REDIS_HOST=env.pop("REDIS_HOST", "127.0.0.1"),
                              REDIS_HOST_PORT=str(port), **env)["services"]["worker"]["environment"]
    return worker_env["TOKENBUS_REDIS_URL"]


def test_compose_redis_auth_acl_healthcheck_and_aof(compose, compose_redis):
    srv, admin = compose_redis
    cfg = {k: v.decode() if isinstance(v, bytes) else v for k, v in admin.config_get("*").items()}
    assert (cfg["appendonly"], cfg["appendfsync"]) == ("yes", "everysec")
    assert cfg["maxmemory-policy"] == "noeviction"
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=srv.port).ping()
    test = compose["services"]["redis"]["healthcheck"]["test"]
    assert healthcheck_rc(test, srv.port, ENV["REDIS_PASSWORD"]) == 0
    assert healthcheck_rc(test, srv.port, "wrong") != 0

    app = redis.Redis.from_url(app_url(srv.port))
    app.set("{tokenbus}:probe", "1")
    for denied in (lambda: app.set("other:key", "1"), lambda: app.config_get("*"), app.flushall,
                   lambda: app.keys("*"), lambda: app.get("rq:job:1")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            denied()
    app.close()

    # AOF, fsynced every second: a SIGKILLed Redis comes back with the write.
    time.sleep(1.5)
    srv.kill()
    srv.start(admin.ping)
    assert admin.get("{tokenbus}:probe") == b"1"


def test_the_tokenbus_acl_user_runs_the_real_producer_and_worker_operations(compose_redis):
    from producer.client import Client
    from worker.serve.job_queue import Ending, JobQueue

    srv, _ = compose_redis
    url = app_url(srv.port)
    client = Client(url)
    q = JobQueue(redis.Redis.from_url(url), "tokenbus", "box-1", result_ttl_s=600)
    q.ensure_group()
    done, handed_back = client.submit("hello", max_tokens=4), client.submit("again", max_tokens=4)
    entries = {e.fields["job_id"]: e.entry_id for e in q.read_new(count=10, block_ms=None)}
    assert set(entries) == {done, handed_back}
    for job_id, entry_id in entries.items():
        assert q.start(job_id, entry_id, q.keys.queue())[0] == "running"
    assert q.renew([(q.keys.queue(), e) for e in entries.values()]) == []
    q.heartbeat(Heartbeat(name="box-1", model="m", running=2), ttl_s=30)
    assert q.depth() == (2, 2)
    assert q.cancel_requests() == set()

    pipe = q.r.pipeline(transaction=False)
    q.first_token(pipe, done, time.time())
    q.publish_tokens(pipe, done, 0, [1, 2], "hi", done=True)
    q.finish(pipe, Ending(done, entries[done], "finished",
                          result={"text": "hi", "token_ids": [1, 2], "finish_reason": "length"}))
    q.hand_back(pipe, handed_back, entries[handed_back], q.keys.queue(), count_attempt=False)
    pipe.execute()
    assert client.wait(done, timeout=5).status == "finished"
    _, reclaimed = q.claim_lapsed(min_idle_ms=1000, count=10, cursors={})
    assert [e.fields["job_id"] for e in reclaimed] == [handed_back]
    q.dead_letter(q.r, DeadLetter(handed_back, "test", 1, "{}"))
    assert client.cancel(handed_back) in ("cancelled", "cancelling")
    info = client.info()
    assert info.dead_letters == 1 and [w.name for w in info.workers] == ["box-1"]
    q.sign_off()
    client.close()


def test_tls_recipe_in_the_docs(compose, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    subprocess.run(["bash", "-euo", "pipefail", "-c", doc_block("run: tls-certs")], cwd=tmp_path, check=True,
                   capture_output=True, timeout=60)
    override = load_compose(doc_block("file: compose.tls.yaml"))
    validate(override)
    command = override["services"]["redis"]["command"]
    base = compose["services"]["redis"]["command"]
    assert command[:len(base)] == base, "the TLS override's redis command drifted from compose.yaml's"
    tls = str(tmp_path / "tls") + "/"
    srv = LocalRedis(command, tmp_path, port_flag="--tls-port", tls_dir=tls)
    url = app_url(srv.port, REDIS_HOST="localhost", REDIS_SCHEME="rediss",
                  REDIS_URL_QUERY=f"?ssl_ca_certs={tls}ca.crt")
    assert url.startswith("rediss://tokenbus:")
    app = redis.Redis.from_url(url, socket_timeout=5)
    srv.start(app.ping)
    try:
        assert app.set("{tokenbus}:over-tls", "1")
        with pytest.raises(redis.ConnectionError):  # plain text to the TLS port
            redis.Redis(port=srv.port, password=ENV["REDIS_PASSWORD"], socket_timeout=2).ping()
        test = override["services"]["redis"]["healthcheck"]["test"]
        assert healthcheck_rc(test, srv.port, ENV["REDIS_PASSWORD"], tls_dir=tls) == 0
    finally:
        app.close()
        srv.kill()
