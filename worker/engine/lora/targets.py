"""Which linears of a native model an adapter may change, and where each PEFT module's weights land in them.

Every native family keeps the Llama layer's four linears (models/llama.py): qkv_proj (q, k, v fused), o_proj,
gate_up_proj (gate, up fused) and down_proj; a mixture-of-experts layer's experts are not linears (moe.py)
and take no adapter. A PEFT adapter names the checkpoint's modules: q_proj / k_proj / v_proj and gate_proj /
up_proj for the split layouts (Llama, Qwen, Mistral, Gemma), qkv_proj / gate_up_proj for the fused ones
(Phi-3), o_proj and down_proj everywhere. A split module is one slice of our fused linear; a fused module
covers every slice (its lora_A shared by them).

Phi-3 with partial rotary permutes the q and k rows of qkv_proj within each head at load (phi3.py); an
adapter's lora_B rows for q and k are permuted the same way (`row_order`), so its delta lands on the
permuted outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from worker.engine.models.llama import MLP, Attention
from worker.engine.models.phi3 import Phi3ForCausalLM, rotary_order

# PEFT module (after "layers.N.") -> (our linear, which slice; None = every slice)
MODULES: dict[str, tuple[str, int | None]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "self_attn.qkv_proj": ("self_attn.qkv_proj", None),
    "self_attn.o_proj": ("self_attn.o_proj", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.gate_up_proj": ("mlp.gate_up_proj", None),
    "mlp.down_proj": ("mlp.down_proj", 0),
}


@dataclass
class Target:
    """One linear of one layer that adapters may change."""

    layer: int
    name: str  # "self_attn.qkv_proj", ...: the attribute path inside the layer
    in_features: int
    slices: tuple[tuple[int, int], ...]  # (output offset, width) of each slice
    row_order: torch.Tensor | None = None  # lora_B's output rows are taken in this order (Phi-3), None = as is

    @property
    def out_features(self) -> int:
        return sum(w for _, w in self.slices)

    def module_of(self, model: nn.Module) -> tuple[nn.Module, str]:
        """(the parent module, the attribute) holding this linear."""
        parent_name, attr = self.name.split(".")
        return getattr(model.layers[self.layer], parent_name), attr


def lora_targets(model: nn.Module) -> dict[tuple[int, str], Target]:
    """(layer, linear) -> Target for every linear of a native model an adapter may change."""
    arch = model.arch
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    inter, hidden = arch.intermediate_size, arch.hidden_size
    qk_order = _phi3_qk_order(model, q + kv)
    targets: dict[tuple[int, str], Target] = {}
    for i, layer in enumerate(model.layers):
        if isinstance(getattr(layer, "self_attn", None), Attention):
            targets[(i, "self_attn.qkv_proj")] = Target(i, "self_attn.qkv_proj", hidden,
                                                        ((0, q), (q, kv), (q + kv, kv)), qk_order)
            targets[(i, "self_attn.o_proj")] = Target(i, "self_attn.o_proj", q, ((0, hidden),))
        if isinstance(getattr(layer, "mlp", None), MLP):  # not a mixture of experts' layer
            targets[(i, "mlp.gate_up_proj")] = Target(i, "mlp.gate_up_proj", hidden, ((0, inter), (inter, inter)))
            targets[(i, "mlp.down_proj")] = Target(i, "mlp.down_proj", inter, ((0, hidden),))
    return targets


def _phi3_qk_order(model: nn.Module, qk_rows: int) -> torch.Tensor | None:
    arch = model.arch
    if not isinstance(model, Phi3ForCausalLM) or arch.rotary_dim == arch.head_dim:
        return None
    order = torch.tensor(rotary_order(arch.head_dim, arch.rotary_dim))
    heads = qk_rows // arch.head_dim
    qk = (torch.arange(heads)[:, None] * arch.head_dim + order[None, :]).reshape(-1)
    v_rows = arch.num_kv_heads * arch.head_dim
    return torch.cat([qk, torch.arange(qk_rows, qk_rows + v_rows)])
