"""Triton kernel: the SwiGLU activation on the fused gate_up projection output (and Gemma's GeGLU).

silu_and_mul_triton(gate_up, out=None) -> out
  gate_up  [num_tokens, 2 * inter]: gate in the first half of each row, up in the second (any strides)
  out      [num_tokens, inter], gate_up's dtype (any strides); allocated contiguous if None
  out = silu(gate) * up, silu(g) = g / (1 + exp(-g)) in fp32, rounded to the dtype before the product and
  after it, as eager `F.silu(gate) * up` rounds.

gelu_tanh_and_mul_triton(gate_up, out=None) -> out: the same with gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi)
  (g + 0.044715 g^3))) in place of silu (Gemma 2/3's gelu_pytorch_tanh); the GELU constexpr picks the variant.

One pass instead of eager PyTorch's two ops (silu, mul) and their intermediate [num_tokens, inter] tensor.
Grid (num_tokens, cdiv(inter, BLOCK)); BLOCK and the warps depend on `inter` only, nothing is read back to the
host (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenbus_kernels.launch import Launch, check_launchable
from tokenbus_kernels.rounding import rounded

MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_gn, stride_gd, stride_on, stride_od, inter,
    BLOCK: tl.constexpr, SOFT_BF16: tl.constexpr, GELU: tl.constexpr,
):
    """Grid (num_tokens, cdiv(inter, BLOCK)): BLOCK columns of one row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate_ptrs = gate_up_ptr + row * stride_gn + cols * stride_gd
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + inter * stride_gd, mask=mask, other=0.0).to(tl.float32)
    dtype = gate_up_ptr.dtype.element_ty
    if GELU:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi) (g + 0.044715 g^3)
        act = rounded(0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)), dtype, SOFT_BF16)  # 1 + tanh
    else:
        act = rounded(gate / (1.0 + tl.exp(-gate)), dtype, SOFT_BF16)
    out = rounded(act * up, dtype, SOFT_BF16)
    tl.store(out_ptr + row * stride_on + cols * stride_od, out.to(out_ptr.dtype.element_ty), mask=mask)


def plan_silu_and_mul(
    gate_up: torch.Tensor, out: torch.Tensor, on_gpu: bool, block: int | None = None, gelu: bool = False
) -> list[Launch]:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_and_mul: gate_up {tuple(gate_up.shape)} must be [n, 2 * inter]")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out.shape != (num_tokens, inter) or out.dtype != gate_up.dtype:
        raise ValueError(f"silu_and_mul: out {tuple(out.shape)} {out.dtype} must be [{num_tokens}, {inter}] "
                         f"{gate_up.dtype}")
    if out.numel() == 0:
        return []
    block = block or min(MAX_BLOCK, triton.next_power_of_2(inter))
    args = (gate_up, out, *gate_up.stride(), *out.stride(), inter)
    # 4 warps: 8 elements a thread at BLOCK 1024, i.e. one 16-byte load per half-precision operand
    meta = {"BLOCK": block, "SOFT_BF16": not on_gpu, "GELU": gelu, "num_warps": 4, "enable_fp_fusion": False}
    return [Launch(_silu_and_mul_kernel, (num_tokens, triton.cdiv(inter, block)), args, meta)]


def silu_and_mul_triton(
    gate_up: torch.Tensor, *, out: torch.Tensor | None = None, block: int | None = None
) -> torch.Tensor:
    """silu(gate) * up [n, inter] from gate_up [n, 2 * inter], in `out` if given; see the module doc.
    `block` (a power of two) forces the column tile, for tests."""
    check_launchable(_silu_and_mul_kernel, gate_up)
    if out is None:
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype, device=gate_up.device)
    for launch in plan_silu_and_mul(gate_up, out, gate_up.is_cuda, block):
        launch()
    return out


def gelu_tanh_and_mul_triton(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu_tanh(gate) * up [n, inter] from gate_up [n, 2 * inter] (Gemma's GeGLU); see the module doc."""
    check_launchable(_silu_and_mul_kernel, gate_up)
    if out is None:
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype, device=gate_up.device)
    for launch in plan_silu_and_mul(gate_up, out, gate_up.is_cuda, gelu=True):
        launch()
    return out
