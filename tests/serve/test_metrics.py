"""worker.serve.metrics over real HTTP: scrape /metrics, parse it with prometheus_client's parser, poll /healthz."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from worker.serve.metrics import WorkerMetrics


@pytest.fixture
def served():
    metrics = WorkerMetrics(model="smollm2-135m", worker="w1", stale_after_s=0.5)
    port = metrics.start_http(0, addr="127.0.0.1")
    yield metrics, f"http://127.0.0.1:{port}"
    metrics.stop_http()


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def scrape(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one /metrics scrape."""
    status, content_type, body = get(base + "/metrics")
    assert status == 200
    assert content_type.startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_scrape_shows_what_the_serve_loop_reported(served):
    metrics, base = served
    for _ in range(4):
        metrics.job_started()
    metrics.job_finished("finished", "stop", latency_s=2.0, ttft_s=0.2, generated_tokens=100)
    metrics.job_finished("finished", "length", latency_s=40.0, ttft_s=0.03, generated_tokens=256)
    metrics.job_finished("failed", "invalid_request")
    metrics.job_finished("cancelled", "abort", latency_s=1.0, ttft_s=0.1, generated_tokens=7)
    metrics.observe_step(0.004, running=3, waiting=2, used_blocks=40, free_blocks=60, preemptions_total=2)
    metrics.observe_step(0.02, running=5, waiting=0, used_blocks=90, free_blocks=10, preemptions_total=5)
    metrics.observe_queue(depth=17, pending=5)

    m = scrape(base)
    assert m[("tokenbus_jobs_started_total", ())] == 4
    assert m[("tokenbus_jobs_finished_total", (("reason", "stop"),))] == 1
    assert m[("tokenbus_jobs_finished_total", (("reason", "length"),))] == 1
    assert m[("tokenbus_jobs_failed_total", (("reason", "invalid_request"),))] == 1
    assert m[("tokenbus_jobs_cancelled_total", ())] == 1
    assert m[("tokenbus_generated_tokens_total", ())] == 363
    assert m[("tokenbus_preemptions_total", ())] == 5  # cumulative totals 2 then 5, not 7
    # gauges hold the last step
    assert m[("tokenbus_running_sequences", ())] == 5
    assert m[("tokenbus_waiting_sequences", ())] == 0
    assert m[("tokenbus_kv_blocks_used", ())] == 90
    assert m[("tokenbus_kv_blocks_free", ())] == 10
    assert m[("tokenbus_queue_depth", ())] == 17
    assert m[("tokenbus_queue_pending", ())] == 5
    assert m[("tokenbus_worker_info", (("model", "smollm2-135m"), ("worker", "w1")))] == 1
    assert abs(m[("tokenbus_last_heartbeat_timestamp_seconds", ())] - time.time()) < 60
    # histograms: the failed job had no latency/TTFT, so 3 observations each
    assert m[("tokenbus_job_latency_seconds_count", ())] == 3
    assert m[("tokenbus_job_latency_seconds_sum", ())] == pytest.approx(43.0)
    assert m[("tokenbus_job_latency_seconds_bucket", (("le", "2.5"),))] == 2
    assert m[("tokenbus_time_to_first_token_seconds_count", ())] == 3
    assert m[("tokenbus_time_to_first_token_seconds_bucket", (("le", "0.05"),))] == 1
    assert m[("tokenbus_step_seconds_count", ())] == 2
    assert m[("tokenbus_step_seconds_bucket", (("le", "0.005"),))] == 1


def test_preemption_counter_survives_an_engine_restart(served):
    metrics, base = served
    metrics.observe_step(0.01, 1, 0, 1, 1, preemptions_total=4)
    # a new engine starts counting from zero: the counter must not go down nor lose the new ones
    metrics.observe_step(0.01, 1, 0, 1, 1, preemptions_total=1)
    metrics.observe_step(0.01, 1, 0, 1, 1, preemptions_total=3)
    assert scrape(base)[("tokenbus_preemptions_total", ())] == 7


def test_bad_calls_raise_and_count_nothing(served):
    metrics, base = served
    with pytest.raises(ValueError, match="status must be one of"):
        metrics.job_finished("done", "stop", latency_s=1.0, generated_tokens=10)
    with pytest.raises(ValueError, match="generated_tokens"):
        metrics.job_finished("finished", "stop", latency_s=1.0, generated_tokens=-1)
    m = scrape(base)
    assert m[("tokenbus_jobs_finished_total", (("reason", "stop"),))] == 0
    assert m[("tokenbus_generated_tokens_total", ())] == 0
    assert m[("tokenbus_job_latency_seconds_count", ())] == 0
    with pytest.raises(ValueError, match="stale_after_s"):
        WorkerMetrics(stale_after_s=0)


def test_healthz_starting_ok_stale_ok(served):
    metrics, base = served
    status, content_type, body = get(base + "/healthz")
    assert (status, json.loads(body)["status"]) == (503, "starting")
    assert content_type == "application/json"

    metrics.heartbeat()
    status, _, body = get(base + "/healthz")
    assert (status, json.loads(body)["status"]) == (200, "ok")

    time.sleep(0.8)  # past stale_after_s=0.5 with no beat: a wedged loop
    status, _, body = get(base + "/healthz")
    assert (status, json.loads(body)["status"]) == (503, "stale")
    assert json.loads(body)["last_beat_age_s"] >= 0.5

    metrics.observe_step(0.01, 1, 0, 1, 1, 0)  # a step is a beat too
    status, _, _ = get(base + "/healthz")
    assert status == 200


def test_unknown_path_and_second_server(served):
    metrics, base = served
    status, _, body = get(base + "/nope")
    assert status == 404 and "/metrics" in body
    with pytest.raises(RuntimeError, match="already running"):
        metrics.start_http(0)


def test_instances_do_not_share_a_registry():
    a, b = WorkerMetrics(), WorkerMetrics()
    a.job_started()
    assert a.registry.get_sample_value("tokenbus_jobs_started_total") == 1
    assert b.registry.get_sample_value("tokenbus_jobs_started_total") == 0
    b.stop_http()  # never started: a no-op
