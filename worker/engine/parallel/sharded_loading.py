"""Sharded loading: what a model must be for tensor parallelism (checked on rank 0 before any rank starts),
each rank's slices of the safetensors files, and the weight memory a rank holds.

Only safetensors can be read a slice at a time (safe_open's get_slice reads just those bytes), so only
a checkpoint directory of *.safetensors shards: a GGUF file (when its dequantized copy could not be cached),
PyTorch .bin files, transformers' fallback modeling code and FP8 checkpoints are refused, each saying what to
use instead. The built-in smollm2-135m is dequantized into a safetensors directory once and loads that
way, but its 9 heads (3 KV heads) split only 3 ways: TpShard checks the shapes.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from worker.engine.parallel.shard import TpShard
from worker.engine.quant.schemes import W8A8_GROUP


def safetensors_files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "*.safetensors")))


def check_shardable(source: Any, arch: Any, model_path: str, hf_config: Any, size: int,
                    quantization: str | None = None) -> TpShard:
    """Rank 0's shard, or ValueError saying why this model cannot be split `size` ways and what to do. Every
    refusal comes here, before any other rank starts."""
    why = None
    if model_path != "native":
        why = (f"its type {arch.model_type!r} is served by transformers' own modeling code, which has no "
               "sharded layers; tensor parallelism serves tokenbus's native families (Llama, Qwen, Mistral, "
               "Gemma, Phi-3, Mixtral, Qwen3-MoE)")
    elif not getattr(arch, "causal", True):
        why = (f"it is an encoder ({arch.model_type}: embeddings only), whose layers have no sharded form; a small "
               "encoder fits one device: serve it with tensor_parallel_size 1")
    elif source.gguf_file:
        why = (f"it is a GGUF file ({source.gguf_file}), which cannot be read a slice at a time: convert it to a "
               "safetensors checkpoint directory (or let the cache directory be writable, so tokenbus "
               "dequantizes it into one)")
    elif not safetensors_files(source.directory):
        why = (f"{source.directory!r} has no *.safetensors files (only safetensors can be read a slice per "
               "rank): save the checkpoint with safetensors")
    elif getattr(hf_config, "quantization_config", None):
        why = ("it is a quantized (FP8) checkpoint, whose scale tensors are not sliced per rank yet: serve "
               "the unquantized checkpoint with --quantization fp8 (weights quantized per rank at load)")
    if why:
        raise ValueError(f"model {source.name!r} cannot be served with tensor_parallel_size {size}: {why}")
    shard = TpShard.of(arch, 0, size)
    if shard.vocab_per_rank * (size - 1) >= shard.vocab_size:
        raise ValueError(f"a vocabulary of {shard.vocab_size} tokens is too small to split over {size} ranks")
    # W8A8 rounds each linear's input per group of W8A8_GROUP features: a row-parallel shard whose input is not
    # a whole number of groups would group its features otherwise than the unsharded model does
    widths = {shard.local_heads * shard.head_dim, shard.intermediate_size // size,
              shard.moe_intermediate_size // size} - {0}
    if quantization == "w8a8" and any(w % W8A8_GROUP for w in widths):
        raise ValueError(f"w8a8 with tensor_parallel_size {size} needs each rank's o_proj / down_proj input width "
                         f"to be a multiple of {W8A8_GROUP} (its activation groups); this model's are "
                         f"{sorted(widths)}: use --quantization int8, or a size that leaves whole groups")
    return shard


def weights(tp: Any) -> Callable[[Any], Iterator[tuple[str, torch.Tensor]]]:
    """The loader's iter_weights for this rank: each tensor as the slice the rank holds."""
    return lambda source: tp.shard.iter_weights(safetensors_files(source.directory))


def model_bytes(model: torch.nn.Module) -> int:
    """The weights and persistent buffers a model holds (shared tensors once; the rope tables excluded)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *(b for name, b in model.named_buffers() if "rotary" not in name)]:
        if t.data_ptr() not in seen and t.device.type != "meta":
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def checkpoint_bytes(directory: str, shard: TpShard) -> tuple[int, int]:
    """(every tensor's bytes, the bytes each rank holds whole: tensors the shard does not cut, and the K/V
    projections when KV heads are replicated), read from the files' headers only."""
    from safetensors import safe_open

    total = replicated = 0
    for path in safetensors_files(directory):
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                shape = piece.get_shape()
                size = int(torch.tensor(shape).prod().item()) if shape else 1
                nbytes = size * _itemsize(piece.get_dtype())
                total += nbytes
                kv = shard.kv_replicated and ("k_proj" in name or "v_proj" in name)
                if shard.cut(name, shape) is None or kv:
                    replicated += nbytes
    return total, replicated


def _itemsize(dtype: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}.get(dtype, 1)
