"""Sliding windows and attention soft-capping in the paged attention kernels, against tokenbus_kernels/reference.py.

The Triton decode and prefill kernels run in scripts/test's TRITON_INTERPRET=1 process (see
tests/kernels/test_kernels.py for why a process of their own), the C++ decode kernel (which also serves
prefill on the CPU path, one query at a time) here. Windows shorter than a block, equal to one, longer than
one and longer than every sequence; soft-caps small enough to change the softmax. The reference's window
itself is checked against a dense mask written from Hugging Face's definition (key t visible to query p
iff p - window < t <= p).
The new constexpr variants also compile for sm_90 (ptxas ships with triton).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.kernel_cases import INTERPRETED, attention_plan_inputs, paged_cache
from tests.support.sm90_compile import check_attention_compiles
from tokenbus_kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref

BLOCK = 16
WINDOWS = [5, BLOCK, BLOCK + 3, 1000]  # shorter than a block, one block, longer, longer than any sequence
LENS = [1, BLOCK - 1, BLOCK + 1, 3 * BLOCK + 7]


def paged(lens, hk, d, gen):
    """float32 caches of BLOCK-token blocks on the CPU (the tests move them where their kernel runs)."""
    return paged_cache(lens, BLOCK, hk, d, torch.float32, gen, device="cpu")


def dense_attention(q, keys, values, q_pos, scale, window, softcap):
    """One sequence, written out: q [n, h, d] at positions q_pos over keys/values [t, h, d] (MHA)."""
    scores = torch.einsum("nhd,thd->hnt", q, keys) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    t = torch.arange(keys.shape[0])
    visible = (t[None, :] <= q_pos[:, None]) & (t[None, :] > q_pos[:, None] - window if window else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnt,thd->nhd", scores.softmax(-1), values)


@pytest.mark.skipif(INTERPRETED, reason="a reference check: runs once, in the parent")
@pytest.mark.parametrize("window,softcap", [(5, 0.0), (BLOCK + 3, 1.5), (0, 1.5)])
def test_reference_window_is_hugging_faces(window, softcap):
    gen = torch.Generator().manual_seed(window)
    lens, hk, d = [BLOCK + 1, 3 * BLOCK + 7], 2, 16
    k, v, table = paged(lens, hk, d, gen)
    q_lens = [BLOCK + 1, 9]
    cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    q = torch.randn(sum(q_lens), hk, d, generator=gen)
    out = paged_prefill_attention_ref(q, k, v, table, cu, torch.tensor(lens, dtype=torch.int32), 0.3, window, softcap)
    for i, (n, q_len) in enumerate(zip(lens, q_lens, strict=True)):
        blocks = table[i, : -(-n // BLOCK)].long()
        keys, values = k[blocks].reshape(-1, hk, d)[:n], v[blocks].reshape(-1, hk, d)[:n]
        expected = dense_attention(q[cu[i] : cu[i + 1]], keys, values, torch.arange(n - q_len, n), 0.3, window, softcap)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], expected, rtol=1e-5, atol=1e-5)
    last = [q_lens[0] - 1, sum(q_lens) - 1]  # each sequence's newest token, as a decode step sees it
    decode = paged_decode_attention_ref(q[last], k, v, table, torch.tensor(lens, dtype=torch.int32), 0.3, window,
                                        softcap)
    torch.testing.assert_close(decode, out[last], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(INTERPRETED, reason="the C++ kernels run in the parent")
@pytest.mark.parametrize("window", WINDOWS)
def test_cpp_decode_window_matches_reference(window):
    from tokenbus_kernels.cpu import extension

    ext = extension()
    if ext is None:
        pytest.skip("the C++ kernels cannot be built here")
    gen = torch.Generator().manual_seed(window + 1)
    hq, hk, d = 6, 2, 32
    k, v, table = paged(LENS, hk, d, gen)
    q = torch.randn(len(LENS), hq, d, generator=gen)
    seq_lens = torch.tensor(LENS, dtype=torch.int32)
    for softcap in (0.0, 1.5):
        out = ext.paged_decode_attention_cpu(q, k, v, table, seq_lens, 0.2, window, softcap)
        ref = paged_decode_attention_ref(q, k, v, table, seq_lens, 0.2, window, softcap)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("partition", [None, 24], ids=["one-partition", "p24"])  # 24: not a block multiple
def test_triton_decode_window_matches_reference(window, partition):
    from tokenbus_kernels.decode_attention import paged_decode_attention_triton

    gen = torch.Generator().manual_seed(window * 7 + (partition or 0))
    hq, hk, d = 4, 2, 16
    k, v, table = paged(LENS, hk, d, gen)
    q = torch.randn(len(LENS), hq, d, generator=gen)
    seq_lens = torch.tensor(LENS, dtype=torch.int32)
    softcap = 1.5 if window % 2 else 0.0
    out = torch.full(q.shape, float("nan"))
    paged_decode_attention_triton(q, k, v, table, seq_lens, 0.2, out=out, partition_size=partition, window=window,
                                  softcap=softcap)
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k, v, table, seq_lens, 0.2, window, softcap),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
@pytest.mark.parametrize("window", WINDOWS)
def test_triton_prefill_window_matches_reference(window):
    from tokenbus_kernels.prefill_attention import paged_prefill_attention_triton

    gen = torch.Generator().manual_seed(window * 11)
    hq, hk, d = 4, 2, 16
    # (cached tokens, new query tokens): whole prompts, chunks after earlier chunks, one token, none
    pairs = [(1, 1), (BLOCK - 1, BLOCK - 1), (BLOCK + 1, 3), (2 * BLOCK, 0), (3 * BLOCK + 7, 2 * BLOCK + 5)]
    lens = [c for c, _ in pairs]
    k, v, table = paged(lens, hk, 16, gen)
    cu = [0]
    for _, q_len in pairs:
        cu.append(cu[-1] + q_len)
    cu_q = torch.tensor(cu, dtype=torch.int32)
    q = torch.randn(cu[-1], hq, d, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    softcap = 1.5 if window % 2 else 0.0
    out = torch.full(q.shape, float("nan"))
    paged_prefill_attention_triton(q, k, v, table, cu_q, seq_lens, 0.25, out=out, window=window, softcap=softcap)
    torch.testing.assert_close(out, paged_prefill_attention_ref(q, k, v, table, cu_q, seq_lens, 0.25, window, softcap),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
def test_triton_gelu_tanh_and_mul_matches_reference():
    from tokenbus_kernels.activation import gelu_tanh_and_mul_triton
    from tokenbus_kernels.reference import gelu_tanh_and_mul_ref

    gate_up = torch.randn(5, 2 * 48, generator=torch.Generator().manual_seed(3)) * 4
    torch.testing.assert_close(gelu_tanh_and_mul_triton(gate_up), gelu_tanh_and_mul_ref(gate_up), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(INTERPRETED, reason="compiles the GPU plans; the interpreter run has no compiler")
def test_windowed_plans_compile_for_sm90(tmp_path):
    """The SLIDING / SOFTCAP variants (Gemma 2's shapes: head_dim 256, GQA 2) and GeGLU compile for sm_90,
    without register spills, their K/V loops still software-pipelined."""
    from tokenbus_kernels.activation import plan_silu_and_mul
    from tokenbus_kernels.decode_attention import plan_decode
    from tokenbus_kernels.prefill_attention import plan_prefill

    dtype, head_dim, hq, hk = torch.bfloat16, 256, 8, 4
    k_cache, table, seq_lens, q, q_prefill, cu = attention_plan_inputs(dtype, hq, hk, head_dim, BLOCK)
    gate_up = torch.randn(8, 512).to(dtype)
    launches = [
        *plan_decode(q, k_cache, k_cache, table, seq_lens, 0.1, torch.empty_like(q), on_gpu=True,
                     partition_size=128, window=100, softcap=50.0),
        *plan_prefill(q_prefill, k_cache, k_cache, table, cu, seq_lens, 0.1, torch.empty_like(q_prefill),
                      on_gpu=True, window=100, softcap=50.0),
        *plan_silu_and_mul(gate_up, torch.empty(8, 256).to(dtype), on_gpu=True, gelu=True),
    ]
    assert all(launch.meta.get("SLIDING", True) and launch.meta.get("GELU", True) for launch in launches)
    check_attention_compiles(launches, tmp_path)

