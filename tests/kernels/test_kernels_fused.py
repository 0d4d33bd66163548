"""The fused elementwise Triton kernels (tokenbus_kernels/norm.py, rope.py, activation.py) against their references.

As in tests/kernels/test_kernels.py (see its docstring for why), the parent pytest process never sets
TRITON_INTERPRET: scripts/test runs this file in a pytest process of its own with TRITON_INTERPRET=1, where
the kernel tests run on CPU tensors. With a GPU the parent runs them on CUDA. The parent also compiles the
GPU launch plans for sm_90 without a GPU, ties the references to transformers' own code, and checks that
the comparisons below do catch the mistakes a kernel could make (wrong eps, no residual, a missed rounding).

Inputs are awkward on purpose: 1, 3, 5 and 37 rows, hidden sizes that are not powers of two (72, 576),
head_dim 64/80/128, GQA 9/3 and MQA, q/k/v as strided slices of one fused qkv tensor, rows of a wider
buffer whose other columns hold junk that must survive.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.fused_inputs import (
    DTYPES,
    EPS,
    check_close,
    check_equal,
    norm_inputs,
    qkv_inputs,
    randn,
    split,
    wide_rows,
)
from tests.support.kernel_cases import DEVICE, case_id, generator, needs_kernels
from tokenbus_kernels.reference import (
    add_rms_norm_ref,
    rms_norm_ref,
    rotary_ref,
    rotary_write_kv_ref,
    silu_and_mul_ref,
)

# (rows, hidden, block): block None = one pass; a block below hidden = the chunked two-pass path, with a tail
NORM_CASES = [(1, 576, None), (3, 576, 128), (37, 72, None), (5, 72, 32), (3, 4096, None)]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("n,hidden,block", NORM_CASES)
def test_add_rms_norm_matches_reference(dtype, n, hidden, block):
    from tokenbus_kernels.norm import add_rms_norm_triton

    x_buf, x, res_buf, residual, weight = norm_inputs(n, hidden, dtype, "add")
    ref_x_buf, ref_res_buf = x_buf.clone(), res_buf.clone()
    ref_x, ref_res = add_rms_norm_ref(ref_x_buf[:, 2 : hidden + 2], ref_res_buf[:, 2 : hidden + 2], weight, EPS)
    out, res_out = add_rms_norm_triton(x, residual, weight, EPS, block=block)
    assert out is x and res_out is residual  # the in-place contract
    check_equal(residual, ref_res)  # residual + x rounded once, as the eager add
    check_close(x, ref_x)
    junk = [slice(0, 2), slice(hidden + 2, None)]
    for cols in junk:  # columns outside the rows' views are not touched
        check_equal(x_buf[:, cols], ref_x_buf[:, cols])
        check_equal(res_buf[:, cols], ref_res_buf[:, cols])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("n,hidden,block", NORM_CASES[:4])
def test_rms_norm_matches_reference(dtype, n, hidden, block):
    from tokenbus_kernels.norm import rms_norm_triton

    x_buf, x, _, _, weight = norm_inputs(n, hidden, dtype, "plain")
    x_before = x_buf.clone()
    out = rms_norm_triton(x, weight, EPS, block=block)
    check_equal(x_buf, x_before)  # x is only read
    assert out.is_contiguous()
    ref = rms_norm_ref(x, weight, EPS)
    check_close(out, ref)
    rms_norm_triton(x, weight, EPS, out=x, block=block)  # in place
    check_close(x, ref)
    check_equal(x_buf[:, :2], x_before[:, :2])
    check_equal(x_buf[:, hidden + 2 :], x_before[:, hidden + 2 :])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
def test_rms_norm_per_head_on_qkv_slices(dtype):
    """Qwen3's q/k norm: [n, heads, head_dim] strided slices of the fused qkv output, one norm per head."""
    from tokenbus_kernels.norm import rms_norm_triton

    gen = generator("heads", case_id(dtype))
    n, hq, hk, head_dim = 5, 9, 3, 64
    heads = randn(n, hq + 2 * hk, head_dim, gen=gen, dtype=dtype, scale=3.0)
    weight = randn(head_dim, gen=gen, dtype=dtype)
    for view in (heads[:, :hq], heads[:, hq : hq + hk]):
        check_close(rms_norm_triton(view, weight, EPS), rms_norm_ref(view, weight, EPS))


