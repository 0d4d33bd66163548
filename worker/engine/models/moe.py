"""Mixtral and Qwen3-MoE: the Llama-family decoder with a sparse mixture-of-experts feed-forward.

Attention is the Llama family's (Mixtral's is Mistral's; Qwen3-MoE's is Qwen3's, with q/k norms), so these
models are LlamaForCausalLM with the MLP of each sparse layer swapped for SparseMoe:
  router     logits = gate(x) [n, experts]; softmax in fp32; top_k of it. Mixtral always rescales the top_k to
             sum to 1; Qwen3-MoE only when its config says norm_topk_prob, and casts them to the model dtype
  experts    backend.fused_moe: the Triton fused-MoE kernel (tokenbus_kernels/moe.py) on CUDA / under the interpreter,
             tokenbus_kernels/moe_reference.py on the CPU
Qwen3-MoE keeps a dense MLP on the layers in mlp_only_layers and off its decoder_sparse_step.

Checkpoints name experts per expert (hub files: Mixtral's block_sparse_moe.experts.E.w1/w3/w2, Qwen3-MoE's
mlp.experts.E.gate_proj/up_proj/down_proj) or stacked (transformers 5: experts.gate_up_proj, experts.down_proj);
both load into one stacked [experts, 2 * inter, hidden] and [experts, hidden, inter] pair per layer.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenbus_kernels.moe_reference import route_topk_ref
from worker.engine.backends import Backend
from worker.engine.models.llama import LlamaArch, LlamaForCausalLM

# our model type -> the Llama-family type whose attention it shares
MOE_MODEL_TYPES = {"mixtral": "mistral", "qwen3_moe": "qwen3"}


@dataclass
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # rescale the top_k weights to sum to 1
    weights_in_model_dtype: bool  # Qwen3-MoE casts the routing weights to the model dtype; Mixtral keeps fp32
    sparse_layers: tuple[int, ...]


@dataclass
class MoeArch(LlamaArch):
    moe: MoeSpec | None = None


def moe_arch(config: Any) -> MoeArch:
    model_type = config.model_type
    twin = copy.copy(config)
    twin.model_type = MOE_MODEL_TYPES[model_type]  # the attention family's checks and fields
    dense = LlamaArch.from_hf_config(twin)
    if model_type == "mixtral":
        spec = MoeSpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True, False,
                       tuple(range(config.num_hidden_layers)))
    else:
        step = config.decoder_sparse_step or 1
        sparse = tuple(i for i in range(config.num_hidden_layers)
                       if i not in (config.mlp_only_layers or []) and config.num_experts > 0 and (i + 1) % step == 0)
        spec = MoeSpec(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       bool(config.norm_topk_prob), True, sparse)
    fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(LlamaArch)}
    return MoeArch(**{**fields, "model_type": model_type}, moe=spec)


class SparseMoe(nn.Module):
    def __init__(self, arch: MoeArch, backend: Backend) -> None:
        super().__init__()
        spec = arch.moe
        self.spec = spec
        self.backend = backend
        self.gate = nn.Linear(arch.hidden_size, spec.num_experts, bias=False)
        # buffers, not parameters: the generic loader never sees them (load_weights fills them expert by expert)
        self.register_buffer("w13", torch.empty(spec.num_experts, 2 * spec.intermediate_size, arch.hidden_size))
        self.register_buffer("w2", torch.empty(spec.num_experts, arch.hidden_size, spec.intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        weights, ids = route_topk_ref(logits, self.spec.top_k, self.spec.renormalize)
        if self.spec.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        # experts split within each expert under TP (parallel/shard.py): a partial sum, like down_proj's
        return self.backend.all_reduce(self.backend.fused_moe(x, self.w13, self.w2, weights, ids))


# per-expert checkpoint names: (projection -> which stacked buffer and which half of it)
_EXPERT = re.compile(r"layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
                     r"\.weight$")
_STACKED = re.compile(r"layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)$")
_HALF = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1), "up_proj": ("w13", 1),
         "w2": ("w2", None), "down_proj": ("w2", None)}


class MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: MoeArch, backend: Backend) -> None:
        super().__init__(arch, backend)
        for i in arch.moe.sparse_layers:
            self.layers[i].mlp = SparseMoe(arch, backend)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        filled: dict[tuple[int, str], int] = {}  # (layer, buffer) -> expert halves written
        super().load_weights(self._experts_taken(weights, filled))
        spec = self.arch.moe
        for layer in spec.sparse_layers:
            for buffer, per_expert in (("w13", 2), ("w2", 1)):
                if filled.get((layer, buffer), 0) != spec.num_experts * per_expert:
                    raise ValueError(f"checkpoint is missing experts of layer {layer} ({buffer}): "
                                     f"{filled.get((layer, buffer), 0)} of {spec.num_experts * per_expert} tensors")

    def _experts_taken(self, weights: Iterable[tuple[str, torch.Tensor]],
                       filled: dict[tuple[int, str], int]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint less its expert tensors, which go straight into the stacked buffers; the router
        (block_sparse_moe.gate) is renamed to where SparseMoe keeps it (mlp.gate)."""
        inter = self.arch.moe.intermediate_size
        for name, tensor in weights:
            if m := _EXPERT.search(name):
                layer, expert, proj = int(m.group(1)), int(m.group(2)), m.group(3)
                buffer, half = _HALF[proj]
                target = getattr(self.layers[layer].mlp, buffer)[expert]
                (target if half is None else target[half * inter : (half + 1) * inter]).copy_(tensor)
                filled[(layer, buffer)] = filled.get((layer, buffer), 0) + 1
            elif m := _STACKED.search(name):
                layer, buffer = int(m.group(1)), "w13" if m.group(2) == "gate_up_proj" else "w2"
                getattr(self.layers[layer].mlp, buffer).copy_(tensor)
                filled[(layer, buffer)] = self.arch.moe.num_experts * (2 if buffer == "w13" else 1)
            else:
                yield name.replace(".block_sparse_moe.gate.", ".mlp.gate."), tensor
