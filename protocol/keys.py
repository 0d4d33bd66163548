"""Every Redis key of one tokenbus namespace (a job's model and priority pick its queue).

Part of the wire protocol (docs/protocol.md describes them).

Every key starts with the namespace in braces, `{ns}:` (namespace `tokenbus`: `{tokenbus}:q:default`): a Redis
Cluster hash tag, so all the keys of one namespace hash to one slot and live on one shard, where the Lua scripts
may touch any of them (docs/deployment.md, "Redis Cluster"). The gateway's keys (gateway/keys.py) use the same
prefix. Before 0.3.0 the prefix had no braces (`tokenbus:q:default`): docs/operations.md says how to move.

A job that names a model waits on that model's queues: the same keys with `:m:{model id}` after the prefix
(`{tokenbus}:m:llama:q:default`); one that names none waits on the default queues (`{tokenbus}:q:default`, the
keys of every release before models), which the default model's workers read (protocol/registry.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property

from protocol.priority import PRIORITIES, Priority
from protocol.registry import check_model_name

DEFAULT_NAMESPACE = "tokenbus"


def key_prefix(ns: str) -> str:
    """`{ns}`, the hash tag every key of the namespace starts with (a namespace with a brace in it could not be
    one: Redis hashes the text between the first `{` and the next `}`)."""
    if not ns or "{" in ns or "}" in ns:
        raise ValueError(f"namespace {ns!r}: must be non-empty and hold no '{{' or '}}' (it becomes the key "
                         "prefix {ns}:, a Redis Cluster hash tag)")
    return "{" + ns + "}"


def _template(key: str) -> list[str]:
    """[prefix, suffix] of a key built around one id (built with the id "\0"): Lua joins prefix .. id .. suffix."""
    prefix, suffix = key.split("\0")
    return [prefix, suffix]


@dataclass(frozen=True)
class Keys:
    """Every Redis key of one namespace; with `model` (a model's id), its queue keys are that model's."""

    ns: str = DEFAULT_NAMESPACE
    model: str = ""  # '' = the default queues (no model in the key)

    def __post_init__(self) -> None:
        key_prefix(self.ns)  # refuse a namespace that cannot be a hash tag now, not at the first key
        if self.model:
            check_model_name(self.model)

    @property
    def prefix(self) -> str:
        """`{ns}`: every key below is this + `:` + the rest."""
        return key_prefix(self.ns)

    @property
    def queue_prefix(self) -> str:
        """What the queue keys (queue, registry, turn, ready, depth, wake) start with: `{ns}`, or `{ns}:m:{model}`
        for a model's queues."""
        return f"{self.prefix}:m:{self.model}" if self.model else self.prefix

    def for_model(self, model: str) -> Keys:
        """The keys of `model`'s queues ('' = the default queues); the other keys are the namespace's own."""
        return self if model == self.model else Keys(self.ns, model)

    @property
    def routing_key(self) -> str:
        """A key in the namespace's slot, passed as KEYS[1] to the scripts that find every other key through the
        layout, so that a Redis Cluster client sends them to the namespace's shard (it routes by KEYS)."""
        return self.config

    @cached_property
    def layout(self) -> str:
        """The keys the Lua scripts find for themselves, and the priorities, as one JSON table (an ARGV of the
        scripts that walk the queues; protocol/lua/_layout.lua): the Lua spells no key name or priority. It is
        the namespace's whatever `model` is: the scripts derive a model's queue keys from it (model_layout)."""
        if self.model:
            return Keys(self.ns).layout
        return json.dumps({
            "priorities": [p.value for p in PRIORITIES],
            "default_priority": Priority.default.value,
            "queue": {p.value: self.queue(p) for p in PRIORITIES},
            "batch_queue": {p.value: _template(self.queue(p, "\0")) for p in PRIORITIES},
            "registry": {p.value: self.registry(p) for p in PRIORITIES},
            "turn": {p.value: self.turn(p) for p in PRIORITIES},
            "ready": {p.value: self.ready(p) for p in PRIORITIES},
            "depth": self.depth,
            "wake": self.wake,
            "batch": _template(self.batch("\0")),
            "batch_jobs": _template(self.batch_jobs("\0")),
            "prefix": self.prefix,
            "model_prefix": _template(f"{self.prefix}:m:\0"),
            "models": self.models,
            "model_names": self.model_names,
        }, separators=(",", ":"))

    def queue(self, priority: str = Priority.default, batch_id: str = "") -> str:
        """The stream a job is queued on: `{ns}:q:{priority}` for a loose job, `{ns}:q:{priority}:{batch_id}`
        for a batch's jobs (one stream per batch, so batches of one priority take turns)."""
        base = f"{self.queue_prefix}:q:{Priority(priority).value}"
        return f"{base}:{batch_id}" if batch_id else base

    def registry(self, priority: str) -> str:
        """Sorted set of the live batch queues of one priority (member: stream key, score: first submit)."""
        return f"{self.queue_prefix}:queues:{Priority(priority).value}"

    def turn(self, priority: str) -> str:
        """The queue of this priority that intake read from last (round-robin position, shared by workers)."""
        return f"{self.queue_prefix}:turn:{Priority(priority).value}"

    def ready(self, priority: str) -> str:
        """Sorted set of the batch queues of one priority that may hold entries no worker has read yet (member:
        stream key, score: its registry score). Intake visits only these, so a read costs the same with 1 or
        1,000 live batches; a queue found empty leaves it, the next submit to it puts it back."""
        return f"{self.queue_prefix}:ready:{Priority(priority).value}"

    @property
    def depth(self) -> str:
        """Hash of counters kept exact by the scripts that write queue entries: field <priority> = entries in
        that priority's queues (queued + running), field `pending` = entries READ delivered, not acked yet."""
        return f"{self.queue_prefix}:depth"

    @property
    def wake(self) -> str:
        """Stream with an entry each time a batch queue becomes ready: an idle worker's XREAD BLOCK waits on it
        (and on the loose queues) instead of on every batch queue."""
        return f"{self.queue_prefix}:wake"

    @property
    def events(self) -> str:
        return f"{self.prefix}:events"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    @property
    def cancel(self) -> str:
        return f"{self.prefix}:cancel"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    @property
    def config(self) -> str:
        return f"{self.prefix}:config"

    @property
    def models(self) -> str:
        """Hash of the declared models: id -> ModelRecord JSON (protocol/registry.py)."""
        return f"{self.prefix}:models"

    @property
    def model_names(self) -> str:
        """Hash of every name a job may give for a model -> the model's id."""
        return f"{self.prefix}:model-names"

    @property
    def adapters(self) -> str:
        """Hash of the operator's LoRA adapters (`tokenbus adapters add|remove`): adapter name -> its entry (JSON:
        name, base, path, state added | removed, rev, at), and field `:rev` the revision the workers poll."""
        return f"{self.prefix}:adapters"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def vectors(self, job_id: str) -> str:
        """String: an embedding job's vectors, raw little-endian bytes (protocol/embeddings.py); the record's TTL."""
        return f"{self.prefix}:job:{job_id}:vectors"

    def tokens(self, job_id: str) -> str:
        """Stream of a `stream: true` job's partial output: entries {offset, token_ids (JSON), text, done}."""
        return f"{self.prefix}:job:{job_id}:tokens"

    def worker(self, name: str) -> str:
        return f"{self.prefix}:worker:{name}"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}"

    def batch_jobs(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:jobs"
