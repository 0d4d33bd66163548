"""Hugging Face `generate` as the independent reference: greedy, float32, one prompt at a time."""

from __future__ import annotations

from typing import Any

import torch


def load_hf(directory: str, **kwargs: Any):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs)
    return model.eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    ids = torch.tensor([prompt_ids])
    kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
    if ignore_eos:
        kwargs["eos_token_id"] = None
        kwargs["min_new_tokens"] = max_new_tokens
    out = model.generate(ids, **kwargs)
    return out[0, len(prompt_ids) :].tolist()
