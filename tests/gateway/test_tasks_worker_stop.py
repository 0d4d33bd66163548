"""The gateway's RQ workers stop within about a second: their command listener (a pub/sub thread) waits in
1-second steps. RQ's own waits 60 s, and when its unsubscribe reply arrives before the stop flag is cleared
(a loaded machine) a SIGTERM waited all of that."""

from __future__ import annotations

import threading
import time

from rq import Queue

from gateway.tasks_worker import LISTEN_WAIT_S, TasksWorker


def test_a_stop_after_the_unsubscribe_reply_was_consumed_ends_within_the_listen_wait(redis_server):
    worker = TasksWorker([Queue("q", connection=redis_server.client())], connection=redis_server.client())
    worker.subscribe()
    worker.pubsub.unsubscribe()
    time.sleep(0.5)  # the listener has read (and ignored) the unsubscribe reply and waits on
    stopper = threading.Thread(target=worker.pubsub_thread.stop, daemon=True)
    stopper.start()
    stopper.join(timeout=10 * LISTEN_WAIT_S)
    assert not stopper.is_alive(), "the listener kept the stop waiting (RQ's 60 s wait)"
    worker.pubsub.close()
