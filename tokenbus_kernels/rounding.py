"""What the fused elementwise kernels (norm.py, rope.py, activation.py) share: rounding an fp32 value to the
model dtype where eager PyTorch rounds, so that fp16/bf16 results follow Hugging Face's arithmetic.

Eager PyTorch computes each fp16/bf16 op in fp32 and rounds its result to nearest-even; a fused kernel that
kept everything in fp32 would be (slightly) more accurate but would not match the model it replaces.
The kernels launch with enable_fp_fusion=False: otherwise LLVM contracts `rounded(a * b) - c` into one
(bf16) fma on the GPU, which skips the product's rounding.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rounded(x, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 x rounded to nearest-even in `dtype`, returned as fp32 (exactly representable in dtype).

    SOFT_BF16 rounds bf16 with integer ops: Triton 3.9's interpreter converts fp32 -> bf16 by truncating the
    mantissa (also when asked for "rtne"). The GPU's conversion is already round-to-nearest-even.
    """
    if dtype == tl.float32:
        y = x
    elif SOFT_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        y = bits.to(tl.float32, bitcast=True)
    else:
        y = x.to(dtype).to(tl.float32)
    return y
