"""50 jobs through Client -> Redis -> serve loop on the real SmolLM2-135M, compared with the offline engine."""

from __future__ import annotations

from collections import Counter

import pytest

from producer import scripts
from producer.protocol import Keys
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
