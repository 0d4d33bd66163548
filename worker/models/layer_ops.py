"""The elementwise parts of a decoder layer: RMSNorm (with the residual add folded in), SiLU·mul and RoPE.

On the CPU in float32 each is one pass of the C++ kernels (kernels/cpu.py); everywhere else (CUDA, other
dtypes, or no C++ build) the PyTorch versions below run, which are Hugging Face's arithmetic. A decode step's
tensors are a few rows wide, so on the CPU the eager version's cost was its 4-8 ops per call, not the math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 2 and (ext := cpu.usable(x)) is not None:
        return ext.rms_norm_cpu(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # normalise in fp32, scale in the model dtype, as Hugging Face does
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x). On the CPU path both happen in place, in x and residual."""
    if x.is_contiguous() and (ext := cpu.usable(x)) is not None:
        ext.add_rms_norm_cpu(x, residual, weight, eps)
        return x, residual
    residual = residual + x
    return rms_norm_ref(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2 * inter] -> silu(gate) * up, [n, inter]."""
    if (ext := cpu.usable(gate_up)) is not None:
        return ext.silu_and_mul_cpu(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, hq, d], k [n, hk, d]; cos, sin [n, 1, d]. The CPU path rotates q and k in place."""
    if cos.is_contiguous() and (ext := cpu.usable(q)) is not None and k.stride(-1) == 1:
        ext.rotary_cpu(q, k, cos, sin)
        return q, k
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
