"""The Hugging Face ways of doing the engine's work, as baselines: `generate` one request at a time, `generate`
in left-padded static batches, and transformers' continuous batching (generate_batch's manager)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class SystemResult:
    name: str
    seconds: float
    outputs: list[list[int]]
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def hf_one_at_a_time(model, prompt_ids, max_tokens) -> SystemResult:
    outs = []
    start = time.perf_counter()
    with torch.inference_mode():
        for ids, m in zip(prompt_ids, max_tokens, strict=True):
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=m, min_new_tokens=m,
                               do_sample=False, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return SystemResult("HF generate, one request at a time", time.perf_counter() - start, outs)


def hf_static_batches(model, prompt_ids, max_tokens, batch_size: int = 16) -> SystemResult:
    """Left-padded static batches: every row runs as long as the batch's longest request."""
    outs: list[list[int]] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(prompt_ids), batch_size):
            rows, lens = prompt_ids[b : b + batch_size], max_tokens[b : b + batch_size]
            width = max(len(r) for r in rows)
            x = torch.tensor([[0] * (width - len(r)) + r for r in rows])
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
            n = max(lens)
            y = model.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)
            outs += [y[i, width : width + m].tolist() for i, m in enumerate(lens)]
    return SystemResult(f"HF generate, static batches of {batch_size}", time.perf_counter() - start, outs)


def hf_continuous_batching(model, prompt_ids, max_tokens) -> SystemResult:
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(max_tokens), eos_token_id=None, pad_token_id=0)
    results: dict[str, list[int]] = {}
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
        for i, (ids, m) in enumerate(zip(prompt_ids, max_tokens, strict=True)):
            manager.add_request(ids, request_id=f"r{i}", max_new_tokens=m)
        while len(results) < len(prompt_ids):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = list(r.generated_tokens)
    seconds = time.perf_counter() - start
    outs = [results[f"r{i}"] for i in range(len(prompt_ids))]
    return SystemResult("transformers continuous batching (generate_batch's manager)", seconds, outs)
