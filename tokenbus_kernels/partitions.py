"""How split-KV decode attention (tokenbus_kernels/decode_attention.py) cuts a step's contexts into partitions, in plain
Python (no Triton import: the engine plans CUDA-graph shapes with it before any kernel module loads).

Stage 1 of the decode kernel runs a grid (num_seqs, num_kv_heads, num_partitions), where num_partitions
covers the table width (block_tables.shape[1] * block_size tokens); a program whose partition starts past
its sequence's length exits at once. So the width handed to the kernel decides how many programs are
launched for nothing: a padded decode step cuts the table to `table_widths`' bucket of the step's longest
context (worker/engine/cuda_graphs.py), not to max_model_len.
"""

from __future__ import annotations

MIN_PARTITION = 128
MAX_PARTITION = 1024


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def pick_partition_size(max_context: int, num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Power of two in [MIN_PARTITION, MAX_PARTITION] giving ~4 waves of stage-1 programs on the GPU."""
    wanted_parts = max(1, cdiv(4 * num_sms, max(1, num_seqs * num_kv_heads)))
    size = next_power_of_2(max(1, cdiv(max_context, wanted_parts)))
    return min(MAX_PARTITION, max(MIN_PARTITION, size))


def num_partitions(max_context: int, num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    return max(1, cdiv(max_context, pick_partition_size(max_context, num_seqs, num_kv_heads, num_sms)))


def table_widths(max_blocks_per_seq: int, block_size: int) -> list[int]:
    """Table widths (blocks) a padded decode step is cut to: MIN_PARTITION tokens' worth, doubling, the last
    one max_blocks_per_seq. Doubling keeps the idle share of a uniform batch under one half and the graph
    count logarithmic in max_model_len."""
    widths, w = [], max(1, MIN_PARTITION // block_size)
    while w < max_blocks_per_seq:
        widths.append(w)
        w *= 2
    return [*widths, max_blocks_per_seq]


def idle_programs(seq_lens: list[int], width_tokens: int, num_kv_heads: int, num_sms: int) -> tuple[int, int]:
    """(stage-1 programs that exit at once, stage-1 programs launched) for one decode call, as
    decode_attention.plan_decode launches it on a GPU with num_sms multiprocessors."""
    size = pick_partition_size(width_tokens, len(seq_lens), num_kv_heads, num_sms)
    parts = max(1, cdiv(width_tokens, size))
    idle = sum(parts - min(parts, cdiv(n, size)) for n in seq_lens) * num_kv_heads
    return idle, len(seq_lens) * num_kv_heads * parts
