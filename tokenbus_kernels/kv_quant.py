"""Quantized KV caches (`--kv-cache-dtype`): the storage layout, and the PyTorch quantizer and dequantizer that
define what the C++ (tokenbus_kernels/csrc/cpu_attention.cpp) and Triton (kv_write.py, rope.py, decode_attention.py,
prefill_attention.py) kernels store and read.

Storage dtype of a cache tensor, and what it means:
  float32, bfloat16, float16   plain values, [num_blocks, block_size, num_kv_heads, head_dim]
  int8                         symmetric int8 (CPU), [num_blocks, block_size, num_kv_heads, head_dim + 4]
  float8_e4m3fn                fp8 e4m3 (CUDA), the same layout
A quantized row (one token, one KV head) is its head_dim codes followed by the 4 bytes of its fp32 scale, so
row = codes * scale. int8: scale = max|x| / 127, codes = round(x / scale). fp8: scale = max|x| / 448 (e4m3's
largest finite value), codes = fp8(x / scale).

Why a scale per (token, KV head), stored inside the row:
  - a token's K and V are written once, when it is computed, and never again (a full block is then shared
    read-only by the prefix cache): a per-token scale is final at write time, where a scale per block would
    have to be re-chosen, and the block re-quantized, each time a larger value arrived;
  - keys carry per-head outlier channels of very different sizes: one scale across heads would waste most
    of the int8 range of the small ones;
  - inside the row, the scale arrives with the codes it scales (same cache lines, no second pointer), and
    the (k_cache, v_cache) pair every backend and model passes around stays two tensors.
The cost is 4 bytes per head_dim codes: at head_dim 64 an int8 row is 68 bytes against 256 in fp32 (3.8x
more tokens in the same memory), 132 against 512 at head_dim 128 (3.9x).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
QUANTIZED = (torch.int8, torch.float8_e4m3fn)
CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# --kv-cache-dtype names (worker/engine/config.py KV_CACHE_DTYPES) -> the cache tensors' dtype
STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
           "fp8": torch.float8_e4m3fn}


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in QUANTIZED


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row in a cache of this dtype (codes and scale bytes for quantized)."""
    return head_dim + SCALE_BYTES if dtype in QUANTIZED else head_dim


def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> tuple[int, int, int, int]:
    return (num_blocks, block_size, num_kv_heads, row_width(head_dim, dtype))


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V bytes of one token of context, all layers."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * row_width(head_dim, dtype) * elem


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> the packed rows [..., head_dim + 4] of a `dtype` cache."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # x * (limit / amax), not x / scale: the C++ kernel multiplies by the same fp32 reciprocal (same codes)
    inv = torch.where(amax > 0, CODE_MAX[dtype] / amax, torch.zeros_like(amax))
    scaled = xf * inv
    if dtype == torch.int8:
        codes = scaled.round().clamp(-127, 127).to(torch.int8)
    else:
        codes = scaled.clamp(-448.0, 448.0).to(dtype)
    scale = (amax / CODE_MAX[dtype]).contiguous()
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1).view(dtype)


def dequantize(packed: torch.Tensor) -> torch.Tensor:
    """Packed rows [..., head_dim + 4] (int8 or fp8) -> float32 [..., head_dim]; other dtypes: .float()."""
    if packed.dtype not in QUANTIZED:
        return packed.float()
    head_dim = packed.shape[-1] - SCALE_BYTES
    raw = packed.view(torch.uint8)
    scale = raw[..., head_dim:].contiguous().view(torch.float32)
    return raw[..., :head_dim].view(packed.dtype).float() * scale

