"""ReferenceBackend: every operation of a step in plain PyTorch. The other backends subclass it and replace
what they run faster; what they do not replace runs as here.

The layer ops are Hugging Face's arithmetic (normalise in fp32, scale in the model dtype; rotate-half RoPE),
so a model served by this backend matches `transformers` token for token in float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref, write_kv_ref

if TYPE_CHECKING:
    from worker.engine.attention_metadata import AttentionMetadata


class ReferenceBackend:
    name = "torch-reference"

    def prepare(self, model: torch.nn.Module) -> None:
        """Called once the weights are loaded: a backend may repack or replace modules here."""

    # ---- attention over the paged KV cache (kernels/reference.py has the shapes) --------------------------

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping)

    def decode_attention(self, q, k_cache, v_cache, block_tables, seq_lens, scale: float) -> torch.Tensor:
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)

    def prefill_attention(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                          scale: float) -> torch.Tensor:
        return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)

    # ---- the elementwise parts of a decoder layer ---------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x). Subclasses may write both into x and residual."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2 * inter] -> silu(gate) * up, [n, inter]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, hq, d], k [n, hk, d]; cos, sin [n, 1, d]. Subclasses may rotate q and k in place."""
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    # ---- whole layers and sampling ------------------------------------------------------------------------

    def run_layers(self, model: torch.nn.Module, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers one after another: (last output, residual before it)."""
        residual = None
        for layer, kv_cache in zip(model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rotary, kv_cache, meta)
        return x, residual

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] -> each row's first maximum (int64)."""
        return logits.argmax(dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
