"""The fp8 KV cache (--kv-cache-dtype fp8) in the Triton kernels: write_kv quantizes each (token, KV head) row
as tokenbus_kernels/kv_quant.quantize does, and decode and prefill attention over an fp8 cache equal the PyTorch
reference over the same cache dequantized. Triton 3.9's interpreter runs fp8 (tl.float8e4nv) on the CPU, so
scripts/test runs this file under TRITON_INTERPRET=1 (INTERPRETED_SUITES); on a GPU the main suite runs it.
The main suite also compiles the fp8 launch plans for sm_90 (no spills, the K/V loop still pipelined)."""

from __future__ import annotations

import pytest
import torch

from tests.support.kernel_cases import (
    DEVICE,
    INTERPRETED,
    LENGTH_CASES,
    needs_kernels,
    paged_cache,
    prefill_inputs,
    strided,
)
from tests.support.sm90_compile import compile_for_sm90, stack_bytes
from tokenbus_kernels.kv_quant import cache_shape, dequantize, quantize
from tokenbus_kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref, write_kv_ref

FP8 = torch.float8_e4m3fn
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def fp8_cache(lens, block_size, hk, head_dim, gen):
    k, v, table = paged_cache(lens, block_size, hk, head_dim, torch.float32, gen, device="cpu")
    return quantize(k, FP8).to(DEVICE), quantize(v, FP8).to(DEVICE), table.to(DEVICE)


@needs_kernels
@pytest.mark.parametrize("block_size,hk,head_dim", [(16, 3, 64), (8, 1, 32)])
def test_write_kv_quantizes_like_the_reference(block_size, hk, head_dim):
    from tokenbus_kernels.kv_write import write_kv_triton

    gen = torch.Generator().manual_seed(block_size + hk)
    num_blocks, num_tokens = 5, 30
    shape = cache_shape(num_blocks, block_size, hk, head_dim, FP8)
    k_cache, v_cache = torch.zeros(shape, dtype=FP8, device=DEVICE), torch.zeros(shape, dtype=FP8, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1
    k = strided(torch.randn(num_tokens, hk, head_dim, generator=gen) * 5, gen).to(DEVICE)
    v = strided(torch.randn(num_tokens, hk, head_dim, generator=gen), gen).to(DEVICE)
    k[3, 0] = 0.0  # an all-zero row: scale 0, codes 0
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_triton(k, v, k_cache, v_cache, slots.to(DEVICE))
    write_kv_ref(k, v, k_ref, v_ref, slots.to(DEVICE))
    for got, want in ((k_cache, k_ref), (v_cache, v_ref)):
        # GPU fp32 division and fp8 rounding may differ from torch's in the last bit: one fp8 step at most
        torch.testing.assert_close(dequantize(got.cpu()), dequantize(want.cpu()), rtol=0.07, atol=1e-6)
        torch.testing.assert_close(got.cpu().view(torch.uint8)[..., head_dim:].contiguous().view(torch.float32),
                                   want.cpu().view(torch.uint8)[..., head_dim:].contiguous().view(torch.float32),
                                   rtol=1e-6, atol=0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size,hq,hk,head_dim,partition", [
    (16, 4, 4, 64, None), (16, 6, 2, 32, 32), (32, 8, 1, 128, 64), (16, 6, 2, 80, 32),  # 80: padded lanes
])
def test_decode_over_fp8_equals_reference_dequantized(dtype, block_size, hq, hk, head_dim, partition):
    from tokenbus_kernels.decode_attention import paged_decode_attention_triton

    gen = torch.Generator().manual_seed(block_size * 100 + hq + head_dim)
    lens = LENGTH_CASES(block_size)
    k_cache, v_cache, table = fp8_cache(lens, block_size, hk, head_dim, gen)
    q = strided(torch.randn(len(lens), hq, head_dim, generator=gen).to(dtype).to(DEVICE), gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    paged_decode_attention_triton(q, k_cache, v_cache, table, seq_lens, head_dim**-0.5, out=out,
                                  partition_size=partition)
    # the reference over the dequantized cache, rounded to q's dtype as the kernel's tiles are
    ref = paged_decode_attention_ref(q, dequantize(k_cache).to(dtype), dequantize(v_cache).to(dtype), table,
                                     seq_lens, head_dim**-0.5)
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), **TOL[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_over_fp8_equals_reference_dequantized(dtype):
    from tokenbus_kernels.prefill_attention import paged_prefill_attention_triton

    gen = torch.Generator().manual_seed(5)
    block_size, hq, hk, head_dim = 16, 6, 2, 32
    pairs = [(1, 1), (block_size + 1, block_size + 1), (2 * block_size, 0), (4 * block_size + 7, 9)]
    k_cache, v_cache, table = fp8_cache([c for c, _ in pairs], block_size, hk, head_dim, gen)
    q, cu_seqlens_q, seq_lens = prefill_inputs(pairs, hq, head_dim, dtype, gen)
    out = paged_prefill_attention_triton(q, k_cache, v_cache, table, cu_seqlens_q, seq_lens, 0.2)
    ref = paged_prefill_attention_ref(q, dequantize(k_cache).to(dtype), dequantize(v_cache).to(dtype), table,
                                      cu_seqlens_q, seq_lens, 0.2)
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), **TOL[dtype])


