"""The worker's Redis operations (leases, hand-back, reclaim) and its settings, on a real redis-server."""

from __future__ import annotations

import json
import threading
import time

import pytest
from pydantic import ValidationError

from protocol import scripts
from protocol.keys import Keys
from protocol.models import GROUP
from worker.serve.intake import IntakeBudget
from worker.serve.job_queue import JobQueue
from worker.settings import WorkerSettings, build_parser, load_settings, lora_flags

NS = "tokenbus"
Q = Keys(NS).queue()  # the default loose queue, where submit() puts every job


def submit(r, job_id: str, request: dict | None = None) -> str:
    request = request or {"prompt": "hi", "max_tokens": 4}
    keys, args = scripts.submit_args(Keys(NS), scripts.PendingJob(job_id, json.dumps(request)), time.time(), 0, 60)
    code, entry = scripts.script(scripts.SUBMIT_JOB)(keys=keys, args=args, client=r)
    assert int(code) == 1
    return entry.decode()


@pytest.fixture
def r(redis_server):
    client = redis_server.client(socket_timeout=5)
    scripts.ensure_group(client, Q)
    return client


def test_renew_keeps_own_leases_and_reports_reclaimed_ones(r):
    a = JobQueue(r, NS, "worker-a", 60)
    b = JobQueue(r, NS, "worker-b", 60)
    e1, e2 = submit(r, "j1"), submit(r, "j2")
    assert [e.entry_id for e in a.read_new(10, None)] == [e1, e2]
    time.sleep(0.15)
    # j2's lease lapses (min idle 100 ms) and b takes it; a renews j1 in time
    assert a.renew([(Q, e1)]) == []
    _, claimed = b.claim_lapsed(100, 10, {})
    assert [e.entry_id for e in claimed] == [e2]
    assert claimed[0].fields["job_id"] == "j2"
    # a no longer holds e2: renewing must say so and must not steal it back from b
    assert a.renew([(Q, e1), (Q, e2)]) == [e2]
    owners = {p["message_id"].decode(): p["consumer"].decode() for p in r.xpending_range(Q, GROUP,
                                                                                          "-", "+", 10)}
    assert owners == {e1: "worker-a", e2: "worker-b"}


def test_renew_resets_the_idle_time(r):
    a = JobQueue(r, NS, "worker-a", 60)
    b = JobQueue(r, NS, "worker-b", 60)
    e1 = submit(r, "j1")
    a.read_new(10, None)
    for _ in range(4):  # renewed every 60 ms, it never gets 150 ms idle
        time.sleep(0.06)
        assert a.renew([(Q, e1)]) == []
        assert b.claim_lapsed(150, 10, {})[1] == []
    time.sleep(0.2)
    assert [e.entry_id for e in b.claim_lapsed(150, 10, {})[1]] == [e1]


def test_hand_back_requeues_without_counting_an_attempt(r):
    a = JobQueue(r, NS, "worker-a", 60)
    b = JobQueue(r, NS, "worker-b", 60)
    e1 = submit(r, "j1")
    a.read_new(1, None)
    assert a.start("j1", e1, Q) == ("running", 1)
    pipe = r.pipeline()
    a.hand_back(pipe, "j1", e1, Q, count_attempt=False)
    assert pipe.execute() == [1]
    rec = {k.decode(): v.decode() for k, v in r.hgetall(Keys(NS).job("j1")).items()}
    assert rec["status"] == "queued" and rec["attempts"] == "0" and "worker" not in rec
    # claimable at once by anyone, however long their lease
    _, claimed = b.claim_lapsed(3_600_000, 10, {})
    assert [e.entry_id for e in claimed] == [e1]
    assert b.start("j1", e1, Q) == ("running", 1)


