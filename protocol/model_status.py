"""The state of a namespace's models, read in a few round trips whatever the number of jobs: the declared
models (protocol/registry.py), the workers serving each (their heartbeats), and each model's depth counter. What
`tokenbus info`, the gateway's /v1/models and dashboard, and a worker's metrics show."""

from __future__ import annotations

import redis

from protocol import scripts
from protocol.keys import Keys
from protocol.records import Heartbeat, ModelInfo
from protocol.registry import DEFAULT_MODEL_FIELD, ModelRecord


def _s(value: str | bytes) -> str:
    """A reply as text (the worker's client answers bytes, the producer's text)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def declared(r: redis.Redis, keys: Keys) -> dict[str, ModelRecord]:
    """id -> record of every declared model."""
    return {_s(mid): ModelRecord.from_json(raw) for mid, raw in sorted(r.hgetall(keys.models).items())}


def default_model(r: redis.Redis, keys: Keys) -> str | None:
    found = r.hget(keys.config, DEFAULT_MODEL_FIELD)
    return _s(found) if found else None


def live_heartbeats(r: redis.Redis, keys: Keys) -> dict[str, Heartbeat | None]:
    """name -> heartbeat of every worker that ever registered (None: gone, or unreadable)."""
    names = sorted(_s(n) for n in r.smembers(keys.workers))
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
            id=mid, names=rec.names if rec else [], kind=rec.kind.value if rec else "",
            kinds=rec.served_kinds() if rec else [], default=mid == default,
            parent=rec.parent if rec else None, root=rec.root if rec else None,
            context_length=rec.context_length if rec else None, queue_depth=depth.total, pending=depth.pending,
            by_priority=depth.by_priority, workers=workers, unserved=depth.total > 0 and workers == 0))
    return infos
