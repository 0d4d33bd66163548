"""LoRA adapters served as models of their own, end to end on real processes: redis-server, a worker on a tiny
random-weight Llama with two `--lora` adapters, `python -m gateway serve` and `... tasks`. The official openai SDK
lists the adapters with their parent and runs a batch whose lines name both adapters and the base: every output
line carries the model it asked for, and the adapters' tokens equal the engine's own greedy generation with that
adapter. `tokenbus adapters add|remove` change the running worker, each change confirmed by its heartbeat; a bad
directory is refused naming the adapter and the file, and the worker serves on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from testbed.gateway_procs import KEYS, ROOT, WEBHOOK_SECRET, Deployment, Proc, healthy, wait_until, write_jsonl
from testbed.redis_server import RedisServer, free_port

BASE = "tiny"
PROMPTS = ["Write a haiku about queues.", "Name three rivers."]
MAX_TOKENS = 8
ENGINE_FLAGS = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_lora_rank=16)


def write_adapters(root: Path) -> tuple[str, dict[str, str]]:
    from transformers import AutoConfig

    from testbed.lora_adapters import write_random_adapter
    from testbed.tiny_models import make_tiny_model

    base = make_tiny_model(str(root / "tiny-llama"), "llama")
    config = AutoConfig.from_pretrained(base)
    paths = {name: write_random_adapter(str(root / name), config, rank, seed)
             for name, rank, seed in (("judge", 8, 1), ("writer", 16, 2), ("late", 4, 3))}
    return base, paths


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters")
    base, paths = write_adapters(tmp)
    srv = RedisServer().start()
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENBUS_REDIS_URL=srv.url, TOKENBUS_LOG_JSON="1",
               HF_HUB_OFFLINE="1", TOKENBUS_DEVICE="cpu", TOKENBUS_GATEWAY_API_KEYS=",".join(KEYS.values()),
               TOKENBUS_GATEWAY_PORT=str(port), TOKENBUS_GATEWAY_FILES_DIR=str(tmp / "files"),
               TOKENBUS_GATEWAY_WEBHOOK_SECRET=WEBHOOK_SECRET, TOKENBUS_GATEWAY_WATCH_INTERVAL_S="0.3")
    dep = Deployment(redis=srv, base_url=f"http://127.0.0.1:{port}")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_FLAGS.items()]
    try:
        dep.procs["worker"] = Proc("worker", [
            "-m", "worker", "--model", base, "--served-model-name", BASE, "--worker-name", "lora-worker",
            "--lora", f"judge={paths['judge']}", "--lora", f"writer={paths['writer']}", "--max-loras", "2",
            "--lora", f"ghost={tmp / 'no-such-dir'}",  # refused at start; the worker serves the rest
            "--kv-cache-gb", "0.05", "--heartbeat-s", "0.3", *flags], env, tmp)
        dep.procs["gateway"] = Proc("gateway", ["-m", "gateway", "serve"], env, tmp)
        dep.procs["tasks"] = Proc("tasks", ["-m", "gateway", "tasks"], env, tmp)
        r = srv.client(decode_responses=True)
        wait_until(lambda: healthy(dep.base_url), 60, "the gateway's /healthz", dep.all(), every=0.1)
        wait_until(lambda: "writer" in (json.loads(r.get("{tokenbus}:worker:lora-worker") or "{}")
                                        .get("adapters", [])), 300, "the worker's adapters", dep.all(), every=0.2)
        wait_until(lambda: r.scard("rq:workers") >= 1, 60, "the RQ worker", dep.all(), every=0.1)
        yield dep, base, paths, env, tmp
    finally:
        for p in dep.procs.values():
            p.stop()
        srv.cleanup()


def reference(base: str, paths: dict[str, str], loras: list[str | None]) -> list[list[int]]:
    """The engine's own greedy tokens for each prompt under each adapter, no Redis."""
    from worker import Engine, SamplingParams

    engine = Engine(base, device="cpu", dtype="float32", max_loras=2, **ENGINE_FLAGS)
    for name in ("judge", "writer"):
        engine.add_lora(name, paths[name])
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS for _ in loras]
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                           loras=[lo for _ in PROMPTS for lo in loras])
    return [o.token_ids for o in outs]


def heartbeat(dep: Deployment) -> dict:
    return json.loads(dep.redis.client(decode_responses=True).get("{tokenbus}:worker:lora-worker"))


