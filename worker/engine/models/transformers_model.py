"""The fallback: any decoder-only model transformers can build, run by transformers' own modeling code with
tokenbus's paged KV cache and attention kernels.

transformers 5 looks every attention call up by name in `AttentionInterface` (config._attn_implementation).
We register "tokenbus" there: the model runs its own embeddings, MLPs and RoPE on our flat batch
(input_ids [1, num_tokens], position_ids [1, num_tokens]: each token's own position), and at each layer hands
us q [1, heads, n, d] and k, v [1, kv_heads, n, d] after its RoPE; we write k, v into the layer's paged cache
(module.layer_idx picks it) and run the backend's prefill / decode attention over the AttentionMetadata, as
the native models do. Its Llama-form RMSNorms run on the backend's kernel (fallback_norms.py, probe-checked).
transformers builds no mask for a name it has no mask function for, so none is made.
The step's caches and metadata reach the attention function through `_STEP` (one engine step at a time).

What cannot run this way is refused at load (FallbackArch.from_hf_config, TransformersCausalLM.probe):
encoder-decoders, multimodal configs, types transformers has no causal LM for, and models whose attention does
not go through AttentionInterface or needs what our kernels lack (sliding windows, logit soft-capping, sinks).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from torch import nn

from worker.engine.attention_metadata import AttentionMetadata, paged_attention
from worker.engine.backends import Backend
from worker.engine.models.fallback_norms import swap_rms_norms
from worker.engine.models.llama import AttentionShape, attention_shape

log = structlog.get_logger("tokenbus.engine")

ATTN_NAME = "tokenbus"
_STEP = threading.local()  # .model (TransformersCausalLM), .kv_caches, .meta while a forward runs


@dataclass
class FallbackArch(AttentionShape):
    """What the engine needs to size the KV cache and the kernels; the model itself stays transformers'."""

    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_window: int | None = None
    qk_norm: bool = False
    model_path: str = "transformers"

    @classmethod
    def from_hf_config(cls, config: Any, model_name: str = "") -> FallbackArch:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        model_type = getattr(config, "model_type", None)
        what = f"model {model_name!r} ({model_type})"
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError(f"{what} is an encoder-decoder; tokenbus serves decoder-only causal LMs")
        subconfigs = [k for k in ("vision_config", "audio_config", "text_config", "encoder") if hasattr(config, k)]
        if subconfigs:
            raise ValueError(f"{what} is multimodal ({', '.join(subconfigs)}); tokenbus serves text-only causal "
                             "LMs: serve its text model as a checkpoint of its own")
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ValueError(f"{what}: transformers has no causal-LM class for this type, so tokenbus cannot serve "
                             "it (neither natively nor through transformers)")
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise ValueError(f"{what} uses sliding-window attention, which the transformers fallback does not "
                             "apply; it is served only where tokenbus implements the family natively")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            **attention_shape(config, model_type, head_dim),
            max_position_embeddings=getattr(config, "max_position_embeddings", None) or 2048,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


def tokenbus_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """AttentionInterface entry: query [1, heads, n, d], key/value [1, kv_heads, n, d] -> ([1, n, heads, d], None)."""
    model: TransformersCausalLM = _STEP.model
    for unsupported in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"model type {model.arch.model_type!r} asks attention for {unsupported}, which the "
                             "tokenbus kernels do not implement: it cannot run through the transformers fallback")
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    return model.attend(module.layer_idx, q, k, v, scale).unsqueeze(0), None


