"""How the flat token batch of one step maps onto sequences and KV-cache slots.

The batch holds the prefill tokens first (sequences feeding more than one token: prompt chunks), then the
decode tokens (one per sequence). Attention runs the prefill kernel on the first part and the decode
kernel on the rest; both read the K/V that write_kv has just stored. `cascade` (kernels/cascade.py), when
set, groups the decode rows that share their first KV blocks: the decode kernel then reads those once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cascade import CascadeLayout


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    num_prefill_tokens: int
    # prefill part
    prefill_block_tables: torch.Tensor | None  # int32 [num_prefill_seqs, max_blocks]
    prefill_cu_seqlens_q: torch.Tensor | None  # int32 [num_prefill_seqs + 1]
    prefill_seq_lens: torch.Tensor | None  # int32 [num_prefill_seqs]
    # decode part
    decode_block_tables: torch.Tensor | None  # int32 [num_decode_seqs, max_blocks]
    decode_seq_lens: torch.Tensor | None  # int32 [num_decode_seqs]
    cascade: CascadeLayout | None = None  # the decode rows' shared prefixes, when cascading pays (cascade.py)
