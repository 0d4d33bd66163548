"""Which code serves a model: a native family of worker/engine/models, or transformers' own modeling code
(the fallback, transformers_model.py). Decided once from the Hugging Face config's model_type."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
import torch

from worker.engine.backends import Backend
from worker.engine.models import NATIVE_MODELS
from worker.engine.models.moe import MOE_MODEL_TYPES, MoeForCausalLM, moe_arch
from worker.engine.models.transformers_model import FallbackArch, TransformersCausalLM

NATIVE_MODEL_TYPES = (*NATIVE_MODELS, *MOE_MODEL_TYPES)
log = structlog.get_logger("tokenbus.engine")


def model_arch(hf_config: Any, model_name: str = "", model_impl: str = "auto") -> Any:
    """The native family's arch for a type tokenbus implements, else the fallback's (which refuses what
    neither path can serve: encoder-decoders, multimodal configs, non-causal types). model_impl
    "transformers" takes the fallback for any type; "native" refuses it."""
    model_type = getattr(hf_config, "model_type", None)
    if model_impl == "transformers":
        return FallbackArch.from_hf_config(hf_config, model_name)
    if model_impl == "native" and model_type not in NATIVE_MODEL_TYPES:
        raise ValueError(f"model type {model_type!r} is not supported natively; tokenbus implements "
                         f"{list(NATIVE_MODEL_TYPES)} (model_impl 'auto' serves it through transformers)")
    if model_type in MOE_MODEL_TYPES:
        return moe_arch(hf_config)
    if model_type in NATIVE_MODELS:
        return NATIVE_MODELS[model_type].arch_type.from_hf_config(hf_config)
    return FallbackArch.from_hf_config(hf_config, model_name)


def model_path(arch: Any) -> str:
    """Which code runs the model, 'native' or 'transformers': what the worker logs, its heartbeat carries
    (`model_path`) and `tokenbus info` shows."""
    return getattr(arch, "model_path", "native")


def build_model(arch: Any, hf_config: Any, source: Any, backend: Backend, dtype: torch.dtype,
                device: torch.device, max_model_len: int, weights: Any,
                prepare: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
    """The model with its weights, in eval mode. `weights` is the loader's iter_weights (native path only);
    `prepare` may swap modules of the meta model, in the target dtype, before memory is allocated (fp8.py)."""
    path = model_path(arch)
    log.info("model_path", model=source.name, model_type=arch.model_type, path=path)
    if path == "transformers":
        return TransformersCausalLM.load(source, arch, backend, dtype, device)
    cls = MoeForCausalLM if arch.model_type in MOE_MODEL_TYPES else NATIVE_MODELS[arch.model_type]
    with torch.device("meta"):  # no memory is touched until the weights arrive
        meta_model = cls(arch, backend)
    # cast while on meta: the weights are allocated once, in the target dtype, on the target device
    meta_model = meta_model.to(dtype)
    if prepare is not None:
        prepare(meta_model)
    model = meta_model.to_empty(device=device)
    if arch.tie_word_embeddings:  # materialising from meta unties shared parameters
        model.lm_head.weight = model.embed_tokens.weight
    if hasattr(model, "build_rotary"):  # an encoder's positions are a learned table, loaded as a weight
        model.attach_rotary(model.build_rotary(hf_config, max_model_len).to(device))
    model.load_weights(weights(source))
    return model.eval().requires_grad_(False)
