"""TritonBackend: paged attention and the KV write in our Triton kernels (kernels/*.py); CUDA tensors, or
CPU tensors under TRITON_INTERPRET=1 (tests). The layer ops still run as in the ReferenceBackend."""

from __future__ import annotations

import torch

from worker.engine.backends.reference import ReferenceBackend


class TritonBackend(ReferenceBackend):
    def __init__(self, interpreted: bool = False) -> None:
        # imported here, not at module level: Triton must see TRITON_INTERPRET before these modules load
        from kernels.decode_attention import paged_decode_attention_triton
        from kernels.kv_write import write_kv_triton
        from kernels.prefill_attention import paged_prefill_attention_triton

        self.name = "triton-interpreter" if interpreted else "triton"
        self._write_kv = write_kv_triton
        self._decode = paged_decode_attention_triton
        self._prefill = paged_prefill_attention_triton

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self._write_kv(k, v, k_cache, v_cache, slot_mapping)

    def decode_attention(self, q, k_cache, v_cache, block_tables, seq_lens, scale: float) -> torch.Tensor:
        return self._decode(q, k_cache, v_cache, block_tables, seq_lens, scale)

    def prefill_attention(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                          scale: float) -> torch.Tensor:
        return self._prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
