"""Gemma 2, Gemma 3 and Phi-3, tiny random-weight models built by the test, token for token equal to Hugging
Face `generate` (greedy, float32) through a workload that exercises what serving adds: a staggered batch
(requests joining a running decode batch), chunked prefill (prompts longer than the 16-token step budget),
preemption (a KV pool too small for the running set: recomputed sequences must come back the same), and a
prefix-cache hit (the last prompt starts with the first one's full block).

The tiny configs (tests/tiny_models.py) make each difference bite: Gemma 2's window of 7 (shorter than a
block) and its soft-caps of 2 and 3, Gemma 3's window of 20 (longer than a block) with its two RoPE bases
(the global one linearly scaled), Phi-3's head_dim 96, window of 24, half-rotary heads and longrope switching
to the long factors at position 32, which the decodes cross. Phi-3's reference is HF's model stepped with its own cache
(hf_stepwise): HF `generate` alone recomputes a Phi-3 sequence's whole cache with the long factors when it
first crosses the original context, which tokenbus does not (docs/architecture.md, "Phi-3 longrope").

On the CPU serving path (C++ kernels) in this process; on the Triton path in a TRITON_INTERPRET=1 child (see
tests/engine/test_engine_triton.py for why a child), which refuses the PyTorch attention references outright.
Run directly, this file is that child: `python -m tests.engine.test_gemma_phi3 MODEL_DIR...` prints JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FAMILIES = ["gemma2", "gemma3_text", "phi3"]
# (prompt length, max_tokens, the step at which it arrives); every prompt < 32 tokens, every sequence past 32
WORKLOAD = [(28, 12, 0), (20, 16, 0), (9, 25, 1), (30, 6, 4), (26, 10, 7)]
SHARED = 16  # the last prompt starts with the first one's first 16 tokens: one full block
# the interpreter runs every kernel program in Python: 6 tokens a request and a pool of 4 blocks (still
# 3 preemptions, chunked prefill and the prefix hit), about half the steps
TRITON_WORKLOAD = [(n, min(m, 6), at) for n, m, at in WORKLOAD]


def prompts() -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(23)
    out = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n, _, _ in WORKLOAD]
    out[-1][:SHARED] = out[0][:SHARED]
    return out


def run_workload(directory: str, workload=WORKLOAD, num_kv_blocks: int = 6) -> dict:
    """The engine over a workload: outputs by request, the backend, preemptions and prefix-cache hits."""
    from worker import Engine, SamplingParams

    # 6 blocks of 16 for three running sequences of up to 40 tokens: someone is preempted
    engine = Engine(directory, device="cpu", dtype="float32", block_size=16, max_num_seqs=3,
                    max_num_batched_tokens=16, num_kv_blocks=num_kv_blocks, max_model_len=64)
    pending = [(i, ids, m, at) for i, (ids, (_, m, at)) in enumerate(zip(prompts(), workload, strict=True))]
    outputs, step = {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            i, ids, m, _ = pending.pop(0)
            engine.add_request(str(i), ids, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True,
                                                           logprobs=1))
        for out in engine.step():
            chosen = [lps[t] for lps, t in zip(out.logprobs, out.token_ids, strict=True)]
            outputs[out.request_id] = {"tokens": out.token_ids, "logprobs": chosen}
        step += 1
    engine.block_manager.check_invariants([])
    return {"outputs": outputs, "backend": engine.backend.name, "preemptions": engine.scheduler.num_preemptions,
            "prefix_hit_tokens": engine.block_manager.stats.hit_tokens}


def hf_generate(hf, ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """HF greedy tokens and each one's logprob from the logits `generate` computed for it (final soft-capping
    included: greedy tokens alone cannot see a monotonic cap)."""
    import torch

    t = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                          do_sample=False, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    rows = zip(out.logits, tokens, strict=True)
    return tokens, [torch.log_softmax(row[0].float(), -1)[tok].item() for row, tok in rows]


def hf_stepwise(hf, ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """HF's model stepped greedily with its own cache, one token a forward: `generate` without Phi-3's
    prepare_inputs_for_generation, which drops the cache when a sequence first crosses
    original_max_position_embeddings and recomputes every position with the long factors. tokenbus keeps
    the cached keys (as this loop and vLLM do); docs/architecture.md says so."""
    import torch
    from transformers import DynamicCache

    tokens, logprobs, cache = [], [], DynamicCache(config=hf.config)
    step = torch.tensor([ids])
    with torch.inference_mode():
        for i in range(max_tokens):
            positions = torch.arange(len(ids) + i - step.shape[1], len(ids) + i)[None]
            logits = hf(step, past_key_values=cache, use_cache=True, position_ids=positions).logits[0, -1]
            tokens.append(int(logits.argmax()))
            logprobs.append(torch.log_softmax(logits.float(), -1)[tokens[-1]].item())
            step = torch.tensor([[tokens[-1]]])
    return tokens, logprobs


def check_against_hf(directory: str, result: dict, family: str, workload=WORKLOAD) -> None:
    from tests.support.hf_reference import load_hf

    assert result["preemptions"] > 0, "the small KV pool did not force a preemption"
    assert result["prefix_hit_tokens"] >= SHARED, "the last prompt did not reuse the first one's cached block"
    hf = load_hf(directory)
    reference = hf_stepwise if family == "phi3" else hf_generate
    for i, (ids, (_, m, _)) in enumerate(zip(prompts(), workload, strict=True)):
        tokens, logprobs = reference(hf, ids, m)
        got = result["outputs"][str(i)]
        assert got["tokens"] == tokens, f"request {i}: {got['tokens']} != HF {tokens}"
        assert max(abs(a - b) for a, b in zip(got["logprobs"], logprobs, strict=True)) < 1e-3, \
            f"request {i}: logprobs {got['logprobs']} != HF {logprobs}"


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    from testbed.tiny_models import make_tiny_model

    return {f: make_tiny_model(str(tmp_path_factory.mktemp(f)), f) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_kernels_equal_hf(family_dirs, family):
    result = run_workload(family_dirs[family])
    assert result["backend"] == "cpu-cpp", result["backend"]
    check_against_hf(family_dirs[family], result, family)


def run_with_triton(directory: str) -> dict:
    """Child side: the same workload with the interpreted Triton kernels; the attention references raise."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from worker.engine.backends import reference

    def refuse(*args, **kwargs):
        raise AssertionError("a PyTorch attention reference ran although TRITON_INTERPRET=1")

    for name in ("paged_decode_attention_ref", "paged_prefill_attention_ref", "gelu_tanh_and_mul_ref"):
        setattr(reference, name, refuse)
    return run_workload(directory, TRITON_WORKLOAD, num_kv_blocks=4)


@pytest.mark.slow
def test_triton_path_equals_hf(family_dirs):
    """All three families in one interpreter child (one start-up): Gemma 2's window below a block, both
    soft-caps and GeGLU; Gemma 3's window above a block with its two RoPE bases; Phi-3's head_dim 96 (padded
    to 128 lanes in every attention kernel), half-rotary heads and longrope through the Triton kernels."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    dirs = [family_dirs[f] for f in FAMILIES]
    proc = subprocess.run([sys.executable, "-m", "tests.engine.test_gemma_phi3", *dirs], cwd=root,
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"engine child failed:\n{(proc.stdout + proc.stderr)[-6000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for family, directory in zip(FAMILIES, dirs, strict=True):
        assert results[directory]["backend"] == "triton-interpreter", results[directory]["backend"]
        check_against_hf(directory, results[directory], family, TRITON_WORKLOAD)


if __name__ == "__main__":
    print(json.dumps({directory: run_with_triton(directory) for directory in sys.argv[1:]}))