# (tokens, num_heads, num_kv_heads, head_dim, cos/sin layout)
ROPE_CASES = [
    (3, 9, 3, 64, "cos_sin"),  # SmolLM2's heads
    (1, 14, 2, 64, "rows"),
    (5, 32, 8, 128, "cos_sin"),
    (19, 4, 1, 80, "rows"),  # MQA, head_dim whose half is not a power of two
    (3, 6, 2, 128, "random"),
]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("n,hq,hk,head_dim,layout", ROPE_CASES)
def test_rotary_matches_reference(dtype, n, hq, hk, head_dim, layout):
    from tokenbus_kernels.rope import rotary_triton

    qkv, cos, sin, _ = qkv_inputs(n, hq, hk, head_dim, dtype, layout, "inplace")
    expected = qkv.clone()
    q, k, _ = split(qkv, hq, hk, head_dim)
    rotary_ref(*split(expected, hq, hk, head_dim)[:2], cos, sin)
    out_q, out_k = rotary_triton(q, k, cos, sin)
    assert out_q is q and out_k is k
    check_equal(qkv, expected)  # q, k rotated in place, v untouched


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("n,hq,hk,head_dim,layout", ROPE_CASES)
def test_rotary_write_kv_matches_reference(dtype, n, hq, hk, head_dim, layout):
    from tokenbus_kernels.rope import rotary_write_kv_triton

    qkv, cos, sin, gen = qkv_inputs(n, hq, hk, head_dim, dtype, layout, "cache")
    block_size, num_blocks = 16, 2 + n // 8
    k_cache = randn(num_blocks, block_size, hk, head_dim, gen=gen, dtype=dtype)  # junk that must survive
    v_cache = randn(num_blocks, block_size, hk, head_dim, gen=gen, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[1::3] = -1  # padding tokens
    slots = slots.to(DEVICE)
    expected, k_expected, v_expected = qkv.clone(), k_cache.clone(), v_cache.clone()
    rotary_write_kv_ref(*split(expected, hq, hk, head_dim), cos, sin, k_expected, v_expected, slots)
    q, k, v = split(qkv, hq, hk, head_dim)
    assert rotary_write_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots) is q
    check_equal(qkv, expected)  # q rotated in place; k and v as they were
    check_equal(k_cache, k_expected)
    check_equal(v_cache, v_expected)


# (rows, inter, block, out): out "strided" = a view of a wider junk buffer
SILU_CASES = [(1, 576, None, None), (37, 72, None, "strided"), (3, 1536, 256, None), (3, 576, 256, "strided")]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("n,inter,block,out", SILU_CASES)
def test_silu_and_mul_matches_reference(dtype, n, inter, block, out):
    from tokenbus_kernels.activation import silu_and_mul_triton

    gen = generator("silu", n, inter, block, out, case_id(dtype))
    gate_up_buf, gate_up = wide_rows(n, 2 * inter, gen, dtype, 4.0)  # silu's curved part and both tails
    ref = silu_and_mul_ref(gate_up)
    if out is None:
        result = silu_and_mul_triton(gate_up, block=block)
        assert result.is_contiguous()
    else:
        out_buf, target = wide_rows(n, inter, gen, dtype)
        out_before = out_buf.clone()
        result = silu_and_mul_triton(gate_up, out=target, block=block)
        assert result is target
        check_equal(out_buf[:, :2], out_before[:, :2])
        check_equal(out_buf[:, inter + 2 :], out_before[:, inter + 2 :])
    check_close(result, ref)
