"""The gateway's Redis keys, all under `{ns}:gw:` so the namespace's ACL covers them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayKeys:
    ns: str

    def file(self, file_id: str) -> str:
        """hash: the file's metadata (owner, filename, purpose, bytes, created_at, path, endpoint, lines)."""
        return f"{self.ns}:gw:file:{file_id}"

    def files(self, owner: str) -> str:
        """sorted set: one owner's file ids by created_at."""
        return f"{self.ns}:gw:files:{owner}"

    def batch(self, batch_id: str) -> str:
        """hash: the gateway's half of a batch (owner, input file, window, metadata, webhook, final status).

        The producer's `{ns}:batch:{id}` (same id) holds the counts; the batch object combines both."""
        return f"{self.ns}:gw:batch:{batch_id}"

    def batches(self, owner: str) -> str:
        """sorted set: one owner's batch ids by created_at (for GET /v1/batches)."""
        return f"{self.ns}:gw:batches:{owner}"

    @property
    def open_batches(self) -> str:
        """set: batches submitted and not yet finalised; the watcher scans it."""
        return f"{self.ns}:gw:open-batches"

    def job(self, job_id: str) -> str:
        """hash: owner and endpoint of a job submitted through /v1/chat/completions or /v1/completions."""
        return f"{self.ns}:gw:job:{job_id}"

    @property
    def validating(self) -> str:
        """set: batches created and not yet submitted or ended; the watcher sweeps it (ingest.py)."""
        return f"{self.ns}:gw:validating"

    def submit_lease(self, batch_id: str) -> str:
        """string with a TTL: held by whoever is submitting (or ending) a validating batch (ingest.py)."""
        return f"{self.ns}:gw:submit-lease:{batch_id}"

    @property
    def queued_bytes(self) -> str:
        """hash: owner -> estimated Redis bytes of its open batches; '*' -> all owners' (capacity.py)."""
        return f"{self.ns}:gw:queued-bytes"

    @property
    def config(self) -> str:
        """hash: limits changed at run time (capacity.py), over the settings."""
        return f"{self.ns}:gw:config"
