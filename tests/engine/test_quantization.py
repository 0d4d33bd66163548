"""--quantization int8 and w8a8 through the engine on a tiny random model: the served tokens equal Hugging Face
`generate` on the dequantized weights (the model int8 defines; w8a8 also rounds each linear's input per token
to int8), the cache on disk is written and read back,
and a wrong scheme or a mismatched scale layout is a clear error at load."""

from __future__ import annotations

import os

import pytest
import torch

from testbed.tiny_models import make_tiny_model
from tests.support.hf_reference import hf_greedy, load_hf
from worker import Engine, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.quant.schemes import quantize_int8, round_activations_int8

PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3,", "a b c d e f g h"]
MAX_TOKENS = [12, 20, 7, 16]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # qwen2: tied lm_head (must be untied and quantized, the embedding kept fp32) and a qkv bias
    return make_tiny_model(str(tmp_path_factory.mktemp("qwen2-int8")), "qwen2")


@pytest.fixture
def fresh_cache(tiny_dir):
    """The tiny model's int8 cache file in tokenbus's cache directory, removed before and after the test (a
    cache_dir of its own would rebuild the C++ kernels there: ~40 s)."""
    paths: list[str] = []
    yield paths
    for path in paths:
        if path and os.path.exists(path):
            os.remove(path)


def hf_dequantized(directory: str, w8a8: bool = False):
    hf = load_hf(directory)
    with torch.no_grad():
        hf.lm_head.weight = torch.nn.Parameter(hf.lm_head.weight.detach().clone())  # untie from the embedding
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(quantize_int8(module.weight).dequantize())
                if w8a8:  # the input of every linear (lm_head too) rounded per token and group, as the W8A8 kernel does
                    module.register_forward_pre_hook(lambda _m, args: (round_activations_int8(args[0]), *args[1:]))
    return hf


def generate(engine: Engine) -> dict[str, list[int]]:
    outputs = engine.generate(PROMPTS, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                                        for m in MAX_TOKENS])
    return {str(i): out.token_ids for i, out in enumerate(outputs)}


def test_int8_engine_equals_hf_on_dequantized_weights(tiny_dir, fresh_cache):
    engine = Engine(tiny_dir, device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
                    quantization="int8")
    cached = engine.quantized_cache
    fresh_cache.append(cached)
    assert engine.backend.name == "cpu-cpp" and engine.backend.fused is not None  # the C++ int8 path serves
    assert engine.model.lm_head.panels.dtype == torch.int8
    assert engine.model.embed_tokens.weight.dtype == torch.float32
    outputs = generate(engine)
    hf = hf_dequantized(tiny_dir)
    plain = load_hf(tiny_dir)
    differs = 0
    for i, (prompt, m) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        ids = engine.tokenize(prompt)
        assert outputs[str(i)] == hf_greedy(hf, ids, m, ignore_eos=True), f"prompt {prompt!r} differs"
        differs += outputs[str(i)] != hf_greedy(plain, ids, m, ignore_eos=True)
    assert differs > 0, "int8 gave the fp32 tokens on every prompt: is the model quantized at all?"
    assert os.path.isfile(cached)


