"""A job's priority: the one definition of its names and its rank.

The same value is the request's `priority` field, the record's `priority` field and the queue key's last part
(Keys.queue); the engine seats by its rank (`rank_of`), the UI and the CLI list `PRIORITIES`.
"""

from __future__ import annotations

from enum import StrEnum


class Priority(StrEnum):
    """Ranked by the order of its members: every worker's intake reads interactive queues first, then default,
    then bulk, and the engine seats lower ranks first."""

    interactive = "interactive"
    default = "default"
    bulk = "bulk"

    @property
    def rank(self) -> int:
        """0 for interactive, 1 default, 2 bulk."""
        return PRIORITIES.index(self)


PRIORITIES = tuple(Priority)  # the order intake serves them in
NAMES = tuple(p.value for p in PRIORITIES)


def rank_of(priority: Priority | str | int) -> int:
    """The seating rank of a priority given as the enum, its name or its rank (the engine's callers pass any)."""
    if isinstance(priority, int) and not isinstance(priority, bool):
        if not 0 <= priority < len(PRIORITIES):
            raise ValueError(f"priority rank {priority} is not one of 0..{len(PRIORITIES) - 1} ({', '.join(NAMES)})")
        return priority
    return Priority(priority).rank
