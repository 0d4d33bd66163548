"""The runner of the language-neutral conformance cases (protocol/conformance/*.json; their format is in
protocol/conformance/README.md): each case's steps are operations (submit, cancel, get, read, start, finish,
...) that a driver carries out with its own client, then checks of what Redis holds (keys, fields, TTLs,
events, the depth counter). Two drivers here: DocDriver, the Lua scripts driven as docs/protocol.md says
(tests/protocol/doc_client.py), and PythonDriver, the producer Client and the worker's JobQueue. A client in
another language runs the same files with a driver of its own.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import redis

from producer import Client
from producer.openai_batch import parse_line
from protocol.errors import InvalidBatch, InvalidJob, JobNotFound, QueueFull
from protocol.jobs import JobResult
from protocol.models import validate_request
from protocol.scripts import PendingJob
from tests.protocol.doc_client import GROUP, PRIORITIES, DocClient, P, queue_of
from worker.serve.job_queue import Ending, JobQueue

CASES = Path(__file__).resolve().parents[2] / "protocol" / "conformance"
OUTCOMES = {1: "queued", 0: "exists", -1: "full", -2: "taken"}  # SUBMIT_JOB's codes, by name
STATELESS = frozenset({"validate", "map_line"})  # ops that write nothing: a driver without them runs the rest


def load_cases() -> list[dict]:
    return [json.loads(p.read_text()) | {"file": p.name} for p in sorted(CASES.glob("*.json"))]


class DocDriver:
    """The cases' operations as docs/protocol.md spells them: EVAL of the linked scripts, plain commands. The
    scripts check no request and map no OpenAI line (a client does): `validate` and `map_line` are not its."""

    unsupported = frozenset({"validate", "map_line"})

    def __init__(self, r: redis.Redis, scripts: dict[str, str] | None = None) -> None:
        self.c = DocClient(r, scripts)
        self.entries: dict[str, tuple[str, str]] = {}  # job id -> (queue, entry id) READ delivered

    def submit(self, s: dict) -> Any:
        code, value = self.c.submit(s["job_id"], s.get("request_json") or s["request"], s.get("result_ttl", 60),
                                    s.get("max_queue_len", 0), s.get("batch_id", ""), s.get("custom_id", ""),
                                    s.get("priority", "default"))
        return OUTCOMES[int(code)]

    def submit_plain(self, s: dict) -> Any:
        return self.c.submit_plain(s["job_id"], s.get("request_json") or s["request"], s.get("result_ttl", 60),
                                   s.get("max_queue_len", 0), s.get("priority", "default"), s.get("step2", True))

    def cancel(self, s: dict) -> Any:
        return self.c.cancel(s["job_id"])

    def get(self, s: dict) -> Any:
        rec = self.c.get(s["job_id"])
        if rec is None:
            return None
        return {"status": rec["status"], "request": json.loads(rec["request"]) if rec.get("request") else None}

    def read(self, s: dict) -> Any:
        got = self.c.read(s["count"])
        for queue, entry_id, fields in got:
            self.entries[fields["job_id"]] = (queue, entry_id)
        return [fields["job_id"] for _q, _e, fields in got]

    def start(self, s: dict) -> Any:
        queue, entry_id = self.entries[s["job_id"]]
        status, attempts = self.c.start(s["job_id"], entry_id, queue)
        return [status, int(attempts)]

    def finish(self, s: dict) -> Any:
        queue, entry_id = self.entries[s["job_id"]]
        return int(self.c.finish(s["job_id"], s["status"], entry_id, queue, s.get("result"), s.get("error", ""),
                                 s.get("error_code", "")))

    def publish(self, s: dict) -> Any:
        return bool(self.c.publish(s["job_id"], s["offset"], s["token_ids"], s["text"], s["done"]))

    def submit_batch(self, s: dict) -> Any:
        """docs/protocol.md, "Submitting a batch", steps 2-6, with the case's jobs (its lines, mapped)."""
        r, bid, jobs = self.c.r, s["batch_id"], s["jobs"]
        bkey, priority = f"{P}:batch:{bid}", s.get("priority", "bulk")
        ids = [f"{bid}-{i}" for i in range(len(jobs))]
        existing = r.hgetall(bkey)
        if not existing:
            if any(r.exists(f"{P}:job:{j}") for j in ids):
                return {"error": "taken"}
            with r.pipeline(transaction=True) as pipe:
                pipe.hset(bkey, mapping={"id": bid, "status": "validating", "endpoint": s.get("endpoint", ""),
                                         "total": len(jobs), "finished": 0, "failed": 0, "cancelled": 0,
                                         "created_at": time.time(), "input_file": "", "priority": priority,
                                         "queue": queue_of(priority, bid)})
                pipe.delete(f"{bkey}:jobs")
                pipe.execute()
            r.rpush(f"{bkey}:jobs", *ids)
        else:
            if existing["status"] != "validating":
                return {"status": existing["status"]}
            priority = existing["priority"]
            if r.llen(f"{bkey}:jobs") != len(jobs):
                r.delete(f"{bkey}:jobs")
                r.rpush(f"{bkey}:jobs", *ids)
        for jid, job in zip(ids, jobs, strict=True):
            code, _ = self.c.submit(jid, job["request"], batch_id=bid, custom_id=job["custom_id"], priority=priority)
            if int(code) == -2:
                return {"error": "taken"}
        self.c.eval("START_BATCH", [bkey], [time.time()])
        return {"status": r.hget(bkey, "status")}



