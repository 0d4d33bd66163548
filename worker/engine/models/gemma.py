"""Gemma 2 and Gemma 3 (text) on the Llama parts, with what makes them Gemma:

- (1 + w) RMSNorm: the checkpoint stores w, the norm scales by 1 + w (in fp32, as Hugging Face does); the
  loader adds the 1 once, so every norm kernel runs unchanged (QK-norm included);
- four norms a layer: input, post-attention (on the attention output, before the residual add),
  pre-feed-forward and post-feed-forward;
- GeGLU with tanh GELU (gelu_pytorch_tanh) in place of SwiGLU;
- embeddings scaled by sqrt(hidden_size), rounded to the model dtype as HF rounds it;
- attention scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- interleaved sliding-window and global layers (config.layer_types), each layer with its own window;
- Gemma 2: attention-logit soft-capping (in the kernels) and final-logit soft-capping (here);
- Gemma 3: QK-norm, and separate RoPE for local (sliding) and global layers (rope_local_base_freq vs
  rope_theta with its own scaling).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.engine.backends import Backend
from worker.engine.models.llama import (
    MLP,
    Attention,
    LlamaArch,
    LlamaForCausalLM,
    RMSNorm,
    RotaryEmbedding,
    shape_fields,
)

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")


@dataclass
class GemmaArch(LlamaArch):
    final_softcap: float = 0.0  # final_logit_softcapping (0 = none)
    local_rope: bool = False  # Gemma 3: sliding layers use rope_local_base_freq

    @classmethod
    def from_hf_config(cls, config: Any) -> GemmaArch:
        model_type = getattr(config, "model_type", None)
        if model_type not in GEMMA_MODEL_TYPES:
            raise ValueError(f"model type {model_type!r} is not a Gemma 2/3 text model {list(GEMMA_MODEL_TYPES)}")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("bidirectional Gemma (an embedding model) is not a causal LM: tokenbus cannot serve it")
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma activation {act!r} is not supported; only 'gelu_pytorch_tanh' (GeGLU)")
        window = config.sliding_window or 0
        layer_types = list(config.layer_types)
        return cls(
            **shape_fields(config, model_type, config.head_dim),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
            qkv_bias=bool(getattr(config, "attention_bias", False)),
            qk_norm=model_type == "gemma3_text",
            sliding_window=None,
            layer_windows=tuple(window if t == "sliding_attention" else 0 for t in layer_types),
            attn_scale=config.query_pre_attn_scalar**-0.5,
            attn_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
            hidden_act="gelu_pytorch_tanh",
            final_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
            local_rope=model_type == "gemma3_text",
        )


class GemmaDecoderLayer(nn.Module):
    def __init__(self, arch: GemmaArch, backend: Backend, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(arch, backend, layer)
        self.mlp = MLP(arch, backend)
        norm = lambda: RMSNorm(arch.hidden_size, arch.rms_norm_eps, backend)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        # which of the model's cos/sin tables: 1 = the local one (Gemma 3's sliding layers), else 0
        self.rope = 1 if arch.local_rope and arch.window(layer) else 0

    def forward(self, x, residual, rotary, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer.forward: (output, residual before it), each residual add inside the next norm;
        the post-attention and post-feed-forward norms apply to a sublayer's output before its add."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rotary[self.rope], kv_cache, meta))
        h, residual = self.pre_feedforward_layernorm.add(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    arch_type = GemmaArch
    layer_type = GemmaDecoderLayer
    cpu_fusable = False  # the C++ decode step is Llama's layer; Gemma's runs per layer

    embed_scale: torch.Tensor  # set by attach_rotary, once the weights live on their device

    def attach_rotary(self, rotary: nn.Module) -> None:
        super().attach_rotary(rotary)
        # HF keeps sqrt(hidden) as an fp32 tensor and rounds it to the weights' dtype before the multiply. Not
        # a buffer made in __init__: the engine builds the model on meta and to_empty() would leave it junk.
        w = self.embed_tokens.weight
        self.embed_scale = torch.tensor(self.arch.hidden_size**0.5).to(w.dtype).to(w.device)

    def build_rotary(self, hf_config: Any, max_positions: int) -> nn.Module:
        if not self.arch.local_rope:
            return RotaryEmbedding(hf_config, self.arch.head_dim, max_positions)
        return GemmaRotary(hf_config, self.arch.head_dim, max_positions)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        x = self.embed(input_ids) * self.embed_scale
        if isinstance(self.rotary, GemmaRotary):
            rotary = self.rotary.cos_sin(positions, x.dtype)
        else:
            global_rope = self.rotary.cos_sin(positions, x.dtype)
            rotary = (global_rope, global_rope)
        x, residual = self.backend.run_layers(self, x, rotary, kv_caches, meta)
        return self.norm.add(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.arch.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        # (1 + w) RMSNorm: fold the 1 into the weight once (fp32 sum, as HF's 1.0 + weight.float())
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + param.float())


class GemmaRotary(nn.Module):
    """Gemma 3: a global table (rope_theta, with the checkpoint's scaling) and a local one
    (rope_local_base_freq, unscaled) for the sliding layers; cos_sin gives (global, local)."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.tables = nn.ModuleList(
            RotaryEmbedding(hf_config, head_dim, max_positions, layer_type)
            for layer_type in ("full_attention", "sliding_attention")
        )

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        return tuple(table.cos_sin(positions, dtype) for table in self.tables)
