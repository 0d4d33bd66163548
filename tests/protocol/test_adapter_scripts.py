"""ADAPTER_ADD / ADAPTER_REMOVE on a real redis-server: an adapter is asked for under a name of its own on a
declared base, each change one idempotent script that moves the revision the workers poll; removing retires the
adapter's model (a job naming it is refused) and is refused while its queues hold jobs."""

from __future__ import annotations

import pytest

from producer import adapters, models
from protocol import scripts
from protocol.errors import ModelNotFound, TokenbusError
from protocol.keys import Keys
from protocol.registry import DEFAULT_MODEL_FIELD, ModelRecord

K = Keys("tokenbus")


def declare(c, mid: str, parent: str | None = None) -> None:
    scripts.declare_model(c.redis, K, ModelRecord(id=mid, names=[mid], checkpoint=f"{mid}#fp", parent=parent,
                                                  declared_by="test"))


def entry(c, name: str) -> dict:
    import json

    return json.loads(c.redis.hget(K.adapters, name))


def test_add_is_idempotent_and_moves_the_revision_only_on_a_change(make_client):
    c = make_client()
    declare(c, "base")
    assert adapters.add(c.redis, K, "judge", "base", "/a/judge") == (1, "base")
    assert adapters.add(c.redis, K, "judge", "base", "/a/judge") == (1, "base")  # the same: nothing written
    assert adapters.add(c.redis, K, "judge", "base", "/a/judge-v2") == (2, "base")
    assert entry(c, "judge") | {"at": 0} == {"name": "judge", "base": "base", "path": "/a/judge-v2",
                                              "state": "added", "rev": 2, "at": 0}
    assert c.redis.hget(K.adapters, ":rev") == "2"


def test_add_refuses_an_unknown_base_an_adapter_base_and_a_name_another_model_holds(make_client):
    c = make_client()
    declare(c, "base")
    declare(c, "other")
    declare(c, "tuned", parent="base")
    with pytest.raises(ModelNotFound) as err:
        adapters.add(c.redis, K, "judge", "no-such-base", "/a")
    assert "no-such-base" in str(err.value) and "base" in str(err.value)
    with pytest.raises(TokenbusError, match="itself a LoRA adapter"):
        adapters.add(c.redis, K, "judge", "tuned", "/a")
    with pytest.raises(TokenbusError, match="already model 'other'"):
        adapters.add(c.redis, K, "other", "base", "/a")
    assert adapters.add(c.redis, K, "tuned", "base", "/a/tuned") == (1, "base")  # its own name: fine
    assert not c.redis.hexists(K.adapters, "judge")


def test_an_adapter_never_becomes_the_default_model(make_client):
    c = make_client()
    declare(c, "tuned", parent="base")
    assert c.redis.hget(K.config, DEFAULT_MODEL_FIELD) is None
    declare(c, "base")
    assert c.redis.hget(K.config, DEFAULT_MODEL_FIELD) == "base"


def test_remove_retires_the_adapter_and_leaves_a_tombstone_once(make_client):
    c = make_client()
    declare(c, "base")
    declare(c, "tuned", parent="base")
    job = c.submit("hi", model="tuned")
    with pytest.raises(TokenbusError, match="1 jobs in its queues"):
        adapters.remove(c.redis, K, "tuned")
    assert c.redis.hexists(K.models, "tuned")
    with pytest.raises(TokenbusError, match=r"base of LoRA adapters \['tuned'\]"):
        models.remove(c.redis, K, "base")
    with pytest.raises(TokenbusError, match="tokenbus adapters remove tuned"):
        models.remove(c.redis, K, "tuned", force=True)  # the workers would never hear of it
    c.cancel(job)
    assert adapters.remove(c.redis, K, "tuned") == (1, "base")
    assert entry(c, "tuned")["state"] == "removed"
    assert not c.redis.hexists(K.models, "tuned") and not c.redis.hexists(K.model_names, "tuned")
    with pytest.raises(ModelNotFound):
        c.submit("hi", model="tuned")
    assert adapters.remove(c.redis, K, "tuned") == (1, "base")  # again: nothing more written
    assert c.redis.hget(K.adapters, ":rev") == "1"
    with pytest.raises(TokenbusError, match="a base model"):
        adapters.remove(c.redis, K, "base")
    assert adapters.remove(c.redis, K, "never-added") == (1, "")
