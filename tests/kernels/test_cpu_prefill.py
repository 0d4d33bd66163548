"""The C++ paged prefill attention (tokenbus_kernels/csrc/cpu_prefill_attention.cpp) against the PyTorch reference
over the same cache dequantized: fp32, bf16 and int8 caches; sequences with cached prefixes, single tokens,
chunks longer than a work item's tile, an empty entry, several lengths in one call; GQA, MHA, MQA, a group
wider than a tile; block sizes that hold whole vectors and ones that do not; compile-time and run-time
head_dims; sliding windows and soft-capping; non-causal (an encoder's bidirectional attention); junk (NaN) past
each sequence; the AVX-512 and AVX2 builds."""

from __future__ import annotations

import pytest
import torch

from tests.support.kernel_cases import paged_cache, prefill_inputs, stored_cache
from tokenbus_kernels import cpu
from tokenbus_kernels.kv_quant import dequantize
from tokenbus_kernels.reference import paged_prefill_attention_ref
from worker.engine.backends import CpuBackend

DTYPES = [torch.float32, torch.bfloat16, torch.int8]


def prefill_pairs(bs: int) -> list[tuple[int, int]]:
    """(cached tokens with the new ones, new tokens): whole prompts, chunks after a cached prefix, single
    tokens, an empty entry, and a chunk of 70 (more than one tile at every group size)."""
    return [(1, 1), (bs - 1, bs - 1), (bs, 3), (bs + 1, bs + 1), (2 * bs, 0), (4 * bs + 7, 1),
            (4 * bs + 7, 2 * bs + 5), (3 * bs + 90, 70)]


