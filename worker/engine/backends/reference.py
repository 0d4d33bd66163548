"""ReferenceBackend: every operation of a step in plain PyTorch, through tokenbus_kernels/reference.py (the definition
of correct). The other backends subclass it and replace what they run faster; what they do not replace runs
as here.

The layer ops are Hugging Face's arithmetic (normalise in fp32, scale in the model dtype; rotate-half RoPE),
so a model served by this backend matches `transformers` token for token in float32. add_rms_norm and rotary
work in place, as every backend's do: their inputs are a step's intermediates, used once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tokenbus_kernels.cascade import CascadeLayout, cascade_decode_attention_ref
from tokenbus_kernels.reference import (
    add_rms_norm_ref,
    gelu_ref,
    gelu_tanh_and_mul_ref,
    layer_norm_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    rms_norm_ref,
    rotary_ref,
    silu_and_mul_ref,
    write_kv_ref,
)

if TYPE_CHECKING:
    from worker.engine.attention_metadata import AttentionMetadata
    from worker.engine.lora.layer import LoraBatch, LoraState


class ReferenceBackend:
    name = "torch-reference"
    # the model's adapters' shared state, when the engine serves LoRA (lora/manager.py sets it): a backend that
    # fuses whole layers (CpuBackend) runs a step with adapter rows layer by layer instead
    lora_state: LoraState | None = None
    # the rank's TpGroup when the engine is one rank of a tensor-parallel worker (worker/engine/parallel/):
    # the model sizes its sharded layers by it and sums row-parallel outputs through all_reduce
    tp: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel output summed over the ranks (as it is without tensor parallelism)."""
        return x if self.tp is None else self.tp.all_reduce(x)

    def check_model(self, arch: Any, model_name: str) -> None:
        """Raises ValueError naming the model and the limit when the kernels cannot serve its shapes."""

    def prepare(self, model: torch.nn.Module) -> None:
        """Called once the weights are loaded: a backend may repack or replace modules here."""

    def reserve(self, arch: Any, max_num_seqs: int, max_context: int, device: torch.device) -> None:
        """Called once the engine knows its widest batch and table: a backend may preallocate workspaces."""

    # ---- attention over the paged KV cache (tokenbus_kernels/reference.py has the shapes) --------------------------

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping)

    # window: the layer's sliding window (0 = none); softcap: attention-logit soft-capping (0 = none);
    # cascade: the step's groups of rows sharing a prefix (tokenbus_kernels/cascade.py), None = plain decode
    # causal False (prefill): every query sees all its sequence's keys (an encoder's bidirectional attention)
    def decode_attention(self, q, k_cache, v_cache, block_tables, seq_lens, scale: float, window: int = 0,
                         softcap: float = 0.0, cascade: CascadeLayout | None = None) -> torch.Tensor:
        if cascade is not None:
            return cascade_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, cascade, scale, window,
                                                softcap)
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap)

    def prefill_attention(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                          scale: float, window: int = 0, softcap: float = 0.0, causal: bool = True) -> torch.Tensor:
        return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                           window, softcap, causal)

    # ---- the elementwise parts of a decoder layer ---------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [n, hidden] or [n, heads, head_dim] (a QK-norm's strided view) -> a new normalised tensor."""
        return rms_norm_ref(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """In place: residual += x, x = rms_norm(residual). Returns (x, residual)."""
        return add_rms_norm_ref(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2 * inter] -> silu(gate) * up, [n, inter]."""
        return silu_and_mul_ref(gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2 * inter] -> gelu_tanh(gate) * up, [n, inter] (Gemma's GeGLU)."""
        return gelu_tanh_and_mul_ref(gate_up)

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        """[n, hidden] -> LayerNorm(x) with weight and bias (an encoder's norm)."""
        return layer_norm_ref(x, weight, bias, eps)

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        """The exact (erf) GELU of an encoder's feed-forward."""
        return gelu_ref(x)

    def linear_gelu(self, linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """gelu(linear(x)): an encoder's feed-forward up-projection and its activation (one call where a
        backend fuses them)."""
        return self.gelu(linear(x))

    def linear_add(self, linear: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """linear(x) + residual: an encoder's output projections before their post-norm (one call where a
        backend fuses them)."""
        return linear(x) + residual

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """In place: q [n, hq, d] and k [n, hk, d] rotated by cos, sin [n, 1, d]. Returns (q, k)."""
        return rotary_ref(q, k, cos, sin)

    def rotary_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> torch.Tensor:
        """q rotated (returned); rotated k and v written into the paged cache. k may be left rotated or not:
        attention reads K back from the cache."""
        q, k = self.rotary(q, k, cos, sin)
        self.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        """A mixture-of-experts layer's experts, weighted and summed (shapes: tokenbus_kernels/moe_reference.py)."""
        from tokenbus_kernels.moe_reference import fused_moe_ref

        return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)

    def lora(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             slices: tuple[tuple[int, int], ...], batch: LoraBatch) -> torch.Tensor:
        """In place: y += (x · A_slot) · B_slot for every row of the batch that uses an adapter (tokenbus_kernels/
        lora_reference.py has the layout): grouped torch matmuls, one shrink and one expand a slice per slot."""
        from tokenbus_kernels.lora_reference import lora_apply_ref

        return lora_apply_ref(y, x, a, b, slices, batch.rows, batch.groups)

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

