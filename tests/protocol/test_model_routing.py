"""Queues per model and the model registry, on a real redis-server: a job naming a model waits on that model's
queues, an undeclared one is refused before anything is written, names that cannot be key parts are refused,
and DECLARE_MODEL / RETIRE_MODEL keep the registry consistent."""

from __future__ import annotations

import json

import pytest

from producer import models
from protocol import scripts
from protocol.errors import InvalidJob, ModelNotFound, TokenbusError
from protocol.keys import Keys
from protocol.registry import ModelRecord

K = Keys("tokenbus")


def declare(client, mid: str, *aliases: str, checkpoint: str = "") -> list[str]:
    record = ModelRecord(id=mid, names=[mid, *aliases], checkpoint=checkpoint or f"{mid}#fp", declared_by="test")
    return scripts.declare_model(client.redis, client.keys, record)


def test_jobs_wait_on_their_models_queues_and_the_unnamed_on_the_default_queues(make_client):
    c = make_client()
    before = c.submit("no model yet", model="anything")  # nothing declared: the default queues, as before models
    assert c.redis.hget(K.job(before), "queue") == K.queue()
    declare(c, "alpha", "a-alias")
    declare(c, "beta")
    a = c.submit("hi", model="a-alias")
    b = c.submit("hi", model="beta", priority="interactive")
    loose = c.submit("hi")
    assert c.redis.hget(K.job(a), "queue") == "{tokenbus}:m:alpha:q:default" == K.for_model("alpha").queue()
    assert c.redis.hget(K.job(b), "queue") == K.for_model("beta").queue("interactive")
    assert c.redis.hget(K.job(loose), "queue") == K.queue()
    assert scripts.depth(c.redis, K.for_model("alpha")).by_priority == {"interactive": 0, "default": 1, "bulk": 0}
    assert scripts.depth(c.redis, K.for_model("beta")).total == 1
    assert scripts.depth(c.redis, K).total == 2
    for mid in ("", "alpha", "beta"):
        assert scripts.queue_totals(c.redis, K.for_model(mid))[0] == scripts.depth(c.redis, K.for_model(mid)).total
    # cancel finds the model's depth counter from the record's queue
    assert c.cancel(a) == "cancelled"
    assert scripts.depth(c.redis, K.for_model("alpha")).total == 0
    assert scripts.queue_totals(c.redis, K.for_model("alpha")) == (0, 0)


def test_an_undeclared_model_is_refused_listing_the_declared_ones_and_nothing_is_written(make_client):
    c = make_client()
    declare(c, "alpha")
    declare(c, "beta")
    with pytest.raises(ModelNotFound) as err:
        c.submit("hi", model="gamma", job_id="refused-1")
    assert err.value.declared == ["alpha", "beta"] and "'alpha', 'beta'" in str(err.value)
    assert not c.redis.exists(K.job("refused-1"))
    with pytest.raises(ModelNotFound):  # many: refused whole before anything is written
        c.submit_many([{"prompt": "x", "model": "alpha"}, {"prompt": "y", "model": "gamma"}], job_ids=["m1", "m2"])
    assert not c.redis.exists(K.job("m1"), K.job("m2"))
    assert scripts.depth(c.redis, K.for_model("alpha")).total == 0


@pytest.mark.parametrize("name", ["a:b", "{x}", "x}", "tab\there", "nl\n", "é" * 101, ""])
def test_a_model_name_that_cannot_be_a_key_part_is_refused_at_submit(make_client, name):
    c = make_client()
    with pytest.raises(InvalidJob, match="model"):
        c.submit("hi", model=name)
    assert c.redis.dbsize() == 0


