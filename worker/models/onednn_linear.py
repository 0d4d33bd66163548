"""nn.Linear with its weight prepacked for oneDNN, for the CPU serving path.

On this project's x86 CPUs PyTorch's default fp32 GEMM (the BLAS behind F.linear) reaches about a third of
what oneDNN does with a prepacked weight for the shapes a decode step has (a few to a few hundred rows
against a 576–49152 wide weight): docs/benchmarks.md, "Where an engine step's time goes". Only the layout
of the weight changes; the product is the same fp32 (or bf16) arithmetic.
"""

from __future__ import annotations

import torch
from torch import nn

PACK_FOR_ROWS = 16  # the row count oneDNN picks the packed layout for; any row count still works


def onednn_prepack_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class OneDnnLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # plain attributes, not parameters: a packed weight is opaque to state_dict
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_FOR_ROWS)
        self.bias = linear.bias.detach().clone() if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def use_onednn_linears(model: nn.Module) -> int:
    """Swap every nn.Linear of a CPU model for OneDnnLinear; returns how many were swapped."""
    if not onednn_prepack_available():
        return 0
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu":
                setattr(module, name, OneDnnLinear(child))
                swapped += 1
    return swapped
