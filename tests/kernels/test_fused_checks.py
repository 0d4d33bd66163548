"""The fused kernels' tests, checked themselves (the parent process only; no kernel runs here): the references
are transformers' own arithmetic, the comparisons reject the mistakes a kernel could make (wrong eps, no
residual, a missed rounding), the plans refuse bad arguments, and every GPU launch plan compiles for sm_90."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from tests.kernels import fused_inputs as inputs
from tests.kernels.fused_inputs import DTYPES, EPS, norm_inputs, qkv_inputs, rope_tables, split, wide_rows
from tests.support.kernel_cases import INTERPRETED, case_id, generator, parent_only
from tests.support.sm90_compile import compile_for_sm90, stack_bytes
from tokenbus_kernels.reference import rms_norm_ref, rotary_ref, silu_and_mul_ref


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
    assert _raises(inputs.check_close, rms_norm_ref(residual + x, weight, 10 * EPS), right), "eps x10 not caught"
    assert _raises(inputs.check_close, rms_norm_ref(residual + x, weight, EPS / 10), right), "eps / 10 not caught"
    assert _raises(inputs.check_close, rms_norm_ref(x, weight, EPS), right), "missing residual not caught"
    assert _raises(inputs.check_close, rms_norm_ref(residual + x, torch.ones_like(weight), EPS), right), "no weight"
    h = (residual + x).float()
    fused = (weight.float() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    if dtype != torch.float32:  # one rounding instead of LlamaRMSNorm's two
        assert _raises(inputs.check_close, fused, right), "missed rounding not caught"

    qkv, cos, sin, _ = qkv_inputs(5, 6, 2, 128, dtype, "random", "checks", "cpu")
    q, k, _ = split(qkv, 6, 2, 128)
    right_q = rotary_ref(q.clone(), k.clone(), cos, sin)[0]
    assert _raises(inputs.check_equal, rotary_ref(q.clone(), k.clone(), sin, cos)[0], right_q), "cos/sin swapped"
    assert _raises(inputs.check_equal, rotary_ref(q.clone(), k.clone(), cos, -sin)[0], right_q), "rotation sign"
    half = cos.shape[-1] // 2
    first_half = torch.cat((cos[..., :half], cos[..., :half]), -1)
    assert _raises(inputs.check_equal, rotary_ref(q.clone(), k.clone(), first_half, sin)[0], right_q), "cos halves"

    _, gate_up = wide_rows(n, 2 * hidden, generator("checks", case_id(dtype)), dtype, 4.0, "cpu")
    right = silu_and_mul_ref(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert _raises(inputs.check_close, F.silu(up) * gate, right), "gate/up swapped not caught"
    assert _raises(inputs.check_close, torch.sigmoid(gate) * up, right), "sigmoid for silu not caught"
    if dtype != torch.float32:
        one_rounding = (F.silu(gate.float()) * up.float()).to(dtype)
        assert _raises(inputs.check_close, one_rounding, right), "missed rounding not caught"


@parent_only
def test_plans_reject_bad_arguments():
    from tokenbus_kernels.activation import plan_silu_and_mul
    from tokenbus_kernels.norm import plan_add_rms_norm, plan_rms_norm
    from tokenbus_kernels.rope import plan_rotary

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
    from tokenbus_kernels.activation import silu_and_mul_triton
    from tokenbus_kernels.norm import add_rms_norm_triton, rms_norm_triton
    from tokenbus_kernels.rope import rotary_triton, rotary_write_kv_triton

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

    from tokenbus_kernels.activation import plan_silu_and_mul
    from tokenbus_kernels.norm import plan_add_rms_norm, plan_rms_norm
    from tokenbus_kernels.rope import plan_rotary

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
