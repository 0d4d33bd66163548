"""50 jobs through Client -> Redis -> serve loop on the real SmolLM2-135M, compared with the offline engine."""

from __future__ import annotations

from collections import Counter

import pytest

from protocol import scripts
from protocol.keys import Keys
from worker import Engine, SamplingParams

K = Keys("tokenbus")

TOPICS = ["the sea", "a cat", "Paris", "bread", "rain", "chess", "music", "the moon", "a river", "winter"]


@pytest.fixture(scope="module")
def smollm2():
    return Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=64, max_num_batched_tokens=1024,
                  kv_cache_gb=0.25)


def test_fifty_jobs_round_trip_equal_offline_output(smollm2, serve, make_client, redis_server):
    requests = []
    for i in range(50):
        topic = TOPICS[i % len(TOPICS)]
        if i % 2:
            prompt = {"messages": [{"role": "user", "content": f"Write one sentence about {topic}."}]}
        else:
            prompt = {"prompt": f"Here is a short fact about {topic}:"}
        requests.append(prompt | {"max_tokens": 8 + i % 9, "temperature": 0.0})
    prompts = [r.get("prompt") or r["messages"] for r in requests]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0) for r in requests]
    expected = smollm2.generate(prompts, params)

    handle = serve(smollm2)
    client = make_client()
    ids = client.submit_many(requests)
    jobs = {j.id: j for j in client.as_completed(ids, timeout=600)}

    mismatches = [(i, jobs[job_id].result.text, exp.text)
                  for i, (job_id, exp) in enumerate(zip(ids, expected, strict=True))
                  if jobs[job_id].result.token_ids != exp.token_ids]
    assert not mismatches, mismatches
    for job_id, exp in zip(ids, expected, strict=True):
        job = jobs[job_id]
        assert job.status == "finished" and job.attempts == 1
        assert job.result.text == exp.text and job.result.finish_reason == exp.finish_reason
        assert job.result.model == "smollm2-135m"
    r = redis_server.client()
    assert Counter(f[b"job_id"].decode() for _id, f in r.xrange(K.events)) == Counter(ids)
    assert scripts.queue_totals(r, K) == (0, 0)
    assert handle.stop() == 0


def test_n_choices_and_prefix_hits_through_redis(smollm2, serve, make_client, redis_server):
    import json
    import time

    from worker.serve.metrics import WorkerMetrics

    system = "You are a terse assistant. " + " ".join(f"Fact {i}: {TOPICS[i % 10]} is nice." for i in range(30))
    request = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Say hi."}],
               "max_tokens": 10, "temperature": 0.8, "seed": 77, "n": 3}
    alone = [smollm2.generate([request["messages"]], SamplingParams(max_tokens=10, temperature=0.8, seed=77 + i))[0]
             for i in range(3)]
    metrics = WorkerMetrics(model="smollm2-135m", worker="w")
    handle = serve(smollm2, metrics=metrics)
    client = make_client()
    job = client.wait(client.submit(**request), timeout=300)
    assert job.status == "finished"
    assert [c.index for c in job.result.choices] == [0, 1, 2]
    assert [c.token_ids for c in job.result.choices] == [a.token_ids for a in alone]
    assert [c.text for c in job.result.choices] == [a.text for a in alone]
    assert job.result.token_ids == alone[0].token_ids and job.result.text == alone[0].text
    assert job.result.usage.completion_tokens == sum(len(a.token_ids) for a in alone)
    # the prefix cache shows in Prometheus and in the heartbeat
    hit_rate = metrics.registry.get_sample_value("tokenbus_prefix_cache_hit_rate", {"unit": "tokens"})
    assert hit_rate is not None and hit_rate > 0
    assert metrics.registry.get_sample_value("tokenbus_prefix_cache_hits_total", {"unit": "blocks"}) > 0
    beat = None
    for _ in range(100):  # the heartbeat is rewritten every 0.5 s
        raw = redis_server.client().get(K.worker(handle.server.jobs.consumer))
        beat = json.loads(raw) if raw else None
        if beat and beat["prefix_hit_tokens"] > 0:
            break
        time.sleep(0.1)
    assert beat and beat["prefix_hit_tokens"] > 0 and beat["prefix_queried_tokens"] > 0
    assert handle.stop() == 0