def test_the_sdk_batch_names_two_adapters_and_the_base_and_gets_each_ones_tokens(stack):
    dep, base, paths, _env, tmp = stack
    client = dep.openai("alice")
    listed = {m.id: m.model_extra for m in client.models.list()}
    assert listed["judge"]["parent"] == listed["writer"]["parent"] == BASE and listed[BASE]["parent"] is None
    assert listed["judge"]["root"] == paths["judge"] and listed["judge"]["workers"] == 1
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-adapter", messages=[{"role": "user", "content": "hi"}])
    assert err.value.code == "model_not_found"
    chat = client.chat.completions.create(model="writer", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.model == "writer"

    models = ["judge", "writer", BASE]
    lines = [json.dumps({"custom_id": f"{i}-{m}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": m, "messages": [{"role": "user", "content": p}], "max_tokens": MAX_TOKENS,
                                  "temperature": 0.0, "ignore_eos": True}})
             for i, p in enumerate(PROMPTS) for m in models]
    fid = client.files.create(file=write_jsonl(tmp / "in.jsonl", lines).open("rb"), purpose="batch").id
    batch = client.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed") and b,
                      180, "the batch", dep.all(), every=0.3)
    assert done.status == "completed" and done.request_counts.completed == len(lines), done
    out = {o["custom_id"]: o for o in map(json.loads, client.files.content(done.output_file_id).text.splitlines())}
    assert set(out) == {json.loads(line)["custom_id"] for line in lines}
    from producer import Client

    with Client(dep.redis.url) as c:
        tokens = {}
        for cid, o in out.items():
            assert o["response"]["body"]["model"] == cid.split("-", 1)[1], o  # the model each line asked for
            tokens[cid] = c.get(o["response"]["body"]["id"].removeprefix("chatcmpl-")).result.token_ids
    expected = reference(base, paths, ["judge", "writer", None])
    got = [tokens[f"{i}-{m}"] for i in range(len(PROMPTS)) for m in models]
    assert got == expected
    assert got[0] != got[2] and got[1] != got[2]  # the adapters changed the tokens: they ran


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "producer", "adapters", *args], cwd=str(ROOT), env=env,
                          capture_output=True, text=True, timeout=120)


def test_tokenbus_adapters_add_and_remove_are_confirmed_by_the_heartbeat(stack):
    dep, _base, paths, env, tmp = stack
    from producer import Client
    from protocol.errors import ModelNotFound

    ghost = heartbeat(dep)["adapter_errors"]["ghost"]  # the flag refused at start, naming adapter and file
    assert ghost.startswith("LoRA adapter 'ghost'") and "adapter_config.json: missing" in ghost, ghost

    broken = tmp / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((Path(paths["late"]) / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    bad = cli(env, "add", "broken", str(broken), "--base", BASE, "--timeout", "60")
    assert bad.returncode == 1, bad
    assert "lora-worker: refused broken" in bad.stdout and "adapter_model.safetensors" in bad.stdout, bad.stdout
    assert heartbeat(dep)["adapter_errors"]["broken"].startswith("LoRA adapter 'broken'")

    added = cli(env, "add", "late", paths["late"], "--base", BASE, "--timeout", "60")
    assert added.returncode == 0 and "lora-worker: serving late" in added.stdout, (added.stdout, added.stderr)
    beat = heartbeat(dep)
    assert sorted(beat["adapters"]) == ["judge", "late", "writer"] and "late" in beat["models"]
    listed = cli(env, "list").stdout
    assert "late  base=tiny  added  workers=1" in listed and "broken  base=tiny  added  workers=0" in listed
    models = subprocess.run([sys.executable, "-m", "producer", "models", "list"], cwd=str(ROOT), env=env,
                            capture_output=True, text=True, timeout=60).stdout
    assert any(line.startswith("late ") and "workers=1" in line and "parent=tiny" in line
               for line in models.splitlines()), models

    with Client(dep.redis.url) as c:
        job = c.wait(c.submit("Hi", model="late", max_tokens=3, temperature=0.0), timeout=60)
        assert job.status == "finished" and job.result.model == "late"  # it serves on after the refusal
        with pytest.raises(ModelNotFound):
            c.submit("Hi", model="broken")  # refused at load: never declared

        removed = cli(env, "remove", "late", "--timeout", "60")
        assert removed.returncode == 0 and "lora-worker: stopped late" in removed.stdout, removed.stdout
        assert "late" not in heartbeat(dep)["adapters"]
        with pytest.raises(ModelNotFound):
            c.submit("Hi", model="late")
        job = c.wait(c.submit("Hi", model="judge", max_tokens=3, temperature=0.0), timeout=60)
        assert job.status == "finished" and job.result.model == "judge"
