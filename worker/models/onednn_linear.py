"""nn.Linear with its weight held in oneDNN's layout, for the CPU serving path.

On this project's x86 CPUs PyTorch's default fp32 GEMM (the BLAS behind F.linear) reaches about half of what
oneDNN does for the shapes a decode step has (a few to a few hundred rows against a 576–3072 wide weight);
see docs/benchmarks.md. Only the layout changes: the arithmetic is the same fp32 (or bf16) product.
"""

from __future__ import annotations

import torch
from torch import nn


class OneDnnLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # plain attributes, not parameters: oneDNN tensors have no storage that state_dict could save
        self.weight_onednn = weight.to_mkldnn()
        bias = linear.bias.detach() if linear.bias is not None else torch.zeros(self.out_features)
        self.bias_onednn = bias.float().to_mkldnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), self.weight_onednn, self.bias_onednn).to_dense()


def use_onednn_linears(model: nn.Module) -> int:
    """Swap every nn.Linear of a CPU model for OneDnnLinear; returns how many were swapped."""
    if not torch.backends.mkldnn.is_available():
        return 0
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu":
                setattr(module, name, OneDnnLinear(child))
                swapped += 1
    return swapped
