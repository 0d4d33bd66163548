"""The overview's history: queue depth by priority, jobs done and tokens generated, sampled at most every
SAMPLE_S into a capped Redis list that every gateway replica shares. A sample is taken when a dashboard asks
for the overview and the last one is older than SAMPLE_S (a SET NX lock picks one taker), so an idle
deployment costs nothing and no background thread is needed."""

from __future__ import annotations

import json
import time
from typing import Any

from gateway.context import GatewayContext
from gateway.keys import GatewayKeys
from protocol.priority import NAMES
from protocol.records import QueueInfo

SAMPLE_S = 2.0
KEEP = 900  # samples: half an hour at SAMPLE_S


def _key(ns: str) -> str:
    return GatewayKeys(ns).ui_samples


def sample_of(info: QueueInfo, now: float) -> dict[str, Any]:
    beats = [w.heartbeat for w in info.workers if w.alive and w.heartbeat]
    return {"t": round(now, 3), **{p: info.by_priority.get(p, 0) for p in NAMES},
            # per worker, so a restarted worker (its counters back at 0) is told apart from a slowdown
            "done": {hb.name: hb.jobs_done for hb in beats}, "tokens": {hb.name: hb.generated_tokens for hb in beats},
            "workers": len(beats), "model": {hb.name: hb.model or "" for hb in beats}}


def record(ctx: GatewayContext, info: QueueInfo) -> None:
    now = time.time()
    lock = f"{_key(ctx.settings.namespace)}:lock"
    if not ctx.redis.set(lock, "1", nx=True, px=int(SAMPLE_S * 1000)):
        return
    pipe = ctx.redis.pipeline(transaction=False)
    pipe.rpush(_key(ctx.settings.namespace), json.dumps(sample_of(info, now)))
    pipe.ltrim(_key(ctx.settings.namespace), -KEEP, -1)
    pipe.execute()


def _rate(a: dict[str, int], b: dict[str, int], dt: float) -> float:
    """Summed per-worker growth between two samples per second; a worker whose counter fell restarted."""
    grown = sum(max(0, n - a.get(w, 0)) if n >= a.get(w, 0) else n for w, n in b.items())
    return grown / dt if dt > 0 else 0.0


def model_rates(ctx: GatewayContext) -> dict[str, float]:
    """model id -> jobs/s between the last two samples (each worker's jobs counted for the model it serves)."""
    rows = [json.loads(r) for r in ctx.redis.lrange(_key(ctx.settings.namespace), -2, -1)]
    if len(rows) < 2:
        return {}
    prev, cur = rows
    dt, out = cur["t"] - prev["t"], {}
    for model in set(cur.get("model", {}).values()):
        mine = {w for w, m in cur["model"].items() if m == model}
        out[model] = round(_rate({w: n for w, n in prev["done"].items() if w in mine},
                                 {w: n for w, n in cur["done"].items() if w in mine}, dt), 2)
    return out


def series(ctx: GatewayContext) -> dict[str, list[float]]:
    """Columns for the charts: t, each priority's depth, jobs/s and tokens/s (rates from consecutive samples)."""
    raw = ctx.redis.lrange(_key(ctx.settings.namespace), 0, -1)
    rows = [json.loads(r) for r in raw]
    out: dict[str, list[float]] = {k: [] for k in ("t", *NAMES, "jobs_s", "tokens_s")}
    for prev, cur in zip([None, *rows[:-1]], rows, strict=True):
        out["t"].append(cur["t"])
        for p in NAMES:
            out[p].append(cur[p])
        dt = cur["t"] - prev["t"] if prev else 0.0
        out["jobs_s"].append(round(_rate(prev["done"], cur["done"], dt), 2) if prev else 0.0)
        out["tokens_s"].append(round(_rate(prev["tokens"], cur["tokens"], dt), 1) if prev else 0.0)
    return out
