"""Start-up work on a GPU: the memory plan and the kernel warm-up, before the engine takes its first request.

    profile_peak   a forward at max_num_batched_tokens (one long prompt chunk, plus the logits of
                   max_num_seqs rows) over a throwaway KV cache: its peak allocation, weights included, is
                   what a step may need on top of the KV cache
    decode_peak    the same for a padded decode step at the widest bucket: what the CUDA graphs' private
                   memory pool holds (counted apart: the graphs keep it); with cascade graphs, the larger of
                   the plain step and the cascade one (its prefix partials)
    warm_up        runs each kernel variant the serve loop hits, so no request waits for Triton to compile:
                   Triton compiles one variant per specialization (constexprs; an int argument == 1, or a
                   multiple of 16, or neither; a pointer 16-byte aligned or not), so warm-up feeds what serving
                   feeds: block tables that are row views of a [rows, max_blocks_per_seq] table (the row
                   stride serving has), prefills of 1, 2 and 16 sequences, mixed prefill + decode steps, eager
                   decodes at every table-width bucket (1, several and 16+ partitions), then every padded
                   decode shape (rows, width) (tests/engine/test_warmup_coverage.py records both sides)

The engine sizes the KV cache as total x gpu_memory_utilization - profile_peak - decode_peak (graphs on).
"""

from __future__ import annotations

import dataclasses

import torch

from tokenbus_kernels.cascade import CascadeLayout
from tokenbus_kernels.partitions import table_widths
from worker.engine import kv_cache
from worker.engine.attention_metadata import AttentionMetadata


def _caches(model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
            device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """dtype: the KV cache's (tokenbus_kernels/kv_quant.py)."""
    return kv_cache.allocate(model.arch, num_blocks, block_size, dtype, device)


def prefill_meta(num_tokens: int, block_size: int, device: torch.device, first_block: int = 0) -> AttentionMetadata:
    """One prompt chunk of num_tokens tokens in blocks first_block, first_block + 1, ..."""
    blocks = -(-num_tokens // block_size)
    table = torch.arange(first_block, first_block + blocks, dtype=torch.int32, device=device)[None]
    return AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device) + first_block * block_size,
        num_prefill_tokens=num_tokens, prefill_block_tables=table,
        prefill_cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        prefill_seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        decode_block_tables=None, decode_seq_lens=None,
    )


def decode_meta(num_seqs: int, width: int, block: int, block_size: int, device: torch.device,
                row_stride: int | None = None) -> AttentionMetadata:
    """num_seqs one-token decodes, every one writing into and reading from `block` (tables width wide). With
    row_stride the tables are views of rows that wide, as StepInputs hands them on a GPU."""
    return AttentionMetadata(
        slot_mapping=torch.full((num_seqs,), block * block_size, dtype=torch.int64, device=device),
        num_prefill_tokens=0, prefill_block_tables=None, prefill_cu_seqlens_q=None, prefill_seq_lens=None,
        decode_block_tables=_table(num_seqs, width, block, device, row_stride),
        decode_seq_lens=torch.ones(num_seqs, dtype=torch.int32, device=device),
    )


def _table(rows: int, width: int, block: int, device: torch.device, row_stride: int | None) -> torch.Tensor:
    return torch.full((rows, row_stride or width), block, dtype=torch.int32, device=device)[:, :width]


def serving_meta(num_prefill: int, num_decode: int, block: int, block_size: int, row_stride: int,
                 device: torch.device) -> AttentionMetadata:
    """A step as StepInputs builds one: num_prefill two-token prompt chunks then num_decode one-token decodes,
    all in `block`, tables one block wide as views of rows row_stride wide."""
    p = 2 * num_prefill
    tokens = p + num_decode
    return AttentionMetadata(
        slot_mapping=(torch.arange(tokens, device=device) % 2) + block * block_size,
        num_prefill_tokens=p,
        prefill_block_tables=_table(num_prefill, 1, block, device, row_stride) if num_prefill else None,
        prefill_cu_seqlens_q=torch.arange(0, p + 1, 2, dtype=torch.int32, device=device) if num_prefill else None,
        prefill_seq_lens=torch.full((num_prefill,), 2, dtype=torch.int32, device=device) if num_prefill else None,
        decode_block_tables=_table(num_decode, 1, block, device, row_stride) if num_decode else None,
        decode_seq_lens=torch.ones(num_decode, dtype=torch.int32, device=device) if num_decode else None,
    )


