"""Inputs and comparisons of the fused elementwise kernel tests (test_kernels_fused.py runs the kernels on
them; test_fused_checks.py shows the comparisons catch a wrong kernel and ties the references to transformers)."""

from __future__ import annotations

import torch

from tests.support.kernel_cases import DEVICE, case_id, generator

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# fp32 math (sum order, rsqrt, exp) may differ from PyTorch's by an ulp or two; half outputs then round alike
# except near a rounding boundary, so besides the tolerance at most MAX_MISMATCH of them may differ at all
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}
MAX_MISMATCH = 0.02  # skipping one of HF's roundings changes ~26% of half-precision outputs
EPS = 1e-5


def randn(*shape, gen, dtype, scale=1.0, device: str = DEVICE) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


def check_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within the dtype's tolerance, and in half precision equal but for a few rounding-boundary cases."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not torch.isnan(out).any(), "NaN in the kernel's output"
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), **TOL[out.dtype])
    if out.dtype != torch.float32:
        mismatch = (out.cpu() != ref.cpu()).float().mean().item()
        assert mismatch <= MAX_MISMATCH, f"{mismatch:.1%} of the outputs differ from the reference's rounding"


def check_equal(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit-exact: products of halves are exact in fp32 and each rounding is the reference's."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if not torch.equal(out.cpu(), ref.cpu()):
        diff = (out.float() - ref.float()).abs()
        raise AssertionError(f"{int((diff > 0).sum())} elements differ, max {diff.max().item():.3g}")


def wide_rows(
    n: int, width: int, gen, dtype, scale: torch.Tensor | float = 1.0, device: str = DEVICE
) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer [n, width + 5] of junk, view of its columns 2..width+2 holding random rows): strided rows."""
    buffer = randn(n, width + 5, gen=gen, dtype=torch.float32, device=device)
    buffer[:, 2 : width + 2] *= torch.as_tensor(scale, device=device)
    buffer = buffer.to(dtype)
    return buffer, buffer[:, 2 : width + 2]


def norm_inputs(n: int, hidden: int, dtype, case, device: str = DEVICE):
    gen = generator("norm", n, hidden, case_id(dtype), case)
    # rows from 1e-3 to 10 in scale, the residual's alike: at 1e-3 the mean square of residual + x (~5e-6) is
    # below eps, so eps matters
    scale = torch.logspace(-3, 1, n)[:, None] if n > 1 else 1e-3
    x_buf, x = wide_rows(n, hidden, gen, dtype, scale, device)
    res_buf, residual = wide_rows(n, hidden, gen, dtype, 2 * scale, device)
    weight = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    return x_buf, x, res_buf, residual, weight


def rope_tables(positions: torch.Tensor, head_dim: int, dtype, layout: str, gen, device: str = DEVICE):
    """cos, sin as RotaryEmbedding.cos_sin gives them ([n, 1, head_dim] in the model dtype), or [n, head_dim]
    views of a wider table, or random values (then the two halves of a row differ, unlike rope's)."""
    n = positions.shape[0]
    if layout == "random":
        return randn(n, head_dim, gen=gen, dtype=dtype, device=device), randn(n, head_dim, gen=gen, dtype=dtype,
                                                                              device=device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    emb = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((emb, emb), dim=-1)
    cos, sin = emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
    if layout == "cos_sin":
        return cos.unsqueeze(1), sin.unsqueeze(1)
    table = torch.cat((cos, sin), dim=-1)  # [n, 2 * head_dim]: strided row views
    return table[:, :head_dim], table[:, head_dim:]


def qkv_inputs(n, hq, hk, head_dim, dtype, layout, case, device: str = DEVICE):
    gen = generator("rope", n, hq, hk, head_dim, layout, case_id(dtype), case)
    # the fused projection's output
    qkv = randn(n, (hq + 2 * hk) * head_dim, gen=gen, dtype=dtype, scale=2.0, device=device)
    positions = torch.randint(0, 8192, (n,), generator=gen)
    cos, sin = rope_tables(positions, head_dim, dtype, layout, gen, device)
    return qkv, cos, sin, gen


def split(qkv: torch.Tensor, hq: int, hk: int, head_dim: int):
    heads = qkv.view(qkv.shape[0], hq + 2 * hk, head_dim)
    return heads[:, :hq], heads[:, hq : hq + hk], heads[:, hq + hk :]
