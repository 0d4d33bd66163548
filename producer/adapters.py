"""LoRA adapters from the operator's side: `tokenbus adapters add|remove|list` (docs/adapters.md).

An adapter is a model of its own whose `parent` is its base (protocol/registry.py). `add` and `remove` each run one
idempotent script (ADAPTER_ADD / ADAPTER_REMOVE: the adapter's entry in `{ns}:adapters` and the revision the base's
workers poll), then wait until every live worker of the base confirms in its heartbeat: it has applied that
revision (`adapters_rev`) and serves the adapter (`adapters`) or says why it refused it (`adapter_errors`).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from protocol import scripts
from protocol.errors import ModelNotFound, TokenbusError
from protocol.keys import Keys
from protocol.model_status import declared, live_heartbeats
from protocol.registry import check_model_name

REV_FIELD = ":rev"  # {ns}:adapters' revision (worker/serve/adapters.py polls it)


@dataclass
class Confirmation:
    """What the live workers of an adapter's base said about one change, by worker name."""

    name: str
    base: str
    rev: int
    done: list[str] = field(default_factory=list)  # serve it (add) / no longer serve it (remove)
    refused: dict[str, str] = field(default_factory=dict)  # worker -> why it refused the adapter
    waiting: list[str] = field(default_factory=list)  # live workers of the base that had not confirmed in time

    @property
    def ok(self) -> bool:
        return not self.refused and not self.waiting


def add(r: redis.Redis, keys: Keys, name: str, base: str, path: str) -> tuple[int, str]:
    """ADAPTER_ADD: (the revision, the base's id); ModelNotFound for an undeclared base, TokenbusError for a name
    that is another model's or a base that is an adapter."""
    check_model_name(name, "adapter")
    code, *rest = scripts.add_adapter(r, keys, name, base, path)
    if code == -1:
        raise ModelNotFound(base, json.loads(rest[0]), keys.ns)
    if code == -2:
        raise TokenbusError(f"model {rest[0]!r} is itself a LoRA adapter: give the base model it was trained on")
    if code == -3:
        raise TokenbusError(f"the name {name!r} is already model {rest[0]!r}'s: give the adapter another name")
    return int(rest[0]), rest[1]


def remove(r: redis.Redis, keys: Keys, name: str, force: bool = False) -> tuple[int, str]:
    """ADAPTER_REMOVE: (the revision, the base's id; '' when no adapter had that name); TokenbusError while its
    queues hold jobs (unless forced) or for a base model."""
    code, *rest = scripts.remove_adapter(r, keys, name, force)
    if code == -1:
        raise TokenbusError(f"adapter {name!r} has {rest[0]} jobs in its queues; let them finish (or cancel them), "
                            "or remove it anyway with --force (its queued jobs then wait for an adapter nobody "
                            "serves)")
    if code == -2:
        raise TokenbusError(f"{rest[0]!r} is a base model, not an adapter: retire it with `tokenbus models remove`")
    return int(rest[0]), rest[1]


def wait_confirmed(r: redis.Redis, keys: Keys, name: str, base: str, rev: int, serving: bool,
                   timeout_s: float = 60.0) -> Confirmation:
    """Poll the heartbeats until every live worker of `base` has applied `rev` and serves `name` (serving) or
    no longer does, or refused it; the ones that had not by the timeout are `waiting`."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = Confirmation(name, base, rev)
        for worker, hb in sorted(live_heartbeats(r, keys).items()):
            if hb is None or base not in hb.models:
                continue
            if hb.adapters_rev >= rev and (name in hb.adapters) == serving:
                seen.done.append(worker)
            elif hb.adapters_rev >= rev and serving and name in hb.adapter_errors:
                seen.refused[worker] = hb.adapter_errors[name]
            else:
                seen.waiting.append(worker)
        if not seen.waiting or time.monotonic() >= deadline:
            return seen
        time.sleep(0.2)


def listing(r: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    """Every adapter declared or asked for: its base, the operator's state and directory, the workers serving it."""
    entries = {k: json.loads(v) for k, v in r.hgetall(keys.adapters).items() if k != REV_FIELD}
    serving: dict[str, list[str]] = {}
    for worker, hb in live_heartbeats(r, keys).items():
        for a in hb.adapters if hb is not None else ():
            serving.setdefault(a, []).append(worker)
    out = {mid: {"name": mid, "base": rec.parent, "root": rec.root, "state": "declared"}
           for mid, rec in declared(r, keys).items() if rec.parent}
    for name, e in entries.items():
        out.setdefault(name, {"name": name, "base": e.get("base"), "root": e.get("path")})["state"] = e["state"]
    return [v | {"workers": sorted(serving.get(k, []))} for k, v in sorted(out.items())]


# ---- the CLI ---------------------------------------------------------------------------------------------------

def add_parser(sub: Any) -> None:
    """`tokenbus adapters ...` on the CLI's subparsers."""
    a = sub.add_parser("adapters", help="LoRA adapters served as models of their own: list, add, remove").\
        add_subparsers(dest="adapters_command", required=True)
    a.add_parser("list", help="every adapter: its base, state, directory, live workers serving it")
    aa = a.add_parser("add", help="have the live workers of a base model load an adapter (and workers that start "
                      "later); waits for their heartbeats")
    aa.add_argument("name", help="the adapter's model name (what jobs give as `model`)")
    aa.add_argument("path", help="its PEFT directory, as the workers see it")
    aa.add_argument("--base", required=True, help="the base model (any of its names)")
    ar = a.add_parser("remove", help="have every worker stop serving an adapter and retire its name")
    ar.add_argument("name")
    ar.add_argument("--force", action="store_true", help="even with jobs in its queues")
    for p in (aa, ar):
        p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the heartbeats")


def command(r: redis.Redis, keys: Keys, a: argparse.Namespace) -> int:
    if a.adapters_command == "list":
        for row in listing(r, keys):
            print(f"{row['name']}  base={row['base']}  {row['state']}  workers={len(row['workers'])}  "
                  f"{row['root'] or ''}".rstrip())
        return 0
    if a.adapters_command == "add":
        rev, base = add(r, keys, a.name, a.base, a.path)
    else:
        rev, base = remove(r, keys, a.name, a.force)
        if not base:
            print(f"{a.name}: no adapter of that name (already removed)")
            return 0
    seen = wait_confirmed(r, keys, a.name, base, rev, a.adapters_command == "add", a.timeout)
    verb = "serving" if a.adapters_command == "add" else "stopped"
    for worker in seen.done:
        print(f"{worker}: {verb} {a.name}")
    for worker, why in seen.refused.items():
        print(f"{worker}: refused {a.name}: {why}")
    for worker in seen.waiting:
        print(f"{worker}: not confirmed within {a.timeout:g} s")
    if not (seen.done or seen.refused or seen.waiting):
        print(f"{a.name}: recorded (revision {rev}); no live worker serves {base} now: its workers "
              f"{'load' if a.adapters_command == 'add' else 'skip'} it when they start")
    return 0 if seen.ok else 1