def test_a_batch_mixing_models_puts_each_line_on_its_models_queue_and_ends_cleanly(make_client):
    c = make_client()
    declare(c, "alpha")
    declare(c, "beta")
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "alpha" if i % 2 else "beta", "prompt": f"p{i}"}}) for i in range(6)]
    record = c.submit_batch(lines, batch_id="mixed")
    qa, qb = K.for_model("alpha").queue("bulk", "mixed"), K.for_model("beta").queue("bulk", "mixed")
    assert c.redis.xlen(qa) == 3 and c.redis.xlen(qb) == 3
    assert sorted(json.loads(c.redis.hget(K.batch("mixed"), "queues"))) == sorted([qa, qb])
    assert c.redis.zscore(K.for_model("alpha").registry("bulk"), qa) is not None
    bad = [*lines, json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "gamma", "prompt": "p"}})]
    with pytest.raises(ModelNotFound):
        c.submit_batch(bad, batch_id="refused")
    assert not c.redis.exists(K.batch("refused"))
    c.cancel_batch(record.id)  # every job ends: both queues leave their registries and are deleted
    assert c.get_batch("mixed").status == "cancelled"
    assert not c.redis.exists(qa, qb)
    assert [c.redis.zcard(K.for_model(m).registry("bulk")) for m in ("alpha", "beta")] == [0, 0]


def test_declare_refuses_an_alias_of_another_checkpoint_naming_both_and_shares_one_of_the_same(make_client):
    c = make_client()
    assert declare(c, "llama", "chat", checkpoint="llama-8b#1") == ["llama"]
    with pytest.raises(TokenbusError, match=r"'chat'.*'llama'.*llama-8b#1.*qwen#2"):
        declare(c, "qwen", "chat", checkpoint="qwen#2")
    assert c.redis.hget(K.model_names, "qwen") is None, "a refused declaration writes nothing"
    # the same checkpoint under another id: it serves the model holding the name too
    assert declare(c, "prod", "chat", checkpoint="llama-8b#1") == ["prod", "llama"]
    assert models.default_model(c.redis, K) == "llama", "the first declared is the default"
    # declared by hand, then claimed by a worker: one model, the worker's checkpoint filled in
    models.add(c.redis, K, "embedder", aliases=["emb"])
    assert declare(c, "embedder", checkpoint="e5#3") == ["embedder"]
    assert models.lookup(c.redis, K, "emb").checkpoint == "e5#3"


def test_retire_keeps_a_model_with_queued_jobs_unless_forced(make_client):
    c = make_client()
    declare(c, "alpha", "a2")
    c.submit("hi", model="alpha")
    with pytest.raises(TokenbusError, match="1 jobs"):
        models.remove(c.redis, K, "a2")
    models.remove(c.redis, K, "a2", force=True)
    assert c.redis.hlen(K.models) == 0 and c.redis.hlen(K.model_names) == 0
    assert models.default_model(c.redis, K) is None


def test_a_job_naming_a_model_costs_one_redis_command_more_and_one_naming_none_the_same(make_client):
    """INFO commandstats around one submit each: the model's lookup is one HGET inside SUBMIT_JOB, no round
    trip; a job naming no model runs exactly the commands it ran before models (the default queues)."""
    c = make_client()
    c.submit("warm up the script cache and the depth counter")
    declare(c, "alpha")
    c.submit("warm alpha's counter", model="alpha")

    def calls() -> dict[str, int]:
        return {k: v["calls"] for k, v in c.redis.info("commandstats").items()}

    def cost(**params) -> dict[str, int]:
        before = calls()
        c.submit("x", **params)
        after = calls()
        # the INFO call itself is counted once between the two reads
        return {k: n - before.get(k, 0) for k, n in after.items() if n - before.get(k, 0) and k != "cmdstat_info"}

    plain, named = cost(), cost(model="alpha")
    assert {k: v for k, v in named.items() if k != "cmdstat_hget"} == plain
    assert named.get("cmdstat_hget", 0) == plain.get("cmdstat_hget", 0) + 1
    assert plain.get("cmdstat_evalsha") == 1 == named.get("cmdstat_evalsha"), "one round trip each"
