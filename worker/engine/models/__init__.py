from worker.engine.models.llama import SUPPORTED_MODEL_TYPES, LlamaArch, LlamaForCausalLM

__all__ = ["SUPPORTED_MODEL_TYPES", "LlamaArch", "LlamaForCausalLM"]
