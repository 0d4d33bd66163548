"""W8A8 int8 (worker/engine/quantization.py): the C++ VNNI panel kernel (kernels/csrc/cpu_w8a8.cpp) against an
independent PyTorch reference — x quantized per row as the kernel does (quantize_rows_int8), the integer
product in int64, the scales applied in float64 — on awkward shapes, on the AVX-512 VNNI build and an AVX2
(AVX-VNNI) build of the same source; CpuLinear around it on both its paths."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu
from tests.support.kernel_cases import count_calls, int8_linear
from worker.engine.backends.cpu_linear import PANEL_MAX_ROWS, CpuLinear, pack_panels_w8a8
from worker.engine.quantization import quantize_int8, quantize_rows_int8, round_rows_int8

ROWS = [1, 3, 16, 17, 40, 64]


@pytest.fixture(scope="module")
def ext():
    module = cpu.extension()
    assert module is not None, "the C++ CPU kernels did not build (see the cpu_kernels_unavailable warning)"
    return module


def reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    codes, sx = quantize_rows_int8(x)
    acc = codes.long() @ qweight.long().T  # exact
    y = acc.double() * sx.double() * scale.double()[None, :]
    return (y + bias.double() if bias is not None else y).float()


def check_kernel(module, out_features: int, in_features: int, seed: int, bias: bool, rows_list=ROWS) -> None:
    gen = torch.Generator().manual_seed(seed)
    q = quantize_int8(torch.randn(out_features, in_features, generator=gen) * 0.05)
    panels, scales = pack_panels_w8a8(q.qweight, q.scale)
    b = torch.randn(out_features, generator=gen) if bias else None
    for rows in rows_list:
        wide = torch.randn(rows, in_features + 7, generator=gen) * torch.logspace(-2, 1, rows)[:, None]
        x = wide[:, 3 : 3 + in_features]  # strided rows of very different sizes, as a slice of a wider activation
        out = module.panel_linear_w8a8_cpu(x, panels, scales, out_features, b)
        # the int32 sums are exact; fp32 rounds them (above 2^24) and the two scale products
        torch.testing.assert_close(out, reference(x, q.qweight, q.scale, b), rtol=2e-6, atol=1e-6,
                                   msg=lambda m, rows=rows: f"{rows} rows, {out_features}x{in_features}: {m}")


@pytest.mark.parametrize(("out_features", "in_features", "bias"),
                         [(49, 70, True), (49, 70, False), (1536, 576, True), (576, 1536, False), (16, 3, True)])
def test_w8a8_kernel_equals_integer_reference(ext, out_features, in_features, bias):
    """Every tile height of interest (1, 3, 16, 17: a full tile and one more, 40, 64), in_features not a multiple
    of 4 or 16, out_features not a multiple of 16."""
    check_kernel(ext, out_features, in_features, seed=out_features + in_features, bias=bias)


def test_w8a8_kernel_every_tile_height(ext):
    check_kernel(ext, 45, 1101, seed=7, bias=True, rows_list=range(1, 35))


def test_an_all_zero_row_gives_the_bias_not_nan(ext):
    gen = torch.Generator().manual_seed(11)
    q = quantize_int8(torch.randn(49, 70, generator=gen))
    panels, scales = pack_panels_w8a8(q.qweight, q.scale)
    b = torch.randn(49, generator=gen)
    x = torch.randn(5, 70, generator=gen)
    x[2] = 0.0
    out = ext.panel_linear_w8a8_cpu(x, panels, scales, 49, b)
    assert not out.isnan().any()
    assert torch.equal(out[2], b)
    torch.testing.assert_close(out, reference(x, q.qweight, q.scale, b), rtol=2e-6, atol=1e-6)


def test_pack_panels_w8a8_layout():
    gen = torch.Generator().manual_seed(3)
    q = quantize_int8(torch.randn(20, 7, generator=gen))
    panels, scales = pack_panels_w8a8(q.qweight, q.scale)
    assert panels.shape == (2, 2, 16, 4) and scales.shape == (2, 32)
    assert panels[1, 1, 2, 2] == q.qweight[18, 6] and panels[1, 1, 2, 3] == 0  # column 16 + 2, input 4 + 2
    assert torch.equal(panels[1, :, 4:], torch.zeros(2, 12, 4, dtype=torch.int8))  # columns past 20
    assert torch.equal(scales[1, :20], q.qweight.sum(dim=1).float()) and torch.equal(scales[0, :20], q.scale)


@pytest.mark.slow  # builds a second copy of the extension (~1-3 min) the first time on a machine, cached afterwards
def test_w8a8_kernel_avx2_path_equals_integer_reference():
    """The AVX-VNNI path (two ymm per row, 6-row tiles) compiled with -mno-avx512f where the machine has
    AVX-512; the plain C++ sums where it has no AVX-VNNI either."""
    module = cpu.extension(avx2_only=True)
    assert module is not None
    check_kernel(module, 49, 70, seed=5, bias=True, rows_list=range(1, 20))
    check_kernel(module, 1536, 576, seed=6, bias=False)


@pytest.mark.parametrize("rows", [1, 7, 16, 64, 65, 130])
def test_cpu_linear_w8a8_panels_then_onednn(ext, rows):
    """CpuLinear of a W8A8 linear: the kernel up to PANEL_MAX_ROWS rows, oneDNN on the rounded activations and
    the dequantized weight beyond; both equal F.linear of the same."""
    linear = int8_linear(rows, w8a8=True)
    gen = torch.Generator().manual_seed(rows + 1000)
    cpu_linear = CpuLinear(linear, ext)
    assert cpu_linear.panels.shape == (5, 50, 16, 4) and cpu_linear.scales.shape == (2, 80)
    calls = count_calls(cpu_linear, "panel_linear_w8a8_cpu")
    x = torch.randn(rows, 200, generator=gen)
    with torch.inference_mode():
        out = cpu_linear(x)
    expected = torch.nn.functional.linear(round_rows_int8(x), linear.weight, linear.bias)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert calls == ([rows] if rows <= PANEL_MAX_ROWS else [])


def test_bad_w8a8_input_is_refused_with_a_reason(ext):
    q = quantize_int8(torch.randn(32, 64))
    panels, scales = pack_panels_w8a8(q.qweight, q.scale)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"W8A8 packing"):
        ext.panel_linear_w8a8_cpu(torch.randn(2, 68), panels, scales, 32, None)
    with pytest.raises(RuntimeError, match="the weight scales, then the column sums"):
        ext.panel_linear_w8a8_cpu(x, panels, scales[0].contiguous(), 32, None)
