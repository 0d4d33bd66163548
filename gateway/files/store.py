"""Files: content on a volume (files_dir), metadata in Redis.

Why a volume and not Redis: batch files run to hundreds of MB, and Redis holds the job queue in memory with
noeviction, so a few big files there would refuse the queue's own writes (and slow AOF rewrites). A file on
disk also streams in and out in constant memory. The cost: every gateway and tasks process must mount the
same files_dir (one box: a named volume; several boxes: a shared filesystem).

A batch input file has its validated requests beside it (`{file_id}.requests`, producer/batch_spool.py's
spool: one line each, the request JSON as the submit sends it), written by the upload as it validates each
line; the submit task streams that to Redis and never reads or validates the file again. Beside it too, the
order its lines are sent in (`{file_id}.requests.order`, producer/prefix_order.py: lines whose prompts start
alike together, keyed as the upload streams in); the output file keeps the input order whatever the order sent.

A file's metadata counts against its key's byte limits (batches/capacity.py) for as long as it is kept: an
upload past them is refused 429 and nothing of it kept; DELETE (or the expiry of an output file) gives it back.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, BinaryIO

import redis
import structlog
from pydantic import BaseModel, PrivateAttr

from gateway.byte_limits import INDEX_ENTRY_BYTES, STORED_CODES, raise_for
from gateway.errors import invalid, not_found
from gateway.keys import GatewayKeys, hash_fields
from producer.batch_file import BatchFileReader
from producer.batch_spool import spool_writer
from producer.openai_batch import submit_fields
from producer.prefix_order import PrefixOrder
from protocol.priority import Priority
from protocol.scripts import lua, script

log = structlog.get_logger("tokenbus.gateway")

PURPOSES_UPLOADED = ("batch",)  # what a client may upload; "batch_output" files are made by finalisation
BATCH_PRIORITY = Priority.bulk  # every gateway batch's queue: set in each request as the upload validates it
_KEEP = lua("keep_file")  # protocol/lua/keep_file.lua: the metadata and its bytes counted, in one step
_DROP = lua("drop_file")  # protocol/lua/drop_file.lua


class FileMeta(BaseModel):
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: float
    endpoint: str | None = None  # batch input files: the one endpoint of their lines
    requests: int | None = None  # batch input files: non-blank lines
    line_errors: list[dict[str, Any]] | None = None  # batch input files: invalid lines (a batch of it fails)
    tokens: int | None = None  # batch input files: prompt + max_tokens x n, summed (per-key quotas)
    models: list[str] | None = None  # batch input files: the models their lines name ('' = none)
    result_bytes: int | None = None  # batch input files: their results' most Redis bytes (batches/capacity.py)
    expires_at: float | None = None  # a batch's output files (output_expires_after, else its retention): gone after
    # an upload's sha256 of purpose, filename and content (Idempotency-Key); never stored
    _digest: str = PrivateAttr("")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": int(self.created_at),
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": None if self.expires_at is None else int(self.expires_at), "status_details": None}


class FileStore:
    def __init__(self, r: redis.Redis, keys: GatewayKeys, root: Path, max_line_bytes: int,
                 max_tokens: int = 2**31 - 1, max_requests: int = 2**31 - 1,
                 byte_limits: Callable[[], tuple[int, int]] = lambda: (0, 0)) -> None:
        # No mkdir here: the serving processes make the directory (a mere import must not create one).
        self.r, self.keys, self.root, self.max_line_bytes = r, keys, Path(root), max_line_bytes
        self.max_tokens, self.max_requests = max_tokens, max_requests
        # (max_queued_bytes_per_key, max_queued_bytes) as the settings have them now ({ns}:gw:config wins)
        self.byte_limits = byte_limits

    def path(self, file_id: str) -> Path:
        # Two hex characters of fan-out keep any one directory small.
        return self.root / file_id[-2:] / file_id

    def requests_path(self, file_id: str) -> Path:
        """A batch input file's validated requests, as its submit sends them (written by its upload)."""
        return self.path(file_id).with_name(f"{file_id}.requests")

    def order_path(self, file_id: str) -> Path:
        """The prefix order a batch input file's requests are sent in (producer/prefix_order.py; by its upload)."""
        return self.path(file_id).with_name(f"{file_id}.requests.order")

    def find(self, owner: str, file_id: str) -> FileMeta | None:
        """The file's metadata, or None unless it exists and belongs to owner."""
        raw = self.r.hgetall(self.keys.file(file_id)) if file_id.startswith("file-") else {}
        if not raw or raw.get("owner") != owner:
            return None
        if raw.get("expires_at") and float(raw["expires_at"]) <= time.time():
            self.remove(file_id, owner)  # its output_expires_after passed: gone, as if deleted
            return None
        return FileMeta.model_validate(hash_fields(raw, ("line_errors", "models")))

    def get(self, owner: str, file_id: str) -> FileMeta:
        """The file's metadata; 404 unless it exists and belongs to owner."""
        meta = self.find(owner, file_id)
        if meta is None:
            raise not_found("file", file_id)
        return meta

    def open_upload(self, owner: str) -> Upload:
        return Upload(self, owner, "file-" + uuid.uuid4().hex[:24])

    def register(self, meta: FileMeta, check: bool = False) -> FileMeta:
        """Write the file's metadata, counted against its owner's bytes until the file is deleted (KEEP_FILE).
        check=True (an upload): past the key's or everyone's byte limit, 429 and nothing written; else (a file
        the gateway makes: a batch's output) counted without a check."""
        fields = {k: ("" if v is None else json.dumps(v) if isinstance(v, list) else v)
                  for k, v in meta.model_dump().items()}
        per_key, total = self.byte_limits()
        out = script(_KEEP)(
            keys=[self.keys.file(meta.id), self.keys.files(meta.owner), self.keys.expiring_files,
                  self.keys.queued_bytes, self.keys.kept_bytes(meta.owner), self.keys.kept_bytes("*"),
                  self.keys.config],
            args=[meta.owner, meta.id, meta.created_at, "" if meta.expires_at is None else meta.expires_at,
                  per_key, total, time.time(), int(check), INDEX_ENTRY_BYTES,
                  *[x for kv in fields.items() for x in kv]],
            client=self.r)
        if int(out[0]) < 0:
            code, value, per_key, total, need = map(int, out)
            raise_for(code, value, need, per_key, total, "file's metadata", STORED_CODES,
                               "upload a file with fewer invalid lines")
        return meta

    def delete(self, owner: str, file_id: str) -> None:
        self.get(owner, file_id)
        self.remove(file_id, owner)
        log.info("file_deleted", file_id=file_id, owner=owner)

    def remove(self, file_id: str, owner: str) -> None:
        """The file's metadata and content gone (DELETE, or its expiry), its bytes given back (DROP_FILE)."""
        script(_DROP)(keys=[self.keys.file(file_id), self.keys.files(owner), self.keys.expiring_files,
                            self.keys.kept_bytes(owner), self.keys.kept_bytes("*")],
                      args=[file_id, f"{owner}:{file_id}"], client=self.r)
        self.path(file_id).unlink(missing_ok=True)
        self.requests_path(file_id).unlink(missing_ok=True)
        self.order_path(file_id).unlink(missing_ok=True)

    def sweep_expired(self, now: float | None = None) -> int:
        """Delete the files whose expires_at passed (the watcher calls this); returns how many."""
        due = self.r.zrangebyscore(self.keys.expiring_files, "-inf", now or time.time(), start=0, num=1000)
        for member in due:
            owner, _, file_id = member.partition(":")
            self.remove(file_id, owner)
        if due:
            log.info("files_expired", count=len(due))
        return len(due)