def test_stale_hand_back_changes_nothing(r):
    a = JobQueue(r, NS, "worker-a", 60)
    b = JobQueue(r, NS, "worker-b", 60)
    e1 = submit(r, "j1")
    a.read_new(1, None)
    a.start("j1", e1, Q)
    time.sleep(0.05)
    b.claim_lapsed(10, 10, {})
    b.start("j1", e1, Q)  # b runs it now (attempt 2)
    pipe = r.pipeline()
    a.hand_back(pipe, "j1", e1, Q, count_attempt=True)
    assert pipe.execute() == [0]
    rec = {k.decode(): v.decode() for k, v in r.hgetall(Keys(NS).job("j1")).items()}
    assert rec["status"] == "running" and rec["worker"] == "worker-b" and rec["attempts"] == "2"


def test_hand_back_after_a_failed_step_counts_the_attempt(r):
    a = JobQueue(r, NS, "worker-a", 60)
    e1 = submit(r, "j1")
    a.read_new(1, None)
    a.start("j1", e1, Q)
    pipe = r.pipeline()
    a.hand_back(pipe, "j1", e1, Q, count_attempt=True)
    pipe.execute()
    assert r.hget(Keys(NS).job("j1"), "attempts") == b"1"


def test_claim_lapsed_skips_deleted_entries(r):
    a = JobQueue(r, NS, "worker-a", 60)
    b = JobQueue(r, NS, "worker-b", 60)
    e1, e2 = submit(r, "j1"), submit(r, "j2")
    a.read_new(10, None)
    r.xdel(Q, e1)
    time.sleep(0.05)
    _, claimed = b.claim_lapsed(10, 10, {})
    assert [e.entry_id for e in claimed] == [e2]


def test_read_new_recreates_a_vanished_group(r):
    a = JobQueue(r, NS, "worker-a", 60)
    r.flushall()
    assert a.read_new(5, None) == []  # NOGROUP -> group made again
    e1 = submit(r, "j1")
    assert [e.entry_id for e in a.read_new(5, None)] == [e1]


def test_intake_budget_counts_jobs_in_transit():
    budget = IntakeBudget(room=3)
    assert budget.wait(0) == 3
    budget.sent(3)
    assert budget.wait(0.01) == 0  # all read, none taken by the engine yet
    budget.taken(3)
    budget.set_room(1)  # the engine seated them: one seat left
    assert budget.wait(0) == 1
    budget.sent(1)
    woke = []
    t = threading.Thread(target=lambda: woke.append(budget.wait(5)))
    t.start()
    time.sleep(0.05)
    assert not woke
    budget.taken(1)
    budget.set_room(4)  # jobs ended: intake wakes at once
    t.join(2)
    assert woke == [4]


def test_settings_env_then_cli(monkeypatch):
    monkeypatch.setenv("TOKENBUS_LEASE_MS", "5000")
    monkeypatch.setenv("TOKENBUS_MODEL", "from-env")
    s = load_settings(["--model", "from-cli", "--max-num-seqs", "8", "--stream-tokens", "false"])
    assert (s.lease_ms, s.engine.model, s.engine.max_num_seqs, s.stream_tokens) == (5000, "from-cli", 8, False)
    monkeypatch.setenv("TOKENBUS_BLOCK_SIZE", "32")  # the engine's settings, flat in the environment too
    monkeypatch.setenv("TOKENBUS_CPU_KERNELS", "false")
    s = load_settings([])
    assert (s.engine.model, s.engine.block_size, s.engine.cpu_kernels) == ("from-env", 32, False)
    assert load_settings(["--block-size", "64"]).engine.block_size == 64
    with pytest.raises(ValidationError, match="block_size must be one of"):  # EngineConfig's own check
        load_settings(["--block-size", "7"])
    assert s.redis_url == "redis://127.0.0.1:6379/0"
    with pytest.raises(ValidationError, match="lease_ms"):
        WorkerSettings(lease_ms=1)
    with pytest.raises(SystemExit):
        load_settings(["--no-such-flag"])
    # every setting documents itself
    assert all(f.description for f in WorkerSettings.model_fields.values())
    assert all(a.help for a in build_parser()._actions if a.dest != "help")


