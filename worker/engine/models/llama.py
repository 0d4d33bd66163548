"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) on a flat token batch, no padding. Gemma 2/3
(gemma.py) and Phi-3 (phi3.py) reuse its parts with the switches LlamaArch carries (per-layer windows, the
attention scale and soft-cap, the activation).

Every forward takes all tokens of a step as one [num_tokens] vector with their positions. The model holds
the arithmetic's order; every kernel-level operation (attention and KV writes, which learn from the
AttentionMetadata which tokens belong to whom; norms, RoPE, SiLU·mul; a whole-step fusion of the layers)
goes through the engine's backend (worker/engine/backends).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.engine.attention_metadata import AttentionMetadata, paged_attention
from worker.engine.backends import Backend

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class AttentionShape:
    """The sizes and head counts attention_shape() reads: what the KV cache and the kernels are sized by (the
    arch of the transformers fallback and of the encoders extend it)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


def attention_shape(config: Any, model_type: str, head_dim: int) -> dict[str, Any]:
    """The sizes and head counts any model reads from a Hugging Face config the same way (the native families,
    the encoders and the transformers fallback's FallbackArch)."""
    num_heads = config.num_attention_heads
    return dict(
        model_type=model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
    )


def shape_fields(config: Any, model_type: str, head_dim: int) -> dict[str, Any]:
    """The LlamaArch fields every native family reads from a Hugging Face config the same way (sizes, eps)."""
    return dict(attention_shape(config, model_type, head_dim), intermediate_size=config.intermediate_size,
                rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings)


def _rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    # transformers >= 5 keeps rope settings in `rope_parameters` (per layer type for Gemma 3); 4.x in
    # rope_theta / rope_scaling
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None:
        if layer_type in params:
            params = dict(params[layer_type])
        elif layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None):
            return {"rope_type": "default", "rope_theta": config.rope_local_base_freq}  # Gemma 3, transformers 4.x
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    scaling = getattr(config, "rope_scaling", None)
    if scaling and "rope_type" not in params:
        params.update(scaling)
        params["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    params.setdefault("rope_type", "default")
    return params


@dataclass
class LlamaArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None  # one window for every layer (Mistral, Qwen2, Phi-3), or None
    # the switches the other families set (gemma.py, phi3.py); their defaults are Llama's
    layer_windows: tuple[int, ...] = ()  # a window per layer (0 = global), where layers differ (Gemma)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float = 0.0  # Gemma 2's attn_logit_softcapping (0 = none)
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh" (GeGLU)

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in tokens, 0 for full attention."""
        if self.layer_windows:
            return self.layer_windows[layer]
        return self.sliding_window or 0

    @classmethod
    def from_hf_config(cls, config: Any) -> LlamaArch:
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {model_type!r} is not supported; tokenbus implements {list(SUPPORTED_MODEL_TYPES)}"
            )
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"activation {act!r} is not supported; only 'silu' (SwiGLU) is implemented")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        if model_type == "qwen2":
            qkv_bias = True
        else:
            qkv_bias = bool(getattr(config, "attention_bias", False))
        window = getattr(config, "sliding_window", None)
        if model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
            window = None
        if model_type == "qwen3" and not getattr(config, "use_sliding_window", False):
            window = None
        # Qwen2/3 window only the layers from max_window_layers on; transformers names each layer's kind
        layer_types = getattr(config, "layer_types", None)
        layer_windows = ()
        if window and layer_types and len(set(layer_types)) > 1:
            layer_windows = tuple(window if t == "sliding_attention" else 0 for t in layer_types)
        return cls(
            **shape_fields(config, model_type, head_dim),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            layer_windows=layer_windows,
        )


def embedding(rows: int, dim: int) -> nn.Embedding:
    """An nn.Embedding without its random init: every model is built on the meta device and takes its weights
    from the checkpoint, and nn.Embedding's normal_ on a meta tensor imports torch._dynamo (~0.7 CPU-s a start)."""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, backend: Backend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add folded into the norm (may reuse x, residual)."""
        return self.backend.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(hf_config: Any, head_dim: int, layer_type: str | None = None,
                  **init_kwargs: Any) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, cos/sin scaling) as Hugging Face's rotary embedding computes them."""
    params = _rope_parameters(hf_config, layer_type)
    rope_type = params["rope_type"]
    if rope_type == "default":
        dim = int(head_dim * params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"rope type {rope_type!r} is not supported")
    if layer_type is not None:
        init_kwargs["layer_type"] = layer_type
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **init_kwargs)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once the way Hugging Face computes them per step."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(hf_config, head_dim, layer_type)
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, 1, head_dim] tables for this step's positions (looked up once, used by every layer)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


