"""The FP8 linear (tokenbus_kernels/fp8_linear.py) on the CPU: torch._scaled_mm's CPU build, with the per-token
activation and per-channel weight scales the GPU path passes it, equals the fp32 reference within fp32
rounding on awkward shapes; the quantizers keep their contract (scale = max|row| / 448, no overflow, zero
rows). The same call runs on CUDA sm_89+ (PyTorch's CUTLASS rowwise kernel): gpu_check stage q
(gpu_check/fp8.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenbus_kernels.fp8_linear import (
    FP8,
    FP8_MAX,
    dequantize_weight,
    fp8_linear,
    fp8_linear_reference,
    quantize_rows,
    quantize_weight,
    scaled_mm_takes,
)

SHAPES = [(1, 64, 48), (3, 40, 24), (17, 130, 70), (64, 128, 384)]  # (M, K, N): K and N not all 16-divisible


def _operands(m: int, k: int, n: int, seed: int, bias: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4  # rows of different ranges
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 0.2
    b = torch.randn(n, generator=gen) if bias else None
    return x, w, b


def test_quantize_rows_contract():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [1e-3, 3e4, -7.0]])
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (3, 1) and scale.dtype == torch.float32
    assert torch.allclose(scale[[0, 2]], x[[0, 2]].abs().amax(1, keepdim=True) / FP8_MAX)
    assert q.float().abs().max() <= FP8_MAX and not torch.isnan(q.float()).any()  # the max maps to 448, no NaN
    assert torch.equal(q[1].float(), torch.zeros(3))  # an all-zero row: zeros, a finite scale
    # e4m3 keeps 3 mantissa bits: each element within half a step (1/16 relative) of where it was
    deq = q.float() * scale
    big = x.abs() > scale * 2**-6  # normal range of the row's e4m3
    assert ((deq - x).abs()[big] <= x.abs()[big] / 16 + 1e-9).all()


def test_quantize_weight_round_trip():
    _, w, _ = _operands(1, 70, 33, 0, False)
    qweight, w_scale = quantize_weight(w)
    assert qweight.shape == w.shape and w_scale.shape == (33,)
    err = (dequantize_weight(qweight, w_scale) - w).abs() / w.abs().amax(1, keepdim=True)
    assert err.max() <= 16 / FP8_MAX + 1e-6  # half of e4m3's step at the top of the range (32 in [256, 448])


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_equals_reference_fp32(m, k, n, bias):
    x, w, b = _operands(m, k, n, m * 7 + n, bias)
    qweight, w_scale = quantize_weight(w)
    out = fp8_linear(x, qweight, w_scale, b)
    ref = fp8_linear_reference(x, qweight, w_scale, b)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # and the reference is the layer it quantizes: within e4m3's error of x · Wᵀ
    exact = F.linear(x, w, b)
    assert ((ref - exact).norm() / exact.norm()) < 0.06


@pytest.mark.parametrize("m,k,n", SHAPES[1:3])
def test_fp8_linear_bf16_activations(m, k, n):
    x, w, b = _operands(m, k, n, 3, True)
    x, b = x.bfloat16(), b.bfloat16()
    qweight, w_scale = quantize_weight(w)
    out = fp8_linear(x, qweight, w_scale, b)
    ref = fp8_linear_reference(x, qweight, w_scale, b)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


def test_fp8_linear_keeps_leading_dims():
    x, w, _ = _operands(6, 32, 16, 5, False)
    qweight, w_scale = quantize_weight(w)
    out = fp8_linear(x.view(2, 3, 32), qweight, w_scale)
    torch.testing.assert_close(out.view(6, 16), fp8_linear(x, qweight, w_scale))


def test_cublas_shape_rule():
    assert scaled_mm_takes("cpu", 24, 40)  # the CPU build takes any shape
    assert scaled_mm_takes("cuda", 48, 64) and not scaled_mm_takes("cuda", 24, 40)
    assert not scaled_mm_takes("cuda", 48, 40)  # K too
