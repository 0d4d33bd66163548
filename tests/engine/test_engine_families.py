"""Tiny random-weight Llama (llama3 rope scaling), Qwen2 (qkv bias), Qwen3 (q/k norm) and Mistral, each
built by the test and checked token for token against Hugging Face `generate`."""

from __future__ import annotations

import pytest

from testbed.tiny_models import make_tiny_model
from tests.support.hf_reference import hf_greedy, load_hf
from worker import Engine, SamplingParams

PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3,", "def f(x):\n    return", "a b c d e f g h"]
MAX_TOKENS = [12, 20, 7, 25, 16]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_tiny_family_equals_hf(tmp_path_factory, model_type):
    directory = make_tiny_model(str(tmp_path_factory.mktemp(model_type)), model_type)
    hf = load_hf(directory)
    engine = Engine(directory, device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16)
    outputs = engine.generate(PROMPTS, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                                        for m in MAX_TOKENS])
    for prompt, m, out in zip(PROMPTS, MAX_TOKENS, outputs, strict=True):
        expected = hf_greedy(hf, engine.tokenize(prompt), m, ignore_eos=True)
        assert out.token_ids == expected, f"{model_type}: prompt {prompt!r} differs"
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def test_a_type_no_path_can_serve_is_refused(tmp_path):
    """Types tokenbus has no code for go through transformers (tests/engine/test_moe_and_fallback.py); one
    transformers has no causal LM for is refused, naming why."""
    from transformers import ViTConfig

    ViTConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"\(vit\): transformers has no causal-LM class"):
        Engine(str(tmp_path), device="cpu", dtype="float32")


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Engine(str(tmp_path / "nope.gguf"), device="cpu")
    with pytest.raises(ValueError, match="config.json"):
        Engine(str(tmp_path), device="cpu")
