"""ServedAdapters: the LoRA adapters this worker serves, each under a model name of its own (docs/adapters.md).

They come from the worker's `--lora NAME=PATH` flags, loaded at start, and from the operator's `tokenbus adapters
add|remove`, which write `{ns}:adapters` (ADAPTER_ADD / ADAPTER_REMOVE: an entry per adapter name, its base,
directory and state, and a revision `:rev`). An entry for this worker's base wins over its flag of the same name.

    housekeeper: poll (HGET :rev each beat; HGETALL when it moved) ──AdapterChange──▶ engine thread: apply
                 (Engine.add_lora / remove_lora) ──▶ housekeeper: sync (DECLARE_MODEL each newly loaded adapter,
                 its base as parent; its queues read from then on) ──▶ the heartbeat: adapters, adapter_errors,
                 adapters_rev

An adapter's jobs wait on its own queues (`{ns}:m:{adapter}:q:...`), so its depth, metrics and autoscaling are
its own, and a job costs Redis what any model's does. The engine thread owns the engine and the housekeeper owns
Redis; `_lock` guards what both touch.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from protocol import scripts
from protocol.errors import TokenbusError
from protocol.keys import Keys
from protocol.registry import ModelRecord
from worker.serve.served import ServedModels

log = structlog.get_logger("tokenbus.worker")

REV_FIELD = ":rev"  # the field of {ns}:adapters holding its revision (no adapter name holds ':')
_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass
class AdapterChange:
    """The operator's entries for this worker's base at revision `rev` (name -> entry), for the engine thread."""

    rev: int
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    drop: list[str] = field(default_factory=list)  # loaded, but the registry refused their names: unload them


def fingerprint(path: str) -> str:
    """A digest of an adapter's files: two directories of one name must hold the same weights to share it."""
    digest = hashlib.blake2b(digest_size=8)
    for name in _FILES:
        try:
            with open(os.path.join(path, name), "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
        except OSError:
            pass  # the engine's load has refused it already, naming the file
    return digest.hexdigest()


class ServedAdapters:
    def __init__(self, keys: Keys, served: ServedModels, flags: dict[str, str]) -> None:
        self.keys, self.served, self.flags = keys, served, flags
        self._lock = threading.Lock()
        self.loaded: dict[str, tuple[str, str]] = {}  # name -> (path, checkpoint): in the engine
        self.errors: dict[str, str] = {}  # name -> why the latest attempt to serve it was refused
        self.unloading: set[str] = set()  # removed, still used by requests in the engine: unloaded once they end
        self.seen_rev = 0  # the revision last handed to the engine thread
        self.applied_rev = 0  # the revision the engine thread has applied
        self.confirmed_rev = 0  # ... and whose loaded adapters are declared: what the heartbeat says

    # ---- housekeeper (Redis) -------------------------------------------------------------------------------

    def poll(self, r: Any) -> AdapterChange | None:
        """The operator's entries for this worker's base when `{ns}:adapters` moved past what was seen."""
        rev = int(r.hget(self.keys.adapters, REV_FIELD) or 0)
        if rev <= self.seen_rev:
            return None
        entries = {}
        for name, raw in r.hgetall(self.keys.adapters).items():
            name = name.decode() if isinstance(name, bytes) else name
            if name != REV_FIELD:
                entry = json.loads(raw)
                if entry.get("base") in self.served.ids:
                    entries[name] = entry
        self.seen_rev = rev
        return AdapterChange(rev, entries)

    def sync(self, r: Any) -> list[str]:
        """Declare the adapters loaded since the last beat and stop serving those gone; returns the names whose
        declaration was refused (the engine thread unloads them: AdapterChange with their entries removed)."""
        with self._lock:
            loaded, rev = dict(self.loaded), self.applied_rev
        refused = []
        for name, (path, checkpoint) in loaded.items():
            if name in self.served.adapter_ids:
                continue
            base = self.served.record
            record = ModelRecord(id=name, names=[name], kind=base.kind, checkpoint=checkpoint, parent=self.served.id,
                                 root=path, context_length=base.context_length, declared_at=time.time(),
                                 declared_by=base.declared_by)
            try:
                scripts.declare_model(r, self.keys, record)
            except TokenbusError as err:
                self._refused(name, f"adapter name {name!r} cannot be declared: {err}")
                refused.append(name)
                continue
            log.info("adapter_declared", adapter=name, base=self.served.id, path=path)
        with self._lock:
            self.served.adapter_ids = sorted(n for n in self.loaded if n not in refused and n not in self.unloading)
        self.confirmed_rev = rev
        return refused

    def heartbeat_fields(self) -> dict[str, Any]:
        with self._lock:
            return {"adapters": list(self.served.adapter_ids), "adapter_errors": dict(self.errors),
                    "adapters_rev": self.confirmed_rev}

    # ---- engine thread -------------------------------------------------------------------------------------

    def start(self, engine: Any, r: Any) -> None:
        """At start, before the other threads run (this thread may use both the engine and Redis): the flags'
        adapters, overridden by the operator's entries for this base, loaded and declared."""
        change = self.poll(r) or AdapterChange(0)
        for name, path in self.flags.items():
            if name not in change.entries:
                self._load(engine, name, path)
        self.apply(engine, change)
        self.apply(engine, AdapterChange(change.rev, drop=self.sync(r)))

    def beat(self, r: Any, engine_inbox: Any) -> None:
        """The housekeeper's every beat: hand a new revision to the engine thread, declare what it loaded."""
        change = self.poll(r)
        if change is not None:
            engine_inbox.put(change)
        refused = self.sync(r)
        if refused:
            engine_inbox.put(AdapterChange(self.seen_rev, drop=refused))

    def apply(self, engine: Any, change: AdapterChange | None) -> None:
        """Load and unload as the operator's entries say (None: nothing new); then retry the unloads that waited
        for their requests to end."""
        if change is not None:
            for name in change.drop:
                self._unload(engine, name, keep_error=True)
            for name, entry in change.entries.items():
                if entry.get("state") == "added":
                    self._load(engine, name, entry["path"])
                else:
                    self._unload(engine, name)
            self.applied_rev = max(self.applied_rev, change.rev)
        for name in list(self.unloading):
            self._unload(engine, name)

    def _load(self, engine: Any, name: str, path: str) -> None:
        if self.loaded.get(name, ("",))[0] == path and name not in self.unloading:
            return
        try:
            engine.add_lora(name, path)  # replaces an older directory of that name (when no request uses it)
        except (ValueError, OSError) as err:  # LoraError (names the field), no slots, still in use
            self._refused(name, str(err))
            return
        except Exception as err:  # the engine's own failure: this adapter is refused, the worker serves on
            log.exception("adapter_load_error", adapter=name)
            self._refused(name, f"the worker failed to load it ({type(err).__name__}: {err})")
            return
        checkpoint = f"{self.served.record.checkpoint}+lora#{fingerprint(path)}"
        with self._lock:
            self.loaded[name] = (path, checkpoint)
            self.errors.pop(name, None)
            self.unloading.discard(name)
        log.info("adapter_loaded", adapter=name, path=path)

    def _unload(self, engine: Any, name: str, keep_error: bool = False) -> None:
        with self._lock:
            self.loaded.pop(name, None)
            if not keep_error:
                self.errors.pop(name, None)
            if name in self.served.adapter_ids:
                self.served.adapter_ids = [n for n in self.served.adapter_ids if n != name]  # read no more jobs
        if name not in engine.lora_names():
            self.unloading.discard(name)
            return
        try:
            engine.remove_lora(name)
        except ValueError:  # requests inside the engine use it: again after a later step
            self.unloading.add(name)
            return
        self.unloading.discard(name)
        log.info("adapter_unloaded", adapter=name)

    def _refused(self, name: str, why: str) -> None:
        with self._lock:
            self.errors[name] = why
        log.warning("adapter_refused", adapter=name, error=why)
