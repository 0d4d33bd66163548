"""The fused elementwise Triton kernels (kernels/norm.py, rope.py, activation.py) against their references.

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

import os
import re
import zlib

import pytest
import torch
import torch.nn.functional as F

from kernels.reference import (
    add_rms_norm_ref,
    rms_norm_ref,
    rotary_ref,
    rotary_write_kv_ref,
    silu_and_mul_ref,
)
from tests.support.sm90_compile import compile_for_sm90, stack_bytes

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
needs_kernels = pytest.mark.skipif(
    not INTERPRETED and not torch.cuda.is_available(),
    reason="no GPU: runs on the CPU in scripts/test's TRITON_INTERPRET=1 process",
)
parent_only = pytest.mark.skipif(INTERPRETED, reason="runs once, in the parent process")
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


def case_id(value) -> str:
    return str(value).removeprefix("torch.")


def generator(*case) -> torch.Generator:
    # crc32 of the case, not hash(): str hashes change from one process to the next
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


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


# (rows, hidden, block): block None = one pass; a block below hidden = the chunked two-pass path, with a tail
NORM_CASES = [(1, 576, None), (3, 576, 128), (37, 72, None), (5, 72, 32), (3, 4096, None)]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("n,hidden,block", NORM_CASES)
def test_add_rms_norm_matches_reference(dtype, n, hidden, block):
    from kernels.norm import add_rms_norm_triton

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
    from kernels.norm import rms_norm_triton

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
    from kernels.norm import rms_norm_triton

    gen = generator("heads", case_id(dtype))
    n, hq, hk, head_dim = 5, 9, 3, 64
    heads = randn(n, hq + 2 * hk, head_dim, gen=gen, dtype=dtype, scale=3.0)
    weight = randn(head_dim, gen=gen, dtype=dtype)
    for view in (heads[:, :hq], heads[:, hq : hq + hk]):
        check_close(rms_norm_triton(view, weight, EPS), rms_norm_ref(view, weight, EPS))


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


# (tokens, num_heads, num_kv_heads, head_dim, cos/sin layout)
ROPE_CASES = [
    (3, 9, 3, 64, "cos_sin"),  # SmolLM2's heads
    (1, 14, 2, 64, "rows"),
    (5, 32, 8, 128, "cos_sin"),
    (19, 4, 1, 80, "rows"),  # MQA, head_dim whose half is not a power of two
    (3, 6, 2, 128, "random"),
]


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


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("n,hq,hk,head_dim,layout", ROPE_CASES)
def test_rotary_matches_reference(dtype, n, hq, hk, head_dim, layout):
    from kernels.rope import rotary_triton

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
    from kernels.rope import rotary_write_kv_triton

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
    from kernels.activation import silu_and_mul_triton

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


# ---- the parent only: references vs transformers, the checks' power, GPU plans ---------------------------


@parent_only
@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
def test_references_equal_transformers(dtype):
    """The references are Hugging Face's arithmetic to the bit (transformers' own Llama functions)."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    gen = generator("hf", case_id(dtype))
    x = (torch.randn(7, 72, generator=gen) * 3).to(dtype)
    hf_norm = llama.LlamaRMSNorm(72, eps=EPS).to(dtype)
    with torch.no_grad():
        hf_norm.weight.copy_(1 + torch.randn(72, generator=gen))
        assert torch.equal(rms_norm_ref(x, hf_norm.weight, EPS), hf_norm(x))
    q, k = torch.randn(7, 9, 64, generator=gen).to(dtype), torch.randn(7, 3, 64, generator=gen).to(dtype)
    cos, sin = rope_tables(torch.randint(0, 8192, (7,), generator=gen), 64, dtype, "rows", gen, "cpu")
    hf_q, hf_k = llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    ref_q, ref_k = rotary_ref(q.clone(), k.clone(), cos, sin)
    assert torch.equal(ref_q, hf_q) and torch.equal(ref_k, hf_k)


def _raises(check, *args) -> bool:
    try:
        check(*args)
    except AssertionError:
        return True
    return False