def test_lora_flags_repeat_take_slots_and_refuse_what_cannot_be_a_model_name(monkeypatch):
    s = load_settings(["--lora", "judge=/a/judge", "--lora", "writer=/a/w=1"])
    assert lora_flags(s.lora) == {"judge": "/a/judge", "writer": "/a/w=1"} and s.engine.max_loras == 2
    assert load_settings(["--lora", "judge=/a", "--max-loras", "4"]).engine.max_loras == 4
    monkeypatch.setenv("TOKENBUS_LORA", '["judge=/a/judge"]')
    assert load_settings([]).lora == ["judge=/a/judge"]
    for bad, why in (("judge", "NAME=PATH"), ("a:b=/x", "no ':'"), ("=/x", "non-empty")):
        with pytest.raises(ValidationError, match=why):
            load_settings(["--lora", bad])
    with pytest.raises(ValidationError, match="given twice"):
        load_settings(["--lora", "j=/a", "--lora", "j=/b"])


def test_intake_never_restarts_a_job_it_is_running(r):
    """After an outage longer than the lease, XAUTOCLAIM hands a worker its own in-flight entries back:
    intake must recognise them (the lease registry) and not start them a second time."""
    import queue as queue_mod

    from worker.serve.completion import CompletionWriter
    from worker.serve.intake import Intake
    from worker.serve.leases import Leases

    jobs = JobQueue(r, NS, "worker-a", 60)
    leases = Leases()
    inbox: queue_mod.Queue = queue_mod.Queue()
    writer = CompletionWriter(jobs, leases)
    intake = Intake(jobs, leases, IntakeBudget(8), inbox, writer, model_names={"m"}, lease_ms=100,
                    max_attempts=3, stream_tokens=True)
    e1 = submit(r, "j1")
    entry = jobs.read_new(1, None)[0]
    intake._admit(entry, backoff=None)
    started = inbox.get_nowait()
    assert (started.job_id, started.attempts) == ("j1", 1) and leases.entry_of("j1") == e1
    time.sleep(0.15)  # the lease lapses (no housekeeper here) and our own XAUTOCLAIM takes it again
    _, again = jobs.claim_lapsed(100, 10, {})
    assert [e.entry_id for e in again] == [e1]
    intake._admit(again[0], backoff=None)
    assert inbox.empty(), "the running job was handed to the engine a second time"
    assert r.hget(Keys(NS).job("j1"), "attempts") == b"1"
    assert writer.inbox.empty()


def submit_to(r, job_id: str, priority: str, batch_id: str = "") -> str:
    job = scripts.PendingJob(job_id, json.dumps({"prompt": "hi", "max_tokens": 4, "priority": priority}),
                             batch_id=batch_id, priority=priority)
    keys, args = scripts.submit_args(Keys(NS), job, time.time(), 0, 60)
    code, entry = scripts.script(scripts.SUBMIT_JOB)(keys=keys, args=args, client=r)
    assert int(code) == 1
    return entry.decode()


def test_read_serves_interactive_then_default_then_bulk_and_batches_in_turn(r):
    a = JobQueue(r, NS, "worker-a", 60)
    for i in range(6):
        submit_to(r, f"big-{i}", "bulk", "big")
    for i in range(3):
        submit_to(r, f"small-{i}", "bulk", "small")
    submit_to(r, "plain", "default")
    submit_to(r, "chat", "interactive")
    order = [e.fields["job_id"] for n in (2, 1, 1, 3, 2, 5) for e in a.read_new(n, None)]
    # interactive first, then default; then the two bulk batches take turns (the big one was first)
    assert order == ["chat", "plain", "big-0", "small-0", "big-1", "small-1", "big-2", "small-2", "big-3",
                     "big-4", "big-5"]
    assert a.read_new(5, None) == []


def test_read_waits_for_a_new_entry_without_taking_more_than_asked(r):
    a = JobQueue(r, NS, "worker-a", 60)
    late = threading.Timer(0.2, lambda: [submit_to(r, f"late-{i}", "bulk") for i in range(3)])
    late.start()
    t0 = time.monotonic()
    got = a.read_new(1, 3000)
    late.join()  # its last submits must not outlive the test's redis-server
    assert [e.fields["job_id"] for e in got] == ["late-0"] and time.monotonic() - t0 < 2.5
    assert r.xpending(Keys(NS).queue("bulk"), GROUP)["pending"] == 1, "the wait itself took nothing"


