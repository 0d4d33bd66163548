"""Every Redis key of one tokenbus namespace, and the job priorities that pick a job's queue.

Part of the wire protocol (protocol/models.py re-exports these names; docs/protocol.md describes them).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

DEFAULT_NAMESPACE = "tokenbus"


class Priority(StrEnum):
    """A job's priority: every worker's intake reads interactive queues first, then default, then bulk."""

    interactive = "interactive"
    default = "default"
    bulk = "bulk"


PRIORITIES = (Priority.interactive, Priority.default, Priority.bulk)  # the order intake serves them in


def priority_rank(priority: str) -> int:
    """0 for interactive, 1 default, 2 bulk: the engine seats lower ranks first."""
    return PRIORITIES.index(Priority(priority))


@dataclass(frozen=True)
class Keys:
    """Every Redis key of one namespace."""

    ns: str = DEFAULT_NAMESPACE

    @property
    def jobs(self) -> str:
        """The single stream of tokenbus before priorities: workers still read it as a default queue (drain)."""
        return f"{self.ns}:jobs"

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

    def priority_of(self, stream: str) -> Priority:
        """The priority of a queue's stream key; the pre-priority stream {ns}:jobs is default."""
        parts = stream.split(":")
        if len(parts) >= 3 and stream.startswith(f"{self.ns}:q:"):
            return Priority(parts[len(self.ns.split(":")) + 1])
        return Priority.default

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
