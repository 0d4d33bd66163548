"""The model registry from the producer's side (protocol/registry.py): the declared models and their state, the
check that a batch names only declared models (one round trip, before anything is written), and what
`tokenbus models add|remove|default` change."""

from __future__ import annotations

import time
from collections.abc import Iterable

import redis

from protocol import scripts
from protocol.errors import ModelNotFound, TokenbusError
from protocol.keys import Keys
from protocol.model_status import declared, default_model, live_heartbeats, live_workers, model_infos
from protocol.registry import DEFAULT_MODEL_FIELD, ModelKind, ModelRecord, check_model_name

__all__ = ["add", "declared", "default_model", "live_heartbeats", "live_workers", "lookup", "model_infos",
           "remove", "resolve", "set_default"]


def resolve(r: redis.Redis, keys: Keys, names: Iterable[str]) -> dict[str, str]:
    """name -> the id of the model it names ('' for '': the default queues), in one round trip; ModelNotFound
    for a name nobody declared. While no model is declared at all every name goes to the default queues (as
    SUBMIT_JOB routes it)."""
    wanted = sorted({n for n in names if n})
    if not wanted:
        return {"": ""}
    pipe = r.pipeline(transaction=False)
    pipe.hmget(keys.model_names, wanted).hkeys(keys.models)
    ids, all_ids = pipe.execute()
    if not all_ids:
        return {"": ""} | {n: "" for n in wanted}
    missing = [n for n, mid in zip(wanted, ids, strict=True) if mid is None]
    if missing:
        raise ModelNotFound(missing[0], list(all_ids), keys.ns)
    return {"": ""} | dict(zip(wanted, ids, strict=True))


def lookup(r: redis.Redis, keys: Keys, name: str) -> ModelRecord:
    """The record of the model `name` names (any of its names); ModelNotFound listing the declared ones."""
    mid = r.hget(keys.model_names, name)
    raw = r.hget(keys.models, mid) if mid else None
    if raw is None:
        raise ModelNotFound(name, list(r.hkeys(keys.models)), keys.ns)
    return ModelRecord.from_json(raw)


def add(r: redis.Redis, keys: Keys, name: str, aliases: Iterable[str] = (), kind: str = ModelKind.generate,
        context_length: int | None = None, make_default: bool = False) -> ModelRecord:
    """Declare a model by hand (no checkpoint yet: the first worker serving it sets it)."""
    names = [check_model_name(n) for n in dict.fromkeys([name, *aliases])]
    record = ModelRecord(id=names[0], names=names, kind=ModelKind(kind), kinds=[ModelKind(kind)],
                         context_length=context_length,
                         declared_at=time.time(), declared_by="operator")
    served = scripts.declare_model(r, keys, record)
    if make_default:
        set_default(r, keys, served[0])
    return lookup(r, keys, served[0])


def remove(r: redis.Redis, keys: Keys, name: str, force: bool = False) -> ModelRecord:
    """Retire a model: refused while its queues hold jobs or live workers serve it, unless forced."""
    record = lookup(r, keys, name)
    if record.parent:  # its workers must hear of it too: ADAPTER_REMOVE tells them
        raise TokenbusError(f"model {record.id!r} is a LoRA adapter of {record.parent!r}: remove it with "
                            f"`tokenbus adapters remove {record.id}`")
    children = sorted(mid for mid, rec in declared(r, keys).items() if rec.parent == record.id)
    if children and not force:
        raise TokenbusError(f"model {record.id!r} is the base of LoRA adapters {children}: remove them first "
                            "(tokenbus adapters remove NAME), or retire it anyway with --force")
    workers = live_workers(live_heartbeats(r, keys)).get(record.id, 0)
    if workers and not force:
        raise TokenbusError(f"model {record.id!r} is served by {workers} live worker(s); stop them first, or "
                            "retire it anyway with --force (they keep serving it until they stop)")
    code, jobs = scripts.retire_model(r, keys, record.id, force)
    if code == -1:
        raise TokenbusError(f"model {record.id!r} has {jobs} jobs in its queues; let them finish (or cancel them), "
                            "or retire it anyway with --force (its queued jobs then wait for a model nobody can "
                            "name)")
    return record


def set_default(r: redis.Redis, keys: Keys, name: str) -> str:
    """Make a declared model the namespace's default (the model of jobs naming none); returns its id."""
    record = lookup(r, keys, name)
    r.hset(keys.config, DEFAULT_MODEL_FIELD, record.id)
    return record.id
