"""Every Redis key of one tokenbus namespace, and the job priorities that pick a job's queue.

Part of the wire protocol (protocol/models.py re-exports these names; docs/protocol.md describes them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property

DEFAULT_NAMESPACE = "tokenbus"


class Priority(StrEnum):
    """A job's priority, ranked by the order of its members: every worker's intake reads interactive queues
    first, then default, then bulk, and the engine seats lower ranks first."""

    interactive = "interactive"
    default = "default"
    bulk = "bulk"

    @property
    def rank(self) -> int:
        """0 for interactive, 1 default, 2 bulk."""
        return PRIORITIES.index(self)


PRIORITIES = tuple(Priority)  # the order intake serves them in


def _template(key: str) -> list[str]:
    """[prefix, suffix] of a key built around one id (built with the id "\0"): Lua joins prefix .. id .. suffix."""
    prefix, suffix = key.split("\0")
    return [prefix, suffix]


@dataclass(frozen=True)
class Keys:
    """Every Redis key of one namespace."""

    ns: str = DEFAULT_NAMESPACE

    @cached_property
    def layout(self) -> str:
        """The keys the Lua scripts find for themselves, and the priorities, as one JSON table (an ARGV of the
        scripts that walk the queues; protocol/lua/_layout.lua): the Lua spells no key name or priority."""
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
        }, separators=(",", ":"))

    def queue(self, priority: str = Priority.default, batch_id: str = "") -> str:
        """The stream a job is queued on: `{ns}:q:{priority}` for a loose job, `{ns}:q:{priority}:{batch_id}`
        for a batch's jobs (one stream per batch, so batches of one priority take turns)."""
        base = f"{self.ns}:q:{Priority(priority).value}"
        return f"{base}:{batch_id}" if batch_id else base

    def registry(self, priority: str) -> str:
        """Sorted set of the live batch queues of one priority (member: stream key, score: first submit)."""
        return f"{self.ns}:queues:{Priority(priority).value}"

    def turn(self, priority: str) -> str:
        """The queue of this priority that intake read from last (round-robin position, shared by workers)."""
        return f"{self.ns}:turn:{Priority(priority).value}"

    def ready(self, priority: str) -> str:
        """Sorted set of the batch queues of one priority that may hold entries no worker has read yet (member:
        stream key, score: its registry score). Intake visits only these, so a read costs the same with 1 or
        1,000 live batches; a queue found empty leaves it, the next submit to it puts it back."""
        return f"{self.ns}:ready:{Priority(priority).value}"

    @property
    def depth(self) -> str:
        """Hash of counters kept exact by the scripts that write queue entries: field <priority> = entries in
        that priority's queues (queued + running), field `pending` = entries READ delivered, not acked yet."""
        return f"{self.ns}:depth"

    @property
    def wake(self) -> str:
        """Stream with an entry each time a batch queue becomes ready: an idle worker's XREAD BLOCK waits on it
        (and on the loose queues) instead of on every batch queue."""
        return f"{self.ns}:wake"

    @property
    def events(self) -> str:
        return f"{self.ns}:events"

    @property
    def dead(self) -> str:
        return f"{self.ns}:dead"

    @property
    def cancel(self) -> str:
        return f"{self.ns}:cancel"

    @property
    def workers(self) -> str:
        return f"{self.ns}:workers"

    @property
    def config(self) -> str:
        return f"{self.ns}:config"

    def job(self, job_id: str) -> str:
        return f"{self.ns}:job:{job_id}"

    def tokens(self, job_id: str) -> str:
        """Stream of a `stream: true` job's partial output: entries {offset, token_ids (JSON), text, done}."""
        return f"{self.ns}:job:{job_id}:tokens"

    def worker(self, name: str) -> str:
        return f"{self.ns}:worker:{name}"

    def batch(self, batch_id: str) -> str:
        return f"{self.ns}:batch:{batch_id}"

    def batch_jobs(self, batch_id: str) -> str:
        return f"{self.ns}:batch:{batch_id}:jobs"
