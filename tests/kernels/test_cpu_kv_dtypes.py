"""The C++ KV write and paged attention over bfloat16 and int8 caches (tokenbus_kernels/csrc/cpu_attention.cpp,
cpu_attention_block.cpp, cpu_decode_attention.cpp, tokenbus_kernels/kv_quant.py): the write quantizes as
kv_quant.quantize does, and attention over a quantized cache equals the PyTorch reference over the same cache
dequantized (within fp32 rounding), on awkward shapes, with the AVX-512 and the AVX2 builds."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_cpu_kernels import DECODE_CASES
from tests.support.kernel_cases import LENGTH_CASES, paged_cache, stored_cache, strided
from tokenbus_kernels import cpu
from tokenbus_kernels.kv_quant import cache_shape, dequantize, quantize
from tokenbus_kernels.reference import paged_decode_attention_ref, write_kv_ref

KV_DTYPES = [torch.bfloat16, torch.int8]


def test_quantized_rows_round_trip_within_half_a_step():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 80, generator=gen) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7, 1] = 0.0  # an all-zero row: scale 0, codes 0, no division by zero
    packed = quantize(x, torch.int8)
    assert packed.dtype == torch.int8 and packed.shape == (50, 3, 84)
    back = dequantize(packed)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert bool(((back - x).abs() <= step / 2 + 1e-6 * step).all())
    assert bool((back[7, 1] == 0).all())


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("block_size,hk,head_dim", [(16, 3, 64), (32, 1, 128), (8, 4, 48)])
def test_write_kv_stores_what_the_reference_stores(ext, dtype, block_size, hk, head_dim):
    gen = torch.Generator().manual_seed(block_size + hk + head_dim)
    num_blocks, num_tokens = 7, 45
    shape = cache_shape(num_blocks, block_size, hk, head_dim, dtype)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::6] = -1  # padding tokens are skipped
    k = strided(torch.randn(num_tokens, hk, head_dim, generator=gen) * 3, gen)
    v = strided(torch.randn(num_tokens, hk, head_dim, generator=gen), gen)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ext.write_kv_cpu(k, v, k_cache, v_cache, slots)
    write_kv_ref(k, v, k_ref, v_ref, slots)
    if dtype == torch.bfloat16:
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
        return
    for got, want in ((k_cache, k_ref), (v_cache, v_ref)):
        # the scales may differ in the last bit (-ffast-math may divide by 127 as a multiply), a code by one
        # step where x * (127 / amax) lands on .5 within that bit
        torch.testing.assert_close(got[..., head_dim:].contiguous().view(torch.float32),
                                   want[..., head_dim:].contiguous().view(torch.float32), rtol=2e-7, atol=0)
        codes = (got[..., :head_dim].int() - want[..., :head_dim].int()).abs()
        assert int(codes.max()) <= 1 and int((codes > 0).sum()) <= 2


def check_decode(module, dtype, block_size, hq, hk, head_dim, window=0, softcap=0.0):
    gen = torch.Generator().manual_seed(block_size * 1000 + hq * 10 + head_dim)
    lens = LENGTH_CASES(block_size) + [int(n) for n in torch.randint(1, 9 * block_size, (4,), generator=gen)]
    k_cache, v_cache, table = paged_cache(lens, block_size, hk, head_dim, torch.float32, gen, device="cpu")
    k_cache, v_cache = stored_cache(k_cache * 2, dtype), stored_cache(v_cache, dtype)
    q = strided(torch.randn(len(lens), hq, head_dim, generator=gen), gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    out = module.paged_decode_attention_cpu(q, k_cache, v_cache, table, seq_lens, scale, window, softcap)
    # the reference over the dequantized cache, float32 throughout
    ref = paged_decode_attention_ref(q, dequantize(k_cache), dequantize(v_cache), table, seq_lens, scale, window,
                                     softcap)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("block_size,hq,hk,head_dim", DECODE_CASES)
def test_decode_over_a_quantized_cache_equals_reference_on_it_dequantized(ext, dtype, block_size, hq, hk, head_dim):
    check_decode(ext, dtype, block_size, hq, hk, head_dim)


# Groups above 1 widen each block into an fp32 scratch, group 1 widens in registers; head_dim 64 and 128 are
# compiled as constants, 80 and 96 take the run-time loops; windows shorter and longer than a block
WINDOW_CASES = [
    (16, 8, 2, 64, 21, 5.0),  # group 4
    (16, 9, 3, 64, 5, 0.0),  # SmolLM2's heads, a window inside one block
    (32, 4, 4, 128, 40, 3.0),  # group 1
    (8, 6, 2, 80, 19, 2.0),  # group 3, run-time head_dim
    (16, 16, 4, 96, 0, 4.0),  # group 4, run-time head_dim, softcap alone
]


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("block_size,hq,hk,head_dim,window,softcap", WINDOW_CASES)
def test_decode_window_and_softcap_over_a_quantized_cache(ext, dtype, block_size, hq, hk, head_dim, window,
                                                          softcap):
    check_decode(ext, dtype, block_size, hq, hk, head_dim, window=window, softcap=softcap)


@pytest.mark.slow  # a second build of the extension (~32 s) the first time on a machine, cached afterwards
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_decode_avx2_build_over_a_quantized_cache(dtype):
    module = cpu.extension(avx2_only=True)
    assert module is not None
    for case in [(16, 9, 3, 64), (8, 7, 1, 48), (32, 16, 2, 128)]:
        check_decode(module, dtype, *case)
    check_decode(module, dtype, 8, 6, 2, 80, window=19, softcap=2.0)


def test_a_cache_too_narrow_for_its_dtype_is_refused(ext):
    q = torch.randn(2, 4, 32)
    cache = torch.zeros(2, 16, 2, 32, dtype=torch.int8)  # int8 rows need 32 + 4 elements
    with pytest.raises(RuntimeError, match="head_dim \\+ 4"):
        ext.paged_decode_attention_cpu(q, cache, cache, torch.zeros(2, 1, dtype=torch.int32),
                                       torch.ones(2, dtype=torch.int32), 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or int8"):
        half = torch.zeros(2, 16, 2, 32, dtype=torch.float16)
        ext.write_kv_cpu(q[:, :2], q[:, :2], half, half, torch.zeros(2, dtype=torch.int64))
