"""What the LoRA tests share: tiny base models, PEFT adapters written with PEFT's own API (random non-zero
lora_A and lora_B, so each changes the output), and PEFT's greedy tokens as the reference.

The reference is `PeftModel.from_pretrained(base, adapter)` with HF `generate` (nothing merged), one prompt at a
time; the base model's rows use the same PeftModel under `disable_adapter()`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from testbed.tiny_models import make_tiny_model
from tests.engine.staggered_batch import TINY

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# name -> LoraConfig fields: ranks 8, 16, 64; a partial target set; plain and rsLoRA scaling
ADAPTERS: dict[str, dict[str, Any]] = {
    "r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
    "r16": dict(r=16, lora_alpha=8, target_modules=[*ATTENTION, *MLP]),
    "r64": dict(r=64, lora_alpha=32, use_rslora=True, target_modules=[*ATTENTION, *MLP]),
}


def tiny_base(root: str, model_type: str, **overrides: Any) -> str:
    return make_tiny_model(os.path.join(root, model_type), model_type, **{**TINY, **overrides})


def write_adapter(base_dir: str, path: str, seed: int, **config: Any) -> str:
    """A PEFT LoRA directory for the model at base_dir, its weights drawn from `seed`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return path
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(**config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 * p.shape[1] ** -0.5)
    model.save_pretrained(path)
    return path


def write_adapters(base_dir: str, root: str, specs: dict[str, dict[str, Any]] = ADAPTERS) -> dict[str, str]:
    """name -> directory of each adapter in specs, for the base at base_dir."""
    return {name: write_adapter(base_dir, os.path.join(root, name), seed, **spec)
            for seed, (name, spec) in enumerate(specs.items(), start=1)}


class PeftReference:
    """Greedy tokens of PEFT over the base model, adapter by adapter (None: the base model itself)."""

    def __init__(self, base_dir: str, adapters: dict[str, str]) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        names = list(adapters)
        self.model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0]).eval()
        for name in names[1:]:
            self.model.load_adapter(adapters[name], adapter_name=name)

    def greedy(self, adapter: str | None, prompt: list[int], max_tokens: int) -> list[int]:
        from tests.support.hf_reference import hf_greedy

        if adapter is None:
            with self.model.disable_adapter():
                return hf_greedy(self.model, prompt, max_tokens, ignore_eos=True)
        self.model.set_adapter(adapter)
        return hf_greedy(self.model, prompt, max_tokens, ignore_eos=True)
