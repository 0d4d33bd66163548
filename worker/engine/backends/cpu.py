"""CpuBackend: how a step runs on the CPU in float32 — the whole fast path in one place.

    attention, KV write   C++ kernels (tokenbus_kernels/csrc/cpu_*attention*) over a float32, bfloat16 or int8 cache: a
                          decode step's (a cascade where rows share a prefix: tokenbus_kernels/cascade.py), and a prompt
                          chunk's causal attention (tiles of query tokens per block)
    norms, SiLU·mul, RoPE one C++ pass each, in place where the layer allows it
    linear layers         CpuLinear (cpu_linear.py): a panel GEMV for decode-sized batches, oneDNN above
                          (an encoder's GELU and residual adds fused into oneDNN's call)
    a pure decode step    all decoder layers in one C++ call (cpu_decode.py), the same kernels in the same
                          order, so the same result to the bit
    greedy sampling       a row-wise argmax in C++
    LoRA adapters         decode-sized batches in C++ (csrc/cpu_lora.cpp), inside the fused decode step's call
                          too; prompt chunks as grouped torch matmuls
Anything a kernel does not take (a strided view it cannot read, other dtypes) runs as in the ReferenceBackend.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch

from tokenbus_kernels.cascade import CascadeLayout
from worker.engine.backends.cpu_decode import FusedDecodeLayers, cascade_tensors
from worker.engine.backends.cpu_linear import PANEL_MAX_ROWS, CpuLinear, use_cpu_linears
from worker.engine.backends.reference import ReferenceBackend

KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8)  # the caches the C++ attention reads

if TYPE_CHECKING:
    from worker.engine.attention_metadata import AttentionMetadata


class CpuBackend(ReferenceBackend):
    name = "cpu-cpp"

    def __init__(self, ext: ModuleType) -> None:
        self.ext = ext
        self.fused: FusedDecodeLayers | None = None

    def prepare(self, model: torch.nn.Module) -> None:
        use_cpu_linears(model, self.ext)
        # off under tensor parallelism: the one C++ call runs every layer with no way out between them, and a
        # sharded layer needs two all-reduces (after o_proj and down_proj); the per-layer path takes them
        self.fused = FusedDecodeLayers.build(model, self.ext) if self.tp is None else None

    # ---- attention ----------------------------------------------------------------------------------------

    @staticmethod
    def _takes(t: torch.Tensor, cache: torch.Tensor) -> bool:
        # the cache float32, or bfloat16 / int8 (--kv-cache-dtype, tokenbus_kernels/kv_quant.py): widened in registers
        return t.dtype == torch.float32 and cache.dtype in KV_DTYPES and t.stride(-1) == 1 and cache.is_contiguous()

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        if self._takes(k, k_cache) and v.stride(-1) == 1:
            self.ext.write_kv_cpu(k, v, k_cache, v_cache, slot_mapping)
        else:
            super().write_kv(k, v, k_cache, v_cache, slot_mapping)

    def decode_attention(self, q, k_cache, v_cache, block_tables, seq_lens, scale: float, window: int = 0,
                         softcap: float = 0.0, cascade: CascadeLayout | None = None) -> torch.Tensor:
        if not self._takes(q, k_cache):
            return super().decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap,
                                            cascade)
        if cascade is not None:  # rows sharing a prefix read it once (csrc/cpu_cascade_attention.cpp)
            return self.ext.cascade_decode_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens,
                                                         *cascade_tensors(cascade), scale, window, softcap)
        return self.ext.paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale, window,
                                                   softcap)

    def prefill_attention(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                          scale: float, window: int = 0, softcap: float = 0.0, causal: bool = True) -> torch.Tensor:
        """Causal prefill (query token i of a sequence attends to the keys up to its position, and within the
        window ending there, if any), or with causal False every key of the sequence (an encoder), in one C++
        call: tiles of a sequence's query tokens against each block of its context, the block widened once per
        tile (cpu_prefill_attention.cpp)."""
        if not self._takes(q, k_cache):
            return super().prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                             window, softcap, causal)
        return self.ext.paged_prefill_attention_cpu(
            q, k_cache, v_cache, block_tables.int(), cu_seqlens_q.int().contiguous(), seq_lens.int().contiguous(),
            scale, window, softcap, causal)

    # ---- layer ops ----------------------------------------------------------------------------------------

    def linear_gelu(self, linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if isinstance(linear, CpuLinear) and (out := linear.fused(x, "gelu")) is not None:
            return out
        return super().linear_gelu(linear, x)

    def linear_add(self, linear: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if isinstance(linear, CpuLinear) and (out := linear.fused(x, "add", residual)) is not None:
            return out
        return super().linear_add(linear, x, residual)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32:
            return self.ext.rms_norm_cpu(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if x.is_contiguous() and x.dtype == torch.float32:
            self.ext.add_rms_norm_cpu(x, residual, weight, eps)  # both in place: x = norm, residual = sum
            return x, residual
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype == torch.float32:
            return self.ext.silu_and_mul_cpu(gate_up)
        return super().silu_and_mul(gate_up)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if cos.is_contiguous() and q.dtype == torch.float32 and k.stride(-1) == 1:
            self.ext.rotary_cpu(q, k, cos, sin)  # in place
            return q, k
        return super().rotary(q, k, cos, sin)

    def lora(self, y, x, a, b, slices, batch) -> torch.Tensor:
        """A decode-sized batch's adapter rows in one C++ call per linear (csrc/cpu_lora.cpp: a GEMV and an AXPY
        per rank a row, at the slot's own rank, over b's transposed storage: the manager's CPU layout); longer
        ones (prompt chunks) as grouped matmuls, which reuse each weight across rows."""
        bt = b.transpose(1, 2)
        if batch.rows.shape[0] > PANEL_MAX_ROWS or x.dtype != torch.float32 or x.stride(-1) != 1 \
                or y.stride(-1) != 1 or self.lora_state is None or not bt.is_contiguous():
            return super().lora(y, x, a, b, slices, batch)
        self.ext.lora_cpu(y, x, a, bt, [o for o, _ in slices], [w for _, w in slices], batch.rows, batch.starts,
                          batch.counts, self.lora_state.slot_ranks)
        return y

    # ---- whole layers and sampling ------------------------------------------------------------------------

    def run_layers(self, model: torch.nn.Module, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused is not None and self.fused.serves(x, meta):
            lora = self.lora_state
            if lora is None or lora.batch is None:
                return self.fused(x, rotary, kv_caches, meta)
            adapters = self.fused.lora_tensors(model, lora)  # None: a linear the C++ step cannot take it for
            if adapters is not None:
                return self.fused(x, rotary, kv_caches, meta, adapters)
        return super().run_layers(model, x, rotary, kv_caches, meta)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.stride(-1) == 1 and logits.dtype == torch.float32:
            return self.ext.argmax_rows_cpu(logits)
        return super().argmax(logits)
