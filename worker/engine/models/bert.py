"""Encoders (BERT, RoBERTa, XLM-RoBERTa) on the flat token batch: bidirectional attention over the paged cache.

An encoder's step is one whole input per sequence (the scheduler never chunks it: every layer's attention reads
every position), so the prefill kernel runs non-causal over the K/V the layer has just written; a one-token input
lands in the decode part, where its one query sees its one key either way. The arithmetic is Hugging Face's
BertModel in eval mode: word + token-type + position embeddings and a LayerNorm; per layer self-attention, a
dense layer added to its input and normalized, then GELU feed-forward the same way (post-norm). The output is
the last layer's hidden states (last_hidden_state), which pooling.py turns into vectors; there is no LM head.

Token type: every token is of type 0, which is what a tokenizer gives one text (segment pairs are for
cross-encoders, not embeddings). Positions: a sequence's absolute positions 0, 1, ...; RoBERTa and XLM-R number
them from padding_idx + 1 (their position table's first rows belong to padding), so their usable context is
two short of max_position_embeddings.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.engine.attention_metadata import AttentionMetadata, paged_attention
from worker.engine.backends import Backend
from worker.engine.models.llama import AttentionShape, attention_shape, embedding

ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta")
_PREFIXES = ("bert.", "roberta.", "model.")  # a BertForMaskedLM & co checkpoint's encoder sits under one
_SKIPPED = ("pooler.", "cls.", "lm_head.", "classifier.", "embeddings.position_ids")  # heads nobody pools


@dataclass
class BertArch(AttentionShape):  # num_kv_heads = num_heads: the KV cache is sized by it
    intermediate_size: int
    layer_norm_eps: float
    max_position_embeddings: int  # usable positions: the table's rows past the position offset
    type_vocab_size: int
    position_offset: int  # RoBERTa / XLM-R: padding_idx + 1; BERT: 0
    tie_word_embeddings: bool = False
    causal: bool = False

    def window(self, layer: int) -> int:
        return 0

    @classmethod
    def from_hf_config(cls, config: Any) -> BertArch:
        model_type = getattr(config, "model_type", None)
        if model_type not in ENCODER_MODEL_TYPES:
            raise ValueError(f"model type {model_type!r} is not an encoder tokenbus implements "
                             f"({list(ENCODER_MODEL_TYPES)})")
        act = getattr(config, "hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"encoder activation {act!r} is not supported; only 'gelu' (exact, erf) is implemented")
        kind = getattr(config, "position_embedding_type", "absolute") or "absolute"
        if kind != "absolute":
            raise ValueError(f"position_embedding_type {kind!r} is not supported; only 'absolute' is implemented")
        offset = config.pad_token_id + 1 if model_type != "bert" else 0
        return cls(
            **attention_shape(config, model_type, config.hidden_size // config.num_attention_heads),
            intermediate_size=config.intermediate_size, layer_norm_eps=config.layer_norm_eps,
            max_position_embeddings=config.max_position_embeddings - offset,
            type_vocab_size=getattr(config, "type_vocab_size", 1) or 1, position_offset=offset,
        )


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, backend: Backend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.layer_norm(x, self.weight, self.bias, self.eps)


class BertEmbeddings(nn.Module):
    def __init__(self, arch: BertArch, backend: Backend) -> None:
        super().__init__()
        self.offset = arch.position_offset
        self.word_embeddings = embedding(arch.vocab_size, arch.hidden_size)
        self.position_embeddings = embedding(arch.max_position_embeddings + arch.position_offset, arch.hidden_size)
        self.token_type_embeddings = embedding(arch.type_vocab_size, arch.hidden_size)
        self.LayerNorm = LayerNorm(arch.hidden_size, arch.layer_norm_eps, backend)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # HF's order of the sums: (word + token type) + position
        x = self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0]
        x = x + self.position_embeddings(positions + self.offset if self.offset else positions)
        return self.LayerNorm(x)


class BertLayer(nn.Module):
    def __init__(self, arch: BertArch, backend: Backend) -> None:
        super().__init__()
        self.backend = backend
        self.num_heads, self.head_dim = arch.num_heads, arch.head_dim
        self.scale = arch.head_dim**-0.5
        h = arch.hidden_size
        self.qkv_proj = nn.Linear(h, 3 * h)  # query, key, value fused
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = LayerNorm(h, arch.layer_norm_eps, backend)
        self.intermediate = nn.Linear(h, arch.intermediate_size)
        self.output = nn.Linear(arch.intermediate_size, h)
        self.out_norm = LayerNorm(h, arch.layer_norm_eps, backend)

    def forward(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        heads = self.qkv_proj(x).view(n, 3 * self.num_heads, self.head_dim)
        q, k, v = heads.split(self.num_heads, dim=1)  # strided views into the fused output
        self.backend.write_kv(k, v, *kv_cache, meta.slot_mapping)
        attn = paged_attention(self.backend, q, kv_cache, meta, self.scale, causal=False)
        h = self.attn_norm(self.backend.linear_add(self.attn_out, attn.reshape(n, -1), x))
        return self.out_norm(self.backend.linear_add(self.output, self.backend.linear_gelu(self.intermediate, h), h))


# Hugging Face names inside a layer -> ours (query/key/value are shards of qkv_proj)
_LAYER_NAMES = {
    "attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "intermediate", "output.dense": "output", "output.LayerNorm": "out_norm",
}
_QKV = {"query": 0, "key": 1, "value": 2}


class BertModel(nn.Module):
    arch_type = BertArch
    cpu_fusable = False  # the fused C++ decode step is a Llama layer's
    can_generate = False  # no LM head: embeddings only
    causal = False

    def __init__(self, arch: BertArch, backend: Backend) -> None:
        super().__init__()
        self.arch = arch
        self.backend = backend
        self.embeddings = BertEmbeddings(arch, backend)
        self.layers = nn.ModuleList(BertLayer(arch, backend) for _ in range(arch.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embeddings(input_ids, positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, kv_cache, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an encoder has no LM head: the engine refuses generation requests before this")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        h = self.arch.hidden_size
        for hf_name, tensor in weights:
            name = next((hf_name.removeprefix(p) for p in _PREFIXES if hf_name.startswith(p)), hf_name)
            if name.startswith(_SKIPPED):
                continue
            # checkpoints of the TensorFlow era name LayerNorm's weight and bias gamma and beta
            name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
            target, shard = _our_name(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the {self.arch.model_type} model")
            if shard is None:
                params[target].copy_(tensor)
            else:
                params[target][shard * h : (shard + 1) * h].copy_(tensor)
            loaded.add(target)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]} ...")


def _our_name(name: str) -> tuple[str, int | None]:
    """(our parameter, the qkv shard or None) for an encoder tensor's Hugging Face name (prefix removed)."""
    if not name.startswith("encoder.layer."):
        return name, None
    index, rest = name.removeprefix("encoder.layer.").split(".", 1)
    module, leaf = rest.rsplit(".", 1)
    if module.startswith("attention.self."):
        return f"layers.{index}.qkv_proj.{leaf}", _QKV.get(module.removeprefix("attention.self."))
    return f"layers.{index}.{_LAYER_NAMES.get(module, module)}.{leaf}", None
