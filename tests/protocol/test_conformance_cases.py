"""The language-neutral conformance cases (protocol/conformance/*.json) on a real redis-server, run twice: by the
Lua scripts as docs/protocol.md drives them (the reference a client in another language follows), and by
tokenbus's own Python (producer.Client, the worker's JobQueue). A deliberate mistake in a script makes them
fail: the depth counter's HINCRBY left out of SUBMIT_JOB, the final done chunk left out of CANCEL_JOB."""

from __future__ import annotations

import pytest
import redis

from tests.protocol.conformance import DocDriver, PythonDriver, load_cases, mutate, run_case, runs
from tests.protocol.doc_client import doc_scripts

CASES = load_cases()


@pytest.fixture(scope="module")
def server():
    from testbed.redis_server import RedisServer

    with RedisServer() as srv:
        yield srv


@pytest.fixture
def r(server):
    client = redis.Redis.from_url(server.url, decode_responses=True, socket_timeout=30)
    client.flushall()  # each case starts from an empty Redis
    yield client
    client.close()


def test_the_suite_covers_every_operation():
    ops = {step["op"] for case in CASES for step in case["steps"]}
    assert len(CASES) >= 12 and ops == {"submit", "submit_plain", "cancel", "get", "read", "start", "finish",
                                        "publish", "submit_batch", "validate", "map_line", "redis", "check"}


@pytest.mark.parametrize("driver", [DocDriver, PythonDriver], ids=["lua-as-the-doc-says", "python"])
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_case(case, driver, r):
    """DocDriver: the Lua as the doc drives it; PythonDriver: producer.Client and the worker's JobQueue."""
    runner = driver(r)
    if not runs(case, runner):
        pytest.skip(f"an operation {driver.__name__} does not have ({sorted(runner.unsupported)})")
    run_case(case, runner, r)


@pytest.mark.parametrize(("script", "line", "fails"), [
    ("SUBMIT_JOB", "redis.call('HINCRBY', M.depth, prio, added)", {"submit", "queue_full", "stream_failed_before_run"}),
    ("CANCEL_JOB", "end_stream(KEYS[4], request, ttl)", {"stream_cancelled_queued"}),
    ("FINISH_JOB", "end_stream(KEYS[5]", {"stream_failed_before_run", "stream_ran"}),
    ("CANCEL_JOB", "if e[2][i] == 'job_id' and e[2][i + 1] == job_id then return e[1], e end",
     {"cancel_without_entry_id"}),
])
def test_a_mistake_in_the_lua_fails_the_cases(script, line, fails, r):
    scripts = doc_scripts()
    scripts[script] = mutate(scripts[script], line)
    failed = set()
    for case in CASES:
        r.flushall()
        try:
            run_case(case, DocDriver(r, scripts), r)
        except (AssertionError, redis.ResponseError):
            failed.add(case["name"])
    assert fails <= failed, f"a copy of {script} without {line!r} still passes {fails - failed}"
