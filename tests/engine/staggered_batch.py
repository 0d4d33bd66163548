"""One staggered mixed batch, shared by the per-architecture tests: requests arrive over several steps, one
prompt is longer than a step's token budget (chunked prefill), the KV cache is too small for all of them at
once (preemption), and the last prompt starts with the first one's two full blocks (a prefix-cache hit).
Each request's greedy tokens must equal Hugging Face `generate` on the same prompt."""

from __future__ import annotations

from typing import Any

import torch

# token ids below 1000 (the tiny models keep the first 1024 of SmolLM2's vocabulary); prompt 0 (20 tokens)
# is longer than the 16-token budget
_gen = torch.Generator().manual_seed(23)
_ids = torch.randint(3, 1000, (100,), generator=_gen).tolist()
PROMPTS = [_ids[:20], _ids[20:26], _ids[26:37], _ids[37:51], _ids[:16] + _ids[51:56]]
MAX_TOKENS = [10, 8, 6, 9, 5]
ARRIVALS = [0, 0, 1, 3, 5]  # the step before which each request is added
ENGINE_KWARGS = dict(device="cpu", dtype="float32", block_size=8, max_num_seqs=4, max_num_batched_tokens=16,
                     num_kv_blocks=7)

# tiny configs (2 layers, hidden 64, head_dim 32) of the architectures the tests serve
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32)


SHORT = (1, 2)  # the short batch: these two requests at once, SHORT_TOKENS each (the Triton interpreter is slow)
SHORT_TOKENS = 4


def run_staggered(engine: Any, short: bool = False) -> dict[str, Any]:
    """The batch (or the short one) through `engine`; returns each request's tokens and the engine's counters."""
    from worker import SamplingParams

    requests = SHORT if short else range(len(PROMPTS))
    outputs: dict[int, list[int]] = {}
    step = 0
    while len(outputs) < len(requests):
        for i in requests:
            if (0 if short else ARRIVALS[i]) == step:
                params = SamplingParams(max_tokens=SHORT_TOKENS if short else MAX_TOKENS[i], temperature=0.0,
                                        ignore_eos=True)
                engine.add_request(str(i), PROMPTS[i], params)
        for out in engine.step():
            outputs[int(out.request_id)] = out.token_ids
        step += 1
    stats = engine.stats()
    engine.block_manager.check_invariants([])
    return {"tokens": {i: outputs[i] for i in requests}, "preemptions": stats.preemptions,
            "prefix_hit_tokens": stats.prefix_hit_tokens, "backend": engine.backend.name,
            "model_path": engine.model_path, "short": short}


def hf_tokens(directory: str) -> list[list[int]]:
    from tests.support.hf_reference import hf_greedy, load_hf

    hf = load_hf(directory)
    return [hf_greedy(hf, p, m, ignore_eos=True) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]


def check(result: dict[str, Any], expected: list[list[int]], what: str) -> None:
    """Equal to HF (the short batch: to the first SHORT_TOKENS of HF's, greedy being prefix-stable)."""
    if not result["short"]:
        assert result["preemptions"] > 0, f"{what}: the batch did not preempt"
        assert result["prefix_hit_tokens"] >= 16, f"{what}: the last prompt did not hit the prefix cache"
    for i, got in result["tokens"].items():
        want = expected[int(i)][: len(got)]
        assert len(got) == (SHORT_TOKENS if result["short"] else MAX_TOKENS[int(i)])
        assert got == want, f"{what}: request {i} {got} != HF {want}"


def run_in_engine(directory: str, short: bool = False) -> dict[str, Any]:
    from worker import Engine

    return run_staggered(Engine(directory, **ENGINE_KWARGS), short)
