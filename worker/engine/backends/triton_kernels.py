"""TritonBackend: a step's kernel-level ops in our Triton kernels (tokenbus_kernels/*.py) on CUDA tensors, or on CPU
tensors under TRITON_INTERPRET=1 (tests): paged attention, the KV write fused with RoPE, residual add +
RMSNorm, SiLU·mul, the LoRA shrink and expand. Each is one launch, with no host sync and no data-dependent
allocation, so a decode step can be captured in a CUDA graph."""

from __future__ import annotations

import torch

from tokenbus_kernels.cascade import CascadeLayout
from worker.engine.backends.reference import ReferenceBackend


class TritonBackend(ReferenceBackend):
    def __init__(self, interpreted: bool = False) -> None:
        # imported here, not at module level: Triton must see TRITON_INTERPRET before these modules load
        from tokenbus_kernels.activation import gelu_tanh_and_mul_triton, silu_and_mul_triton
        from tokenbus_kernels.cascade_attention import cascade_decode_attention_triton
        from tokenbus_kernels.decode_attention import DecodeWorkspace, num_sms, paged_decode_attention_triton
        from tokenbus_kernels.kv_write import write_kv_triton
        from tokenbus_kernels.lora import lora_expand_triton, lora_shrink_triton
        from tokenbus_kernels.moe import fused_moe_triton
        from tokenbus_kernels.norm import add_rms_norm_triton, rms_norm_triton
        from tokenbus_kernels.prefill_attention import paged_prefill_attention_triton
        from tokenbus_kernels.rope import rotary_triton, rotary_write_kv_triton

        self.name = "triton-interpreter" if interpreted else "triton"
        self._write_kv = write_kv_triton
        self._decode = paged_decode_attention_triton
        self._cascade = cascade_decode_attention_triton
        self._prefill = paged_prefill_attention_triton
        self._rms_norm = rms_norm_triton
        self._add_rms_norm = add_rms_norm_triton
        self._silu_and_mul = silu_and_mul_triton
        self._gelu_tanh_and_mul = gelu_tanh_and_mul_triton
        self._rotary = rotary_triton
        self._rotary_write_kv = rotary_write_kv_triton
        self._fused_moe = fused_moe_triton
        self._lora_shrink, self._lora_expand = lora_shrink_triton, lora_expand_triton
        self._workspace_type, self._num_sms = DecodeWorkspace, num_sms
        self.decode_workspace: DecodeWorkspace | None = None

    def check_model(self, arch, model_name: str) -> None:
        d = arch.head_dim
        if d % 2 or not 16 <= d <= 256:
            raise ValueError(
                f"model {model_name!r} has head_dim {d}; the Triton attention kernels take an even head_dim "
                "from 16 to 256 (non-powers of two such as 80 or 96 run padded)"
            )

    def reserve(self, arch, max_num_seqs: int, max_context: int, device: torch.device) -> None:
        """The decode partials, allocated once for the widest batch at the widest table (no per-layer
        allocation; a CUDA graph replays the same buffers)."""
        sms = self._num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else 1
        self.decode_workspace = self._workspace_type.for_batches(
            max_num_seqs, arch.num_heads, arch.num_kv_heads, arch.head_dim, max_context, device, sms)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self._write_kv(k, v, k_cache, v_cache, slot_mapping)

    def decode_attention(self, q, k_cache, v_cache, block_tables, seq_lens, scale: float, window: int = 0,
                         softcap: float = 0.0, cascade: CascadeLayout | None = None) -> torch.Tensor:
        if cascade is not None:  # rows sharing a prefix read it once (tokenbus_kernels/cascade_attention.py)
            return self._cascade(q, k_cache, v_cache, block_tables, seq_lens, cascade, scale,
                                 workspace=self.decode_workspace, window=window, softcap=softcap)
        return self._decode(q, k_cache, v_cache, block_tables, seq_lens, scale, workspace=self.decode_workspace,
                            window=window, softcap=softcap)

    def prefill_attention(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                          scale: float, window: int = 0, softcap: float = 0.0, causal: bool = True) -> torch.Tensor:
        return self._prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, window=window,
                             softcap=softcap, causal=causal)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._gelu_tanh_and_mul(gate_up)

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
        return self._fused_moe(x, w13, w2, topk_weights, topk_ids)

    def lora(self, y, x, a, b, slices, batch) -> torch.Tensor:
        """The SGMV shrink and expand kernels (tokenbus_kernels/lora.py), grid bounded by batch.max_count: no sync."""
        t = self._lora_shrink(x, a, batch.rows, batch.starts, batch.counts, batch.max_count)
        return self._lora_expand(y, t, b, slices, batch.rows, batch.starts, batch.counts, batch.max_count)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rotary(q, k, cos, sin)

    def rotary_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> torch.Tensor:
        if k_cache.dtype == torch.float8_e4m3fn:  # fp8 KV: rotate, then write_kv quantizes (rope.py stores plain)
            q, k = self._rotary(q, k, cos, sin)
            self._write_kv(k, v, k_cache, v_cache, slot_mapping)
            return q
        return self._rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