class TransformersCausalLM(nn.Module):
    """A transformers causal LM behind the engine's model interface: forward(input_ids, positions, kv_caches,
    meta) -> hidden [n, hidden]; compute_logits(hidden) -> [n, vocab]."""

    def __init__(self, hf_model: nn.Module, arch: FallbackArch, backend: Backend) -> None:
        super().__init__()
        self.hf = hf_model
        self.arch = arch
        self.backend = backend
        self.seen: dict | None = None  # layer -> (heads, kv_heads, head_dim) during the load-time probe
        config = hf_model.config
        self.logit_divisor = float(getattr(config, "logits_scaling", 1.0) or 1.0)  # Granite
        self.logit_scale = float(getattr(config, "logit_scale", 1.0) or 1.0)  # Cohere
        self.softcap = getattr(config, "final_logit_softcapping", None)

    @classmethod
    def load(cls, source: Any, arch: FallbackArch, backend: Backend, dtype: torch.dtype,
             device: torch.device) -> TransformersCausalLM:
        from transformers import AttentionInterface, AutoModelForCausalLM

        AttentionInterface.register(ATTN_NAME, tokenbus_attention)
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(
                source.directory, dtype=dtype, attn_implementation=ATTN_NAME, **source.hf_kwargs)
        # transformers refuses a custom attention for models that cannot take one (ValueError), or some look
        # their own attention classes up by implementation name (KeyError: Falcon)
        except (ValueError, KeyError) as exc:
            raise ValueError(f"model {source.name!r} ({arch.model_type}): transformers' modeling code does not "
                             f"route attention through AttentionInterface, so tokenbus cannot serve it ({exc})") \
                from exc
        model = cls(hf_model.to(device).eval().requires_grad_(False), arch, backend)
        model.probe(source.name, device)
        norms = swap_rms_norms(model.hf, backend)
        log.info("fallback_kernels", model=source.name, rms_norms_on_backend=norms)
        return model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        _STEP.model, _STEP.kv_caches, _STEP.meta = self, kv_caches, meta
        try:
            out = self.hf.base_model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        finally:
            _STEP.model = _STEP.kv_caches = _STEP.meta = None
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.hf.get_output_embeddings()(hidden)
        if self.logit_divisor != 1.0:
            logits = logits / self.logit_divisor
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Write this step's k, v into layer's cache and attend: the native Attention's arithmetic."""
        meta: AttentionMetadata | None = _STEP.meta
        if meta is None:  # the load-time probe
            # a layer called twice, or k and v of different shapes, make the shapes disagree below
            shape = (q.shape[1], k.shape[1], k.shape[2]) if k.shape == v.shape else ()
            self.seen[layer] = shape if layer not in self.seen else ()
            return torch.zeros_like(q)
        k_cache, v_cache = _STEP.kv_caches[layer]
        self.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(self.backend, q, (k_cache, v_cache), meta, scale)

    @torch.inference_mode()
    def probe(self, model_name: str, device: torch.device) -> None:
        """One 2-token forward with no cache: every layer must call our attention exactly once, and the head
        counts it hands us (which configs name in many ways) become the arch the KV cache is sized by."""
        arch = self.arch
        _STEP.model, _STEP.kv_caches, _STEP.meta = self, None, None  # meta None: attend() only records shapes
        self.seen = {}
        try:
            self.hf.base_model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device),
                               position_ids=torch.arange(2, device=device)[None], use_cache=False)
        except Exception as exc:  # e.g. Falcon looks its own attention classes up by implementation name
            raise ValueError(
                f"model {model_name!r} ({arch.model_type}): its transformers code cannot run with an attention "
                f"implementation registered through AttentionInterface ({type(exc).__name__}: {exc}); tokenbus "
                "cannot serve it through the fallback") from exc
        finally:
            _STEP.model = None
        shapes = set(self.seen.values())
        if sorted(self.seen) != list(range(arch.num_layers)) or len(shapes) != 1:
            raise ValueError(
                f"model {model_name!r} ({arch.model_type}): its transformers code did not route every layer's "
                f"attention through AttentionInterface with one shape (seen: {self.seen}); tokenbus cannot "
                "serve it through the fallback")
        arch.num_heads, arch.num_kv_heads, arch.head_dim = shapes.pop()
        self.seen = None