def logit_gaps(hf, prompt_ids: list[int], out: list[int]) -> torch.Tensor:
    """Teacher-forced over the engine's tokens: for each, HF's top logit minus the logit of the engine's token."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + out[:-1]])).logits[0, len(prompt_ids) - 1 :]
    return logits.max(dim=1).values - logits.gather(1, torch.tensor(out)[:, None])[:, 0]


# One activation code rounded the other way (an fp32 summation-order difference upstream of a .5 boundary)
# moves this model's logits (|logit| < 5) by ~1e-2: enough to flip a near-tie, so w8a8 is checked by the logit
# margins of the engine's tokens under the reference rather than by free-running token equality. Served
# weight-only (no activation rounding), the engine's tokens sit 3.3e-2 below the W8A8 reference's top logit.
W8A8_MAX_GAP = 1.5e-2


def test_w8a8_engine_tokens_are_hf_argmax_with_rounded_activations(tiny_dir, fresh_cache):
    engine = Engine(tiny_dir, device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
                    quantization="w8a8")
    fresh_cache.append(engine.quantized_cache)
    assert engine.backend.name == "cpu-cpp" and engine.backend.fused is not None
    assert engine.model.lm_head.panels.dtype == torch.int8 and engine.model.lm_head.panels.dim() == 4
    outputs = generate(engine)
    hf = hf_dequantized(tiny_dir, w8a8=True)
    plain = load_hf(tiny_dir)
    exact, differs = 0, 0
    for i, (prompt, m) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        ids = engine.tokenize(prompt)
        gaps = logit_gaps(hf, ids, outputs[str(i)])
        assert float(gaps.max()) <= W8A8_MAX_GAP, f"prompt {prompt!r}: a token {float(gaps.max()):.2e} below HF's top"
        exact += outputs[str(i)] == hf_greedy(hf, ids, m, ignore_eos=True)
        differs += outputs[str(i)] != hf_greedy(plain, ids, m, ignore_eos=True)
    assert exact >= len(PROMPTS) - 1, "more than one prompt's tokens differ from the W8A8 reference"
    assert differs > 0, "w8a8 gave the fp32 tokens on every prompt: is the model quantized at all?"


def test_the_cache_is_read_back_and_a_mismatched_scale_layout_is_a_clear_error(tiny_dir, fresh_cache):
    from safetensors.torch import load_file, save_file

    cached = Engine(tiny_dir, device="cpu", dtype="float32", num_kv_blocks=8, quantization="int8").quantized_cache
    fresh_cache.append(cached)
    stamp = os.stat(cached).st_mtime_ns
    again = Engine(tiny_dir, device="cpu", dtype="float32", num_kv_blocks=8, quantization="int8")
    assert again.quantized_cache == cached and os.stat(cached).st_mtime_ns == stamp  # read back, not rewritten
    tensors = load_file(cached)
    tensors["lm_head.scale"] = tensors["lm_head.scale"][:1].clone()  # per-tensor: not this scheme's layout
    save_file(tensors, cached)
    with pytest.raises(ValueError, match=r"'lm_head' have a mismatched layout.*one per output channel.*delete it"):
        Engine(tiny_dir, device="cpu", dtype="float32", num_kv_blocks=8, quantization="int8")


def test_unsupported_scheme_is_a_clear_error(tiny_dir):
    with pytest.raises(ValueError, match=r"quantization must be unset or one of \['int8', 'fp8', 'w8a8'\], got 'int4'"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="'int8' is the CPU float32 path"):
        Engine(tiny_dir, device="cpu", dtype="bfloat16", quantization="int8")


def test_a_quantized_checkpoint_of_another_scheme_is_a_clear_error_at_load(tiny_dir, tmp_path):
    """A GPTQ checkpoint is refused before any weight is read, saying what loads instead (FP8 checkpoints
    load: tests/engine/test_fp8.py)."""
    import json
    import shutil

    gptq_dir = tmp_path / "gptq"
    shutil.copytree(tiny_dir, gptq_dir)
    config = json.loads((gptq_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (gptq_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantized with 'gptq'.*unquantized \(fp32/bf16/fp16\) checkpoints"):
        Engine(str(gptq_dir), device="cpu", dtype="float32", num_kv_blocks=8)


def test_quantization_setting_reaches_the_engine_config(monkeypatch):
    from worker.settings import WorkerSettings, load_settings

    monkeypatch.setenv("TOKENBUS_QUANTIZATION", "int8")
    assert WorkerSettings().engine.quantization == "int8"
    monkeypatch.delenv("TOKENBUS_QUANTIZATION")
    assert load_settings(["--quantization", "int8"]).engine.quantization == "int8"
    assert load_settings([]).engine.quantization is None


def test_w8a8_without_vnni_warns_that_int8_is_faster(monkeypatch):
    from structlog.testing import capture_logs

    from worker.engine.quant import schemes as quantization

    monkeypatch.setattr(quantization, "cpu_flags", lambda: "flags\t\t: fpu sse avx2 avx512f")
    with capture_logs() as logs:
        quantization.check_scheme("w8a8", torch.device("cpu"), torch.float32)
    assert [entry["event"] for entry in logs] == ["w8a8_without_vnni"]
    monkeypatch.setattr(quantization, "cpu_flags", lambda: "flags\t\t: fpu avx2 avx512f avx512_vnni")
    with capture_logs() as logs:
        quantization.check_scheme("w8a8", torch.device("cpu"), torch.float32)
    assert logs == []
    with pytest.raises(ValueError, match="'w8a8' is the CPU float32 path"):
        quantization.check_scheme("w8a8", torch.device("cpu"), torch.bfloat16)
