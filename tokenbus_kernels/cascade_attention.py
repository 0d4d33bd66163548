"""Triton kernel: cascade decode attention (cascade.py beside it has the definition, the layout and the reference).

Shared part, _cascade_prefix_kernel, grid (num_grouped_rows // TILE_SEQS + num_groups, num_kv_heads,
prefix_partitions): a program owns TILE_SEQS members of one group times all GROUP query heads of one KV
head, a [BLOCK_M, head_dim] tile whose row r is member r // GROUP, head r % GROUP (as the prefill kernel
packs tokens), and one partition of the group's shared prefix. It walks that partition's keys in BLOCK_N
tiles through the group's first member's table row, so each shared K/V tile is loaded once for TILE_SEQS
members and every GQA head (one [BLOCK_M, D] x [D, BLOCK_N] dot instead of TILE_SEQS of [GROUP, D]), and
writes fp32 partials (max, sum, accumulator) per (row, head, partition). Group g owns the tiles from
group_starts[g] // TILE_SEQS + g on, which bounds its ceil(members / TILE_SEQS) tiles, so a program finds
its group by a binary search and the grid depends only on counts the host knows; surplus tiles exit. Under
a window each row masks the keys before its own window (a row whose window starts past the partition
writes an empty partial: max -inf, sum 0).

Own part: decode_attention.py's stage 1 with CASCADE (each row's keys from suffix_starts[row]) and its stage
2, always run, which merges the shared partials and then the own ones by log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenbus_kernels import attention_tiles as tiles
from tokenbus_kernels.cascade import CascadeLayout
from tokenbus_kernels.decode_attention import CascadeReduce, DecodeWorkspace, decode_block_n, num_sms, plan_decode
from tokenbus_kernels.launch import Launch, attention_out, head_pad
from tokenbus_kernels.partitions import pick_partition_size


@triton.jit
def _cascade_prefix_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr,
    group_rows_ptr, group_starts_ptr, prefix_lens_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
    qk_scale, num_groups, partition_size, num_partitions, window, softcap,
    stride_qs, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, TILE_SEQS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr,
    FP32_DOT: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Grid (tiles, num_kv_heads, num_partitions) -> fp32 partials [num_seqs, num_q_heads, num_partitions(, D)]
    of the grouped rows (module docstring)."""
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    # Last group g whose first tile, group_starts[g] // TILE_SEQS + g, is <= tile_id.
    lo: tl.int32 = 0
    hi: tl.int32 = num_groups
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(group_starts_ptr + mid) // TILE_SEQS + mid <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    g = lo - 1
    g_begin = tl.load(group_starts_ptr + g)
    g_end = tl.load(group_starts_ptr + g + 1)
    first_member = g_begin + (tile_id - (g_begin // TILE_SEQS + g)) * TILE_SEQS
    prefix_len = tl.load(prefix_lens_ptr + g)
    start = part * partition_size
    if first_member >= g_end or start >= prefix_len:
        return  # stage 2 reads only partitions below the prefix's length
    end = tl.minimum(start + partition_size, prefix_len)

    rows = tl.arange(0, BLOCK_M)
    member = first_member + rows // GROUP
    row_ok = (rows < TILE_SEQS * GROUP) & (member < g_end)
    seq = tl.load(group_rows_ptr + member, mask=row_ok, other=0)
    q_heads = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = tiles.dims_in_head(dims, HEAD_DIM, HEAD_PAD)
    q = tiles.scaled_q(
        q_ptr + seq[:, None].to(tl.int64) * stride_qs + q_heads[:, None] * stride_qh + dims[None, :] * stride_qd,
        row_ok[:, None] & dim_ok[None, :], qk_scale,
    )
    if SLIDING:  # each row's oldest key inside its window; the walk starts at the earliest of them
        seq_len = tl.load(seq_lens_ptr + seq, mask=row_ok, other=0)
        first = tl.where(row_ok, tl.maximum(seq_len - window, 0), end)
        start = tl.maximum(start, tl.min(first, 0))

    m_i, l_i, acc = tiles.softmax_start(BLOCK_M, HEAD_PAD)
    table_row = block_tables_ptr + tl.load(group_rows_ptr + g_begin).to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch + dims[None, :] * stride_cd
    for tile in range(start, end, BLOCK_N):
        tokens, tok_ok, k, v = tiles.kv_tile(
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_row, head_off, kv_head, tile, end, dim_ok,
            stride_cb, stride_co, stride_ch, q.dtype, HEAD_DIM, BLOCK_N, BLOCK_SIZE, KV_FP8,
        )
        s = tiles.qk_scores(q, k, softcap, DOT_FP32, FP32_DOT, SOFTCAP)
        seen = tok_ok[None, :]
        if SLIDING:
            seen = seen & (tokens[None, :] >= first[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: weights 0, not NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        acc, l_i = tiles.softmax_accumulate(acc, l_i, p, alpha, v, DOT_FP32, FP32_DOT)
        m_i = m_new

    slot = (seq * (GROUP * tl.num_programs(1)) + q_heads).to(tl.int64) * num_partitions + part
    tl.store(part_max_ptr + slot, m_i, mask=row_ok)
    tl.store(part_sum_ptr + slot, l_i, mask=row_ok)
    tl.store(part_acc_ptr + slot[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])


def plan_cascade(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, layout: CascadeLayout, scale: float, out: torch.Tensor, on_gpu: bool,
    num_sms: int = 132, workspace: DecodeWorkspace | None = None, window: int = 0, softcap: float = 0.0,
    partition_size: int | None = None,
) -> list[Launch]:
    """The shared part's launch, then the own part's stage 1 and 2 (plan_decode with a CascadeReduce).
    partition_size (tests): both parts' partition size, else each picked as plain decode picks it."""
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    k_scale, v_scale, fp8 = tiles.check_attention("cascade decode", q, k_cache, v_cache, out)
    if layout.suffix_starts.shape != (num_seqs,):
        raise ValueError("cascade decode: the layout's suffix_starts do not match q's num_seqs")
    if num_seqs == 0:
        return []
    group = num_q_heads // num_kv_heads
    # GPU dots need >= 16 rows, and a tile of 64 rows shares each K/V tile among 64 / group members; the
    # interpreter runs numpy: two members a tile, so the tests cross tile edges inside a group
    block_m = max(16, min(64, triton.next_power_of_2(4 * group)), triton.next_power_of_2(group)) if on_gpu \
        else triton.next_power_of_2(2 * group)
    tile_seqs = block_m // group
    num_grouped = layout.group_rows.shape[0]
    num_tiles = num_grouped // tile_seqs + layout.num_groups
    prefix_width = max(1, layout.max_prefix_len)
    prefix_partition = partition_size or pick_partition_size(prefix_width, max(1, num_tiles), num_kv_heads,
                                                             num_sms if on_gpu else 1)
    prefix_parts = triton.cdiv(prefix_width, prefix_partition)
    part_max = torch.empty(num_seqs, num_q_heads, prefix_parts, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty(num_seqs, num_q_heads, prefix_parts, head_dim, dtype=torch.float32, device=q.device)
    launches = []
    if layout.num_groups:
        launches.append(Launch(
            _cascade_prefix_kernel,
            (num_tiles, num_kv_heads, prefix_parts),
            (
                q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens,
                layout.group_rows, layout.group_starts, layout.prefix_lens, part_max, part_sum, part_acc,
                scale * tiles.LOG2E, layout.num_groups, prefix_partition, prefix_parts, window,
                softcap * tiles.LOG2E, *q.stride(), *k_cache.stride(), block_tables.stride(0),
            ),
            {
                "GROUP": group, "BLOCK_M": block_m, "TILE_SEQS": tile_seqs, "HEAD_DIM": head_dim,
                "HEAD_PAD": head_pad(head_dim),
                "BLOCK_N": decode_block_n(head_pad(head_dim), q.element_size(), fp8) if on_gpu else 32,
                "BLOCK_SIZE": block_size, "DOT_FP32": (not on_gpu) or q.dtype == torch.float32,
                "FP32_DOT": "tf32x3" if on_gpu else "ieee", "SLIDING": window > 0, "SOFTCAP": softcap > 0,
                "KV_FP8": fp8, "num_warps": 4, "num_stages": 3,
            },
        ))
    reduce = CascadeReduce(layout.suffix_starts, part_max, part_sum, part_acc, prefix_partition, prefix_parts)
    return launches + plan_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out, on_gpu, partition_size,
                                  num_sms, workspace, window, softcap, cascade=reduce)


def cascade_decode_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, layout: CascadeLayout, scale: float, *, out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None, window: int = 0, softcap: float = 0.0,
    partition_size: int | None = None,
) -> torch.Tensor:
    """paged_decode_attention_triton's result, as a cascade over the layout's groups (module docstring)."""
    out = attention_out(_cascade_prefix_kernel, q, out)
    sms = num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device()) if q.is_cuda else 1
    for launch in plan_cascade(q, k_cache, v_cache, block_tables, seq_lens, layout, scale, out, q.is_cuda, sms,
                               workspace, window, softcap, partition_size):
        launch()
    return out
