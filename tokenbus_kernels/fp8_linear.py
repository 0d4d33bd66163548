"""FP8 (e4m3) weight linears: y = x · Wᵀ + b with W stored as float8_e4m3fn and one fp32 scale per output
channel, the activations quantized to e4m3 per token at each call (dynamic).

    x             [M, K]  bf16/fp16/fp32 activations (any M; rows are tokens)
    qweight       [N, K]  float8_e4m3fn, row-major (one row per output channel): W[n] ≈ qweight[n] · w_scale[n]
    w_scale       [N]     float32
    bias          [N] or None, in x's dtype
    -> y          [M, N]  x's dtype

The GEMM is `torch._scaled_mm` (on CUDA sm_89+ with rowwise scales: PyTorch's CUTLASS f8f8bf16 rowwise
kernel; PyTorch's CPU build has one too, used by the tests and the CPU smoke run): A = the per-token e4m3 of
x, row-major [M, K], with its scales [M, 1]; B = qweight viewed as its transpose, column-major [K, N], with
the weight scales [1, N] ("rowwise" scaling: a scale per row of A and per column of B). The product
accumulates in fp32; each output is scaled by a_scale[m] · w_scale[n].
The CUDA kernel wants K and N multiples of 16; other shapes take `fp8_linear_reference`'s arithmetic.

`fp8_linear_reference` is the definition of correct: the same quantization of x, both operands dequantized
to fp32, an fp32 matmul. Per-tensor weight scales are served as per-channel ones (the scale repeated on every
row): the same numbers, one layout for the GEMM.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_SCALE = 1e-12  # an all-zero row still divides by something: its e4m3 is 0 whatever the scale


def quantize_rows(x: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per token, or per output channel for a weight) symmetric e4m3 of a [R, C] tensor:
    (q [R, C] float8_e4m3fn, scale [R, 1] float32) with x ≈ q · scale and scale = max|row| / 448. reduce: the
    rows' max |x| combined with the other parts of each row held elsewhere (a tensor-parallel row shard)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = ((reduce(amax) if reduce is not None else amax) / FP8_MAX).clamp_min(MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_weight(weight: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A float [N, K] weight as e4m3 with one scale per output channel: (qweight [N, K], w_scale [N])."""
    q, scale = quantize_rows(weight.detach(), reduce)
    return q, scale.view(-1)


def dequantize_weight(qweight: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The fp32 [N, K] weight an (e4m3, per-channel scale) pair stands for."""
    return qweight.float() * w_scale.float().view(-1, 1)


def fp8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """fp8_linear's arithmetic in fp32: dequantize the per-token e4m3 of x and the weight, multiply."""
    xq, x_scale = quantize_rows(x)
    y = (xq.float() * x_scale) @ dequantize_weight(qweight, w_scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def scaled_mm_takes(device_type: str, n: int, k: int) -> bool:
    """Whether torch._scaled_mm serves an [N, K] weight on this device: on CUDA, K and N multiples of 16."""
    return device_type != "cuda" or (k % 16 == 0 and n % 16 == 0)


def fp8_linear(
    x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y = x · (qweight · w_scale)ᵀ + bias through torch._scaled_mm, x quantized per token (module docstring)."""
    if not scaled_mm_takes(x.device.type, *qweight.shape):
        return fp8_linear_reference(x, qweight, w_scale, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_rows(x2)
    # rowwise scaling on CUDA produces bf16 only; the CPU build also gives fp32, kept for an fp32 model
    out_dtype = torch.float32 if x.device.type == "cpu" and x.dtype == torch.float32 else torch.bfloat16
    y = torch._scaled_mm(xq, qweight.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=out_dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).reshape(*lead, qweight.shape[0])
