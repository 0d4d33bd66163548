"""Random-weight LoRA adapters in PEFT's on-disk format (adapter_config.json + adapter_model.safetensors) for a
Llama-shaped checkpoint, written without PEFT: the benchmarks' many adapters (the tests write theirs with PEFT's
own API, tests/engine/lora_cases.py)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """module -> (in, out) of a Llama-shaped decoder layer, from its Hugging Face config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    hidden, inter, q = config.hidden_size, config.intermediate_size, heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def write_random_adapter(path: str, config: Any, rank: int, seed: int, modules: tuple[str, ...] = MODULES,
                         alpha: float | None = None) -> str:
    """A rank-`rank` adapter on `modules` of every layer, its weights drawn from `seed`; returns `path`."""
    from safetensors.torch import save_file

    if os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in modules:
            fan_in, fan_out = shapes[module]
            part = "self_attn" if module in MODULES[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * fan_in**-0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.1 * rank**-0.5
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config_json = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha or 2 * rank, "target_modules": list(modules),
                   "bias": "none", "lora_dropout": 0.0, "use_rslora": False, "use_dora": False,
                   "modules_to_save": None, "task_type": "CAUSAL_LM"}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config_json, f)
    return path
