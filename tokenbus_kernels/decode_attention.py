"""Triton kernels: paged decode attention, split-KV (flash-decoding).

q             [num_seqs, num_q_heads, head_dim] (any strides): one new token per sequence
k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim] (any strides, both caches alike), q's dtype;
              or fp8 (float8_e4m3fn, --kv-cache-dtype fp8), contiguous [..., head_dim + 4]: each row's codes
              then its fp32 scale (tokenbus_kernels/kv_quant.py). A K/V tile is dequantized in registers right after
              its load (codes * scale, in q's dtype), so everything after it runs as for a q-dtype cache.
block_tables  int32 [num_seqs, max_blocks_per_seq]; seq_lens int32 [num_seqs]
window        a layer's sliding window (0 = none): sequence i sees only its last `window` tokens
softcap       attention-logit soft-capping (0 = none): s -> softcap * tanh(s / softcap)
out           [num_seqs, num_q_heads, head_dim], contiguous, dtype of q

Stage 1, _decode_partition_kernel, grid (num_seqs, num_kv_heads, num_partitions): each program takes one
slice of partition_size context tokens of one sequence and one KV head, walks it in BLOCK_N-token tiles
gathered through the block table, and scores every tile against all `group = num_q_heads // num_kv_heads`
query heads of that KV head at once (a [GROUP_PAD, D] x [D, BLOCK_N] dot), so each K/V tile is loaded once
per group. It keeps an online softmax in fp32 and writes the partition's running max, sum and unnormalised
accumulator to fp32 partials [num_seqs, num_q_heads, num_partitions(, head_dim)].
Stage 2, _decode_reduce_kernel, grid (num_seqs, num_q_heads): merges a sequence's partitions.
When one partition covers every context, stage 1 normalises and writes `out` itself and stage 2 is skipped.
With a window (SLIDING), a sequence's keys start at seq_len - window: stage 1 starts its tiles there and
partitions wholly before it exit at once; stage 2 merges only the partitions from the window's first on.
Window and soft-capping are constexpr switches, so a model without them runs the kernel it always ran.

num_partitions comes from block_tables.shape[1] (no device->host sync); partitions past a sequence's
length exit at once, so callers hand a table cut to the step's longest context (tokenbus_kernels/partitions.py).
The partition size is chosen so that num_seqs * num_kv_heads * num_partitions gives
the GPU a few waves of programs: a few long sequences still fill it. A DecodeWorkspace holds the partials
allocated once (the engine's, sized for its widest batch and table), so a step allocates nothing and a
fixed-width table gives a fixed partition count: what a CUDA graph replays.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenbus_kernels import attention_tiles as tiles
from tokenbus_kernels.launch import Launch, attention_out, head_pad
from tokenbus_kernels.partitions import MAX_PARTITION, MIN_PARTITION, pick_partition_size  # noqa: F401 (re-exported)


@triton.jit
def _decode_partition_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, suffix_starts_ptr,
    qk_scale, partition_size, num_partitions, window, softcap,
    stride_qs, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_bt,
    stride_os, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SINGLE_PARTITION: tl.constexpr, DOT_FP32: tl.constexpr,
    FP32_DOT: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr,
    CASCADE: tl.constexpr,
):
    """Grid (num_seqs, num_kv_heads, num_partitions): one context slice x one KV head x its GROUP q heads.
    Writes fp32 partials [num_seqs, num_q_heads, num_partitions(, HEAD_DIM)], or `out` if SINGLE_PARTITION.
    softcap arrives pre-multiplied by log2(e), as the scores are (they are in log2 units). CASCADE: only the
    sequence's own tokens, from suffix_starts[seq] (cascade_attention.py reads the shared ones)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * partition_size
    if start >= seq_len:
        return
    end = tl.minimum(start + partition_size, seq_len)
    if SLIDING:
        first = tl.maximum(seq_len - window, 0)  # the oldest key still inside the window
        if end <= first:
            return  # stage 2 starts at the window's first partition and never reads this one
        start = tl.maximum(start, first)
    if CASCADE:
        start = tl.maximum(start, tl.load(suffix_starts_ptr + seq))
        if start >= end:
            return  # stage 2 starts at the own part's first partition and never reads this one

    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    q_heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = tiles.dims_in_head(dims, HEAD_DIM, HEAD_PAD)
    q = tiles.scaled_q(
        q_ptr + seq * stride_qs + q_heads[:, None] * stride_qh + dims[None, :] * stride_qd,
        row_ok[:, None] & dim_ok[None, :], qk_scale,
    )

    m_i, l_i, acc = tiles.softmax_start(GROUP_PAD, HEAD_PAD)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch + dims[None, :] * stride_cd
    for tile in range(start, end, BLOCK_N):
        tokens, tok_ok, k, v = tiles.kv_tile(
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_row, head_off, kv_head, tile, end, dim_ok,
            stride_cb, stride_co, stride_ch, q.dtype, HEAD_DIM, BLOCK_N, BLOCK_SIZE, KV_FP8,
        )
        s = tiles.qk_scores(q, k, softcap, DOT_FP32, FP32_DOT, SOFTCAP)
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        acc, l_i = tiles.softmax_accumulate(acc, l_i, p, alpha, v, DOT_FP32, FP32_DOT)
        m_i = m_new

    if SINGLE_PARTITION:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_os + q_heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        # partials are contiguous [num_seqs, num_q_heads, num_partitions(, HEAD_DIM)]
        slot = (seq * (GROUP * tl.num_programs(1)) + q_heads).to(tl.int64) * num_partitions + part
        tl.store(part_max_ptr + slot, m_i, mask=row_ok)
        tl.store(part_sum_ptr + slot, l_i, mask=row_ok)
        tl.store(part_acc_ptr + slot[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _merge_partials(m_run, l_run, acc, part_max_ptr, part_sum_ptr, part_acc_ptr, base, first, used, dims, dim_ok,
                    HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr):
    """The running (max, sum, acc) of one (sequence, head) with partials first..used-1 at base merged in,
    BLOCK_P at a time. A partial may be empty (max -inf, sum 0: a cascade row whose window starts past the
    shared prefix); a max still -inf after a chunk is taken as 0, so e^(-inf - 0) weighs it 0, not NaN."""
    for chunk in range(first, used, BLOCK_P):
        parts = chunk + tl.arange(0, BLOCK_P)
        ok = parts < used
        m_p = tl.load(part_max_ptr + base + parts, mask=ok, other=float("-inf"))
        l_p = tl.load(part_sum_ptr + base + parts, mask=ok, other=0.0)
        a_p = tl.load(part_acc_ptr + (base + parts)[:, None] * HEAD_DIM + dims[None, :],
                      mask=ok[:, None] & dim_ok[None, :], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_p, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_safe)
        w = tl.where(ok, tl.exp2(m_p - m_safe), 0.0)
        l_run = l_run * alpha + tl.sum(l_p * w, 0)
        acc = acc * alpha + tl.sum(a_p * w[:, None], 0)
        m_run = m_new
    return m_run, l_run, acc


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, seq_lens_ptr,
    partition_size, num_partitions, window,
    stride_os, stride_oh,
    suffix_starts_ptr, prefix_max_ptr, prefix_sum_ptr, prefix_acc_ptr, prefix_partition, prefix_partitions,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_P: tl.constexpr, SLIDING: tl.constexpr,
    CASCADE: tl.constexpr,
):
    """Grid (num_seqs, num_q_heads): merge the sequence's used partitions, BLOCK_P at a time -> out[seq, head].
    CASCADE: first the partials of its group's shared prefix (cascade_attention.py; [num_seqs, num_q_heads,
    prefix_partitions], prefix_partition tokens each), then those of its own tokens from suffix_starts[seq]."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    used = tl.cdiv(seq_len, partition_size)
    lo = 0
    if SLIDING:
        lo = tl.maximum(seq_len - window, 0)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = tiles.dims_in_head(dims, HEAD_DIM, HEAD_PAD)

    m_run = float("-inf")
    l_run = 0.0
    acc = tl.zeros([HEAD_PAD], tl.float32)
    if CASCADE:
        own = tl.load(suffix_starts_ptr + seq)  # its group's prefix length, 0 for a row in none
        lo = tl.maximum(lo, own)
        used = tl.where(lo < seq_len, used, 0)  # a suffix of zero tokens: no partition of its own
        shared_base = (seq * tl.num_programs(1) + head).to(tl.int64) * prefix_partitions
        m_run, l_run, acc = _merge_partials(m_run, l_run, acc, prefix_max_ptr, prefix_sum_ptr, prefix_acc_ptr,
                                            shared_base, 0, tl.cdiv(own, prefix_partition), dims, dim_ok,
                                            HEAD_DIM, BLOCK_P)
    base = (seq * tl.num_programs(1) + head).to(tl.int64) * num_partitions
    m_run, l_run, acc = _merge_partials(m_run, l_run, acc, part_max_ptr, part_sum_ptr, part_acc_ptr, base,
                                        lo // partition_size, used, dims, dim_ok, HEAD_DIM, BLOCK_P)
    out = acc / l_run
    tl.store(out_ptr + seq * stride_os + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def decode_block_n(head_dim: int, elem: int, fp8: bool) -> int:
    """Tokens per K/V tile on a GPU: 16 KiB of K per tile. An fp8 tile is held twice, as codes and dequantized,
    so from head_dim 128 (bf16) it takes half as many tokens: 64 spilled 24 bytes of registers on sm_90."""
    block_n = min(128, 16384 // (head_dim * elem))
    return block_n // 2 if fp8 and head_dim * elem >= 256 else block_n


@functools.cache
def num_sms(device_index: int) -> int:
    """The GPU's multiprocessor count, asked once per device (the query costs microseconds per call)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


class CascadeReduce(NamedTuple):
    """What stage 1 and 2 of a cascade's own part need from its shared part (cascade_attention.py): where each
    row's own tokens start, and the shared part's partials [num_seqs, num_q_heads, num_partitions(, head_dim)]
    of partition_size tokens each."""

    suffix_starts: torch.Tensor
    part_max: torch.Tensor
    part_sum: torch.Tensor
    part_acc: torch.Tensor
    partition_size: int
    num_partitions: int


class DecodeWorkspace:
    """fp32 partials [num_seqs, num_q_heads, num_partitions(, head_dim)] preallocated for any call up to
    `capacity` (num_seqs * num_q_heads * num_partitions) rows; every layer of a step reuses them in turn."""

    def __init__(self, capacity: int, head_dim: int, device: torch.device) -> None:
        self.capacity = capacity
        self.stats = torch.empty(2, capacity, dtype=torch.float32, device=device)
        self.acc = torch.empty(capacity, head_dim, dtype=torch.float32, device=device)

    @classmethod
    def for_batches(cls, max_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_context: int,
                    device: torch.device, sms: int) -> DecodeWorkspace:
        """Enough for every batch of up to max_seqs sequences over tables of up to max_context tokens."""
        widest = max(
            s * triton.cdiv(max_context, pick_partition_size(max_context, s, num_kv_heads, sms))
            for s in range(1, max_seqs + 1)
        )
        return cls(widest * num_q_heads, head_dim, device)

    def partials(self, num_seqs: int, num_q_heads: int, num_partitions: int):
        """(max, sum, acc) views for this call, or None when it needs more than the workspace holds."""
        n = num_seqs * num_q_heads * num_partitions
        if n > self.capacity:
            return None
        shape = (num_seqs, num_q_heads, num_partitions)
        return self.stats[0, :n].view(shape), self.stats[1, :n].view(shape), self.acc[:n].view(*shape, -1)


def plan_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    on_gpu: bool,
    partition_size: int | None = None,
    num_sms: int = 132,
    workspace: DecodeWorkspace | None = None,
    window: int = 0,
    softcap: float = 0.0,
    cascade: CascadeReduce | None = None,
) -> list[Launch]:
    """Stage 1 and (unless one partition covers every context) stage 2. cascade: the own-part launches of a
    cascade (cascade_attention.py plans the shared part): stage 1 from each row's suffix start, and stage 2,
    always run, merging the shared partials in first."""
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    k_scale, v_scale, fp8 = tiles.check_attention("decode", q, k_cache, v_cache, out)
    if block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError("decode: block_tables / seq_lens do not match q's num_seqs")
    if num_seqs == 0:
        return []

    group = num_q_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    if partition_size is None:
        partition_size = pick_partition_size(max_context, num_seqs, num_kv_heads, num_sms if on_gpu else 1)
    num_partitions = max(1, triton.cdiv(max_context, partition_size))
    single = num_partitions == 1 and cascade is None
    # GPU dots need >= 16 rows; the interpreter runs numpy and wants the smallest tiles.
    group_pad = max(16, triton.next_power_of_2(group)) if on_gpu else triton.next_power_of_2(group)
    reserved = None if single or workspace is None else workspace.partials(num_seqs, num_q_heads, num_partitions)
    if single:
        part_max = part_sum = part_acc = out  # not touched by the single-partition variant
    elif reserved is not None:
        part_max, part_sum, part_acc = reserved
    else:
        part_max = torch.empty(num_seqs, num_q_heads, num_partitions, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(num_seqs, num_q_heads, num_partitions, head_dim, dtype=torch.float32,
                               device=q.device)
    stage1 = Launch(
        _decode_partition_kernel,
        (num_seqs, num_kv_heads, num_partitions),
        (
            q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens,
            out, part_max, part_sum, part_acc, cascade.suffix_starts if cascade else seq_lens,
            scale * tiles.LOG2E, partition_size, num_partitions, window, softcap * tiles.LOG2E,
            *q.stride(), *k_cache.stride(), block_tables.stride(0), out.stride(0), out.stride(1),
        ),
        {
            "GROUP": group, "GROUP_PAD": group_pad, "HEAD_DIM": head_dim, "HEAD_PAD": head_pad(head_dim),
            "BLOCK_N": decode_block_n(head_pad(head_dim), q.element_size(), fp8) if on_gpu else 64,
            "BLOCK_SIZE": block_size,
            "SINGLE_PARTITION": single, "DOT_FP32": (not on_gpu) or q.dtype == torch.float32,
            "FP32_DOT": "tf32x3" if on_gpu else "ieee", "SLIDING": window > 0, "SOFTCAP": softcap > 0,
            "KV_FP8": fp8, "CASCADE": cascade is not None, "num_warps": 4, "num_stages": 3,
        },
    )
    if single:
        return [stage1]
    shared = (cascade.suffix_starts, cascade.part_max, cascade.part_sum, cascade.part_acc, cascade.partition_size,
              cascade.num_partitions) if cascade else (seq_lens, part_max, part_sum, part_acc, 1, 1)  # unread
    stage2 = Launch(
        _decode_reduce_kernel,
        (num_seqs, num_q_heads),
        (out, part_max, part_sum, part_acc, seq_lens, partition_size, num_partitions, window, out.stride(0),
         out.stride(1), *shared),
        {"HEAD_DIM": head_dim, "HEAD_PAD": head_pad(head_dim), "BLOCK_P": 16, "SLIDING": window > 0,
         "CASCADE": cascade is not None, "num_warps": 4},
    )
    return [stage1, stage2]


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    partition_size: int | None = None,
    workspace: DecodeWorkspace | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Decode attention; see the module docstring. `out` and `partition_size` exist for tests/benchmarks."""
    out = attention_out(_decode_partition_kernel, q, out)
    sms = num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device()) if q.is_cuda else 1
    for launch in plan_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out, q.is_cuda,
                              partition_size, sms, workspace, window, softcap):
        launch()
    return out
