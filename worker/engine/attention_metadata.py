"""How the flat token batch of one step maps onto sequences and KV-cache slots.

The batch holds the prefill tokens first (sequences feeding more than one token: prompt chunks), then the
decode tokens (one per sequence). Attention runs the prefill kernel on the first part and the decode
kernel on the rest; both read the K/V that write_kv has just stored (paged_attention, every model's).
`cascade` (tokenbus_kernels/cascade.py), when set, groups the decode rows that share their first KV blocks: the decode
kernel then reads those once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenbus_kernels.cascade import CascadeLayout


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


def paged_attention(backend: Any, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                    meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                    causal: bool = True) -> torch.Tensor:
    """A layer's attention over the paged cache, its new tokens' K/V already written: the backend's prefill
    kernel on the prefill rows (causal False: an encoder's, every key of the sequence), its decode kernel on the
    rest (one query each, which sees every key either way)."""
    k_cache, v_cache = kv_cache
    p = meta.num_prefill_tokens

    def decode(rows: torch.Tensor) -> torch.Tensor:
        return backend.decode_attention(rows, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                        scale, window, softcap, meta.cascade)

    if p == 0:  # a pure decode step (most steps): the kernel's output is the attention output
        return decode(q)
    out = torch.empty_like(q)
    out[:p] = backend.prefill_attention(q[:p], k_cache, v_cache, meta.prefill_block_tables,
                                        meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, scale, window, softcap,
                                        causal)
    if p < q.shape[0]:
        out[p:] = decode(q[p:])
    return out
