"""--kv-cache-dtype through the engine on a tiny random model (CPU): float32 ("auto") still equals Hugging Face
token for token; bfloat16 and int8 caches are lossy, so they are checked against the PyTorch reference
backend over the same cache (same tokens) and their agreement with float32 is reported; the block count
follows the dtype; a dtype the device cannot serve is refused at load."""

from __future__ import annotations

import pytest
import torch

from testbed.tiny_models import make_tiny_model
from tests.support.hf_reference import hf_greedy, load_hf
from worker import Engine, SamplingParams
from worker.engine.config import EngineConfig

PROMPTS = ["Hello there, how are you today?", "The capital of France is", "1, 2, 3, 4, 5,", "a b c d e f g h",
           "Once upon a time in a land far away", "def main():"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("llama-kv")), "llama")


def generate(engine: Engine) -> list[list[int]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
    return [outputs[str(i)] for i in range(len(PROMPTS))]


def agreement(runs: list[list[int]], base: list[list[int]]) -> tuple[float, float]:
    """(share of identical requests, share of tokens before the first divergence)."""
    same = sum(a == b for a, b in zip(runs, base, strict=True))
    prefix = 0
    for a, b in zip(runs, base, strict=True):
        prefix += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return same / len(base), prefix / sum(len(b) for b in base)


def engine(tiny_dir: str, **options) -> Engine:
    # block_size 8 and a 2-token budget per prompt chunk: prompts span blocks and prefill in several chunks
    return Engine(tiny_dir, device="cpu", dtype="float32", num_kv_blocks=64, block_size=8, max_num_seqs=4,
                  max_num_batched_tokens=12, **options)


def test_float32_kv_still_equals_hf(tiny_dir):
    eng = engine(tiny_dir, kv_cache_dtype="float32")
    assert eng.backend.name == "cpu-cpp" and eng.kv_dtype == torch.float32
    hf = load_hf(tiny_dir)
    for prompt, got in zip(PROMPTS, generate(eng), strict=True):
        assert got == hf_greedy(hf, eng.tokenize(prompt), MAX_TOKENS, ignore_eos=True), prompt


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("int8", torch.int8)])
def test_lossy_kv_equals_the_reference_backend_and_mostly_agrees_with_float32(tiny_dir, name, dtype):
    """C++ (fused decode layers included) and the PyTorch reference over the same quantized cache give the
    same tokens; against the float32 cache they agree on most tokens (printed: pytest -s)."""
    fast = engine(tiny_dir, kv_cache_dtype=name)
    assert fast.backend.name == "cpu-cpp" and fast.backend.fused is not None
    assert fast.runner.kv_caches[0][0].dtype == dtype
    got = generate(fast)
    assert got == generate(engine(tiny_dir, kv_cache_dtype=name, cpu_kernels=False))
    requests, tokens = agreement(got, generate(engine(tiny_dir)))
    print(f"\n{name} KV vs float32 KV: {requests:.0%} of requests identical, {tokens:.0%} of tokens before the "
          "first divergence")
    assert tokens >= 0.5


def test_the_block_count_follows_the_kv_dtype(tiny_dir):
    blocks = {name: Engine(tiny_dir, device="cpu", dtype="float32", kv_cache_gb=0.01,
                           kv_cache_dtype=name).block_manager.num_blocks for name in ("auto", "bf16", "int8")}
    # head_dim 32: int8 rows are 32 codes + a 4-byte scale, 36 bytes against 128 in float32
    assert blocks["bf16"] == pytest.approx(2 * blocks["auto"], abs=2)
    assert blocks["int8"] == pytest.approx(128 / 36 * blocks["auto"], abs=4)


def test_a_kv_dtype_the_device_cannot_serve_is_refused_at_load(tiny_dir, monkeypatch):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*got 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match=r"'fp8' is the CUDA Triton kernels'.*on the CPU use --kv-cache-dtype int8"):
        engine(tiny_dir, kv_cache_dtype="fp8")
    from worker.settings import load_settings

    monkeypatch.setenv("TOKENBUS_KV_CACHE_DTYPE", "int8")
    assert load_settings([]).engine.kv_cache_dtype == "int8"
    assert load_settings(["--kv-cache-dtype", "bf16"]).engine.kv_cache_dtype == "bfloat16"
