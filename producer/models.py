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
from protocol.records import Heartbeat, ModelInfo
from protocol.registry import DEFAULT_MODEL_FIELD, ModelKind, ModelRecord, check_model_name


def declared(r: redis.Redis, keys: Keys) -> dict[str, ModelRecord]:
    """id -> record of every declared model."""
    return {mid: ModelRecord.from_json(raw) for mid, raw in sorted(r.hgetall(keys.models).items())}


def default_model(r: redis.Redis, keys: Keys) -> str | None:
    return r.hget(keys.config, DEFAULT_MODEL_FIELD) or None


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
    record = ModelRecord(id=names[0], names=names, kind=ModelKind(kind), context_length=context_length,
                         declared_at=time.time(), declared_by="operator")
    served = scripts.declare_model(r, keys, record)
    if make_default:
        set_default(r, keys, served[0])
    return lookup(r, keys, served[0])


def remove(r: redis.Redis, keys: Keys, name: str, force: bool = False) -> ModelRecord:
    """Retire a model: refused while its queues hold jobs or live workers serve it, unless forced."""
    record = lookup(r, keys, name)
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


def live_heartbeats(r: redis.Redis, keys: Keys) -> dict[str, Heartbeat | None]:
    """name -> heartbeat of every worker that ever registered (None: gone, or unreadable)."""
    names = sorted(r.smembers(keys.workers))
    beats = r.mget([keys.worker(n) for n in names]) if names else []
    return {n: Heartbeat.parse(raw) for n, raw in zip(names, beats, strict=True)}


def live_workers(beats: dict[str, Heartbeat | None]) -> dict[str, int]:
    """model id -> live workers serving it ('' = the default queues)."""
    out: dict[str, int] = {}
    for hb in beats.values():
        for mid in hb.served() if hb is not None else ():
            out[mid] = out.get(mid, 0) + 1
    return out


def model_infos(r: redis.Redis, keys: Keys, beats: dict[str, Heartbeat | None]) -> list[ModelInfo]:
    """Every declared model with its depth, pending and live workers, then the default queues (id '') when they
    hold jobs; a model with jobs in its queues and no live worker is `unserved`."""
    records = declared(r, keys)
    default = default_model(r, keys)
    counts = live_workers(beats)
    infos = []
    for mid in [*records, ""]:
        depth = scripts.depth(r, keys.for_model(mid))
        if not mid and not depth.total and records:
            continue
        rec = records.get(mid)
        # the default queues are served by the default model's workers
        workers = counts.get(mid, 0) if mid else counts.get("", 0)
        infos.append(ModelInfo(
            id=mid, names=rec.names if rec else [], kind=rec.kind.value if rec else "", default=mid == default,
            context_length=rec.context_length if rec else None, queue_depth=depth.total, pending=depth.pending,
            by_priority=depth.by_priority, workers=workers, unserved=depth.total > 0 and workers == 0))
    return infos