def test_reclaim_renew_and_hand_back_work_across_queues(r):
    a = JobQueue(r, NS, "worker-a", 60)
    b = JobQueue(r, NS, "worker-b", 60)
    e_bulk = submit_to(r, "b-0", "bulk", "nightly")
    e_chat = submit_to(r, "chat", "interactive")
    got = a.read_new(10, None)
    assert [(e.fields["job_id"], e.queue) for e in got] == [
        ("chat", Keys(NS).queue("interactive")), ("b-0", Keys(NS).queue("bulk", "nightly"))]
    for e in got:
        assert a.start(e.fields["job_id"], e.entry_id, e.queue) == ("running", 1)
    assert r.hget(Keys(NS).job("b-0"), "queue") == Keys(NS).queue("bulk", "nightly").encode()
    time.sleep(0.15)  # worker a dies: its leases lapse; b reclaims both, the interactive one first
    complete, claimed = b.claim_lapsed(100, 10, {})
    assert complete and [(e.fields["job_id"], e.queue) for e in claimed] == [
        (e.fields["job_id"], e.queue) for e in got]
    assert a.renew([(e.queue, e.entry_id) for e in got]) == [e_chat, e_bulk], "a holds neither any more"
    assert b.renew([(e.queue, e.entry_id) for e in claimed]) == []
    pipe = r.pipeline()
    for e in claimed:
        b.start(e.fields["job_id"], e.entry_id, e.queue)
        b.hand_back(pipe, e.fields["job_id"], e.entry_id, e.queue, count_attempt=False)
    assert pipe.execute() == [1, 1]
    _, again = a.claim_lapsed(3_600_000, 10, {})
    assert {e.fields["job_id"] for e in again} == {"chat", "b-0"}


def test_renew_reports_an_entry_whose_queue_is_gone(r):
    a = JobQueue(r, NS, "worker-a", 60)
    e = submit_to(r, "b-0", "bulk", "gone")
    a.read_new(1, None)
    r.delete(Keys(NS).queue("bulk", "gone"))  # its batch ended (another worker finished the job)
    assert a.renew([(Keys(NS).queue("bulk", "gone"), e)]) == [e]
    pipe = r.pipeline()
    a.hand_back(pipe, "b-0", e, Keys(NS).queue("bulk", "gone"), count_attempt=False)
    assert pipe.execute() == [0]
    assert a.claim_lapsed(0, 10, {}) == (True, [])


def test_engine_scheduler_seats_lower_priority_numbers_first():
    from worker.engine.sampling_params import SamplingParams
    from worker.engine.scheduler import Scheduler
    from worker.engine.sequence import Sequence

    s = Scheduler(block_manager=None, stop_checker=None, max_num_seqs=4, max_num_batched_tokens=64)
    for name, priority in [("bulk-1", 2), ("bulk-2", 2), ("default-1", 1), ("chat-1", 0), ("bulk-3", 2),
                           ("chat-2", 0)]:
        s.add(Sequence(name, [1, 2], SamplingParams(), 0.0, detokenizer=None, priority=priority))
    assert [q.request_id for q in s.waiting] == ["chat-1", "chat-2", "default-1", "bulk-1", "bulk-2", "bulk-3"]
    # an n > 1 request's later choices join ahead of their own priority (their prompt is cached), never ahead
    # of a more urgent one
    s.add(Sequence("bulk-fork", [1, 2], SamplingParams(), 0.0, detokenizer=None, priority=2),
          first_of_its_priority=True)
    s.add(Sequence("default-fork", [1, 2], SamplingParams(), 0.0, detokenizer=None, priority=1),
          first_of_its_priority=True)
    assert [q.request_id for q in s.waiting] == ["chat-1", "chat-2", "default-fork", "default-1", "bulk-fork",
                                                 "bulk-1", "bulk-2", "bulk-3"]
