"""One namespace, two models, real worker processes: a batch mixing both is served line by line by the right
worker; SIGKILL every worker of model B and A's jobs keep finishing while B's wait, then B's finish once a
B worker is back, none lost or ended twice, while a worker claiming A's name for B's checkpoint is refused at start."""

from __future__ import annotations

import json
import signal
from collections import Counter

import pytest

from protocol import scripts
from protocol.keys import Keys
from testbed.polling import until
from tests.support.worker_runs import worker_args

K = Keys("tokenbus")


@pytest.fixture(scope="module")
def model_b_dir(tmp_path_factory):
    """A second tiny checkpoint, of another family (so another config fingerprint)."""
    from testbed.tiny_models import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("model-b") / "tiny-qwen"), "qwen2")


def start(worker_process, url: str, model_dir: str, name: str, alias: str, *extra: str):
    return worker_process(*worker_args(url, model_dir, name, "--served-model-name", alias, *extra))


def line(i: int, model: str, max_tokens: int = 4) -> str:
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                       "body": {"model": model, "prompt": f"line {i}", "max_tokens": max_tokens,
                                "temperature": 0}})


def test_a_mixed_batch_is_served_by_each_models_worker_and_b_waits_while_its_workers_are_gone(
        redis_server, serve_model_dir, model_b_dir, worker_process, make_client):
    client = make_client()
    a = start(worker_process, redis_server.url, serve_model_dir, "worker-a", "model-a", "--lease-ms", "1500")
    b = start(worker_process, redis_server.url, model_b_dir, "worker-b", "model-b", "--lease-ms", "1500")
    a.wait_for_event("worker_ready", timeout=120)
    b.wait_for_event("worker_ready", timeout=120)

    record = client.submit_batch([line(i, "model-a" if i % 2 else "model-b") for i in range(8)])
    ids = [f"{record.id}-{i}" for i in range(8)]
    jobs = {j.id: j for j in client.as_completed(ids, timeout=180)}
    assert all(j.status == "finished" for j in jobs.values()), [j.error for j in jobs.values()]
    for i, jid in enumerate(ids):
        want = "model-a" if i % 2 else "model-b"
        assert jobs[jid].result.model == want and jobs[jid].worker == ("worker-a" if i % 2 else "worker-b")
    info = {m.id: m for m in client.info().models}
    assert info["model-a"].workers == 1 and info["model-b"].workers == 1 and not info["model-b"].unserved

    # every worker of B gone mid-job: A's jobs go on, B's wait on B's queues (its running ones reclaimed later)
    b_long = client.submit_many([{"prompt": f"long {i}", "model": "model-b", "max_tokens": 150, "ignore_eos": True}
                                 for i in range(2)])
    until(lambda: all(j.first_token_at for j in client.get_many(b_long)), 120, "B's long jobs to be generating")
    b.proc.send_signal(signal.SIGKILL)
    assert b.wait(10) == -signal.SIGKILL
    a_ids = client.submit_many([{"prompt": f"a{i}", "model": "model-a", "max_tokens": 3} for i in range(4)])
    b_ids = client.submit_many([{"prompt": f"b{i}", "model": "model-b", "max_tokens": 3} for i in range(4)])
    assert all(j.status == "finished" for j in client.as_completed(a_ids, timeout=120))
    assert all(j.status == "queued" for j in client.get_many(b_ids))
    until(lambda: {m.id: m for m in client.info().models}["model-b"].unserved, 30, "B flagged unserved")

    b2 = start(worker_process, redis_server.url, model_b_dir, "worker-b2", "model-b", "--lease-ms", "1500")
    # meanwhile (it starts beside B2): a worker of B's checkpoint that claims A's name is refused at start
    thief = start(worker_process, redis_server.url, model_b_dir, "worker-thief", "model-a")
    done = {j.id: j for j in client.as_completed(b_ids + b_long, timeout=180)}
    assert all(j.status == "finished" and j.result.model == "model-b" and j.worker == "worker-b2"
               for j in done.values()), [(j.status, j.error) for j in done.values()]
    assert [done[i].attempts for i in b_long] == [2, 2] and [done[i].attempts for i in b_ids] == [1] * 4
    assert [done[i].result.usage.completion_tokens for i in b_long] == [150, 150]
    r = redis_server.client()
    events = Counter(f[b"job_id"].decode() for _id, f in r.xrange(K.events))
    assert events == Counter(ids + a_ids + b_ids + b_long), "every job ended exactly once"
    for mid in ("model-a", "model-b", ""):
        assert scripts.queue_totals(r, K.for_model(mid)) == (0, 0)
        assert scripts.depth(r, K.for_model(mid)).total == 0
    assert b2.proc.poll() is None and a.proc.poll() is None

    assert thief.wait(120) == 2, thief.tail()
    refusal = next(e for e in thief.events() if e.get("event") == "model_declaration_refused")
    assert "model-a" in refusal["error"] and "serve-tiny" in refusal["error"] and "tiny-qwen" in refusal["error"]
    assert {m.id: m for m in client.info().models}["model-a"].workers == 1, "the refused worker counts nowhere"


def test_the_move_a_live_namespace_of_the_release_before_models_is_served_as_the_default_models(
        redis_server, serve_model_dir, model_b_dir, worker_process, make_client):
    """Jobs queued by the release before models (the default queues, written with its SUBMIT_JOB call: KEYS
    record, queue, registry and 10 ARGV) while its workers are gone: the new workers start, the first declared
    (A) is the default model and serves them all; B's worker serves none of them; new jobs route by model."""
    client = make_client()
    r = client.redis
    submit = scripts.script(scripts.SUBMIT_JOB)
    old = [f"old-{i}" for i in range(4)]
    for i, jid in enumerate(old):
        request = {"prompt": f"queued before the upgrade {i}", "max_tokens": 3}
        if i == 3:
            request["model"] = "model-a"  # named, and served once A declares that name
        code, _ = submit(keys=[K.job(jid), K.queue(), K.registry("default")],
                         args=[jid, json.dumps(request), 0, 0, 600, "", "", "default", K.layout, "workers"], client=r)
        assert code == 1
    assert scripts.depth(r, K).total == 4
    a = start(worker_process, redis_server.url, serve_model_dir, "worker-a", "model-a")
    a.wait_for_event("worker_ready", timeout=120)
    b = start(worker_process, redis_server.url, model_b_dir, "worker-b", "model-b")
    b.wait_for_event("worker_ready", timeout=120)
    jobs = list(client.as_completed(old, timeout=120))
    assert all(j.status == "finished" and j.worker == "worker-a" and j.result.model == "model-a" for j in jobs), \
        [(j.status, j.worker, j.error) for j in jobs]
    new = client.submit_many([{"prompt": "after", "model": m, "max_tokens": 2} for m in ("model-a", "model-b")])
    assert [j.worker for j in client.as_completed(new, timeout=120)] != []
    assert {j.id: j.worker for j in client.get_many(new)} == {new[0]: "worker-a", new[1]: "worker-b"}
    assert scripts.queue_totals(r, K) == (0, 0) and scripts.depth(r, K).total == 0