class PythonDriver:
    """The same operations through tokenbus's own Python: producer.Client and the worker's JobQueue. Its client
    always submits with SUBMIT_JOB: `submit_plain` is not its (the README recipe's test runs that path)."""

    unsupported = frozenset({"submit_plain"})

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.client = Client(redis_client=r)
        self.jobs = JobQueue(r, "tokenbus", "py-worker", 604800)
        self.entries: dict[str, Any] = {}

    def submit(self, s: dict) -> Any:
        existed = self.r.exists(f"{P}:job:{s['job_id']}")
        client = Client(redis_client=self.r, max_queue_len=s.get("max_queue_len", 0),
                        result_ttl=s.get("result_ttl", 60))
        request = dict(json.loads(s["request_json"]) if "request_json" in s else s["request"])
        request.setdefault("priority", s.get("priority", "default"))  # the request says its queue's priority
        try:
            if s.get("batch_id"):  # a batch's job, one by one: what submit_batch does (Client.enqueue)
                client.enqueue([PendingJob(s["job_id"], validate_request(request).to_json(), s["batch_id"],
                                           s.get("custom_id", ""), request["priority"])])
            else:
                client.submit(job_id=s["job_id"], **request)
        except QueueFull:
            return "full"
        except InvalidJob as err:
            return "taken" if "taken" in str(err) else {"error": str(err)}
        return "exists" if existed else "queued"

    def cancel(self, s: dict) -> Any:
        try:
            return self.client.cancel(s["job_id"])
        except JobNotFound:
            return ""  # CANCEL_JOB's answer for no such job

    def get(self, s: dict) -> Any:
        job = self.client.get_many([s["job_id"]])[0]
        return None if job is None else {"status": job.status.value, "request": job.request}

    def read(self, s: dict) -> Any:
        got = self.jobs.read_new(s["count"], None)
        for e in got:
            self.entries[e.fields["job_id"]] = e
        return [e.fields["job_id"] for e in got]

    def start(self, s: dict) -> Any:
        e = self.entries[s["job_id"]]
        status, attempts = self.jobs.start(s["job_id"], e.entry_id, e.queue)
        return [status, attempts]

    def finish(self, s: dict) -> Any:
        e = self.entries[s["job_id"]]
        result = JobResult.model_validate(s["result"]) if s.get("result") else None
        batch = self.jobs.write_batch()
        batch.finish(Ending(s["job_id"], e.entry_id, s["status"], result=result, error=s.get("error") or None,
                            error_code=s.get("error_code") or None, queue=e.queue))
        return int(batch.execute()[0])

    def publish(self, s: dict) -> Any:
        batch = self.jobs.write_batch()
        batch.publish_tokens(s["job_id"], s["offset"], s["token_ids"], s["text"], s["done"])
        return bool(batch.execute()[0])

    def submit_batch(self, s: dict) -> Any:
        lines = [json.dumps(line) for line in s["lines"]]
        try:
            record = self.client.submit_batch(lines, batch_id=s["batch_id"], priority=s.get("priority", "bulk"))
        except (InvalidBatch, InvalidJob) as err:
            return {"error": "taken" if "taken" in str(err) else str(err)}
        for i, job in enumerate(s["jobs"]):  # the case's mapping of each line is the client's
            assert self.get({"job_id": f"{s['batch_id']}-{i}"})["request"] == job["request"], (i, job)
        return {"status": record.status.value}

    def validate(self, s: dict) -> Any:
        try:
            validate_request(json.loads(s["request_json"]))
        except (InvalidJob, ValueError) as err:
            return {"error": str(err)}
        return "ok"

    def map_line(self, s: dict) -> Any:
        try:
            _line, request, _text = parse_line(json.dumps(s["line"]))
        except InvalidJob as err:
            return {"error": str(err)}
        return json.loads(request.to_json())


# ---- checks -------------------------------------------------------------------------------------------------