def check_prefill(module, dtype, block_size, hq, hk, head_dim, window=0, softcap=0.0, nan_junk=False, causal=True):
    gen = torch.Generator().manual_seed(block_size * 1000 + hq * 10 + head_dim + window)
    pairs = prefill_pairs(block_size)
    lens = [c for c, _ in pairs]
    k_cache, v_cache, table = paged_cache(lens, block_size, hk, head_dim, torch.float32, gen, device="cpu")
    if nan_junk:  # slots past a sequence's last token may hold anything: they must not reach the output
        for i, n in enumerate(lens):
            last = int(table[i, (n - 1) // block_size])
            k_cache[last, (n - 1) % block_size + 1 :] = float("nan")
            v_cache[last, (n - 1) % block_size + 1 :] = float("nan")
    k_cache, v_cache = stored_cache(k_cache * 2, dtype), stored_cache(v_cache, dtype)
    q, cu_seqlens_q, seq_lens = prefill_inputs(pairs, hq, head_dim, torch.float32, gen, device="cpu")
    scale = head_dim**-0.5
    out = module.paged_prefill_attention_cpu(q, k_cache, v_cache, table, cu_seqlens_q, seq_lens, scale, window,
                                             softcap, causal)
    ref = paged_prefill_attention_ref(q, dequantize(k_cache), dequantize(v_cache), table, cu_seqlens_q, seq_lens,
                                      scale, window, softcap, causal)
    assert out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# (block_size, num_q_heads, num_kv_heads, head_dim): SmolLM2's shape; MHA with a run-time head_dim; GQA 8
# with blocks of 2 vectors (AVX-512); MQA with blocks of 8 (AVX-512: no whole vector, per-row loops); blocks
# of 4 vectors with head_dim 80; an awkward block of 12; a group of 70 query heads (one token per tile)
CASES = [(16, 9, 3, 64), (16, 4, 4, 32), (32, 16, 2, 128), (8, 7, 1, 48), (64, 6, 2, 80), (12, 6, 2, 64),
         (16, 70, 1, 16)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size,hq,hk,head_dim", CASES)
def test_prefill_matches_reference(ext, dtype, block_size, hq, hk, head_dim):
    check_prefill(ext, dtype, block_size, hq, hk, head_dim)


# windows inside one block, across blocks and longer than a tile; soft-cap with and without a window
WINDOW_CASES = [
    (16, 9, 3, 64, 5, 0.0),
    (16, 8, 2, 64, 21, 5.0),
    (32, 4, 4, 128, 40, 3.0),
    (8, 6, 2, 80, 19, 2.0),
    (16, 16, 4, 96, 0, 4.0),
    (16, 9, 3, 64, 100, 0.0),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size,hq,hk,head_dim,window,softcap", WINDOW_CASES)
def test_prefill_window_and_softcap(ext, dtype, block_size, hq, hk, head_dim, window, softcap):
    check_prefill(ext, dtype, block_size, hq, hk, head_dim, window=window, softcap=softcap)


# non-causal: every query sees the whole sequence, the keys after it included (the cases' chunks after a cached
# prefix too, which an encoder never sends but the kernel serves the same way); awkward shapes, soft-capping
NONCAUSAL_CASES = [(16, 9, 3, 64, 0.0), (8, 7, 1, 48, 0.0), (12, 6, 2, 80, 3.0), (16, 70, 1, 16, 0.0),
                   (32, 12, 12, 32, 0.0)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size,hq,hk,head_dim,softcap", NONCAUSAL_CASES)
def test_prefill_noncausal_matches_reference(ext, dtype, block_size, hq, hk, head_dim, softcap):
    check_prefill(ext, dtype, block_size, hq, hk, head_dim, softcap=softcap, causal=False)
    check_prefill(ext, dtype, block_size, hq, hk, head_dim, softcap=softcap, nan_junk=True, causal=False)


def test_noncausal_differs_from_causal(ext):
    """The switch bites: a query before the last sees later keys only without the causal mask."""
    gen = torch.Generator().manual_seed(9)
    k_cache, v_cache, table = paged_cache([20], 16, 2, 32, torch.float32, gen, device="cpu")
    q, cu, lens = prefill_inputs([(20, 20)], 4, 32, torch.float32, gen, device="cpu")
    causal = ext.paged_prefill_attention_cpu(q, k_cache, v_cache, table, cu, lens, 0.2, 0, 0.0, True)
    full = ext.paged_prefill_attention_cpu(q, k_cache, v_cache, table, cu, lens, 0.2, 0, 0.0, False)
    torch.testing.assert_close(causal[-1], full[-1], rtol=1e-5, atol=1e-5)  # the last query sees all in both
    assert (causal[:-1] - full[:-1]).abs().amax(dim=(1, 2)).min() > 1e-3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_ignores_junk_past_each_sequence(ext, dtype):
    check_prefill(ext, dtype, 16, 9, 3, 64, nan_junk=True)
    check_prefill(ext, dtype, 12, 4, 4, 32, window=7, nan_junk=True)


def test_the_cpu_backend_prefills_with_the_kernel(ext):
    """CpuBackend.prefill_attention is one call of the kernel (int64 offsets are converted), equal to the
    reference."""
    calls = []

    class Spy:
        def __getattr__(self, name):
            real = getattr(ext, name)

            def wrapped(*args):
                calls.append(name)
                return real(*args)

            return wrapped

    gen = torch.Generator().manual_seed(5)
    pairs = [(40, 40), (70, 9), (1, 1)]
    k_cache, v_cache, table = paged_cache([c for c, _ in pairs], 16, 3, 64, torch.float32, gen, device="cpu")
    q, cu_seqlens_q, seq_lens = prefill_inputs(pairs, 9, 64, torch.float32, gen, device="cpu")
    out = CpuBackend(Spy()).prefill_attention(q, k_cache, v_cache, table, cu_seqlens_q.long(), seq_lens, 0.125,
                                              window=30)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, table, cu_seqlens_q, seq_lens, 0.125, 30)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert calls == ["paged_prefill_attention_cpu"]


def test_bad_offsets_are_refused(ext):
    q = torch.randn(5, 4, 32)
    cache = torch.zeros(2, 16, 2, 32)
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="seq_lens counts the new tokens"):
        ext.paged_prefill_attention_cpu(q, cache, cache, table, torch.tensor([0, 5], dtype=torch.int32),
                                        torch.tensor([4], dtype=torch.int32), 1.0, 0, 0.0, True)
    with pytest.raises(RuntimeError, match="non-causal prefill attention takes no sliding window"):
        ext.paged_prefill_attention_cpu(q, cache, cache, table, torch.tensor([0, 5], dtype=torch.int32),
                                        torch.tensor([5], dtype=torch.int32), 1.0, 8, 0.0, False)


@pytest.mark.slow  # a second build of the extension (~32 s) the first time on a machine, cached afterwards
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_avx2_build(dtype):
    module = cpu.extension(avx2_only=True)
    assert module is not None
    for case in [(16, 9, 3, 64), (8, 7, 1, 48), (32, 16, 2, 128), (12, 6, 2, 64)]:
        check_prefill(module, dtype, *case)
    check_prefill(module, dtype, 8, 6, 2, 80, window=19, softcap=2.0)
    check_prefill(module, dtype, 12, 6, 2, 80, softcap=3.0, causal=False)