def _forward(model, num_tokens: int, kv, meta, logits_rows: int) -> None:
    device = kv[0][0].device
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    rotary = getattr(model, "rotary", None)  # an encoder has a learned position table instead
    span = rotary.cos.shape[0] if rotary is not None else model.arch.max_position_embeddings
    positions = torch.arange(num_tokens, device=device) % span  # inside the position table
    hidden = model(ids, positions, kv, meta)
    if getattr(model, "can_generate", True):
        model.compute_logits(hidden[:logits_rows]).float().softmax(-1)  # a sampler-sized [rows, vocab] in fp32


@torch.inference_mode()
def profile_peak(model, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> int:
    """Peak bytes allocated (weights included) by the largest step; CUDA only."""
    tokens = min(max_num_batched_tokens, max_model_len)
    kv = _caches(model, -(-tokens // block_size), block_size, dtype, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    _forward(model, tokens, kv, prefill_meta(tokens, block_size, device), min(max_num_seqs, tokens))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del kv
    torch.cuda.empty_cache()
    return peak


@torch.inference_mode()
def decode_peak(model, num_seqs: int, width: int, block_size: int, dtype: torch.dtype, device: torch.device,
                cascade_groups: int = 0) -> int:
    """Bytes a padded decode step of num_seqs rows allocates above what is held before it; CUDA only.
    cascade_groups: as a cascade graph runs it, over a layout padded to that many groups (cuda_graphs.py)."""
    kv = _caches(model, 1, block_size, dtype, device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    meta = decode_meta(num_seqs, width, 0, block_size, device)
    if cascade_groups:  # the prefix stage's partials, sized by the bound the graph captures: the table width
        layout = CascadeLayout.build([], num_seqs, device, cascade_groups)
        meta.cascade = dataclasses.replace(layout, max_prefix_len=width * block_size)
    _forward(model, num_seqs, kv, meta, 0)
    torch.cuda.synchronize(device)
    grown = torch.cuda.max_memory_allocated(device) - before
    del kv
    torch.cuda.empty_cache()
    return grown


@torch.inference_mode()
def warm_up(model, kv_caches, pad_block: int, block_size: int, max_blocks_per_seq: int, max_num_seqs: int,
            max_num_batched_tokens: int, shapes: list[tuple[int, int]] | None) -> None:
    """Each kernel variant once, writing only into the pad block. shapes: the padded decode steps (rows,
    table width) to run eagerly (None when CUDA graphs capture them: the capture runs each first)."""
    device = kv_caches[0][0].device
    stride = max_blocks_per_seq

    def run(num_prefill: int, num_decode: int) -> None:
        if num_prefill <= max_num_seqs and num_decode <= max_num_seqs and \
                2 * num_prefill + num_decode <= max_num_batched_tokens:
            meta = serving_meta(num_prefill, num_decode, pad_block, block_size, stride, device)
            _forward(model, 2 * num_prefill + num_decode, kv_caches, meta, num_prefill + num_decode)

    # prefill of 1, 2 and 16 sequences (an int argument specialises on == 1 and on % 16), alone and with decodes
    for num_prefill in (1, 2, 16):
        run(num_prefill, 0)
        run(num_prefill, 1)
    # eager decodes (mixed steps; graphs off) at every width bucket: one partition, several, 16 and more
    for rows in sorted({1, max_num_seqs}):
        for width in table_widths(max_blocks_per_seq, block_size):
            meta = decode_meta(rows, width, pad_block, block_size, device, stride)
            _forward(model, rows, kv_caches, meta, rows)
    for rows, width in shapes or []:
        _forward(model, rows, kv_caches, decode_meta(rows, width, pad_block, block_size, device, stride), rows)

