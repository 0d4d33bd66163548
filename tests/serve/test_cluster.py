"""Redis Cluster: two namespaces on a real 3-shard cluster on loopback (three redis-server processes with
`--cluster-enabled yes`), each served end to end by its own worker (the real serve loop in a thread, tiny
random-weight model) through a redis+cluster:// client. Every key of a namespace lands on the one shard that
owns its hash tag `{ns}`, the two namespaces on different shards, and the results are HF's greedy tokens; a
batch (its own queue, registry entry and counters, a MULTI on submit) completes there too."""

from __future__ import annotations

import json
import time

import pytest

from producer import batches
from producer.client import Client
from protocol import scripts
from protocol.connection import is_cluster, on_shard, redis_from_url
from protocol.keys import Keys
from testbed.redis_cluster import RedisCluster

# Their hash tags fall in different thirds of the 16384 slots, which `redis-cli --cluster create` gives to
# different masters: CLUSTER KEYSLOT {alpha} = 865 (0-5460), {beta} = 15419 (10923-16383).
NAMESPACES = ("alpha", "beta")
PROMPTS = [[1, 2, 3, 4], [7, 7, 7], [100, 200, 300, 400, 500]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def cluster():
    with RedisCluster(3) as c:
        yield c


def test_two_namespaces_end_to_end_on_their_own_shards(cluster, serve_model_dir):
    from tests.conftest import ServeThread
    from tests.support.hf_reference import hf_greedy, load_hf
    from worker import Engine
    from worker.serve.server import Server
    from worker.settings import WorkerSettings

    shards = {ns: cluster.port_of_key(Keys(ns).prefix) for ns in NAMESPACES}
    assert len(set(shards.values())) == 2, f"the test's namespaces share a shard: {shards}"

    # The PyTorch reference kernels: this test is about Redis, it need not wait for a C++ kernel build.
    engines = {ns: Engine(serve_model_dir, device="cpu", dtype="float32", block_size=16, max_num_seqs=8,
                          max_num_batched_tokens=256, kv_cache_gb=0.02, cpu_kernels=False) for ns in NAMESPACES}
    workers = []
    for ns in NAMESPACES:
        settings = WorkerSettings(redis_url=cluster.url, namespace=ns, model=engines[ns].model_name,
                                  lease_ms=2000, heartbeat_s=0.5, drain_grace_s=10, worker_name=f"w-{ns}",
                                  max_num_seqs=engines[ns].max_num_seqs)
        r = redis_from_url(settings.redis_url, socket_timeout=10, socket_connect_timeout=2)
        assert is_cluster(r)
        workers.append(ServeThread(Server(settings, engines[ns], r)))
    for w in workers:
        w.thread.start()
    try:
        clients = {ns: Client(cluster.url, namespace=ns) for ns in NAMESPACES}
        started = time.monotonic()
        ids = {ns: c.submit_many([{"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                   "ignore_eos": True} for p in PROMPTS]) for ns, c in clients.items()}
        # and a batch in beta: its own queue and registry entry, its counters bumped by the finish script
        lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                             "body": {"prompt": f"batch {i}", "max_tokens": 2}}) for i in range(3)]
        batch = batches.submit_batch(clients["beta"], lines, batch_id="cluster-batch")
        assert batch.queue == "{beta}:q:bulk:cluster-batch"
        done = {ns: {j.id: j for j in clients[ns].as_completed(ids[ns], timeout=60)} for ns in NAMESPACES}
        ended = batches.wait_batch(clients["beta"], "cluster-batch", timeout=60)
        assert (ended.status, ended.finished, ended.total) == ("completed", 3, 3), ended
        print(f"\n{len(NAMESPACES) * len(PROMPTS)} jobs in two namespaces: {time.monotonic() - started:.2f} s")

        hf = load_hf(serve_model_dir)
        expected = [hf_greedy(hf, p, MAX_TOKENS, ignore_eos=True) for p in PROMPTS]
        for ns in NAMESPACES:
            jobs = [done[ns][i] for i in ids[ns]]
            assert [j.status for j in jobs] == ["finished"] * len(PROMPTS), jobs
            assert [j.result.token_ids for j in jobs] == expected, f"{ns}: not HF's greedy tokens"
            assert {j.worker for j in jobs} == {f"w-{ns}"}, "a namespace's jobs ran on another's worker"
            assert clients[ns].info().queue_depth == 0

        # Every key of a namespace is on its shard, and only there (asked of each node, not of the client).
        for ns, port in shards.items():
            for node in cluster.nodes:
                with cluster.node(node.port) as n:
                    keys = list(n.scan_iter(match=f"{{{ns}}}:*", count=1000))
                assert bool(keys) == (node.port == port), f"{ns}: keys {keys[:3]} on :{node.port}, shard :{port}"
        # A keyless command aimed at the namespace goes to its shard (WAIT after results, INFO for capacity).
        r = clients["alpha"].redis
        assert on_shard(r, Keys("alpha").routing_key)["target_nodes"].port == shards["alpha"]
        assert scripts.queue_depth(r, Keys("beta")) == 0  # a script with only a routing key runs on beta's shard
    finally:
        for w in workers:
            w.stop()


def test_the_gateway_keeps_its_data_on_the_shard_and_rq_on_a_plain_redis(cluster, redis_server, tmp_path):
    """RQ cannot run on a cluster: the settings refuse it, naming the fix; with TOKENBUS_GATEWAY_RQ_REDIS_URL the
    gateway's keys go to the namespace's shard (capacity reads that shard's INFO) and RQ's to the plain Redis."""
    from gateway.batches import capacity
    from gateway.context import GatewayContext
    from gateway.settings import GatewaySettings

    with pytest.raises(ValueError, match="TOKENBUS_GATEWAY_RQ_REDIS_URL"):
        GatewaySettings(redis_url=cluster.url, namespace="gamma")
    settings = GatewaySettings(redis_url=cluster.url, rq_redis_url=redis_server.url, namespace="gamma",
                               files_dir=tmp_path)
    ctx = GatewayContext(settings)
    try:
        capacity.reserve(ctx, "key_owner", 1000)  # INFO memory of gamma's shard, then RESERVE_BYTES there
        assert capacity.held(ctx, "key_owner") == 1000
        ctx.queue.enqueue(print, "rq job", job_id="cluster-probe")
        assert ctx.client.submit(prompt="x", max_tokens=1)
        shard = cluster.port_of_key(Keys("gamma").prefix)
        with cluster.node(shard) as n:
            assert n.exists(ctx.gkeys.queued_bytes) and n.exists(ctx.keys.queue())
        assert redis_server.client().exists("rq:job:cluster-probe"), "RQ's job is on the plain Redis"
    finally:
        ctx.close()


def test_pipelined_scripts_go_as_evalsha_and_survive_a_script_flush(cluster):
    """A pipeline of the cluster client sends scripts as EVALSHA (loaded once on the namespace's shard), not as
    EVAL with their text; after SCRIPT FLUSH on that shard (what a restart at the same address does) the calls
    that hit NOSCRIPT are sent again alone and their replies are the real ones, a WAIT after them asked again;
    a MULTI pipeline keeps EVAL (a NOSCRIPT inside EXEC would let the rest through)."""
    from protocol.cluster import ScriptPipeline

    ns = "evalsha"
    keys, shard = Keys(ns), cluster.port_of_key(Keys(ns).prefix)
    client = Client(cluster.url, namespace=ns, max_queue_len=0)  # 0: no depth check before the submit
    with cluster.node(shard) as node:

        def calls() -> dict[str, int]:
            stats = node.info("commandstats")
            return {c: int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("eval", "evalsha", "wait")}

        node.config_resetstat()
        ids = client.submit_many([{"prompt": f"p{i}"} for i in range(6)])  # SUBMIT_JOB x 6, one pipeline
        pipe = client.redis.pipeline(transaction=False)
        assert isinstance(pipe, ScriptPipeline)
        scripts.cancel_job(pipe, keys, ids[0])  # CANCEL_JOB loaded on the shard here
        assert pipe.execute() == ["cancelled"]
        assert calls() == {"eval": 0, "evalsha": 7, "wait": 0}

        node.script_flush()
        node.config_resetstat()
        pipe = client.redis.pipeline(transaction=False)
        for job_id in ids[1:4]:
            scripts.cancel_job(pipe, keys, job_id)
        pipe.execute_command("WAIT", 0, 100, **on_shard(client.redis, keys.routing_key))
        replies = pipe.execute()
        assert replies[:3] == ["cancelled"] * 3 and replies[3] == 0, replies
        # NOSCRIPT x 3, then each alone as EVAL; the WAIT twice (in the pipeline, then after the re-sent scripts)
        assert calls() == {"eval": 3, "evalsha": 3, "wait": 2}
        assert [j.status for j in client.get_many(ids)] == ["cancelled"] * 4 + ["queued"] * 2

        node.config_resetstat()
        pipe = client.redis.pipeline(transaction=False)  # loaded again once, then EVALSHA
        scripts.cancel_job(pipe, keys, ids[4])
        assert pipe.execute() == ["cancelled"]
        multi = client.redis.pipeline(transaction=True)
        scripts.cancel_job(multi, keys, ids[5])
        assert multi.execute() == ["cancelled"]
        assert calls() == {"eval": 1, "evalsha": 1, "wait": 0}
    client.close()