def matches(want: Any, got: Any, captured: dict[str, Any], where: str) -> None:
    """`want` as the cases write it: "*" any value present, "$name" a value captured at its first use (the same
    value after), {"json": X} JSON text equal to X, {"json_has": X}
    JSON text holding X (a subset), {"error": "words"} an error naming those words, a dict a
    subset of fields, a list element by element, anything else equal (numbers compare as Redis's strings)."""
    if want == "*":
        assert got is not None, f"{where}: expected a value, got none"
    elif isinstance(want, str) and want.startswith("$"):
        if want in captured:
            assert got == captured[want], f"{where}: {got!r} != {want} ({captured[want]!r})"
        else:
            captured[want] = got
    elif isinstance(want, dict) and set(want) == {"json"}:
        assert got is not None, f"{where}: expected JSON text, got none"
        assert json.loads(got) == want["json"], f"{where}: {got} != {want['json']}"
    elif isinstance(want, dict) and set(want) == {"json_has"}:
        assert got is not None, f"{where}: expected JSON text, got none"
        matches(want["json_has"], json.loads(got), captured, where)
    elif isinstance(want, dict) and set(want) == {"error"}:
        assert isinstance(got, dict) and "error" in got, f"{where}: expected an error ({want['error']!r}), got {got!r}"
        assert want["error"].lower() in got["error"].lower(), f"{where}: {got['error']!r} lacks {want['error']!r}"
    elif isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: expected an object, got {got!r}"
        for k, v in want.items():
            assert k in got, f"{where}: {k!r} missing (has {sorted(got)})"
            matches(v, got[k], captured, f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r} is not {len(want)} items"
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            matches(w, g, captured, f"{where}[{i}]")
    else:
        if isinstance(want, int | float) and not isinstance(want, bool) and isinstance(got, str):
            want = str(want)
        assert got == want, f"{where}: {got!r} != {want!r}"


def check_key(r: redis.Redis, key: str, spec: dict, captured: dict[str, Any]) -> None:
    kind = r.type(key)
    assert kind == spec.get("type", kind), f"{key}: a {kind}, expected a {spec['type']}"
    if kind == "hash":
        fields = r.hgetall(key)
        matches(spec.get("fields", {}), fields, captured, key)
        for name in spec.get("absent", []):
            assert name not in fields, f"{key}: field {name!r} must be absent, holds {fields[name][:80]!r}"
    elif kind == "stream":
        entries = r.xrange(key)
        if "entries" in spec:
            got = [dict(fields, _id=entry_id) for entry_id, fields in entries]
            matches(spec["entries"], got, captured, key)
        if "len" in spec:
            assert len(entries) == spec["len"], f"{key}: {len(entries)} entries, expected {spec['len']}"
    elif kind == "list":
        matches(spec.get("items", []), r.lrange(key, 0, -1), captured, key)
    elif kind == "set":
        matches(spec.get("members", []), sorted(r.smembers(key)), captured, key)
    ttl = spec.get("ttl")
    if ttl == "none":
        assert r.ttl(key) == -1, f"{key}: expires in {r.ttl(key)} s, expected no expiry"
    elif ttl is not None:
        assert ttl[0] <= r.ttl(key) <= ttl[1], f"{key}: TTL {r.ttl(key)}, expected {ttl}"


def check(r: redis.Redis, s: dict, captured: dict[str, Any]) -> None:
    for key, spec in s.get("keys", {}).items():
        check_key(r, key, spec, captured)
    if "depth" in s:
        counter = r.hgetall(f"{P}:depth")
        got = {p: int(counter.get(p, 0)) for p in (*PRIORITIES, "pending")}
        lengths = {p: 0 for p in PRIORITIES}
        for p in PRIORITIES:
            for q in [queue_of(p), *r.zrange(f"{P}:queues:{p}", 0, -1)]:
                lengths[p] += r.xlen(q) if r.type(q) == "stream" else 0
        for name, n in s["depth"].items():
            assert got[name] == n, f"the depth counter's {name} is {got[name]}, expected {n} ({counter})"
        assert {p: got[p] for p in PRIORITIES} == lengths, \
            f"the depth counter {counter} is not the queues' length {lengths}"
    if "events" in s:
        got = [{"job_id": f["job_id"], "status": f["status"]} for _id, f in r.xrange(f"{P}:events")]
        assert got == s["events"], f"events {got}, expected {s['events']}"


def runs(case: dict, driver: DocDriver | PythonDriver) -> bool:
    """Whether the driver can run the case: it has every operation that writes (it may lack stateless ones)."""
    return not any(step["op"] in driver.unsupported - STATELESS for step in case["steps"])


def run_case(case: dict, driver: DocDriver | PythonDriver, r: redis.Redis) -> None:
    captured: dict[str, Any] = {}
    for i, step in enumerate(case["steps"]):
        if step["op"] in driver.unsupported:
            continue
        where = f"{case['file']} step {i} ({step['op']})"
        if step["op"] == "check":
            try:
                check(r, step, captured)
            except AssertionError as err:
                raise AssertionError(f"{where}: {err}") from None
            continue
        if step["op"] == "redis":
            got = r.execute_command(*step["command"])
        else:
            got = getattr(driver, step["op"])(step)
        if "expect" in step:
            matches(step["expect"], got, captured, where)


def mutate(text: str, old: str, new: str = "") -> str:
    """A script's text with one deliberate mistake (the line holding `old` replaced by `new`)."""
    line = re.escape(old)
    out, n = re.subn(rf"^.*{line}.*$", new, text, count=1, flags=re.M)
    assert n == 1, f"{old!r} is not in the script"
    return out


__all__ = ["GROUP", "DocDriver", "PythonDriver", "load_cases", "mutate", "run_case", "runs"]
