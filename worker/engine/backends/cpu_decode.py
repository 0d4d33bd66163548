"""FusedDecodeLayers: a pure decode step's decoder layers as one C++ call (tokenbus_kernels/csrc/decode_layers.cpp).

The call runs the same C++ kernels as the CpuBackend's per-layer path, in the same order, so its output is
the same to the bit; what it saves is the Python between them (module calls, dispatch, argument
conversion), about as long as the kernels themselves at a decode step's few rows. A step with LoRA adapter rows
runs in the same call: each linear's output takes its rows' deltas (csrc/cpu_lora.cpp, the kernel the per-layer
path's LoraLinear calls, so again the same result to the bit). Steps with prompt tokens,
batches wider than the panel linears serve, and models the C++ layer does not cover (QK-norm, Gemma's
layer: cpu_fusable False) take the per-layer path. A step with a cascade layout (tokenbus_kernels/cascade.py) runs
every layer's decode attention as a cascade.
"""

from __future__ import annotations

from types import ModuleType

import torch

from tokenbus_kernels.cascade import CascadeLayout
from worker.engine.attention_metadata import AttentionMetadata
from worker.engine.backends.cpu_linear import PANEL_MAX_ROWS, CpuLinear
from worker.engine.lora.layer import LoraLinear, LoraState

NO_BIAS = torch.empty(0)  # the C++ side reads an empty tensor as "no bias"


def cascade_tensors(layout: CascadeLayout | None) -> list[torch.Tensor]:
    """A step's cascade layout as the C++ calls take it: its four int32 tensors, or none (plain decode)."""
    if layout is None:
        return []
    return [layout.group_rows, layout.group_starts, layout.prefix_lens, layout.suffix_starts]


class FusedDecodeLayers:
    def __init__(self, model: torch.nn.Module, ext: ModuleType) -> None:
        arch = model.arch
        self.ext = ext
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.intermediate_size, self.eps = arch.intermediate_size, arch.rms_norm_eps
        self.scale = arch.head_dim**-0.5
        self.window = arch.window(0)  # one for every layer (build() checks)
        self.weights: list[torch.Tensor] = []
        self.scales: list[torch.Tensor] = []  # per linear: empty (fp32 panels) or its int8 scales
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv_bias = attn.qkv_proj.bias
            self.weights += [
                layer.input_layernorm.weight.detach(), attn.qkv_proj.panels,
                qkv_bias if qkv_bias is not None else NO_BIAS, attn.o_proj.panels,
                layer.post_attention_layernorm.weight.detach(), mlp.gate_up_proj.panels, mlp.down_proj.panels,
            ]
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                self.scales.append(linear.scales if linear.scales is not None else NO_BIAS)
        q, kv, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
        # the slices the C++ step gives each linear's adapter deltas (as worker/engine/lora/targets.py cuts them)
        self.lora_slices = (((0, q), (q, kv), (q + kv, kv)), ((0, arch.hidden_size),), ((0, inter), (inter, inter)),
                            ((0, arch.hidden_size),))
        self.lora_weights: list[torch.Tensor] | None = None  # per layer a and bt of each linear (lora_tensors)

    @classmethod
    def build(cls, model: torch.nn.Module, ext: ModuleType) -> FusedDecodeLayers | None:
        """The fused layers for a CPU float32 model whose linears are panel CpuLinears, else None."""
        arch = getattr(model, "arch", None)
        # only dense Llama-shaped layers (not q/k norms, experts, transformers' own modules, per-layer windows)
        if arch is None or getattr(arch, "qk_norm", True) or getattr(arch, "moe", None) is not None \
                or not getattr(model, "cpu_fusable", False) or model.embed_tokens.weight.dtype != torch.float32:
            return None
        if len({arch.window(i) for i in range(arch.num_layers)}) > 1:  # the C++ step takes one window
            return None
        linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                           layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if not all(isinstance(m, CpuLinear) and m.panels is not None for m in linears):
            return None
        return cls(model, ext)

    def serves(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        return meta.num_prefill_tokens == 0 and x.shape[0] <= PANEL_MAX_ROWS and x.is_contiguous()

    def lora_tensors(self, model: torch.nn.Module, state: LoraState) -> list[torch.Tensor] | None:
        """The step's adapter rows as the C++ call takes them (decode_layers.cpp's `lora`): rows, starts, counts,
        the slots' ranks, then per layer a and bt (b's storage, [slots, rank, out]) of qkv, o, gate_up and down.
        None when a linear is not wrapped as the C++ step expects (the per-layer path then serves the step)."""
        if self.lora_weights is None:
            self.lora_weights = []  # stays empty (None below, every step) unless every linear is as expected
            weights = []
            for layer in model.layers:
                for linear, slices in zip((layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                           layer.mlp.down_proj), self.lora_slices, strict=True):
                    bt = linear.b.transpose(1, 2) if isinstance(linear, LoraLinear) else None
                    if bt is None or not bt.is_contiguous() or tuple(linear.slices) != slices \
                            or linear.a.dtype != torch.float32:
                        return None
                    weights += [linear.a, bt]
            self.lora_weights = weights  # the slots are filled in place (LoraManager._load): built once
        if not self.lora_weights:
            return None
        batch = state.batch
        return [batch.rows, batch.starts, batch.counts, state.slot_ranks, *self.lora_weights]

    def __call__(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        lora: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(last layer's output, residual before it), as the loop over DecoderLayer.forward returns them.
        lora: lora_tensors' list for a step with adapter rows."""
        caches = [cache for pair in kv_caches for cache in pair]
        x, residual = self.ext.decode_layers_cpu(
            x, rotary[0], rotary[1], meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens,
            self.weights, caches, self.scales, self.num_heads, self.num_kv_heads, self.head_dim,
            self.intermediate_size, self.eps, self.scale, self.window, cascade_tensors(meta.cascade), lora or [],
        )
        return x, residual
