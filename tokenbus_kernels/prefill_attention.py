"""Triton kernel: paged prefill attention for chunked prefill, causal (decoders) or not (encoders).

q             [num_tokens, num_q_heads, head_dim] (any strides): each sequence's newest q_len tokens, packed
cu_seqlens_q  int32 [num_seqs + 1]: sequence i owns q rows cu_seqlens_q[i] : cu_seqlens_q[i + 1]
k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim] (any strides, both caches alike), already
              holding all seq_lens[i] tokens of sequence i (earlier chunks and prefix-cache hits included);
              q's dtype, or fp8 [..., head_dim + 4] with a scale per row, dequantized in registers as each
              tile loads (attention_tiles.py's kv_tile; tokenbus_kernels/kv_quant.py has the layout)
block_tables  int32 [num_seqs, max_blocks_per_seq]; seq_lens int32 [num_seqs]
out           [num_tokens, num_q_heads, head_dim], contiguous, dtype of q

Query j of sequence i sits at position seq_lens[i] - q_len + j and sees keys at positions <= its own; with
a sliding window (window > 0) only those > its own - window. softcap > 0 soft-caps the scores
(s -> softcap * tanh(s / softcap), Gemma 2). causal False (CAUSAL off: an encoder's bidirectional
attention, no window) lets every query see all seq_lens[i] keys. All three are constexpr switches (SLIDING,
SOFTCAP, CAUSAL): a model without them runs the kernel it always ran.

Grid (num_tokens // BLOCK_Q + num_seqs, num_kv_heads). A program owns BLOCK_Q query tokens of one sequence
times all `group` query heads of one KV head: a [BLOCK_M = BLOCK_Q * group (+ pad), head_dim] tile whose
row r is token r // group, head r % group. It walks the sequence's keys in BLOCK_N-token tiles gathered
through the block table, up to its last query's position, with an fp32 online softmax; each K/V tile load
serves the whole group. Sequence s owns tiles cu_seqlens_q[s] // BLOCK_Q + s onward; that upper-bounds its
ceil(q_len / BLOCK_Q) tiles, so a program finds its sequence by binary search over cu_seqlens_q and the grid
needs no device->host sync. Tiles past a sequence's q_len exit at once. With a window a program's key loop
starts at its first query's window start, so the keys it walks are at most window + BLOCK_Q - 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenbus_kernels import attention_tiles as tiles
from tokenbus_kernels.launch import Launch, attention_out, head_pad
from tokenbus_kernels.reference import check_causal


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
    out_ptr,
    qk_scale, num_seqs, window, softcap,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr, FP32_DOT: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Grid (num_tokens // BLOCK_Q + num_seqs, num_kv_heads): BLOCK_Q query tokens of one sequence x the GROUP
    q heads of one KV head, as BLOCK_M rows (token r // GROUP, head r % GROUP) -> out rows."""
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Last sequence s whose first tile, cu_seqlens_q[s] // BLOCK_Q + s, is <= tile_id.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    q_start = (tile_id - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q_start >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = q_start + rows // GROUP
    q_heads = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    # Padding rows pretend to be the tile's first query: they see what it sees, so no row is ever all -inf.
    q_first = ctx_len - q_len + q_start
    q_pos = tl.where(row_ok, ctx_len - q_len + tok, q_first)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = tiles.dims_in_head(dims, HEAD_DIM, HEAD_PAD)
    q_rows = (q_begin + tok).to(tl.int64)
    q = tiles.scaled_q(
        q_ptr + q_rows[:, None] * stride_qt + q_heads[:, None] * stride_qh + dims[None, :] * stride_qd,
        row_ok[:, None] & dim_ok[None, :], qk_scale,
    )

    m_i, l_i, acc = tiles.softmax_start(BLOCK_M, HEAD_PAD)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch + dims[None, :] * stride_cd
    kv_end = ctx_len - q_len + tl.minimum(q_start + BLOCK_Q, q_len)  # last query position + 1
    if not CAUSAL:
        kv_end = ctx_len  # every query sees every key
    kv_start = 0
    if SLIDING:
        kv_start = tl.maximum(q_first - window + 1, 0)  # no query of this tile sees a key before it
    for tile in range(kv_start, kv_end, BLOCK_N):
        tokens, tok_ok, k, v = tiles.kv_tile(
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_row, head_off, kv_head, tile, kv_end, dim_ok,
            stride_cb, stride_co, stride_ch, q.dtype, HEAD_DIM, BLOCK_N, BLOCK_SIZE, KV_FP8,
        )
        s = tiles.qk_scores(q, k, softcap, DOT_FP32, FP32_DOT, SOFTCAP)
        visible = tok_ok[None, :]
        if CAUSAL:
            visible = visible & (tokens[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (tokens[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
        if SLIDING:
            # a row whose window starts past this tile has seen no key yet (m = -inf): exp2(-inf - -inf)
            # would be NaN, so it subtracts 0 instead and its p and alpha come out 0
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        acc, l_i = tiles.softmax_accumulate(acc, l_i, p, alpha, v, DOT_FP32, FP32_DOT)
        m_i = m_new

    out = acc / l_i[:, None]
    o_rows = (q_begin + tok).to(tl.int64)
    tl.store(
        out_ptr + o_rows[:, None] * stride_ot + q_heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :],
    )


def _tile_shape(head_dim: int, group: int, dtype: torch.dtype, on_gpu: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps), sized to stay clear of register spills on sm_90 (see the tests).
    BLOCK_M always holds >= 1 token of the whole group."""
    if not on_gpu:
        block_m, block_n, warps = 64, 32, 1  # interpreter: moderate numpy tiles
    elif dtype == torch.float32:  # twice the bytes per tile, and 3xTF32 dots hold more registers
        block_m, block_n, warps = (64, 32, 4) if head_dim <= 64 else (64 if head_dim <= 128 else 32, 16, 8)
    elif head_dim <= 64:
        block_m, block_n, warps = 128, 64, 4
    elif head_dim <= 128:
        block_m, block_n, warps = 128, 64, 8
    else:
        block_m, block_n, warps = 64, 32, 8
    return max(block_m, triton.next_power_of_2(group)), block_n, warps


def plan_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    on_gpu: bool,
    window: int = 0,
    softcap: float = 0.0,
    causal: bool = True,
) -> list[Launch]:
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    k_scale, v_scale, fp8 = tiles.check_attention("prefill", q, k_cache, v_cache, out)
    check_causal(causal, window)
    if cu_seqlens_q.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError("prefill: cu_seqlens_q / block_tables do not match seq_lens")
    if num_tokens == 0 or num_seqs == 0:
        return []
    group = num_q_heads // num_kv_heads
    block_m, block_n, warps = _tile_shape(head_dim, group, q.dtype, on_gpu)
    block_q = block_m // group
    args = (
        q, k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_q, seq_lens, out,
        scale * tiles.LOG2E, num_seqs, window, softcap * tiles.LOG2E,
        *q.stride(), *k_cache.stride(), block_tables.stride(0), out.stride(0), out.stride(1),
    )
    meta = {
        "GROUP": group, "HEAD_DIM": head_dim, "HEAD_PAD": head_pad(head_dim), "BLOCK_M": block_m, "BLOCK_Q": block_q,
        "BLOCK_N": block_n,
        "BLOCK_SIZE": block_size, "DOT_FP32": (not on_gpu) or q.dtype == torch.float32,
        "FP32_DOT": "tf32x3" if on_gpu else "ieee", "SLIDING": window > 0, "SOFTCAP": softcap > 0,
        "KV_FP8": fp8, "CAUSAL": causal, "num_warps": warps, "num_stages": 2,
    }
    return [Launch(_prefill_kernel, (num_tokens // block_q + num_seqs, num_kv_heads), args, meta)]


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    causal: bool = True,
) -> torch.Tensor:
    """Chunked-prefill attention; see the module docstring. `out` exists for tests/benchmarks."""
    out = attention_out(_prefill_kernel, q, out)
    for launch in plan_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out, q.is_cuda,
                              window, softcap, causal):
        launch()
    return out
