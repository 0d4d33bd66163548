"""Structured output on the real SmolLM2-135M: JSON schemas, a regex, a choice list and unconstrained jobs
mixed in one served batch (real Redis), seeded sampling, preemption, and grammars the engine refuses."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from protocol.models import JobRequest
from protocol.scripts import PendingJob
from worker import Engine, SamplingParams
from worker.engine.errors import InvalidRequest

OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS = [
    # nested objects
    OBJ | {"properties": {"book": OBJ | {"properties": {"title": {"type": "string", "maxLength": 24},
                                                      "year": {"type": "integer", "minimum": 1800,
                                                               "maximum": 2030}},
                                        "required": ["title", "year"]}},
           "required": ["book"]},
    # enums and a bounded number
    OBJ | {"properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                          "score": {"type": "integer", "minimum": 0, "maximum": 10}},
           "required": ["sentiment", "score"]},
    # an array of objects
    OBJ | {"properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                    "items": OBJ | {"properties": {"name": {"type": "string", "maxLength": 12},
                                                                   "qty": {"type": "integer", "minimum": 1,
                                                                           "maximum": 9}},
                                                    "required": ["name", "qty"]}}},
           "required": ["items"]},
    # bounded numbers and a boolean
    OBJ | {"properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                          "lon": {"type": "number", "minimum": -180, "maximum": 180},
                          "capital": {"type": "boolean"}},
           "required": ["lat", "lon", "capital"]},
    # strings, an array of enums
    OBJ | {"properties": {"name": {"type": "string", "maxLength": 16},
                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                          "langs": {"type": "array", "maxItems": 2,
                                    "items": {"enum": ["en", "fr", "de"]}}},
           "required": ["name", "age", "langs"]},
]
ASKS = ["a famous book", "the review 'great film'", "a shopping list", "Paris", "a person"]
REGEX = r"[0-9]{3}-[0-9]{4}"
CHOICE = ["yes", "no", "maybe"]
TOPICS = ["the sea", "a cat", "bread", "rain", "chess", "music"]


def json_format(i: int) -> dict:
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i]}}


def sixty_jobs() -> list[dict]:
    """Interleaved: 6 jobs for each of the 5 schemas, 6 regex, 6 choice and 18 unconstrained jobs."""
    jobs = []
    for i in range(60):
        kind = i % 10
        if kind < 5:
            msg = f"Describe {ASKS[kind]} as JSON."
            extra = {"response_format": json_format(kind), "max_tokens": 48}
        elif kind == 5:
            msg, extra = f"Make up phone number {i}.", {"regex": REGEX, "max_tokens": 12}
        elif kind == 6:
            msg, extra = f"Is {TOPICS[i % 6]} nice? Answer yes, no or maybe.", {"choice": CHOICE, "max_tokens": 6}
        else:
            msg, extra = f"Write one sentence about {TOPICS[i % 6]}.", {"max_tokens": 8 + i % 7}
        jobs.append({"messages": [{"role": "user", "content": msg}], "temperature": 0.0} | extra)
    return jobs


def check_output(job: dict, text: str, finish_reason: str) -> bool:
    """Assert a constrained output that ended with "stop" is valid; True when it was checked."""
    if finish_reason != "stop":
        return False
    if "response_format" in job:
        jsonschema.validate(json.loads(text), job["response_format"]["json_schema"]["schema"])
    elif "regex" in job:
        assert re.fullmatch(job["regex"], text), text
    elif "choice" in job:
        assert text in job["choice"], text
    else:
        return False
    return True


@pytest.fixture(scope="module")
def smollm2():
    return Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=64, max_num_batched_tokens=1024,
                  kv_cache_gb=0.25)


def params_of(job: dict) -> SamplingParams:
    return SamplingParams.model_validate(JobRequest.model_validate(job).sampling_fields())


def test_sixty_mixed_jobs_served_valid_and_unconstrained_unchanged(smollm2, serve, make_client):
    jobs = sixty_jobs()
    plain = [i for i, j in enumerate(jobs) if not ({"response_format", "regex", "choice"} & set(j))]
    alone = smollm2.generate([jobs[i]["messages"] for i in plain], [params_of(jobs[i]) for i in plain])

    handle = serve(smollm2)
    client = make_client()
    ids = []
    for wave in range(3):  # staggered: later jobs join a batch that is already decoding
        ids += client.submit_many(jobs[wave * 20:(wave + 1) * 20])
        time.sleep(1.0)
    done = {j.id: j for j in client.as_completed(ids, timeout=900)}

    checked = {"json": 0, "regex": 0, "choice": 0}
    cut = []
    for i, (job, job_id) in enumerate(zip(jobs, ids, strict=True)):
        record = done[job_id]
        assert record.status == "finished", (i, record.error)
        kind = "json" if "response_format" in job else "regex" if "regex" in job else "choice" \
            if "choice" in job else None
        if check_output(job, record.result.text, record.result.finish_reason):
            checked[kind] += 1
        elif kind is not None:
            cut.append((i, record.result.finish_reason, record.result.text, record.result.token_ids))
    # most constrained jobs end on their own: the checks above are not vacuous
    assert checked["json"] >= 20 and checked["regex"] == 6 and checked["choice"] == 6, (checked, cut)
    for k, out in zip(plain, alone, strict=True):
        assert done[ids[k]].result.token_ids == out.token_ids, k
    assert handle.stop() == 0


def test_seeded_schema_sampling_is_reproducible(smollm2):
    job = sixty_jobs()[4] | {"temperature": 0.9, "seed": 1234}
    alone = smollm2.generate([job["messages"]], [params_of(job)])[0]
    others = sixty_jobs()[:4] + sixty_jobs()[5:8]
    mixed = smollm2.generate([job["messages"]] + [o["messages"] for o in others],
                             [params_of(job)] + [params_of(o) for o in others])[0]
    assert mixed.token_ids == alone.token_ids
    check_output(job, alone.text, alone.finish_reason)


def test_preemption_mid_generation_keeps_output_valid():
    # 7 blocks of 16 tokens for 6 sequences of ~40 prompt + 48 output tokens: they must take turns
    engine = Engine("smollm2-135m", device="cpu", dtype="float32", block_size=16, num_kv_blocks=12,
                    max_num_seqs=6)
    jobs = [j for j in sixty_jobs()[:20] if "response_format" in j][:6]
    outs = engine.generate([j["messages"] for j in jobs], [params_of(j) for j in jobs])
    assert engine.scheduler.num_preemptions > 0
    assert any(o.num_preemptions for o in outs)
    assert sum(check_output(j, o.text, o.finish_reason) for j, o in zip(jobs, outs, strict=True)) >= 3
    assert not engine.guided.matchers  # every finished sequence let go of its matcher


def test_grammar_the_engine_cannot_compile_fails_that_request_only(smollm2):
    bad = SamplingParams.model_construct(regex="[", max_tokens=8)  # past the producer's check
    good = sixty_jobs()[:7]
    smollm2.add_request("bad-regex", "Say something.", bad)
    for i, j in enumerate(good):
        smollm2.add_request(f"good-{i}", j["messages"], params_of(j))
    outputs, rejected = {}, {}
    while smollm2.has_unfinished_requests():
        outputs.update({o.request_id: o for o in smollm2.step()})
        rejected.update(smollm2.rejected)
    assert list(rejected) == ["bad-regex"] and "cannot be compiled" in str(rejected["bad-regex"])
    assert rejected["bad-regex"].code == "invalid_request"  # the serve loop fails the job with this code
    assert sorted(outputs) == [f"good-{i}" for i in range(7)]
    assert "bad-regex" not in smollm2.requests
    # the failure is cached: the same grammar again is refused at once
    with pytest.raises(InvalidRequest, match="cannot be compiled"):
        smollm2.add_request("bad-again", "Say something.", bad)


def test_served_job_with_bad_schema_fails_invalid_request_alone(smollm2, serve, make_client):
    serve(smollm2)
    client = make_client()
    good = client.submit_many(sixty_jobs()[5:7])
    raw = json.dumps({"prompt": "hi", "response_format": {"type": "json_schema",
                                                          "json_schema": {"schema": {"type": "foo"}}}})
    bad = client.enqueue([PendingJob("bad-schema", raw)])[0]  # written raw: the client's check skipped
    done = {j.id: j for j in client.as_completed(good + [bad], timeout=300)}
    assert done[bad].status == "failed" and done[bad].error_code == "invalid_request"
    assert "Invalid type: foo" in done[bad].error
    assert all(done[g].status == "finished" for g in good)
