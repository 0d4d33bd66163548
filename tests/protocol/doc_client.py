"""A client built from docs/protocol.md alone: the Lua files the doc links (includes expanded as the doc says),
the layout JSON the doc spells out, and plain Redis commands; no `producer` or `protocol` import. The
conformance tests (test_protocol_conformance.py, the cases of protocol/conformance/) and the README recipe's
test drive Redis through it; if the doc and the product disagree, they fail.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "protocol.md"
NS = "tokenbus"
P = "{" + NS + "}"  # the doc: every key starts with the namespace in braces (a Redis Cluster hash tag)
GROUP = "workers"
EVENTS_MAXLEN = 100_000  # the doc: "events_maxlen: the approximate cap of {ns}:events, 100000"
PRIORITIES = ("interactive", "default", "bulk")  # the doc's Priorities, in the order workers serve them
TERMINAL = ("finished", "failed", "cancelled")


def expand(path: Path, seen: set[Path]) -> str:
    """The doc: a line `-- #include _NAME.lua` stands for that file, itself expanded, each file at most once."""
    seen.add(path)
    out = []
    for line in path.read_text().splitlines(keepends=True):
        m = re.fullmatch(r"-- #include (_\w+\.lua)\n?", line)
        if m is None:
            out.append(line)
        elif path.parent / m.group(1) not in seen:
            out.append(expand(path.parent / m.group(1), seen))
    return "".join(out)


def doc_script_files() -> dict[str, Path]:
    """The Script files table: | `NAME` | who | [file](link) |."""
    rows = re.findall(r"^\| `(\w+)` \| (?:client|worker|gateway) \| \[[\w.]+\]\(([^)]+)\) \|$", DOC.read_text(),
                      re.M)
    return {name: (DOC.parent / link).resolve() for name, link in rows}


def doc_scripts() -> dict[str, str]:
    """Each script's text to EVAL: the linked file, expanded."""
    return {name: expand(path, set()) for name, path in doc_script_files().items()}


def layout() -> str:
    """The layout ARGV, the doc's JSON block for the namespace `tokenbus` ("Script files")."""
    m = re.search(r"The \*\*layout\*\* ARGV.*?```json\n(.*?)\n```", DOC.read_text(), re.S)
    assert m, "docs/protocol.md gives the layout JSON in a ```json block after 'The **layout** ARGV'"
    return json.dumps(json.loads(m.group(1)), separators=(",", ":"))


def queue_of(priority: str, batch_id: str = "") -> str:
    return f"{P}:q:{priority}" + (f":{batch_id}" if batch_id else "")


