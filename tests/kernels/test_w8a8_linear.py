"""W8A8 int8 (worker/engine/quant/schemes.py): the C++ VNNI panel kernel (tokenbus_kernels/csrc/cpu_w8a8.cpp) against an
independent PyTorch reference — x quantized per row and group of 64 features as the kernel does
(quantize_activations_int8), each group's integer product in int64, the scales applied in float64 — on
awkward shapes, on the AVX-512 VNNI build and an AVX2 (AVX-VNNI) build of the same source; CpuLinear around it
on both its paths."""

from __future__ import annotations

import pytest
import torch

from tests.support.kernel_cases import count_calls, int8_linear
from tokenbus_kernels import cpu
from worker.engine.backends.cpu_linear import PANEL_MAX_ROWS, CpuLinear, pack_panels_w8a8
from worker.engine.quant.schemes import W8A8_GROUP, quantize_activations_int8, quantize_int8, round_activations_int8

ROWS = [1, 3, 16, 17, 40, 64]


def reference_terms(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each activation group's exact contribution to y, float64 [groups, rows, out]."""
    codes, sx = quantize_activations_int8(x)
    terms = []
    for g in range(sx.shape[1]):
        cols = slice(g * W8A8_GROUP, (g + 1) * W8A8_GROUP)
        acc = codes[:, cols].long() @ qweight[:, cols].long().T  # exact
        terms.append(acc.double() * sx[:, g : g + 1].double() * scale.double()[None, :])
    return torch.stack(terms)


def assert_within_fp32_rounding(out: torch.Tensor, x: torch.Tensor, q, bias: torch.Tensor | None, what: str) -> None:
    """The int32 sums are exact; fp32 rounds each group's product with its scales and the sum over the groups, so
    the error is bounded by a few ulps of the sum of the terms' magnitudes (not of y, which may cancel)."""
    terms = reference_terms(x, q.qweight, q.scale)
    expected = terms.sum(dim=0) + (bias.double() if bias is not None else 0.0)
    bound = (terms.shape[0] + 4) * 2.0**-24 * (terms.abs().sum(dim=0) + expected.abs()) + 1e-7
    excess = (out.double() - expected).abs() - bound
    assert excess.max() <= 0, f"{what}: {int((excess > 0).sum())} outputs beyond fp32 rounding, worst at " \
        f"{divmod(int(excess.argmax()), out.shape[1])}: {float(out.flatten()[excess.argmax()])} vs " \
        f"{float(expected.flatten()[excess.argmax()])}"


def check_kernel(module, out_features: int, in_features: int, seed: int, bias: bool, rows_list=ROWS) -> None:
    gen = torch.Generator().manual_seed(seed)
    q = quantize_int8(torch.randn(out_features, in_features, generator=gen) * 0.05)
    panels, scales = pack_panels_w8a8(q.qweight, q.scale)
    b = torch.randn(out_features, generator=gen) if bias else None
    for rows in rows_list:
        wide = torch.randn(rows, in_features + 7, generator=gen) * torch.logspace(-2, 1, rows)[:, None]
        x = wide[:, 3 : 3 + in_features]  # strided rows of very different sizes, as a slice of a wider activation
        x[:, :: max(1, in_features // 3)] *= 50.0  # outlier features, as real activations have
        out = module.panel_linear_w8a8_cpu(x, panels, scales, out_features, b)
        assert_within_fp32_rounding(out, x, q, b, f"{rows} rows, {out_features}x{in_features}")


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
    assert_within_fp32_rounding(out, x, q, b, "a zero row among others")


def test_pack_panels_w8a8_layout():
    gen = torch.Generator().manual_seed(3)
    q = quantize_int8(torch.randn(20, 70, generator=gen))  # two activation groups: 64 inputs and 6
    panels, scales = pack_panels_w8a8(q.qweight, q.scale)
    assert panels.shape == (2, 18, 16, 4) and scales.shape == (3, 32)
    assert panels[1, 17, 2, 1] == q.qweight[18, 69] and panels[1, 17, 2, 2] == 0  # column 16 + 2, input 68 + 1
    assert torch.equal(panels[1, :, 4:], torch.zeros(18, 12, 4, dtype=torch.int8))  # columns past 20
    assert torch.equal(scales[0, :20], q.scale) and torch.equal(scales[0, 20:], torch.ones(12))
    assert torch.equal(scales[1, :20], q.qweight[:, :64].sum(dim=1).float())
    assert torch.equal(scales[2, :20], q.qweight[:, 64:].sum(dim=1).float())
    assert torch.equal(scales[1:, 20:], torch.zeros(2, 12))


@pytest.mark.slow  # builds a second copy of the extension (~1-3 min) the first time on a machine, cached afterwards
def test_w8a8_kernel_avx2_path_equals_integer_reference():
    """The AVX-VNNI path (two ymm per row, 6-row tiles) compiled with -mno-avx512f where the machine has
    AVX-512; the plain C++ sums where it has no AVX-VNNI either."""
    module = cpu.extension(avx2_only=True)
    assert module is not None
    check_kernel(module, 49, 70, seed=5, bias=True, rows_list=range(1, 20))
    check_kernel(module, 1536, 576, seed=6, bias=False)


class WithoutVnni:
    """The real extension, reporting a CPU without VNNI: what CpuLinear then chooses (the kernels run as built)."""

    def __init__(self, ext) -> None:
        self.ext = ext

    def __getattr__(self, name: str):
        return getattr(self.ext, name)

    def w8a8_native_cpu(self) -> bool:
        return False


@pytest.mark.parametrize("vnni", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 16, 64, 65, 130, 300])
def test_cpu_linear_w8a8_kernel_or_onednn(ext, rows, vnni):
    """CpuLinear of a W8A8 linear: with VNNI the kernel at every row count (300: two chunks of rows) and no oneDNN
    copy of the weight; without, the kernel up to PANEL_MAX_ROWS rows and oneDNN on the rounded activations and
    the dequantized weight beyond. Every path equals F.linear of the same."""
    if vnni and not ext.w8a8_native_cpu():
        pytest.skip("this CPU has no VNNI")
    linear = int8_linear(rows, w8a8=True)
    gen = torch.Generator().manual_seed(rows + 1000)
    cpu_linear = CpuLinear(linear, ext if vnni else WithoutVnni(ext))
    assert cpu_linear.panels.shape == (5, 50, 16, 4) and cpu_linear.scales.shape == (5, 80)
    assert (cpu_linear.packed_weight is None) == vnni
    calls = count_calls(cpu_linear, "panel_linear_w8a8_cpu")
    x = torch.randn(rows, 200, generator=gen)
    with torch.inference_mode():
        out = cpu_linear(x)
    expected = torch.nn.functional.linear(round_activations_int8(x), linear.weight, linear.bias)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert calls == ([rows] if vnni or rows <= PANEL_MAX_ROWS else [])


def test_bad_w8a8_input_is_refused_with_a_reason(ext):
    q = quantize_int8(torch.randn(32, 64))
    panels, scales = pack_panels_w8a8(q.qweight, q.scale)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"W8A8 packing"):
        ext.panel_linear_w8a8_cpu(torch.randn(2, 68), panels, scales, 32, None)
    with pytest.raises(RuntimeError, match="the weight scales, then the column sums"):
        ext.panel_linear_w8a8_cpu(x, panels, scales[0].contiguous(), 32, None)
    # a per-row packing (one column-sum row) for 70 inputs, which need two activation groups
    q70 = quantize_int8(torch.randn(32, 70))
    panels70, scales70 = pack_panels_w8a8(q70.qweight, q70.scale)
    with pytest.raises(RuntimeError, match=r"column sums of each group of 64 inputs"):
        ext.panel_linear_w8a8_cpu(torch.randn(2, 70), panels70, scales70[:2].contiguous(), 32, None)
