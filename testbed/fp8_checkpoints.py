"""Tiny FP8 checkpoints written the way the two formats lay them out (worker/engine/quant/fp8_checkpoint.py), from
an unquantized tiny model: the decoder's linears as float8_e4m3fn with their scales, the rest unchanged, and
beside it the same model dequantized (fp32 weights equal to weight · scale), which Hugging Face `generate`
runs as the reference.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")


def _quantize(w: torch.Tensor, strategy: str, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale in the format's layout) and nothing else: the writers' recipe, not the loader's."""
    n, k = w.shape
    if strategy == "tensor":
        scale = (w.abs().max() / FP8_MAX).reshape(1)
        full = scale.expand(n, k)
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        full = scale.expand(n, k)
    else:
        bn, bk = block
        rows, cols = -(-n // bn), -(-k // bk)
        padded = torch.zeros(rows * bn, cols * bk)
        padded[:n, :k] = w.abs()
        scale = padded.view(rows, bn, cols, bk).amax(dim=(1, 3)) / FP8_MAX
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.float().contiguous()


def write_fp8(
    source: str,
    target: str,
    method: str,
    strategy: str,
    block: tuple[int, int] | None = None,
    input_scale: bool = False,
) -> tuple[str, str]:
    """An FP8 copy of the checkpoint `source` in `target` (method 'compressed-tensors' or 'fp8'), and its
    dequantized fp32 twin in `target`-dequantized. Returns (fp8 dir, dequantized dir)."""
    from safetensors.torch import load_file, save_file

    twin = target.rstrip("/") + "-dequantized"
    for d in (target, twin):
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(source):
            if not f.endswith(".safetensors") and os.path.isfile(os.path.join(source, f)):
                shutil.copy(os.path.join(source, f), d)
    tensors = {}
    for path in sorted(glob.glob(os.path.join(source, "*.safetensors"))):
        tensors.update(load_file(path))
    fp8_tensors, dequantized = {}, {}
    scale_name = "weight_scale_inv" if method == "fp8" and strategy == "block" else "weight_scale"
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and prefix.rpartition(".")[2] in QUANTIZED:
            q, scale = _quantize(t.float(), strategy, block)
            fp8_tensors[name], fp8_tensors[f"{prefix}.{scale_name}"] = q, scale
            if input_scale:
                fp8_tensors[f"{prefix}.input_scale"] = torch.tensor([0.05])
            full = (
                scale
                if strategy != "block"
                else scale.repeat_interleave(block[0], 0)[: t.shape[0]].repeat_interleave(block[1], 1)[:, : t.shape[1]]
            )
            dequantized[name] = q.float() * full
        else:
            fp8_tensors[name] = dequantized[name] = t
    save_file(fp8_tensors, os.path.join(target, "model.safetensors"))
    save_file(dequantized, os.path.join(twin, "model.safetensors"))
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(method, strategy, block, input_scale)
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(config, f)
    return target, twin


def quantization_config(method: str, strategy: str, block: tuple[int, int] | None, input_scale: bool) -> dict:
    if method == "fp8":
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static" if input_scale else "dynamic"}
        if strategy == "block":
            qc["weight_block_size"] = list(block)
        return qc
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    if strategy == "block":
        weights["block_structure"] = list(block)
    activations = {
        "num_bits": 8,
        "type": "float",
        "strategy": "tensor" if input_scale else "token",
        "symmetric": True,
        "dynamic": not input_scale,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
    }