class DocClient:
    """Everything a client (and a worker's Redis side) needs, built from the doc's steps. `scripts` may replace
    the doc's texts (a mutated copy, to prove the tests catch a mistake in the Lua)."""

    def __init__(self, r: redis.Redis, scripts: dict[str, str] | None = None, consumer: str = "doc-worker") -> None:
        self.r = r
        self.scripts = scripts or doc_scripts()
        self.layout = layout()
        self.consumer = consumer
        assert {"SUBMIT_JOB", "QUEUE_DEPTH", "CANCEL_JOB", "START_BATCH", "FINISH_JOB", "READ"} <= set(self.scripts)

    def eval(self, name: str, keys: list[str], args: list) -> object:
        return self.r.eval(self.scripts[name], len(keys), *keys, *args)

    # step 0
    def create_group(self) -> None:
        for priority in PRIORITIES:
            try:
                self.r.xgroup_create(queue_of(priority), GROUP, id="0", mkstream=True)
            except redis.ResponseError as err:
                assert "BUSYGROUP" in str(err)

    # step 1
    def submit(self, job_id: str, request: dict | str, result_ttl: int = 60, max_queue_len: int = 0,
               batch_id: str = "", custom_id: str = "", priority: str = "default") -> list:
        text = request if isinstance(request, str) else json.dumps(request)
        return self.eval("SUBMIT_JOB", [f"{P}:job:{job_id}", queue_of(priority, batch_id), f"{P}:queues:{priority}"],
                         [job_id, text, time.time(), max_queue_len, result_ttl, batch_id, custom_id,
                          priority, self.layout, GROUP])

    def depth(self) -> list[int]:
        """QUEUE_DEPTH: [every queue, pending, interactive, default, bulk]; its KEYS only route it (the doc)."""
        return self.eval("QUEUE_DEPTH", [f"{P}:config"], [self.layout])

    def submit_plain(self, job_id: str, request: dict | str, result_ttl: int = 60, max_queue_len: int = 0,
                     priority: str = "default", step2: bool = True) -> str:
        """Step 1's plain commands: 'queued' | 'exists' | 'full'. step2 False: a client that died after EXEC."""
        key, queue = f"{P}:job:{job_id}", queue_of(priority)
        text = request if isinstance(request, str) else json.dumps(request)
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    if pipe.exists(key):
                        pipe.unwatch()
                        return "exists"
                    if max_queue_len and self.depth()[0] >= max_queue_len:
                        pipe.unwatch()
                        return "full"
                    pipe.multi()
                    pipe.xadd(queue, {"job_id": job_id, "request": text})
                    pipe.hincrby(f"{P}:depth", priority, 1)
                    pipe.hset(key, mapping={"status": "queued", "created_at": time.time(), "result_ttl": result_ttl,
                                            "priority": priority, "queue": queue})
                    entry_id = pipe.execute()[0]
                    break
                except redis.WatchError:
                    continue
            while step2:
                try:
                    pipe.watch(key)
                    if pipe.hget(key, "status") != "queued":
                        pipe.unwatch()
                        break
                    pipe.multi()
                    pipe.hset(key, "entry_id", entry_id)
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        return "queued"

    # step 5
    def cancel(self, job_id: str) -> str:
        return self.eval("CANCEL_JOB", [f"{P}:job:{job_id}", f"{P}:events", f"{P}:cancel", f"{P}:job:{job_id}:tokens"],
                         [GROUP, job_id, time.time(), 604800, self.layout, EVENTS_MAXLEN])

    def record(self, job_id: str) -> dict:
        return self.r.hgetall(f"{P}:job:{job_id}")

    def get(self, job_id: str) -> dict | None:
        """The record; a job that has not ended takes its request from its entry (the doc's Stream entry)."""
        rec = self.record(job_id)
        if not rec:
            return None
        if not rec.get("request") and rec.get("entry_id") and rec.get("queue"):
            found = self.r.xrange(rec["queue"], rec["entry_id"], rec["entry_id"])
            if found:
                rec["request"] = found[0][1].get("request")
        return rec

    # the worker's side: steps 2-4
    def read(self, count: int) -> list[tuple[str, str, dict]]:
        """READ: [(queue, entry id, fields)] in admission order."""
        entries, _wake = self.eval("READ", [f"{P}:config"], [self.layout, GROUP, self.consumer, count])
        return [(q, eid, dict(zip(f[::2], f[1::2], strict=True))) for q, eid, f in entries]

    def start(self, job_id: str, entry_id: str, queue: str) -> list:
        return self.eval("START_JOB", [f"{P}:job:{job_id}", queue],
                         [GROUP, entry_id, self.consumer, time.time(), self.layout])

    def finish(self, job_id: str, status: str, entry_id: str = "", queue: str = "", result: dict | None = None,
               error: str = "", error_code: str = "") -> int:
        keys = [f"{P}:job:{job_id}", queue or queue_of("default"), f"{P}:events", f"{P}:cancel",
                f"{P}:job:{job_id}:tokens"]
        return self.eval("FINISH_JOB", keys, [GROUP, entry_id, job_id, status, json.dumps(result) if result else "",
                                              error, error_code, time.time(), 604800, self.layout, EVENTS_MAXLEN])

    def publish(self, job_id: str, offset: int, token_ids: list[int], text: str, done: bool) -> object:
        return self.eval("PUBLISH_TOKENS", [f"{P}:job:{job_id}:tokens", f"{P}:job:{job_id}"],
                         [offset, json.dumps(token_ids), text, int(done), 604800])

    # Waiting
    def wait(self, job_ids: list[str], timeout: float = 120) -> dict[str, dict]:
        last = self.r.xrevrange(f"{P}:events", count=1)
        last_id = last[0][0] if last else "0-0"
        ended = {j: self.record(j) for j in job_ids}
        ended = {j: rec for j, rec in ended.items() if rec.get("status") in TERMINAL}
        deadline = time.monotonic() + timeout
        while len(ended) < len(job_ids):
            assert time.monotonic() < deadline, f"not ended: {set(job_ids) - set(ended)}"
            for _stream, entries in self.r.xread({f"{P}:events": last_id}, block=500) or []:
                for entry_id, fields in entries:
                    last_id = entry_id
                    if fields["job_id"] in job_ids:
                        ended[fields["job_id"]] = self.record(fields["job_id"])
        return ended


def start_worker(worker_process, url: str, model: str, name: str = "conformance-worker"):
    """A real `python -m worker` on the tiny model, small and quick to notice things."""
    return worker_process("--redis-url", url, "--model", model, "--worker-name", name, "--max-num-seqs", "4",
                          "--intake-lookahead", "2", "--max-num-batched-tokens", "256", "--kv-cache-gb", "0.05",
                          "--heartbeat-s", "0.5", "--lease-ms", "3000", "--cpu-kernels", "false")
