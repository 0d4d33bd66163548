"""`tokenbus exporter`'s counts against a real Redis: waiting and pending per priority, and an outage as a 503."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

from producer import exporter
from protocol import scripts
from protocol.keys import Keys
from protocol.models import GROUP

K = Keys("tokenbus")


def test_counts_split_by_priority_and_escaped(redis_server, make_client):
    client = make_client()
    client.submit_many([{"prompt": f"b {i}", "max_tokens": 1, "priority": "bulk"} for i in range(5)])
    client.submit_many([{"prompt": f"i {i}", "max_tokens": 1, "priority": "interactive"}
                        for i in range(3)])
    r = redis_server.client()
    r.xreadgroup(GROUP, "a-worker", {K.queue("interactive"): ">"}, count=2)  # two delivered, not acked
    text = exporter.render(scripts.queue_counts(r, K), 'a "quoted" model')
    assert 'tokenbus_jobs_waiting{model="a \\"quoted\\" model",priority="interactive"} 1' in text
    assert 'tokenbus_jobs_pending{model="a \\"quoted\\" model",priority="interactive"} 2' in text
    assert 'tokenbus_jobs_waiting{model="a \\"quoted\\" model",priority="bulk"} 5' in text
    assert 'tokenbus_jobs_pending{model="a \\"quoted\\" model",priority="default"} 0' in text


def test_redis_down_is_a_scrape_error_not_zeros(redis_server, make_client):
    http = exporter.make_server(make_client().redis, K, "m", 0, "127.0.0.1")
    threading.Thread(target=http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{http.server_address[1]}"
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as reply:
            assert reply.status == 200 and b"tokenbus_jobs_waiting" in reply.read()
        redis_server.kill()
        for path in ("/metrics", "/healthz"):
            try:
                urllib.request.urlopen(url + path, timeout=30)
                raise AssertionError(f"{path} answered 200 with Redis down")
            except urllib.error.HTTPError as err:
                assert err.code == 503
    finally:
        http.shutdown()
        http.server_close()


def test_every_declared_model_has_its_series_and_the_default_queues_count_for_the_default_model(make_client):
    from producer import models

    client = make_client()
    client.submit("before any model", priority="bulk")  # the default queues, labelled --model until a declaration
    assert 'tokenbus_jobs_waiting{model="m",priority="bulk"} 1' in exporter.render_models(
        exporter.model_counts(client.redis, K, "m"))
    models.add(client.redis, K, "llama")  # the first declared: the default model
    models.add(client.redis, K, "embedder")
    client.submit_many([{"prompt": "x", "model": "llama", "priority": "bulk"}] * 2)
    client.submit("e", model="embedder")
    text = exporter.render_models(exporter.model_counts(client.redis, K, "m"))
    assert 'tokenbus_jobs_waiting{model="llama",priority="bulk"} 3' in text  # its 2 and the default queues' 1
    assert 'tokenbus_jobs_waiting{model="embedder",priority="default"} 1' in text
    assert 'model="m"' not in text