@needs_kernels
def test_the_triton_backend_writes_fp8_through_rotary_then_write_kv():
    """The fused rotary + KV write stores plain values: with an fp8 cache the backend rotates, then quantizes."""
    from tokenbus_kernels.reference import rotary_write_kv_ref
    from worker.engine.backends import TritonBackend

    gen = torch.Generator().manual_seed(9)
    n, hq, hk, d = 5, 4, 2, 32
    q, k, v = (torch.randn(n, h, d, generator=gen).to(DEVICE) for h in (hq, hk, hk))
    angles = torch.randn(n, d // 2, generator=gen)
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(DEVICE) for f in (torch.cos, torch.sin))
    shape = cache_shape(2, 8, hk, d, FP8)
    caches = [torch.zeros(shape, dtype=FP8, device=DEVICE) for _ in range(4)]
    slots = torch.tensor([0, 3, -1, 9, 15], device=DEVICE)
    q_out = TritonBackend(interpreted=INTERPRETED).rotary_write_kv(q.clone(), k.clone(), v, cos, sin, caches[0],
                                                                  caches[1], slots)
    q_ref = rotary_write_kv_ref(q.clone(), k.clone(), v, cos, sin, caches[2], caches[3], slots)
    torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-5)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        torch.testing.assert_close(dequantize(got.cpu()), dequantize(want.cpu()), rtol=0.07, atol=1e-5)


@pytest.mark.skipif(INTERPRETED, reason="compiles for sm_90 with ptxas; the interpreter process only runs kernels")
@pytest.mark.parametrize("dtype,hq,hk,head_dim", [(torch.bfloat16, 32, 8, 128), (torch.bfloat16, 9, 3, 64),
                                                  (torch.float16, 16, 2, 64), (torch.bfloat16, 16, 2, 256)])
def test_fp8_launch_plans_compile_for_sm90_without_spills(tmp_path, dtype, hq, hk, head_dim):
    from tokenbus_kernels.decode_attention import plan_decode
    from tokenbus_kernels.kv_write import plan_write_kv
    from tokenbus_kernels.prefill_attention import plan_prefill

    num_seqs, block_size = 4, 16
    cache = torch.zeros(cache_shape(64, block_size, hk, head_dim, FP8), dtype=FP8)
    table = torch.zeros(num_seqs, 16, dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), 200, dtype=torch.int32)
    q = torch.randn(num_seqs, hq, head_dim).to(dtype)
    q_prefill = torch.randn(40, hq, head_dim).to(dtype)
    cu = torch.tensor([0, 10, 20, 30, 40], dtype=torch.int32)
    launches = [
        *plan_decode(q, cache, cache, table, seq_lens, 0.1, torch.empty_like(q), on_gpu=True,
                     partition_size=16 * block_size),
        *plan_decode(q, cache, cache, table, seq_lens, 0.1, torch.empty_like(q), on_gpu=True, partition_size=128),
        *plan_prefill(q_prefill, cache, cache, table, cu, seq_lens, 0.1, torch.empty_like(q_prefill), on_gpu=True),
        *plan_write_kv(q_prefill[:, :hk], q_prefill[:, :hk], cache, cache, torch.arange(40), on_gpu=True),
    ]
    for launch in launches:
        assert launch.meta.get("KV_FP8") or launch.kernel.__name__ == "_decode_reduce_kernel"
        compiled = compile_for_sm90(launch)
        name = launch.kernel.__name__
        assert stack_bytes(compiled.asm["cubin"], tmp_path) == 0, f"{name} spills registers with an fp8 cache"
        if name in ("_decode_partition_kernel", "_prefill_kernel"):
            assert "async_copy_global_to_local" in compiled.asm["ttgir"], f"{name}: fp8 K/V loop not pipelined"


def test_a_mismatched_cache_is_refused():
    from tokenbus_kernels.decode_attention import plan_decode

    q = torch.randn(2, 4, 32)
    narrow = torch.zeros(4, 16, 2, 32, dtype=FP8)  # fp8 rows need head_dim + 4
    with pytest.raises(ValueError, match=r"head_dim \+ 4"):
        plan_decode(q, narrow, narrow, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
                    0.1, torch.empty_like(q), on_gpu=False)
