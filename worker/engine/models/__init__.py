"""The natively implemented families: Hugging Face model_type -> the model class (its arch_type reads the
config). A model type not listed here is not served natively."""

from worker.engine.models.gemma import GemmaArch, GemmaForCausalLM
from worker.engine.models.llama import SUPPORTED_MODEL_TYPES, LlamaArch, LlamaForCausalLM
from worker.engine.models.phi3 import Phi3Arch, Phi3ForCausalLM

NATIVE_MODELS: dict[str, type[LlamaForCausalLM]] = {
    **{model_type: LlamaForCausalLM for model_type in SUPPORTED_MODEL_TYPES},  # llama, mistral, qwen2, qwen3
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
    "phi3": Phi3ForCausalLM,
}


def native_model_class(hf_config) -> type[LlamaForCausalLM]:
    """The class that serves this config natively; ValueError naming the native types if none does."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in NATIVE_MODELS:
        raise ValueError(f"model type {model_type!r} is not supported; tokenbus implements {sorted(NATIVE_MODELS)}")
    return NATIVE_MODELS[model_type]


__all__ = ["NATIVE_MODELS", "SUPPORTED_MODEL_TYPES", "GemmaArch", "GemmaForCausalLM", "LlamaArch",
           "LlamaForCausalLM", "Phi3Arch", "Phi3ForCausalLM", "native_model_class"]