class Upload:
    """One file being uploaded: bytes go to a hidden part file and through the batch-line validator, which
    writes each valid line's request JSON (with the batch priority set) to a hidden part file of its own."""

    def __init__(self, store: FileStore, owner: str, file_id: str) -> None:
        self.store, self.owner, self.id = store, owner, file_id
        self.final, self.final_requests = store.path(file_id), store.requests_path(file_id)
        self.final_order = store.order_path(file_id)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.part = self.final.with_name(f".{file_id}.part")
        self.requests_part = self.final.with_name(f".{file_id}.requests.part")
        self._f: BinaryIO | None = self.part.open("wb")
        self._requests: IO[str] | None = self.requests_part.open("w", encoding="utf-8")
        self.bytes = 0
        self.sha = hashlib.sha256()
        self.order = PrefixOrder()  # each valid line's prefix group, kept beside the requests at commit
        self.validator = BatchFileReader(store.max_line_bytes, max_tokens=store.max_tokens,
                                         max_requests=store.max_requests,
                                         on_request=spool_writer(self._requests, self.order),
                                         overrides=submit_fields(None, BATCH_PRIORITY))

    def write(self, data: bytes) -> None:
        """Blocking (file I/O, validation): the caller runs it in a thread."""
        assert self._f is not None
        self._f.write(data)
        self.sha.update(data)
        self.bytes += len(data)
        self.validator.feed(data)

    def commit(self, filename: str, purpose: str) -> FileMeta:
        """Validate, move into place, record. Raises a 400 naming the bad lines (and keeps nothing)."""
        self.validator.close()  # first: its last line (no newline after it) is spooled now
        self._close()
        problem = self.validator.upload_problem()
        if problem:
            self.abort()
            raise invalid(problem, param="file", code="invalid_batch_file")
        if self.validator.error_count:  # a batch of it fails in validating: no request of it will be sent
            self.requests_part.unlink(missing_ok=True)
        else:
            self.order.save(self.final_order)  # before the requests: a submit that finds them finds it too
            os.replace(self.requests_part, self.final_requests)
        os.replace(self.part, self.final)
        meta = FileMeta(id=self.id, owner=self.owner, filename=filename, purpose=purpose, bytes=self.bytes,
                        created_at=time.time(), endpoint=self.validator.endpoint,
                        requests=self.validator.requests, line_errors=self.validator.line_errors(),
                        tokens=self.validator.tokens, result_bytes=self.validator.result_bytes,
                        models=sorted(self.validator.models))
        self.sha.update(f"\0{purpose}\0{filename}".encode())
        meta._digest = self.sha.hexdigest()[:32]
        try:
            self.store.register(meta, check=True)
        except BaseException:  # past the key's byte limits (429): nothing of the file is kept
            self.final.unlink(missing_ok=True)
            self.final_requests.unlink(missing_ok=True)
            self.final_order.unlink(missing_ok=True)
            raise
        log.info("file_uploaded", file_id=self.id, owner=self.owner, bytes=self.bytes,
                 requests=meta.requests, endpoint=meta.endpoint, invalid_lines=self.validator.error_count)
        return meta

    def abort(self) -> None:
        self._close()
        self.part.unlink(missing_ok=True)
        self.requests_part.unlink(missing_ok=True)

    def _close(self) -> None:
        for f in (self._f, self._requests):
            if f is not None:
                f.close()
        self._f = self._requests = None
