"""The seam between the model and the hardware: one backend object per engine, chosen once, runs every
kernel-level operation of a step (attention, KV writes, norms, RoPE, SiLU·mul, whole-layer fusions, argmax).

    ReferenceBackend  reference.py       PyTorch everywhere: the fallback, and the definition of correct
    TritonBackend     triton_kernels.py  CUDA (or TRITON_INTERPRET=1): paged attention in Triton
    CpuBackend        cpu.py             CPU float32: C++ kernels, panel linears, fused decode layers
"""

from __future__ import annotations

import torch

import tokenbus_kernels
from tokenbus_kernels import cpu as cpu_kernels
from worker.engine.backends.cpu import CpuBackend
from worker.engine.backends.reference import ReferenceBackend
from worker.engine.backends.triton_kernels import TritonBackend

Backend = ReferenceBackend  # the interface every backend implements

__all__ = ["Backend", "CpuBackend", "ReferenceBackend", "TritonBackend", "select_backend"]


def select_backend(device: torch.device | str, dtype: torch.dtype, cpu_kernels_enabled: bool = True,
                   cache_dir: str | None = None) -> ReferenceBackend:
    device = torch.device(device)
    if device.type == "cuda" or tokenbus_kernels.INTERPRET:
        return TritonBackend(interpreted=device.type != "cuda")
    if device.type == "cpu" and dtype == torch.float32 and cpu_kernels_enabled:
        ext = cpu_kernels.extension(cache_dir)
        if ext is not None:
            return CpuBackend(ext)
    return ReferenceBackend()
