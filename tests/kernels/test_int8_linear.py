"""Weight-only int8 (worker/engine/quant/schemes.py): the C++ int8 panel kernel (tokenbus_kernels/csrc/cpu_quant.cpp) on
its AVX-512 and AVX2 paths, and CpuLinear around it, against F.linear on the dequantized weight (the model an
int8 engine serves) on fresh random inputs of awkward shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.kernel_cases import count_calls, int8_linear
from tokenbus_kernels import cpu
from worker.engine.backends.cpu_linear import PANEL_MAX_ROWS, CpuLinear, pack_panels
from worker.engine.quant.schemes import INT8_MAX, check_int8_layout, quantize_int8


def padded_scales(scale: torch.Tensor) -> torch.Tensor:
    out = torch.ones(-(-scale.numel() // 16) * 16)
    out[: scale.numel()] = scale
    return out


def test_quantize_int8_is_symmetric_per_output_channel():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 53, generator=gen) * torch.logspace(-3, 1, 37)[:, None]  # rows of very different size
    weight[5] = 0.0  # an all-zero row must not divide by zero
    q = quantize_int8(weight)
    assert q.qweight.dtype == torch.int8 and q.scale.shape == (37,) and q.scale.dtype == torch.float32
    assert int(q.qweight.abs().amax(dim=1)[6]) == INT8_MAX  # each nonzero row uses the full range
    assert torch.equal(q.qweight[5], torch.zeros(53, dtype=torch.int8))
    error = (q.dequantize() - weight).abs()
    assert bool((error <= q.scale[:, None] / 2 * (1 + 1e-5)).all()), "more than half a step off"


def check_kernel(module, rows_list, out_features, in_features, seed, bias: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    q = quantize_int8(torch.randn(out_features, in_features, generator=gen) * 0.05)
    panels, scales = pack_panels(q.qweight), padded_scales(q.scale)
    b = torch.randn(out_features, generator=gen) if bias else None
    deq = q.dequantize()
    for rows in rows_list:
        wide = torch.randn(rows, in_features + 7, generator=gen)
        x = wide[:, 3 : 3 + in_features]  # strided rows, as a slice of a wider activation
        out = module.panel_linear_int8_cpu(x, panels, scales, out_features, b)
        # fp32 rounding: s·Σx·q against Σx·(q·s), in another summation order
        torch.testing.assert_close(out, F.linear(x, deq, b), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, rows=rows: f"{rows} rows: {m}")


def test_int8_kernel_every_tile_height_equals_dequantized_reference(ext):
    """GEMV (1 row) and GEMM (every tile height 1-16, tiles repeated past 16) with out not a multiple of 16,
    in_features not a multiple of the prefetch distance, and a bias."""
    check_kernel(ext, range(1, 71), 45, 1100, seed=1, bias=True)
    check_kernel(ext, [1, 6, 64], 577, 96, seed=2, bias=False)


@pytest.mark.slow  # builds a second copy of the extension (~32 s) the first time on a machine, cached afterwards
def test_int8_kernel_avx2_path_equals_dequantized_reference():
    """The AVX2 path (two ymm per row, 6-row tiles) compiled with -mno-avx512f, where the machine has AVX-512;
    on an AVX2-only machine this is the ordinary build."""
    module = cpu.extension(avx2_only=True)
    assert module is not None
    check_kernel(module, range(1, 20), 45, 1100, seed=3, bias=True)


@pytest.mark.parametrize("rows", [1, 7, 16, 64, 65, 130])
def test_cpu_linear_int8_panels_then_onednn(ext, rows):
    """CpuLinear of an int8 linear: int8 panels up to PANEL_MAX_ROWS rows, oneDNN on the dequantized weight
    beyond; both equal F.linear on the dequantized weight."""
    linear = int8_linear(rows, w8a8=False)
    gen = torch.Generator().manual_seed(rows + 1000)
    cpu_linear = CpuLinear(linear, ext)
    assert cpu_linear.panels.dtype == torch.int8 and cpu_linear.scales.shape == (80,)
    calls = count_calls(cpu_linear, "panel_linear_int8_cpu")
    x = torch.randn(rows, 200, generator=gen)
    with torch.inference_mode():
        out = cpu_linear(x)
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    assert calls == ([rows] if rows <= PANEL_MAX_ROWS else [])


def test_bad_int8_input_is_refused_with_a_reason(ext):
    q = quantize_int8(torch.randn(32, 64))
    panels = pack_panels(q.qweight)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="scales must be float32, one per output channel"):
        ext.panel_linear_int8_cpu(x, panels, q.scale[:20].contiguous(), 32, None)
    with pytest.raises(RuntimeError, match="int8"):
        ext.panel_linear_int8_cpu(x, pack_panels(q.dequantize()), padded_scales(q.scale), 32, None)
    with pytest.raises(ValueError, match=r"mismatched layout.*one per output channel"):
        check_int8_layout("lm_head", q.qweight, q.scale[:, None], q.qweight.shape)
