"""The KV cache's dtype (`--kv-cache-dtype`, EngineConfig.kv_cache_dtype): which storage each device and backend
serves, refused at load with what to do otherwise, and the caches themselves (tokenbus_kernels/kv_quant.py has the
layouts: int8 and fp8 rows carry a scale per token and KV head).

    auto       the model's dtype (float32 on the CPU, bfloat16 on CUDA), as before
    bfloat16   half the bytes of float32: the CPU's C++ kernels widen it in registers
    int8       CPU: ~3.8x the tokens of float32 in the same memory; the C++ kernels (or the references)
    fp8        CUDA sm_89+ (and Triton's interpreter): e4m3; the Triton kernels quantize on write and
               dequantize in registers
"""

from __future__ import annotations

import torch

from tokenbus_kernels.kv_quant import STORAGE, bytes_per_token, cache_shape


def storage_dtype(name: str, device: torch.device, model_dtype: torch.dtype, backend_name: str) -> torch.dtype:
    """The cache tensors' dtype for `name`, or ValueError saying why this device or backend cannot serve it."""
    if name == "auto":
        return model_dtype
    dtype = STORAGE[name]
    triton = backend_name.startswith("triton")
    if name == "int8" and (device.type != "cpu" or triton):
        raise ValueError(
            f"kv_cache_dtype 'int8' is the CPU's (C++ kernels); this engine runs {backend_name} on {device.type}: "
            "on CUDA use --kv-cache-dtype fp8 (sm_89+) or auto"
        )
    if name == "fp8":
        if not triton:
            raise ValueError(
                f"kv_cache_dtype 'fp8' is the CUDA Triton kernels' (sm_89+); this engine runs {backend_name} on "
                f"{device.type}: on the CPU use --kv-cache-dtype int8 (or bfloat16)"
            )
        if device.type == "cuda" and model_dtype == torch.float32:
            raise ValueError("kv_cache_dtype 'fp8' on CUDA serves bfloat16 / float16 models (the tiles dequantize to "
                             "the model dtype): use --dtype bfloat16, or --kv-cache-dtype auto")
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            major, minor = torch.cuda.get_device_capability(device)
            raise ValueError(
                f"kv_cache_dtype 'fp8' needs a GPU with fp8 (sm_89+: L4, L40, H100, H200); this one is "
                f"sm_{major}{minor}: use --kv-cache-dtype auto"
            )
    return dtype


def bytes_per_block(arch, block_size: int, dtype: torch.dtype) -> int:
    """K and V bytes of one block, all layers, in a cache of this dtype."""
    return block_size * bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, dtype)


def allocate(arch, num_blocks: int, block_size: int, dtype: torch.dtype,
             device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer a zeroed (k_cache, v_cache) pair."""
    shape = cache_shape(num_blocks, block_size, arch.num_kv_heads, arch.head_dim, dtype)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(arch.num_layers)]
