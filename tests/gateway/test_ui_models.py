"""Each model on the dashboard's overview and at /v1/models, in-process against a real redis-server: queued,
running, live workers, jobs/s, and a model whose jobs wait with no live worker flagged."""

from __future__ import annotations

import re
import time

from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.settings import GatewaySettings
from producer import Client, models
from protocol.keys import Keys
from protocol.records import Heartbeat

KEY = "sk-ui-models-" + "m" * 20
K = Keys("tokenbus")


def beat(r, name: str, model: str, running: int, jobs_done: int) -> None:
    """A live worker's heartbeat as a worker writes it (docs/protocol.md, "Workers")."""
    hb = Heartbeat(name=name, model=model, models=[model], serves_default=True, running=running,
                   jobs_done=jobs_done, last_seen=time.time())
    r.set(K.worker(name), hb.model_dump_json(), ex=30)
    r.sadd(K.workers, name)


def test_the_overview_and_v1_models_show_each_model_and_flag_one_nobody_serves(redis_server, tmp_path):
    client = Client(redis_server.url)
    r = client.redis
    models.add(r, K, "alpha")
    models.add(r, K, "beta", aliases=["b"], kind="embed")
    beat(r, "w-alpha", "alpha", running=2, jobs_done=10)
    client.submit_many([{"prompt": "x", "model": "alpha"}] * 3 + [{"prompt": "y", "model": "b"}] * 2)
    settings = GatewaySettings(api_keys=KEY, ui_keys=KEY, redis_url=redis_server.url, files_dir=tmp_path / "f")
    with TestClient(create_app(settings), base_url="http://gw.test") as http:
        listed = http.get("/v1/models", headers={"authorization": f"Bearer {KEY}"}).json()["data"]
        assert {m["id"]: (m["workers"], m["queued"], m["unserved"]) for m in listed} == {
            "alpha": (1, 3, False), "beta": (0, 2, True)}
        beta = http.get("/v1/models/b", headers={"authorization": f"Bearer {KEY}"}).json()
        assert beta["id"] == "beta" and beta["kind"] == "embed" and beta["kinds"] == ["embed"]
        missing = http.get("/v1/models/zeta", headers={"authorization": f"Bearer {KEY}"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

        form = http.get("/ui/login")
        token = re.search(r'name="login_token" value="([^"]+)"', form.text).group(1)
        http.post("/ui/login", data={"api_key": KEY, "login_token": token})
        http.get("/ui/?fragment=1")  # a first sample of the workers' counters
        time.sleep(2.1)  # the next sample is taken SAMPLE_S later
        beat(r, "w-alpha", "alpha", running=2, jobs_done=20)
        page = http.get("/ui/?fragment=1").text
    rows = dict(re.findall(r'<tr data-model="([^"]+)">(.*?)</tr>', page, re.S))
    alpha = re.findall(r'class="num">([^<]*)<', rows["alpha"])
    assert alpha[:3] == ["3", "2", "1"] and float(alpha[3]) > 0  # queued, running, workers, jobs/s
    assert "no live worker" in rows["beta"] and "no live worker" not in rows["alpha"]
    assert "embed" in rows["beta"] and "generate" in rows["alpha"]  # the kinds each model's workers serve
