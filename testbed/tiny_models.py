"""Tiny random-weight checkpoints of the model families the engine implements, built by the tests.

Each is a real Hugging Face checkpoint directory (config.json, model.safetensors, the SmolLM2 tokenizer),
so the engine loads it through its ordinary directory path and HF `generate` is the reference.
"""

from __future__ import annotations

import os
from typing import Any

import torch

SMOLLM2_VOCAB = 49152

# head_dim 32 unless a family says otherwise (Phi-3: 96, which the Triton kernels run padded)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        rope_theta=500000.0,
    ),
    "qwen2": dict(rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3": dict(rope_theta=1000000.0, head_dim=32),
    "mistral": dict(rope_theta=10000.0, sliding_window=12),  # bites: prompts + outputs run past 12
    # windows shorter than a 16-token block (gemma2) and longer (gemma3, phi3); soft-caps small enough to bite
    "gemma2": dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=7, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0, tie_word_embeddings=False),
    "gemma3_text": dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=20,
                        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 1000000.0}}),
    # Phi-3-mini's head_dim 96 (not a power of two: the Triton kernels pad it to 128 lanes); partial rotary
    # (48 of 96 dims: 24 frequencies), longrope switching to the long factors at position 32
    "phi3": dict(hidden_size=192, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                 original_max_position_embeddings=32, sliding_window=24, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                  "short_factor": [1.0 + 0.125 * i for i in range(24)],
                                  "long_factor": [0.25 * 1.4**i for i in range(24)],
                                  "original_max_position_embeddings": 32}),
}


def _tokenizer():
    from transformers import AutoTokenizer

    from worker.engine import loader

    return AutoTokenizer.from_pretrained(loader.resolve("smollm2-135m").directory)


def make_tiny_model(directory: str, model_type: str = "llama", **overrides: Any) -> str:
    """Write a random-weight checkpoint of `model_type` into `directory` and return its path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    fields = dict(
        vocab_size=SMOLLM2_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
    )
    fields.update(FAMILIES.get(model_type, {}))
    fields.update(overrides)
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # default init is too flat: greedy would be decided by rounding
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif model_type.startswith("gemma"):  # (1 + w) norms start at w = 0: make w matter
                p.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    _tokenizer().save_pretrained(directory)
    return directory
