"""Issue #34 items 7-10, the dashboard's rights, against real processes (redis-server, `gateway serve`, `tasks`,
`webhooks`; no model worker: jobs end the way a worker ends them):

7. with UI_KEYS unset every key was an operator: bob read alice's dead letters (her prompt), re-ran one as his
   own job and deleted hers. Now each key sees and acts on only its own; operators are opt-in (UI_OPERATOR_KEYS).
8. a key made read-only, or taken off the dashboard's keys, kept its rights in its open sessions after a restart.
9. 400 wrong keys in a second or so at the login and at the API, and no check of a key's strength at start.
10. 3,000 logins gave 3,000 live sessions.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from testbed.gateway_procs import Proc
from testbed.light_gateway import KEYS, chat_line, start_light_stack, stop_light_stack, wait_until
from tests.support.dashboard import Dashboard

DEAD = "{tokenbus}:dead"
SESSIONS_CAP, FAILURES = 4, 10
SETTINGS = {"TOKENBUS_GATEWAY_UI_OPERATOR_KEYS": KEYS["carol"],
            "TOKENBUS_GATEWAY_UI_MAX_SESSIONS_PER_KEY": str(SESSIONS_CAP),
            "TOKENBUS_GATEWAY_AUTH_MAX_FAILURES": str(FAILURES), "TOKENBUS_GATEWAY_AUTH_FAILURE_WINDOW_S": "30"}
FORGIVEN_S = 30 / FAILURES  # one more wrong key is allowed this long after the burst


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_light_stack(tmp_path_factory.mktemp("dashboard-roles"), SETTINGS)
    yield s
    stop_light_stack(s)


def dead_letter_as_worker(stack, job_id: str) -> str:
    """What a worker does with a job no worker could finish: its record ends failed, its request goes to
    {ns}:dead (the entry's own request text)."""
    from protocol.records import DeadLetter

    r = stack.r()
    entry_id, queue = r.hmget(f"{{tokenbus}}:job:{job_id}", "entry_id", "queue")
    request = r.xrange(queue, entry_id, entry_id)[0][1]["request"]
    stack.end_job(job_id, error_code="max_attempts")
    letter = DeadLetter(job_id, "gave up after 3 attempts (test)", 3, request)
    return r.xadd(DEAD, letter.fields("test-worker"))


def alices_dead_letters(stack, tmp_path) -> tuple[str, str, str]:
    """A dead letter of alice's batch job, one of a batch job whose record is gone, one nobody's (a plain
    producer's job): their entry ids."""
    from protocol.records import DeadLetter

    batch = stack.batch("alice", [chat_line("q1", "the secret prompt of alice"), chat_line("q2", "two")], tmp_path)
    stack.wait_status("alice", batch.id, ("in_progress",))
    mine = dead_letter_as_worker(stack, f"{batch.id}-0")
    r = stack.r()
    gone = r.xadd(DEAD, DeadLetter(f"{batch.id}-7", "no job record (test)", 0,
                                   json.dumps({"prompt": "alice again"})).fields("w"))
    nobody = r.xadd(DEAD, DeadLetter("plain-job-1", "no job record (test)", 0,
                                     json.dumps({"prompt": "a plain producer's"})).fields("w"))
    return mine, gone, nobody


def test_each_key_sees_and_acts_on_only_its_own_dead_letters(stack, tmp_path):
    mine, gone, nobody = alices_dead_letters(stack, tmp_path)
    r = stack.r()
    alice = Dashboard(stack.base_url, KEYS["alice"]).logged_in()
    bob = Dashboard(stack.base_url, KEYS["bob"]).logged_in()  # UI_KEYS unset: any key logs in, as a tenant
    carol = Dashboard(stack.base_url, KEYS["carol"]).logged_in()  # the one operator
    try:
        page = bob.get("/ui/dead").text
        assert "the secret prompt of alice" not in page and mine not in page and nobody not in page
        assert "No dead letters" in page
        retry = bob.act(f"/ui/dead/{mine}/retry")
        assert "Not retried" in retry.text and r.xlen(DEAD) == 3
        assert "Already gone" in bob.act(f"/ui/dead/{mine}/delete").text and r.xlen(DEAD) == 3
        assert not r.keys("{tokenbus}:gw:job:*")  # bob queued nothing in alice's name or his own

        page = alice.get("/ui/dead").text
        assert "the secret prompt of alice" in page and mine in page and gone in page and nobody not in page
        assert "Not retried" in alice.act(f"/ui/dead/{nobody}/retry").text  # nobody's: only an operator's

        page = carol.get("/ui/dead").text
        assert all(e in page for e in (mine, gone, nobody)) and "3 kept" in page

        done = alice.act(f"/ui/dead/{mine}/retry")
        assert "Queued again" in done.text and r.xlen(DEAD) == 2
        job_id = done.text.split('href="/ui/jobs/')[1].split('"')[0]
        assert r.hget(f"{{tokenbus}}:gw:job:{job_id}", "owner") and alice.get(f"/ui/jobs/{job_id}").status_code == 200
        assert bob.get(f"/ui/jobs/{job_id}").status_code == 404
        assert "Deleted" in carol.act(f"/ui/dead/{nobody}/delete").text and r.xlen(DEAD) == 1
    finally:
        for d in (alice, bob, carol):
            d.close()


def test_a_right_taken_away_reaches_open_sessions(stack):
    r = stack.r()
    alice = Dashboard(stack.base_url, KEYS["alice"]).logged_in()
    bob = Dashboard(stack.base_url, KEYS["bob"]).logged_in()
    try:
        entry = r.xadd(DEAD, {"job_id": "plain-job-2", "reason": "test", "attempts": 0, "request": "{}"})
        # alice read-only, bob off the dashboard's keys; carol stays the operator
        stack.restart_gateway({"TOKENBUS_GATEWAY_UI_READONLY_KEYS": KEYS["alice"],
                               "TOKENBUS_GATEWAY_UI_KEYS": f"{KEYS['alice']},{KEYS['carol']}"})
        page = alice.get("/ui/dead")
        assert page.status_code == 200 and "Read-only" in page.text and "/delete" not in page.text
        refused = alice.act(f"/ui/dead/{entry}/delete")
        assert refused.status_code == 403 and "read-only" in refused.text
        assert alice.act("/ui/jobs/abc/cancel").status_code == 403
        for path in ("/ui/", "/ui/dead", "/ui/batches"):
            assert bob.get(path, headers={"hx-request": "true"}).status_code == 401, path
        assert bob.act(f"/ui/dead/{entry}/delete").status_code == 401
        assert bob.login().headers["location"] == "/ui/login?error=refused"  # and no fresh login either
        carol = Dashboard(stack.base_url, KEYS["carol"]).logged_in()
        assert "Deleted" in carol.act(f"/ui/dead/{entry}/delete").text
        carol.close()
    finally:
        stack.restart_gateway({"TOKENBUS_GATEWAY_UI_READONLY_KEYS": None, "TOKENBUS_GATEWAY_UI_KEYS": None})
        alice.close()
        bob.close()


def test_sessions_per_key_are_capped_oldest_ended_first(stack):
    r = stack.r()
    logins = [Dashboard(stack.base_url, KEYS["dave"]).logged_in() for _ in range(SESSIONS_CAP + 3)]
    try:
        owner = r.hget(f"{{tokenbus}}:gw:ui:session:{_hash(logins[-1].session)}", "owner")
        assert r.zcard(f"{{tokenbus}}:gw:ui:sessions:{owner}") == SESSIONS_CAP
        live = [s for s in logins if s.get("/ui/workers", headers={"hx-request": "true"}).status_code == 200]
        assert live == logins[-SESSIONS_CAP:]  # the 3 oldest ended, the newest 4 live
        assert sum(r.hget(k, "owner") == owner for k in r.scan_iter("{tokenbus}:gw:ui:session:*")) == SESSIONS_CAP
    finally:
        for s in logins:
            s.close()


def _hash(token: str) -> str:
    import hashlib

    return hashlib.sha256(token.encode()).hexdigest()


def _from(address: str, **kw) -> httpx.Client:
    """A client on another loopback address: throttling one address must not throttle 127.0.0.1's tests."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=30, **kw)


def test_wrong_keys_are_throttled_per_address_and_per_key(stack):
    guesses = [f"sk-guess-{i:04d}-" + "x" * 20 for i in range(3 * FAILURES)]
    with _from("127.0.0.2", base_url=stack.base_url) as guesser:
        codes = [guesser.get("/v1/files", headers={"authorization": f"Bearer {g}"}).status_code for g in guesses]
        _throttled_after_the_burst(codes)
        blocked = guesser.get("/v1/files", headers={"authorization": f"Bearer {KEYS['alice']}"})
        assert blocked.status_code == 429 and int(blocked.headers["retry-after"]) >= 1  # a right guess learns nothing
        assert blocked.json()["error"]["code"] == "too_many_auth_failures"
    with stack.http("alice") as alice:  # another address: served
        assert alice.get("/v1/files").status_code == 200

    # one key tried from many addresses: throttled by the key
    wrong = "sk-one-wrong-key-" + "w" * 20
    codes = []
    for i in range(2 * FAILURES):
        with _from(f"127.0.1.{i + 1}", base_url=stack.base_url) as c:
            codes.append(c.get("/v1/files", headers={"authorization": f"Bearer {wrong}"}).status_code)
    _throttled_after_the_burst(codes)

    # the login: the same buckets (127.0.0.3 is fresh)
    dash = Dashboard(stack.base_url, "", transport=httpx.HTTPTransport(local_address="127.0.0.3"))
    answers = []
    for g in guesses:
        dash.api_key = g
        answers.append(dash.login())
    _throttled_after_the_burst([401 if a.headers.get("location") == "/ui/login?error=refused" else a.status_code
                                for a in answers])
    assert "Too many wrong keys" in answers[-1].text
    dash.api_key = KEYS["alice"]
    assert dash.login().status_code == 429
    time.sleep(FORGIVEN_S + 0.5)
    assert dash.login().headers["location"] == "/ui/"
    dash.close()


def _throttled_after_the_burst(codes: list[int]) -> None:
    # FAILURES wrong keys answered 401, then 429 (one more 401 may come: the bucket refills while the test runs)
    assert codes[:FAILURES] == [401] * FAILURES and codes.count(401) <= FAILURES + 1, codes
    assert set(codes[FAILURES + 1:]) == {429}, codes


def test_a_weak_api_key_is_refused_at_start(stack, tmp_path):
    env = dict(stack.env, TOKENBUS_GATEWAY_API_KEYS=f"{KEYS['alice']},hunter2", TOKENBUS_GATEWAY_PORT="0")
    proc = Proc("gateway-weak-key", ["-m", "gateway", "serve"], env, tmp_path)
    try:
        wait_until(lambda: proc.proc.poll() is not None, 60, "the gateway to refuse the weak key")
        log = proc.tail(5000)
        assert proc.proc.returncode != 0
        assert "key 2 (key_" in log and "7 characters" in log and "at least 20 characters" in log
        assert "hunter2" not in log  # the key itself is never printed
    finally:
        proc.stop()
