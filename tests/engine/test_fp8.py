"""FP8 weights through the engine on tiny random models (worker/engine/quant/fp8.py, fp8_checkpoint.py):

- an FP8 checkpoint in each format and scale layout, written by the test, loads on the CPU dequantized and
  serves exactly the tokens Hugging Face `generate` gives on the dequantized weights;
- `--quantization fp8` (the GPU path, run here on PyTorch's CPU torch._scaled_mm) keeps an FP8 checkpoint's
  e4m3 bits and scales, quantizes an unquantized checkpoint per channel, and serves the tokens of HF whose
  linears compute fp8_linear_reference (per-token e4m3 activations, fp32 arithmetic);
- another quantization scheme, or a scale whose shape does not fit the config's strategy, is a clear error
  at load, before any weight is read.
"""

from __future__ import annotations

import json
import os
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file

from testbed.fp8_checkpoints import write_fp8
from testbed.tiny_models import make_tiny_model
from tests.support.hf_reference import hf_greedy, load_hf
from tokenbus_kernels.fp8_linear import fp8_linear_reference, quantize_weight
from worker import Engine, SamplingParams
from worker.engine.quant.fp8 import Fp8Linear

PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3,"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Unquantized tiny checkpoints: llama; qwen2 (tied lm_head, qkv bias); phi3 (fused qkv and gate_up in the
    checkpoint, q/k rows permuted at load)."""
    root = tmp_path_factory.mktemp("fp8-bases")
    return {family: make_tiny_model(str(root / family), family) for family in ("llama", "qwen2", "phi3")}


def serve(directory: str, **options) -> tuple[Engine, list[list[int]]]:
    engine = Engine(
        directory, device="cpu", dtype="float32", num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=64, **options
    )
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return engine, [o.token_ids for o in outs]


def hf_tokens(engine: Engine, hf) -> list[list[int]]:
    return [hf_greedy(hf, engine.tokenize(p), MAX_TOKENS, ignore_eos=True) for p in PROMPTS]


def fp8_linears(engine: Engine) -> dict[str, Fp8Linear]:
    return {n: m for n, m in engine.model.named_modules() if isinstance(m, Fp8Linear)}


def hf_emulating_fp8(directory: str, linears: dict[str, tuple[torch.Tensor, torch.Tensor]]):
    """HF on `directory` with each named linear computing fp8_linear_reference on the given (e4m3, scale)."""
    hf = load_hf(directory)
    for name, (qweight, w_scale) in linears.items():
        module = hf.get_submodule(name)
        module.forward = partial(fp8_linear_reference, qweight=qweight, w_scale=w_scale, bias=module.bias)
    return hf


# ---- FP8 checkpoints dequantized on the CPU ---------------------------------------------------------------

FORMATS = [  # (family, quant_method, strategy, block, static input scales)
    ("llama", "compressed-tensors", "channel", None, False),
    ("qwen2", "compressed-tensors", "tensor", None, True),
    ("llama", "compressed-tensors", "block", (48, 40), False),  # blocks that do not divide the shapes
    ("phi3", "fp8", "tensor", None, False),
    ("qwen2", "fp8", "block", (32, 48), False),
]


@pytest.mark.parametrize(
    "family,method,strategy,block,static", FORMATS, ids=[f"{f}-{m}-{s}" for f, m, s, _, _ in FORMATS]
)
def test_fp8_checkpoint_on_the_cpu_equals_hf_on_its_dequantized_weights(
    bases, tmp_path, family, method, strategy, block, static
):
    fp8_dir, twin = write_fp8(bases[family], str(tmp_path / "fp8"), method, strategy, block, input_scale=static)
    engine, got = serve(fp8_dir)
    assert not fp8_linears(engine)  # dequantized: the CPU's fp32 path (C++ kernels) serves it
    assert engine.backend.name == "cpu-cpp"
    assert got == hf_tokens(engine, load_hf(twin))


# ---- --quantization fp8: the GPU path on the CPU's torch._scaled_mm ---------------------------------------


def test_fp8_serving_keeps_the_checkpoints_bits_and_equals_hf_emulating_fp8(bases, tmp_path):
    fp8_dir, twin = write_fp8(bases["llama"], str(tmp_path / "fp8"), "compressed-tensors", "tensor")
    engine, got = serve(fp8_dir, quantization="fp8")
    files = load_file(os.path.join(fp8_dir, "model.safetensors"))
    linears = fp8_linears(engine)
    assert len(linears) == 4 * 2 and "lm_head" not in linears  # every decoder linear of the 2 layers
    qkv = linears["layers.1.self_attn.qkv_proj"]
    names = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    want_bits = torch.cat([files[f"{n}.weight"] for n in names]).view(torch.uint8)
    assert torch.equal(qkv.weight.view(torch.uint8), want_bits)  # the file's e4m3, not requantized
    # a per-tensor scale repeated on each of its rows
    want_scale = torch.cat([files[f"{n}.weight_scale"].expand(files[f"{n}.weight"].shape[0]) for n in names])
    assert torch.equal(qkv.weight_scale, want_scale)
    reference = {}
    for name in files:
        if name.endswith(".weight_scale"):
            prefix = name.removesuffix(".weight_scale")
            w = files[f"{prefix}.weight"]
            reference[prefix] = (w, files[name].expand(w.shape[0]).contiguous())
    assert got == hf_tokens(engine, hf_emulating_fp8(twin, reference))
    assert got != hf_tokens(engine, load_hf(twin)), "fp8 activations changed no token: are they quantized?"


def test_fp8_serving_of_phi3_permutes_the_scales_with_the_rows(bases, tmp_path):
    fp8_dir, twin = write_fp8(bases["phi3"], str(tmp_path / "fp8"), "compressed-tensors", "channel")
    engine, got = serve(fp8_dir, quantization="fp8")
    assert len(fp8_linears(engine)) == 4 * 2
    files = load_file(os.path.join(fp8_dir, "model.safetensors"))
    reference = {
        name.removesuffix(".weight_scale"): (files[name.replace("_scale", "")], files[name].view(-1))
        for name in files
        if name.endswith(".weight_scale")
    }
    assert got == hf_tokens(engine, hf_emulating_fp8(twin, reference))


def test_dynamic_fp8_of_an_unquantized_checkpoint(bases):
    engine, got = serve(bases["qwen2"], quantization="fp8")
    linears = fp8_linears(engine)
    assert len(linears) == 4 * 2 and linears["layers.0.self_attn.qkv_proj"].bias is not None
    assert engine.model.embed_tokens.weight.dtype == torch.float32  # the tied lm_head stays as loaded
    hf = load_hf(bases["qwen2"])
    reference = {
        name: quantize_weight(m.weight)
        for name, m in hf.named_modules()
        if isinstance(m, torch.nn.Linear) and name != "lm_head"
    }
    assert got == hf_tokens(engine, hf_emulating_fp8(bases["qwen2"], reference))


# ---- clear errors at load ---------------------------------------------------------------------------------


def _with_config(directory: str, quantization_config: dict) -> str:
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(path, "w") as f:
        json.dump(config, f)
    return directory


@pytest.fixture
def fp8_channel(bases, tmp_path):
    return write_fp8(bases["llama"], str(tmp_path / "fp8"), "compressed-tensors", "channel")[0]


@pytest.mark.parametrize(
    "qc,message",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, r"quantized with 'gptq'.*does not support.*FP8 ones"),
        ({"quant_method": "awq", "bits": 4}, r"quantized with 'awq'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
                    }
                },
            },
            r"group_0' quantizes weights to int 4-bit \(format 'pack-quantized'\).*only float 8-bit",
        ),
        ({"quant_method": "fp8", "fmt": "e5m2"}, r"fmt 'e5m2'; only 'e4m3'"),
    ],
)
def test_an_unsupported_scheme_is_a_clear_error(fp8_channel, qc, message):
    with pytest.raises(ValueError, match=message):
        Engine(_with_config(fp8_channel, qc), device="cpu", dtype="float32", num_kv_blocks=8)


def test_a_scale_layout_that_does_not_fit_the_strategy_is_a_clear_error(fp8_channel):
    # per-channel scales [N, 1] in the files, but the config says per tensor
    qc = json.load(open(os.path.join(fp8_channel, "config.json")))["quantization_config"]
    qc["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    with pytest.raises(
        ValueError,
        match=r"mismatched scale layout: model\.layers\.0\.\w+\.\w+_proj\.weight_scale "
        r"is \[\d+, 1\].*strategy 'tensor', whose scale is \[\] or \[1\]",
    ):
        Engine(_with_config(fp8_channel, qc), device="cpu", dtype="float32", num_kv_blocks=8)
    # the fp8 config's block size against [N, 1] scales
    with pytest.raises(
        ValueError,
        match=r"is \[128, 1\] for the weight \[128, \d+\].*strategy 'block' \[128, 128\], "
        r"whose scale is \[1, [12]\]",
    ):
        Engine(
            _with_config(fp8_channel, {"quant_method": "fp8", "weight_block_size": [128, 128]}),
            device="cpu",
            dtype="float32",
            num_kv_blocks=8,
        )


def test_an_fp8_weight_without_its_scale_is_a_clear_error(fp8_channel):
    path = os.path.join(fp8_channel, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, path)
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.1\.mlp\.down_proj\.weight' is float8_e4m3fn \[128, 256\] "
        r"without a weight scale",
    ):
        Engine(fp8_channel, device="cpu", dtype="float32", num_kv_blocks=8)


def test_an_fp8_config_over_unquantized_files_is_a_clear_error(bases, tmp_path):
    import shutil

    directory = str(tmp_path / "plain")
    shutil.copytree(bases["llama"], directory)
    with pytest.raises(ValueError, match=r"config says fp8 FP8, but no \*\.safetensors file.*float8_e4m3fn weight"):
        Engine(_with_config(directory, {"quant_method": "fp8"}), device="cpu", dtype="float32", num_kv_blocks=8)


def test_int8_over_an_fp8_checkpoint_quantizes_its_dequantized_weights(bases, tmp_path):
    """--quantization int8 on the CPU takes an FP8 checkpoint too: dequantized at load, then int8."""
    from worker.engine.quant.schemes import quantize_int8

    fp8_dir, twin = write_fp8(bases["llama"], str(tmp_path / "fp8"), "compressed-tensors", "channel")
    engine, got = serve(fp8_dir, quantization="int8")
    try:
        assert engine.model.lm_head.panels.dtype == torch.int8
        hf = load_hf(twin)
        with torch.no_grad():
            for module in hf.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(quantize_int8(module.weight).dequantize())
        assert got == hf_tokens(engine, hf)
    finally:
        if engine.quantized_cache and os.path.exists(engine.quantized_cache):
            os.remove(engine.quantized_cache)


def test_dynamic_fp8_keeps_the_output_projection_whatever_its_name():
    """The logits' linear stays as loaded however a model names it: transformers' models say which it is
    (get_output_embeddings), and the fallback serves those."""
    from torch import nn

    from worker.engine.quant.fp8 import quantize_model

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.proj_out = nn.Linear(32, 64), nn.Linear(64, 48, bias=False)

        def get_output_embeddings(self) -> nn.Module:
            return self.proj_out

    model = Tiny()
    assert quantize_model(model) == 1
    assert isinstance(model.up, Fp8Linear) and type(model.proj_out) is nn.Linear