@parent_only
@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
def test_checks_catch_wrong_kernels(dtype):
    """The kernel tests' inputs and comparisons fail for the likely mistakes: here each mistake is made in
    PyTorch on the same inputs and the comparison must reject it."""
    n, hidden = 37, 576
    _, x, _, residual, weight = norm_inputs(n, hidden, dtype, "add", "cpu")
    right = rms_norm_ref(residual + x, weight, EPS)
    assert _raises(check_close, rms_norm_ref(residual + x, weight, 10 * EPS), right), "eps x10 not caught"
    assert _raises(check_close, rms_norm_ref(residual + x, weight, EPS / 10), right), "eps / 10 not caught"
    assert _raises(check_close, rms_norm_ref(x, weight, EPS), right), "missing residual not caught"
    assert _raises(check_close, rms_norm_ref(residual + x, torch.ones_like(weight), EPS), right), "no weight"
    h = (residual + x).float()
    fused = (weight.float() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    if dtype != torch.float32:  # one rounding instead of LlamaRMSNorm's two
        assert _raises(check_close, fused, right), "missed rounding not caught"

    qkv, cos, sin, _ = qkv_inputs(5, 6, 2, 128, dtype, "random", "checks", "cpu")
    q, k, _ = split(qkv, 6, 2, 128)
    right_q = rotary_ref(q.clone(), k.clone(), cos, sin)[0]
    assert _raises(check_equal, rotary_ref(q.clone(), k.clone(), sin, cos)[0], right_q), "cos/sin swapped"
    assert _raises(check_equal, rotary_ref(q.clone(), k.clone(), cos, -sin)[0], right_q), "rotation sign"
    half = cos.shape[-1] // 2
    first_half = torch.cat((cos[..., :half], cos[..., :half]), -1)
    assert _raises(check_equal, rotary_ref(q.clone(), k.clone(), first_half, sin)[0], right_q), "cos halves"

    _, gate_up = wide_rows(n, 2 * hidden, generator("checks", case_id(dtype)), dtype, 4.0, "cpu")
    right = silu_and_mul_ref(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert _raises(check_close, F.silu(up) * gate, right), "gate/up swapped not caught"
    assert _raises(check_close, torch.sigmoid(gate) * up, right), "sigmoid for silu not caught"
    if dtype != torch.float32:
        one_rounding = (F.silu(gate.float()) * up.float()).to(dtype)
        assert _raises(check_close, one_rounding, right), "missed rounding not caught"


@parent_only
def test_plans_reject_bad_arguments():
    from kernels.activation import plan_silu_and_mul
    from kernels.norm import plan_add_rms_norm, plan_rms_norm
    from kernels.rope import plan_rotary

    x, w = torch.randn(3, 72), torch.randn(72)
    with pytest.raises(ValueError, match="same memory"):
        plan_add_rms_norm(x, x, w, EPS, on_gpu=True)
    with pytest.raises(ValueError, match="share a dtype"):
        plan_add_rms_norm(x, x.half(), w, EPS, on_gpu=True)
    with pytest.raises(ValueError, match="weight"):
        plan_rms_norm(x, torch.randn(71), EPS, x, on_gpu=True)
    q, k, cos = torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.randn(3, 64)
    with pytest.raises(ValueError, match="share a dtype"):
        plan_rotary(q, k, cos.half(), cos.half(), on_gpu=True)
    with pytest.raises(ValueError, match="cos"):
        plan_rotary(q, k, cos[:2], cos, on_gpu=True)
    with pytest.raises(ValueError, match="slot_mapping"):
        plan_rotary(q, k, cos, cos, True, k, torch.randn(4, 16, 2, 64), torch.randn(4, 16, 2, 64), torch.arange(2))
    with pytest.raises(ValueError, match="2 \\* inter"):
        plan_silu_and_mul(torch.randn(3, 73), torch.empty(3, 36), on_gpu=True)


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(), reason="needs GPU-compiled kernels and no GPU")
def test_compiled_kernels_refuse_cpu_tensors_clearly():
    from kernels.activation import silu_and_mul_triton
    from kernels.norm import add_rms_norm_triton, rms_norm_triton
    from kernels.rope import rotary_triton, rotary_write_kv_triton

    x, w, heads, cache = torch.randn(3, 72), torch.randn(72), torch.randn(3, 4, 64), torch.zeros(2, 16, 1, 64)
    calls = [
        lambda: add_rms_norm_triton(x, x.clone(), w, EPS),
        lambda: rms_norm_triton(x, w, EPS),
        lambda: rotary_triton(heads[:, :3], heads[:, 3:], heads[:, 0], heads[:, 0]),
        lambda: rotary_write_kv_triton(heads[:, :2], heads[:, 2:3], heads[:, 3:], heads[:, 0], heads[:, 0], cache,
                                       cache.clone(), torch.arange(3)),
        lambda: silu_and_mul_triton(x),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            call()


@parent_only
def test_gpu_plans_compile_for_sm90(tmp_path):
    """Every planned GPU launch (0.5B / 8B / wide shapes) compiles for sm_90 without register spills, with
    vectorised (16-byte) loads, and without contracting HF's separately rounded products into fmas."""

    from kernels.activation import plan_silu_and_mul
    from kernels.norm import plan_add_rms_norm, plan_rms_norm
    from kernels.rope import plan_rotary

    launches = []
    for dtype, hidden in ((torch.bfloat16, 896), (torch.bfloat16, 8192), (torch.float32, 16384)):
        x, weight = torch.randn(4, hidden).to(dtype), torch.randn(hidden).to(dtype)
        launches += plan_add_rms_norm(x, x.clone(), weight, 1e-6, on_gpu=True)  # 16384: two passes
    launches += plan_rms_norm(x, weight, 1e-6, torch.empty_like(x), on_gpu=True)
    for dtype, hq, hk, head_dim in ((torch.bfloat16, 14, 2, 64), (torch.bfloat16, 32, 8, 128)):
        heads = torch.randn(4, hq + 2 * hk, head_dim).to(dtype)
        q, k, v = heads[:, :hq], heads[:, hq : hq + hk], heads[:, hq + hk :]
        cos = torch.randn(4, 1, head_dim).to(dtype)
        cache = torch.randn(8, 16, hk, head_dim).to(dtype)
        launches += plan_rotary(q, k, cos, cos, on_gpu=True)
        launches += plan_rotary(q, k, cos, cos, True, v, cache, cache, torch.arange(4))
    launches += plan_silu_and_mul(torch.randn(4, 2 * 4864).bfloat16(), torch.empty(4, 4864).bfloat16(), on_gpu=True)
    for launch in launches:
        compiled = compile_for_sm90(launch)
        name = launch.kernel.__name__
        assert stack_bytes(compiled.asm["cubin"], tmp_path) == 0, f"{name} spills registers"
        ptx = compiled.asm["ptx"]
        assert "ld.global.v4" in ptx, f"{name}: loads not vectorised"
        assert not re.search(r"\bfma\.rn\.(bf16|f16)", ptx), f"{name}: half-precision products contracted"

