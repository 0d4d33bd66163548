"""The gateway's Redis keys, all under `{ns}:gw:` (the namespace's hash tag, protocol/keys.py): the namespace's ACL
covers them, and in a Redis Cluster they live on the namespace's shard next to its jobs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from protocol.keys import key_prefix


@dataclass(frozen=True)
class GatewayKeys:
    ns: str

    @property
    def prefix(self) -> str:
        return key_prefix(self.ns)

    def file(self, file_id: str) -> str:
        """hash: the file's metadata (owner, filename, purpose, bytes, created_at, path, endpoint, lines)."""
        return f"{self.prefix}:gw:file:{file_id}"

    def files(self, owner: str) -> str:
        """sorted set: one owner's file ids by created_at."""
        return f"{self.prefix}:gw:files:{owner}"

    def batch(self, batch_id: str) -> str:
        """hash: the gateway's half of a batch (owner, input file, window, metadata, webhook, final status).

        The producer's `{ns}:batch:{id}` (same id) holds the counts; the batch object combines both."""
        return f"{self.prefix}:gw:batch:{batch_id}"

    def batches(self, owner: str) -> str:
        """sorted set: one owner's batch ids by created_at (for GET /v1/batches)."""
        return f"{self.prefix}:gw:batches:{owner}"

    @property
    def open_batches(self) -> str:
        """set: batches submitted and not yet finalised; the watcher scans it."""
        return f"{self.prefix}:gw:open-batches"

    def job(self, job_id: str) -> str:
        """hash: owner and endpoint of a job submitted through /v1/chat/completions or /v1/completions."""
        return f"{self.prefix}:gw:job:{job_id}"

    @property
    def validating(self) -> str:
        """set: batches created and not yet submitted or ended; the watcher sweeps it (batches/ingest.py)."""
        return f"{self.prefix}:gw:validating"

    def submit_lease(self, batch_id: str) -> str:
        """string with a TTL: held by whoever is submitting (or ending) a validating batch (batches/ingest.py)."""
        return f"{self.prefix}:gw:submit-lease:{batch_id}"

    @property
    def queued_bytes(self) -> str:
        """hash: owner -> estimated Redis bytes of its open batches; '*' -> all owners' (batches/capacity.py)."""
        return f"{self.prefix}:gw:queued-bytes"

    def kept_bytes(self, owner: str) -> str:
        """hash: the end of an hour -> estimated Redis bytes of one owner's results kept until then ('*': all
        owners'), counted against the same limits as open batches (gateway/kept_bytes.py)."""
        return f"{self.prefix}:gw:kept-bytes:{owner}"

    @property
    def config(self) -> str:
        """hash: limits changed at run time (batches/capacity.py), over the settings."""
        return f"{self.prefix}:gw:config"

    def idempotency(self, route: str, owner: str, key_digest: str) -> str:
        """string with a 24 h TTL: `{body digest}:{object id}` of an Idempotency-Key (gateway/idempotency.py)."""
        return f"{self.prefix}:gw:idem:{route}:{owner}:{key_digest}"

    @property
    def ended_batches(self) -> str:
        """sorted set: `{owner}:{batch id}` of ended batches by when their record goes (batch_retention_s); the
        watcher deletes those due (batches/retention.py)."""
        return f"{self.prefix}:gw:ended-batches"

    @property
    def expiring_files(self) -> str:
        """sorted set: output files by expires_at (output_expires_after); the watcher deletes those due."""
        return f"{self.prefix}:gw:expiring-files"

    @property
    def ui_samples(self) -> str:
        """list: the UI overview's history samples (gateway/ui/samples.py); `:lock` after it rate-limits them."""
        return f"{self.prefix}:gw:ui:samples"

    def ui_session(self, token_hash: str) -> str:
        """hash: one UI login session (gateway/ui/session.py), by the sha256 of its cookie token."""
        return f"{self.prefix}:gw:ui:session:{token_hash}"

    def ui_sessions(self, owner: str) -> str:
        """sorted set: one owner's UI session token hashes by created_at (the per-key cap, ui/session.py)."""
        return f"{self.prefix}:gw:ui:sessions:{owner}"


def hash_fields(raw: dict[str, str], json_fields: tuple[str, ...]) -> dict[str, Any]:
    """A record hash of these keys as its model's fields: empty fields left unset, the JSON-valued ones decoded
    (the batch and file records read back)."""
    data: dict[str, Any] = {k: v for k, v in raw.items() if v != ""}
    for name in json_fields:
        if name in data:
            data[name] = json.loads(data[name])
    return data
