"""The fused CPU decode layers (worker/engine/backends/cpu_decode.py) against the per-layer path they replace.

Both run the same C++ kernels in the same order, so every step's hidden states must be equal to the bit;
the engine-level checks against Hugging Face `generate` (test_engine_families, test_engine_smollm2) run
with the fused layers on, as every CPU float32 engine does.
"""

from __future__ import annotations

import os

import pytest
import torch

from testbed.tiny_models import make_tiny_model
from tokenbus_kernels import cpu
from worker import Engine, SamplingParams
from worker.engine.backends.cpu_decode import FusedDecodeLayers

PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3,", "def f(x):\n    return", "a b c d e f g h",
           "Once upon a time"]
MAX_TOKENS = [12, 30, 7, 25, 16, 3]

# head_dim 32 runs the decode kernel's generic loop, 64 its compiled one; 9/3 heads is SmolLM2's grouping
SHAPES = {
    "llama-hd32": ("llama", {}),
    "qwen2-bias": ("qwen2", {}),
    "llama-hd64-gqa3": ("llama", dict(hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                                      intermediate_size=200, num_hidden_layers=3)),
}


@pytest.fixture(scope="module")
def ext():
    module = cpu.extension()
    if module is None:
        pytest.skip("the C++ CPU kernels could not be built here")
    return module


def _hidden_per_step(engine: Engine) -> tuple[list[torch.Tensor], int]:
    """Every step's final hidden states (the lm_head's input), and how many steps ran the fused layers."""
    hiddens: list[torch.Tensor] = []
    fused_calls = 0
    compute_logits = engine.model.compute_logits
    fused = engine.backend.fused

    def record(hidden: torch.Tensor) -> torch.Tensor:
        hiddens.append(hidden.clone())
        return compute_logits(hidden)

    class Counting:
        def serves(self, x, meta):
            return fused.serves(x, meta)

        def __call__(self, *args):
            nonlocal fused_calls
            fused_calls += 1
            return fused(*args)

    engine.model.compute_logits = record
    if fused is not None:
        engine.backend.fused = Counting()
    try:
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
        engine.generate(PROMPTS, params)
    finally:
        engine.model.compute_logits = compute_logits
        engine.backend.fused = fused
    return hiddens, fused_calls


@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_decode_equals_the_per_layer_path(ext, tmp_path_factory, shape):
    model_type, overrides = SHAPES[shape]
    directory = make_tiny_model(str(tmp_path_factory.mktemp(shape)), model_type, **overrides)
    engine = Engine(directory, device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16)
    _check_fused_equals_per_layer(engine, shape)


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_fused_decode_equals_the_per_layer_path_quantized(ext, tmp_path_factory, quantization):
    """The fused layers' int8 linears (weight-only 3-d panels, W8A8 4-d panels) dispatch to the same kernels."""
    directory = make_tiny_model(str(tmp_path_factory.mktemp(quantization)), "qwen2")
    engine = Engine(directory, device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
                    quantization=quantization)
    try:
        _check_fused_equals_per_layer(engine, quantization)
    finally:
        if engine.quantized_cache and os.path.exists(engine.quantized_cache):
            os.remove(engine.quantized_cache)


def _check_fused_equals_per_layer(engine: Engine, shape: str) -> None:
    assert isinstance(engine.backend.fused, FusedDecodeLayers)
    fused, fused_steps = _hidden_per_step(engine)
    saved = engine.backend.fused
    engine.backend.fused = None
    per_layer, _ = _hidden_per_step(engine)
    engine.backend.fused = saved
    assert fused_steps > 10, "the fused layers should have run every pure decode step"
    assert len(fused) == len(per_layer)
    for step, (a, b) in enumerate(zip(fused, per_layer, strict=True)):
        assert torch.equal(a, b), f"{shape}: step {step} differs by up to {(a - b).abs().max().item()}"


def test_fused_decode_is_not_built_where_it_does_not_apply(ext, tmp_path_factory):
    qwen3 = make_tiny_model(str(tmp_path_factory.mktemp("qwen3")), "qwen3")  # QK-norm: not in the C++ layer
    assert Engine(qwen3, device="cpu", dtype="float32").backend.fused is None
    llama = make_tiny_model(str(tmp_path_factory.mktemp("llama")), "llama")
    bf16 = Engine(llama, device="cpu", dtype="bfloat16")  # on a CPU oneDNN will not prepack bf16 for, too
    assert getattr(bf16.backend, "fused", None) is None
    out = bf16.generate(["Hello there"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 5


def test_fused_decode_leaves_prefill_and_wide_batches_to_the_per_layer_path(ext, tmp_path_factory):
    from worker.engine.attention_metadata import AttentionMetadata
    from worker.engine.backends.cpu_linear import PANEL_MAX_ROWS

    directory = make_tiny_model(str(tmp_path_factory.mktemp("llama-serves")), "llama")
    fused = Engine(directory, device="cpu", dtype="float32").backend.fused

    def meta(prefill_tokens: int) -> AttentionMetadata:
        return AttentionMetadata(torch.zeros(1, dtype=torch.long), prefill_tokens, None, None, None, None, None)

    assert fused.serves(torch.zeros(PANEL_MAX_ROWS, 128), meta(0))
    assert not fused.serves(torch.zeros(PANEL_MAX_ROWS + 1, 128), meta(0))
    assert not fused.serves(torch.zeros(4, 128), meta(2))
