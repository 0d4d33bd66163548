"""The natively implemented dense families: Hugging Face model_type -> the model class (its arch_type reads the
config): the decoders, and the encoders (bert.py: embeddings only). The MoE families are in moe.py; registry.py
picks native or the transformers fallback."""

from torch import nn

from worker.engine.models.bert import ENCODER_MODEL_TYPES, BertArch, BertModel
from worker.engine.models.gemma import GemmaArch, GemmaForCausalLM
from worker.engine.models.llama import SUPPORTED_MODEL_TYPES, LlamaArch, LlamaForCausalLM
from worker.engine.models.phi3 import Phi3Arch, Phi3ForCausalLM

NATIVE_MODELS: dict[str, type[nn.Module]] = {
    **{model_type: LlamaForCausalLM for model_type in SUPPORTED_MODEL_TYPES},  # llama, mistral, qwen2, qwen3
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
    "phi3": Phi3ForCausalLM,
    **{model_type: BertModel for model_type in ENCODER_MODEL_TYPES},  # bert, roberta, xlm-roberta
}


__all__ = ["ENCODER_MODEL_TYPES", "NATIVE_MODELS", "SUPPORTED_MODEL_TYPES", "BertArch", "BertModel", "GemmaArch",
           "GemmaForCausalLM", "LlamaArch", "LlamaForCausalLM", "Phi3Arch", "Phi3ForCausalLM"]