class Attention(nn.Module):
    def __init__(self, arch: LlamaArch, backend: Backend, layer: int = 0) -> None:
        super().__init__()
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = arch.attn_scale or self.head_dim**-0.5
        self.window, self.softcap = arch.window(layer), arch.attn_softcap  # 0, 0.0: none
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, backend) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, backend) if arch.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        # one view of the fused output as heads, then slices: q, k, v are strided views into it
        heads = self.qkv_proj(x).view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q = heads[:, : self.num_heads]
        k = heads[:, self.num_heads : self.num_heads + self.num_kv_heads]
        v = heads[:, self.num_heads + self.num_kv_heads :]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        k_cache, v_cache = kv_cache
        q = self.backend.rotary_write_kv(q, k, v, *rotary, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(self.backend, q, kv_cache, meta, self.scale, self.window, self.softcap)
        return self.backend.all_reduce(self.o_proj(out.view(num_tokens, self.q_size)))  # row-parallel under TP


class MLP(nn.Module):
    def __init__(self, arch: LlamaArch, backend: Backend) -> None:
        super().__init__()
        self.backend = backend
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        # SwiGLU, or GeGLU with tanh GELU (Gemma)
        self.act_and_mul = backend.gelu_tanh_and_mul if arch.hidden_act == "gelu_pytorch_tanh" else backend.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.all_reduce(self.down_proj(self.act_and_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch, backend: Backend, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(arch, backend, layer)
        self.mlp = MLP(arch, backend)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, backend)

    def forward(self, x, residual, rotary, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the previous layer's output, residual the stream before it (None at the first layer); returns
        this layer's (output, residual). Each residual add happens inside the next norm."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h = self.self_attn(h, rotary, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add(h, residual)
        return self.mlp(h), residual


# Hugging Face checkpoint names -> (our fused parameter, which shard)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    arch_type = LlamaArch
    layer_type = DecoderLayer
    cpu_fusable = True  # the CPU backend may run a decode step's layers as one C++ call (cpu_decode.py)
    causal = True
    # False once load_weights found no lm_head.weight (an embedding checkpoint saved from the base model, as
    # Qwen3-Embedding's untied shapes are): embeddings only, generation refused
    can_generate = True

    def __init__(self, arch: LlamaArch, backend: Backend) -> None:
        super().__init__()
        self.arch = arch
        self.backend = backend
        # vocabulary-parallel under TP: this rank's rows of the embedding and of lm_head (parallel/shard.py)
        start, stop = backend.tp.shard.vocab_span() if backend.tp is not None else (0, arch.vocab_size)
        self.vocab_start, self.vocab_rows = start, stop - start
        self.embed_tokens = embedding(self.vocab_rows, arch.hidden_size)
        self.layers = nn.ModuleList(self.layer_type(arch, backend, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, backend)
        self.lm_head = nn.Linear(arch.hidden_size, self.vocab_rows, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary: RotaryEmbedding | None = None  # attached by the engine, sized to its context

    def attach_rotary(self, rotary: RotaryEmbedding) -> None:
        self.rotary = rotary

    def build_rotary(self, hf_config: Any, max_positions: int) -> nn.Module:
        """The cos/sin tables this family's layers use, for positions up to max_positions."""
        return RotaryEmbedding(hf_config, self.arch.head_dim, max_positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        rotary = self.rotary.cos_sin(positions, x.dtype)
        x, residual = self.backend.run_layers(self, x, rotary, kv_caches, meta)
        return self.norm.add(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings; under TP each rank looks up the ids in its rows (zeros for the others) and
        the ranks' rows are summed: one value and zeros, so exactly the unsharded lookup."""
        tp = self.backend.tp
        if tp is None:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        x = self.embed_tokens(local.clamp(0, max(self.vocab_rows - 1, 0)))
        return tp.all_reduce(x.masked_fill_(outside.unsqueeze(1), 0.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] logits; under TP each rank's vocabulary slice, gathered (rank 0 samples on them)."""
        logits = self.lm_head(hidden)
        tp = self.backend.tp
        if tp is None:
            return logits
        per_rank = tp.shard.vocab_per_rank
        if logits.shape[1] < per_rank:  # the last rank's shorter slice, padded to the others' width
            logits = torch.nn.functional.pad(logits, (0, per_rank - logits.shape[1]))
        return tp.gather_columns(logits, self.arch.vocab_size)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            parts = name.split(".")
            fused = _FUSED.get(parts[-2]) if len(parts) >= 2 else None
            if fused is not None:
                parts[-2] = fused[0]
                target = ".".join(parts)
                self._load_shard(params[target], tensor, parts[-3], fused[1])
            else:
                target = name
                if target not in params:
                    raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the {self.arch.model_type} model")
                params[target].copy_(tensor)
            loaded.add(target)
        missing = set(params) - loaded
        if self.arch.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing == {"lm_head.weight"}:
            self.can_generate = False
            missing = set()
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]} ...")

    def _load_shard(self, param: nn.Parameter, tensor: torch.Tensor, module: str, shard: int) -> None:
        if module == "self_attn":
            q, kv = self.arch.num_heads * self.arch.head_dim, self.arch.num_kv_heads * self.arch.head_dim
            bounds = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
        else:
            i = self.arch.intermediate_size
            bounds = [(0, i), (i, 2 * i)][shard]
        param[bounds[0] : bounds[1]].copy_(tensor)
