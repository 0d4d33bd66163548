"""Phi-3 and Phi-4-mini (model type phi3) on the Llama parts, with what makes them Phi-3:

- fused checkpoints: qkv_proj and gate_up_proj are stored fused, as the Llama model keeps them (gate first);
- partial rotary (partial_rotary_factor, 0.75 in Phi-4-mini): only the first rotary_dim dims of each q/k
  head rotate, as pairs (i, i + rotary_dim / 2). Our RoPE kernels rotate whole heads in pairs
  (i, i + head_dim / 2), so at load the q and k rows of qkv_proj are permuted within each head so the
  rotated pairs land on (i, i + head_dim / 2) and the pass-through dims elsewhere, where the tables hold
  cos 1 and sin 0. q.k is a sum over dims, so the same permutation of q and k leaves attention unchanged;
  v is not touched, so the output is unchanged too. Every RoPE kernel (Triton, C++, reference) serves it.
- longrope ("su") scaling: short factors while the sequence is within original_max_position_embeddings,
  long ones past it, each times the attention factor. Hugging Face picks one set per forward from the
  longest position in it; here position p uses the long set iff p >= original_max_position_embeddings,
  which is the same for every decode step and for prompts that fit the original context. (A prompt
  longer than that: HF rotates all of it with the long set, tokenbus its first part with the short one.)
- one sliding window for all layers (config.sliding_window), served by the windowed kernels.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.engine.models.llama import LlamaArch, LlamaForCausalLM, _rope_parameters, rope_inv_freq, shape_fields


@dataclass
class Phi3Arch(LlamaArch):
    rotary_dim: int = 0  # dims of a head that rotate (head_dim * partial_rotary_factor)

    @classmethod
    def from_hf_config(cls, config: Any) -> Phi3Arch:
        if getattr(config, "model_type", None) != "phi3":
            raise ValueError(f"model type {config.model_type!r} is not phi3")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"activation {act!r} is not supported; only 'silu' (SwiGLU) is implemented")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        partial = _rope_parameters(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        return cls(
            **shape_fields(config, "phi3", head_dim),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=False,
            qk_norm=False,
            sliding_window=getattr(config, "sliding_window", None),
            rotary_dim=int(head_dim * partial),
        )


def rotary_order(head_dim: int, rotary_dim: int) -> list[int]:
    """New dim j of a head takes old dim order[j]: rotated pairs (i, i + rotary_dim/2) -> (i, i + head_dim/2)."""
    half, mid = rotary_dim // 2, head_dim // 2
    passing = list(range(rotary_dim, head_dim))  # head_dim - rotary_dim dims, split over the two halves
    return [*range(half), *passing[: mid - half], *range(half, rotary_dim), *passing[mid - half :]]


class Phi3Rotary(nn.Module):
    """cos/sin [max_positions, head_dim] in the permuted layout (rotary_order); rows below
    original_max_position_embeddings from the short factors, rows from it on from the long ones (longrope)."""

    def __init__(self, hf_config: Any, head_dim: int, rotary_dim: int, max_positions: int) -> None:
        super().__init__()
        params = _rope_parameters(hf_config)
        positions = torch.arange(max_positions, dtype=torch.float)
        if params["rope_type"] in ("longrope", "su"):
            if params["rope_type"] == "su":  # the older name; transformers knows it as longrope
                raise ValueError("rope type 'su': re-save the config with transformers >= 4.44 (it reads as longrope)")
            original = params.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings
            short, scale = rope_inv_freq(hf_config, head_dim)
            long, _ = rope_inv_freq(hf_config, head_dim, seq_len=original + 1)
            freqs = torch.where(positions[:, None] < original, positions[:, None] * short, positions[:, None] * long)
        else:
            inv_freq, scale = rope_inv_freq(hf_config, head_dim)
            freqs = positions[:, None] * inv_freq[None, :]
        assert freqs.shape[1] * 2 == rotary_dim, (freqs.shape, rotary_dim)
        pad = head_dim // 2 - rotary_dim // 2
        ones, zeros = torch.ones(max_positions, pad), torch.zeros(max_positions, pad)
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        # each half of the head: the rotated dims' tables, then identity (cos 1, sin 0) for pass-through dims
        self.register_buffer("cos", torch.cat([cos, ones, cos, ones], dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat([sin, zeros, sin, zeros], dim=-1), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


class Phi3ForCausalLM(LlamaForCausalLM):
    arch_type = Phi3Arch

    def build_rotary(self, hf_config: Any, max_positions: int) -> nn.Module:
        return Phi3Rotary(hf_config, self.arch.head_dim, self.arch.rotary_dim, max_positions)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        arch = self.arch
        if arch.rotary_dim == arch.head_dim:
            return
        order = torch.tensor(rotary_order(arch.head_dim, arch.rotary_dim))
        rotating = arch.num_heads + arch.num_kv_heads  # q and k heads, in qkv_proj's first rows
        for layer in self.layers:
            qkv = layer.self_attn.qkv_proj
            qk = qkv.weight[: rotating * arch.head_dim].view(rotating, arch.head_dim, -1)
            qk.copy_(qk[:, order].clone())
            scale = getattr(qkv, "weight_scale", None)  # an FP8 checkpoint's rows carry their scales along
            if scale is not None:
                rows = scale[: rotating * arch.head_dim].view(rotating, arch.head_dim)
                rows.copy_(rows[:, order].clone())
