"""The README's "Plain Redis, from any language" recipe, parsed from README.md and run as written (its job id
`my-id` numbered per job), against a real redis-server and a real `python -m worker` (tiny random-weight model),
then the books: the depth counter never negative and back to 0, `tokenbus info`'s figures, and the queue-depth
limit (max_queue_len) refusing when full. The recipe's branches are its comments (`CONDITION → ...: stop` /
`start again at ...`): if the README's wording changes, this test learns it or fails."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import threading
import time

import redis

from tests.protocol.doc_client import ROOT, P, doc_scripts, layout, start_worker

SECTION = re.search(r"^## Plain Redis, from any language\n(.*?)^## ", (ROOT / "README.md").read_text(), re.S | re.M)
BLOCKS = re.findall(r"^```\n(.*?)^```", SECTION.group(1) if SECTION else "", re.S | re.M)


def lines(block: str) -> list[tuple[list[str], str]]:
    """(the command's words, its comment) of each line: the comment starts at ` # ` (the JSON holds none)."""
    out = []
    for line in block.splitlines():
        command, _, comment = line.partition(" # ")
        out.append((shlex.split(command), comment.strip()))
    return out


class Recipe:
    """Runs the recipe's commands on one raw connection (WATCH / MULTI / EXEC need one), as a shell would."""

    def __init__(self, url: str) -> None:
        self.conn = redis.Redis.from_url(url, decode_responses=True, socket_timeout=30).connection_pool \
            .get_connection()
        self.words = {"$QUEUE_DEPTH": doc_scripts()["QUEUE_DEPTH"], "$LAYOUT": layout()}

    def call(self, words: list[str], job_id: str) -> object:
        args = [self.words.get(w, w).replace("my-id", job_id) for w in words]
        self.conn.send_command(*args)
        return self.conn.read_response()

    def submit(self, job_id: str, max_queue_len: int) -> str:
        """The first block: 'queued', or the comment of the line that stopped it."""
        steps = lines(BLOCKS[0])
        i, watch = 0, 0
        while i < len(steps):
            words, comment = steps[i]
            if words[0] == "WATCH":
                watch = i
            if "ENTRY_ID" in words:
                words = [self.words["ENTRY_ID"] if w == "ENTRY_ID" else w for w in words]
            reply = self.call(words, job_id)
            cond, arrow, action = comment.partition(" → ")
            if arrow and holds(cond, reply, max_queue_len):
                if "UNWATCH" in action:
                    self.call(["UNWATCH"], job_id)
                if "stop" in action:
                    return comment
                assert "start again at" in action, f"the README's {comment!r}: what to do is not understood"
                i = watch if "this WATCH" in action else 0
                continue
            if words[0] == "EXEC" and "[ENTRY_ID" in comment:
                self.words["ENTRY_ID"] = reply[0]
            i += 1
        return "queued"

    def wait(self, job_id: str, timeout: float = 120) -> str:
        """The second block: note the last event, read the status, XREAD the events until the job's; its result."""
        (last, _), (status, _), (xread, _), (result, _) = lines(BLOCKS[1])
        got = self.call(last, job_id)
        last_id = got[0][0] if got else "0-0"
        deadline = time.monotonic() + timeout
        if self.call(status, job_id) not in ("finished", "failed", "cancelled"):
            seen = False
            while not seen:
                assert time.monotonic() < deadline, f"{job_id} never ended"
                reply = self.call([last_id if w == "LAST_ID" else w for w in xread], job_id)
                streams = reply.items() if isinstance(reply, dict) else reply or []  # RESP3: a map
                for _stream, entries in streams:
                    for entry_id, fields in entries:
                        last_id = entry_id
                        seen = seen or dict(zip(fields[::2], fields[1::2], strict=True))["job_id"] == job_id
        return self.call(result, job_id)


def holds(cond: str, reply: object, max_queue_len: int) -> bool:
    if cond in ("1", "nil"):
        return reply == (1 if cond == "1" else None)
    if cond == "not queued":
        return reply != "queued"
    if cond == "first element ≥ max_queue_len":
        return bool(max_queue_len) and reply[0] >= max_queue_len
    raise AssertionError(f"the README recipe's condition {cond!r} is not understood by this test")


def info(url: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "producer", "--url", url, "info", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_the_readme_recipe_as_written_keeps_the_books(redis_server, serve_model_dir, worker_process):
    assert len(BLOCKS) >= 2, "README.md's Plain Redis section has a submit block and a waiting block"
    url = redis_server.url
    r = redis.Redis.from_url(url, decode_responses=True)
    recipe = Recipe(url)
    lowest = [0]
    stop = threading.Event()

    def watch_counter() -> None:  # the counter is read by max_queue_len, `tokenbus info`, autoscalers: never < 0
        while not stop.is_set():
            lowest[0] = min([lowest[0], *(int(v) for v in r.hgetall(f"{P}:depth").values())])
            time.sleep(0.005)

    watcher = threading.Thread(target=watch_counter, daemon=True)
    watcher.start()
    try:
        check_the_books(r, recipe, url, serve_model_dir, worker_process)
    finally:
        stop.set()
        watcher.join()
    assert lowest[0] >= 0, f"the depth counter went to {lowest[0]}"


def check_the_books(r: redis.Redis, recipe: Recipe, url: str, model: str, worker_process) -> None:
    # no worker yet: the queue-depth limit refuses the 4th of 3
    r.hset(f"{P}:config", "max_queue_len", 3)
    assert [recipe.submit(f"my-id-{i}", 3) for i in range(3)] == ["queued"] * 3
    assert "queue full" in recipe.submit("my-id-3", 3) and not r.exists(f"{P}:job:my-id-3")
    assert recipe.submit("my-id-0", 3).startswith("1 → already submitted")
    figures = info(url)
    assert (figures["queue_depth"], figures["waiting"], figures["by_priority"]["default"]) == (3, 3, 3)
    assert r.hget(f"{P}:job:my-id-0", "entry_id"), "step 2: a waiting job's request can be found"
    from producer import Client

    with Client(url) as client:
        assert client.get("my-id-0").request == {"prompt": "Hello", "max_tokens": 16}
        assert client.cancel("my-id-1") == "cancelled"
    assert info(url)["queue_depth"] == 2, "a cancelled job stops counting at once"
    r.hdel(f"{P}:config", "max_queue_len")
    assert [recipe.submit(f"my-id-{i}", 0) for i in range(4, 7)] == ["queued"] * 3

    # a real worker runs them; the recipe's waiting finds each end
    start_worker(worker_process, url, model)
    for i in (0, 2, 4, 5, 6):
        result = json.loads(recipe.wait(f"my-id-{i}"))
        assert result["usage"]["completion_tokens"] == 16 or result["finish_reason"] == "stop"
    counter = r.hgetall(f"{P}:depth")
    assert {k: int(v) for k, v in counter.items()} == {"interactive": 0, "default": 0, "bulk": 0, "pending": 0} \
        or all(int(v) == 0 for v in counter.values()), counter
    figures = info(url)
    assert (figures["queue_depth"], figures["pending"], figures["waiting"]) == (0, 0, 0), figures
    assert figures["consumers"] == 1 and figures["dead_letters"] == 0
