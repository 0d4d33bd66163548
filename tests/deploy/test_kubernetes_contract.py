"""The contract between deploy/kubernetes/ and the processes it runs: probe paths and ports against a real
worker metrics server, the env names against the settings the worker and the gateway read, the metric names of
the ScaledObjects' queries against what the exporter serves, and the grace period against the drain. A rename on
either side fails here."""

from __future__ import annotations

import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from producer import exporter
from producer.cli import build_parser
from tests.support.kubernetes import container, env_values, find, render
from worker.serve.metrics import WorkerMetrics
from worker.settings import ENGINE_FIELDS, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
METRIC = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{")
MODEL_SELECTOR = re.compile(r'model="([^"]*)"')


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render("with-redis")


@pytest.fixture(scope="module")
def workers(objects) -> list[dict]:
    found = [d for d in find(objects, "Deployment") if container(d)["image"].startswith("tokenbus-worker")]
    assert len(found) == 2, "one worker Deployment per model of the example fleet"
    return found


def _expanded(env: dict[str, str | None]) -> dict[str, str]:
    """The literal values, with $(VAR) references filled in as Kubernetes would (references to Secrets and
    ConfigMaps get stand-ins)."""
    stand_ins = {"REDIS_SCHEME": "redis", "REDIS_USER": "tokenbus", "REDIS_PASSWORD": "pw", "REDIS_HOST": "redis",
                 "REDIS_PORT": "6379", "REDIS_URL_QUERY": ""}
    out = {}
    for name, value in env.items():
        if value is not None:
            out[name] = re.sub(r"\$\((\w+)\)", lambda m: stand_ins[m.group(1)], value)
    return out


def _port(c: dict, probe_port: str | int) -> int:
    if isinstance(probe_port, int):
        return probe_port
    return next(p["containerPort"] for p in c["ports"] if p["name"] == probe_port)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_worker_probes_hit_the_workers_health_endpoint(workers):
    for d in workers:
        c = container(d)
        env = env_values(c)
        port = int(env["TOKENBUS_METRICS_PORT"])
        annotations = d["spec"]["template"]["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) == port
        startup, liveness = c["startupProbe"], c["livenessProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "~10 minutes to load a model"
        for probe in (startup, liveness):
            assert _port(c, probe["httpGet"]["port"]) == port
        # the paths, asked of a real worker metrics server
        metrics = WorkerMetrics(model="m", worker="w")
        bound = metrics.start_http(_free_port(), addr="127.0.0.1")
        try:
            base = f"http://127.0.0.1:{bound}"
            assert _get(base + startup["httpGet"]["path"])[0] == 503, "unhealthy while the model loads"
            metrics.heartbeat()
            for probe in (startup, liveness):
                assert _get(base + probe["httpGet"]["path"])[0] == 200
            code, body = _get(base + annotations["prometheus.io/path"])
            assert code == 200 and "tokenbus_jobs_started_total" in body
        finally:
            metrics.stop_http()


def test_worker_env_names_are_the_settings_the_worker_reads(workers, monkeypatch):
    for d in workers:
        env = env_values(container(d))
        names = {n.removeprefix("TOKENBUS_").lower() for n in env if n.startswith("TOKENBUS_")}
        unknown = names - set(WorkerSettings.model_fields) - set(ENGINE_FIELDS)
        assert not unknown, f"{d['metadata']['name']} sets TOKENBUS_* the worker does not read: {unknown}"
        for name, value in _expanded(env).items():
            monkeypatch.setenv(name, value)
        settings = WorkerSettings()  # the manifests' values parse as the worker's settings
        assert settings.engine.model == env["TOKENBUS_MODEL"] and settings.redis_url.startswith("redis://tokenbus:")
        assert settings.intake_max_waiting == int(env["TOKENBUS_INTAKE_MAX_WAITING"])


def test_grace_period_outlasts_the_drain_as_in_compose(workers):
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["x-worker"]
    compose_drain = float(re.search(r":-(\d+)", compose["environment"]["TOKENBUS_DRAIN_GRACE_S"]).group(1))
    compose_stop = int(compose["stop_grace_period"].removesuffix("s"))
    for d in workers:
        drain = float(env_values(container(d))["TOKENBUS_DRAIN_GRACE_S"])
        grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        # the drain, then handing the unfinished jobs back and tearing down, before Kubernetes SIGKILLs
        assert grace - drain >= 15, (d["metadata"]["name"], drain, grace)
        assert (drain, grace) == (compose_drain, compose_stop), "the two deployments drain alike"


def test_scaled_objects_query_what_the_exporter_serves(objects, workers):
    served = set(METRIC.findall(exporter.render({"bulk": (3, 1)}, "m")))
    assert served == {exporter.WAITING, exporter.PENDING}
    models = {d["metadata"]["name"]: env_values(container(d))["TOKENBUS_MODEL"] for d in workers}
    scaled = find(objects, "ScaledObject")
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled} == set(models), "one ScaledObject per worker"
    for s in scaled:
        (trigger,) = s["spec"]["triggers"]
        query = trigger["metadata"]["query"]
        assert trigger["type"] == "prometheus" and set(METRIC.findall(query)) == served, query
        target = s["spec"]["scaleTargetRef"]["name"]
        assert set(MODEL_SELECTOR.findall(query)) == {models[target]}, "the query reads its own model's jobs"
        assert s["spec"]["minReplicaCount"] == 0 and trigger["metadata"]["activationThreshold"] == "0"
        env = env_values(container(find(objects, "Deployment", target)[0]))
        # docs/kubernetes.md: the threshold is what one worker holds when full
        full = int(env["TOKENBUS_MAX_NUM_SEQS"]) + int(env["TOKENBUS_INTAKE_MAX_WAITING"])
        assert int(trigger["metadata"]["threshold"]) == full, (target, full)


def test_the_exporter_runs_the_cli_the_scaler_reads(objects, workers):
    (d,) = find(objects, "Deployment", "exporter")
    c = container(d)
    args = [a.replace("$(EXPORTER_MODEL)", "m") for a in c["args"]]
    parsed = build_parser().parse_args(args)
    assert c["command"] == ["tokenbus"] and parsed.command == "exporter"
    assert parsed.port == c["ports"][0]["containerPort"] == int(d["spec"]["template"]["metadata"]["annotations"][
        "prometheus.io/port"])
    config = find(objects, "ConfigMap", "tokenbus")[0]["data"]
    assert config["default-model"] in {env_values(container(w))["TOKENBUS_MODEL"] for w in workers}


def test_gateway_processes_match_compose_and_their_settings(objects, monkeypatch):
    from gateway.settings import GatewaySettings

    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    read = set()  # every variable the gateway reads: TOKENBUS_GATEWAY_<FIELD>, or a field's aliases
    for field_name, field in GatewaySettings.model_fields.items():
        choices = getattr(field.validation_alias, "choices", None)
        read |= set(choices) if choices else {"TOKENBUS_GATEWAY_" + field_name.upper()}
    for name in ("gateway", "gateway-tasks", "gateway-webhooks"):
        (d,) = find(objects, "Deployment", name)
        c = container(d)
        assert c["args"] == services[name]["command"], name
        env = env_values(c)
        unknown = {n for n in env if n.startswith("TOKENBUS_")} - read
        assert not unknown, f"{name} sets TOKENBUS_* the gateway does not read: {unknown}"
        for var, value in _expanded(env).items():
            monkeypatch.setenv(var, value)
        settings = GatewaySettings()
        if name == "gateway":
            probe = c["readinessProbe"]["httpGet"]
            assert probe["path"] == "/healthz" and _port(c, probe["port"]) == settings.port
