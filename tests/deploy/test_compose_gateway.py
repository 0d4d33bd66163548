"""The gateway's compose services, checked without Docker (as tests/deploy/test_deploy.py does for the worker):
their settings parse as meant, and the gateway's Redis ACL user can do the gateway's and RQ's work.
(Named to sort away from test_gateway_*, which share one running deployment, gateway_harness.py.)"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest
import redis

from tests.deploy.test_deploy import COMPOSE_TEXT, DOCKERFILE, ENV, ROOT, LocalRedis, load_compose, validate


@pytest.fixture(scope="module")
def compose() -> dict:
    data = load_compose(COMPOSE_TEXT)
    validate(data)
    return data


def test_gateway_services_run_the_console_script_with_parsed_settings(compose, monkeypatch):
    from gateway.settings import GatewaySettings

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tokenbus-gateway"] == "gateway.__main__:main"
    gateway, tasks = compose["services"]["gateway"], compose["services"]["gateway-tasks"]
    hooks = compose["services"]["gateway-webhooks"]
    for svc, command in ((gateway, ["serve"]), (tasks, ["tasks"]), (hooks, ["webhooks"])):
        assert svc["entrypoint"] == ["tokenbus-gateway"] and svc["command"] == command
        assert svc["image"] == "tokenbus-gateway:latest" and svc["build"]["dockerfile"] == "Dockerfile.gateway"
        assert "deploy" not in svc  # no GPU
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    assert gateway["environment"] == tasks["environment"] and gateway["volumes"] == tasks["volumes"]
    env = gateway["environment"]
    known = {f"TOKENBUS_GATEWAY_{f.upper()}" for f in GatewaySettings.model_fields} | {
        "TOKENBUS_REDIS_URL", "TOKENBUS_NAMESPACE", "TOKENBUS_LOG_LEVEL", "TOKENBUS_LOG_JSON"}
    assert not set(env) - known, f"not gateway settings: {set(env) - known}"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s = GatewaySettings()
    assert s.redis_url == f"redis://tokenbus-gateway:{ENV['TOKENBUS_GATEWAY_REDIS_PASSWORD']}@redis:6379/0"
    assert len(s.keys_by_owner) == 2 and s.host == "0.0.0.0" and s.webhook_secret == ""
    # Both processes mount the files volume where the settings point, a directory the image makes for its user.
    assert f"gateway-files:{s.files_dir}" in gateway["volumes"] and "gateway-files" in compose["volumes"]
    assert str(s.files_dir) in re.search(r"mkdir -p ([^\\]+)", DOCKERFILE).group(1)
    assert gateway["ports"] == [f"127.0.0.1:8000:{s.port}"]
    assert f"127.0.0.1:{s.port}/healthz" in gateway["healthcheck"]["test"][-1]


def test_the_gateway_acl_user_runs_producer_and_rq_work(compose, tmp_path):
    from gateway import tasks
    from gateway.context import GatewayContext
    from gateway.enqueue import enqueue_submit
    from gateway.settings import GatewaySettings
    from gateway.tasks_worker import TasksWorker

    srv = LocalRedis(compose["services"]["redis"]["command"], tmp_path)
    admin = redis.Redis(port=srv.port, password=ENV["REDIS_PASSWORD"], socket_timeout=5)
    srv.start(admin.ping)
    try:
        url = f"redis://tokenbus-gateway:{ENV['TOKENBUS_GATEWAY_REDIS_PASSWORD']}@127.0.0.1:{srv.port}/0"
        ctx = GatewayContext(GatewaySettings(redis_url=url, api_keys="k", files_dir=tmp_path / "files"))
        job_id = ctx.client.submit("hello", max_tokens=2)  # the namespace's keys and scripts
        assert ctx.client.get(job_id).status == "queued"
        tasks.set_context(ctx)
        enqueue_submit(ctx, "batch_none")  # no such batch: the job runs and does nothing
        worker = TasksWorker([ctx.queue], connection=ctx.rq_redis)
        assert worker.work(burst=True, with_scheduler=True)
        job = ctx.queue.fetch_job("submit-batch_none")
        assert job.get_status() == "finished" and job.return_value() == "nothing to do"
        with pytest.raises(redis.exceptions.NoPermissionError):
            ctx.redis.set("other:key", "1")
        with pytest.raises(redis.exceptions.NoPermissionError):
            ctx.redis.flushall()
        ctx.close()
    finally:
        tasks.set_context(None)
        admin.close()
        srv.kill()


def test_gateway_imports_no_torch():
    code = ("import sys; from gateway.app import create_app; from gateway.settings import "
            "GatewaySettings; import gateway.tasks_worker; "
            "create_app(GatewaySettings(api_keys='sk-' + '0123456789abcdef' * 2)); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
