"""Mixtral and Qwen3-MoE (native) and five architectures tokenbus has no code for (through transformers'
modeling code with the paged cache: GPT-NeoX, Phi-2, StableLM, OLMo 2, Granite), each a tiny
random-weight model built here, through one staggered mixed batch (staggered_batch.py: chunked prefill,
preemption, a prefix-cache hit), greedy fp32 token for token against Hugging Face `generate`: on the CPU
serving path; and on the Triton path under TRITON_INTERPRET=1 (a child process, since Triton reads the flag
at import), every architecture over the same batch (~33 s for all seven on a quiet machine). Plus what is
refused at load, and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.tiny_models import make_tiny_model
from tests.engine.staggered_batch import ENGINE_KWARGS, TINY, check, hf_tokens, run_in_engine, run_staggered
from worker import Engine

ARCHS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),  # top-k renormalised
    # top-k not renormalised; layer 1 dense (mlp_only_layers); 6 experts for 2 x 24 tokens: some get none
    "qwen3_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=False,
                      mlp_only_layers=[1]),
    "gpt_neox": dict(rotary_pct=0.25, num_key_value_heads=None),  # partial rotary, parallel residual
    "phi": dict(partial_rotary_factor=0.5),  # Phi-2: partial rotary, LayerNorm, parallel attn + MLP
    "stablelm": dict(partial_rotary_factor=0.25),
    "olmo2": {},  # q/k norms over the whole projection, post-norms
    "granite": dict(embedding_multiplier=2.0, attention_multiplier=0.2, residual_multiplier=0.6,
                    logits_scaling=3.0),  # its own attention scale and logit divisor
}
NATIVE = ("mixtral", "qwen3_moe")
# arch -> the short batch (False: the whole staggered batch); every architecture runs on the Triton path too
TRITON_ARCHS = {arch: False for arch in ARCHS}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """arch -> (checkpoint directory, HF generate's tokens for the batch), built on first use."""
    built: dict[str, tuple[str, list[list[int]]]] = {}

    def get(arch: str) -> tuple[str, list[list[int]]]:
        if arch not in built:
            directory = make_tiny_model(str(tmp_path_factory.mktemp(arch)), arch, **{**TINY, **ARCHS[arch]})
            built[arch] = (directory, hf_tokens(directory))
        return built[arch]

    return get


@pytest.mark.parametrize("arch", list(ARCHS))
def test_cpu_model_path_equals_hf(tiny, arch):
    directory, expected = tiny(arch)
    result = run_in_engine(directory)
    assert result["model_path"] == ("native" if arch in NATIVE else "transformers")
    assert result["backend"] == "cpu-cpp"
    check(result, expected, arch)


@pytest.mark.slow
def test_triton_path_under_the_interpreter_equals_hf(tiny):
    """The experts through the fused-MoE kernel and attention through the Triton kernels (the PyTorch
    references are made to raise in the child, so nothing falls back silently)."""
    dirs = {arch: tiny(arch)[0] for arch in TRITON_ARCHS}
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    args = [f"{directory}:{int(TRITON_ARCHS[arch])}" for arch, directory in dirs.items()]
    proc = subprocess.run([sys.executable, __file__, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"engine child failed:\n{(proc.stdout + proc.stderr)[-6000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for arch, directory in dirs.items():
        assert results[directory]["backend"] == "triton-interpreter"
        check(results[directory], tiny(arch)[1], f"{arch} (Triton)")


def test_encoder_decoder_is_refused(tmp_path):
    from transformers import T5Config

    T5Config(d_model=32, num_layers=1, num_heads=2, d_kv=16, d_ff=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="encoder-decoder; tokenbus serves decoder-only"):
        Engine(str(tmp_path), device="cpu", dtype="float32")


def test_multimodal_config_is_refused(tmp_path):
    from transformers import LlavaConfig

    LlavaConfig().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"is multimodal \(vision_config, text_config\)"):
        Engine(str(tmp_path), device="cpu", dtype="float32")


def test_missing_tokenizer_is_refused(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("gpt_neox", **TINY, num_hidden_layers=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no usable tokenizer.*put tokenizer.json"):
        Engine(str(tmp_path), device="cpu", dtype="float32")


def test_attention_outside_the_interface_is_refused(tmp_path):
    """Bloom computes attention itself (ALiBi), so our attention is never called: refused at load, not served
    wrong."""
    directory = make_tiny_model(str(tmp_path), "bloom", vocab_size=1024, hidden_size=64, n_head=2, n_layer=2)
    with pytest.raises(ValueError, match="did not route every layer's attention through AttentionInterface"):
        Engine(directory, device="cpu", dtype="float32", num_kv_blocks=8)


def test_model_impl_transformers_forces_the_fallback(tiny):
    """A Llama-family model (Mixtral) through transformers' own code when asked: the same tokens."""
    directory, expected = tiny("mixtral")
    engine = Engine(directory, **{**ENGINE_KWARGS, "model_impl": "transformers"})
    assert engine.model_path == "transformers"
    check(run_staggered(engine, short=True), expected, "mixtral through transformers")


def _child(directories: list[str]) -> None:
    """The Triton child: every PyTorch reference that the Triton path replaces raises if called."""
    import tokenbus_kernels.moe_reference
    from worker.engine.backends import reference

    def refuse(*args, **kwargs):
        raise AssertionError("a PyTorch reference ran although TRITON_INTERPRET=1")

    for name in ("write_kv_ref", "paged_decode_attention_ref", "paged_prefill_attention_ref", "rms_norm_ref",
                 "add_rms_norm_ref", "rotary_ref", "silu_and_mul_ref"):
        setattr(reference, name, refuse)
    tokenbus_kernels.moe_reference.fused_moe_ref = refuse
    runs = [arg.rsplit(":", 1) for arg in directories]
    print(json.dumps({d: run_in_engine(d, short == "1") for d, short in runs}))


if __name__ == "__main__":
    _child(sys.argv[1:])


def test_only_llama_form_rms_norms_go_to_the_backend():
    """The fallback's norm swap is decided by running each module: Llama's form moves to the backend kernel
    (same output), Gemma's (1 + w) form and a LayerNorm stay transformers' own."""
    import torch
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from worker.engine.backends.reference import ReferenceBackend
    from worker.engine.models.fallback_norms import BackendRMSNorm, swap_rms_norms

    model = torch.nn.ModuleDict({"llama": LlamaRMSNorm(24, eps=1e-5), "gemma": GemmaRMSNorm(24, eps=1e-6),
                                 "layer": torch.nn.LayerNorm(24)})
    for p in model.parameters():
        torch.nn.init.normal_(p, 0.5, 0.3)
    x = torch.randn(2, 5, 24)
    before = {name: module(x) for name, module in model.items()}
    assert swap_rms_norms(model, ReferenceBackend()) == 1
    assert isinstance(model["llama"], BackendRMSNorm)
    assert isinstance(model["gemma"], GemmaRMSNorm) and isinstance(model["layer"], torch.nn.LayerNorm)
    for name, module in model.items():
        torch.testing.assert_close(module(x), before[name])
