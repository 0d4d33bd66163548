"""nn.Linear for the CPU serving path: a panel GEMV for decode-sized batches, prepacked oneDNN for the rest.

At a few rows a linear layer is a read of its whole weight. The C++ panel kernel (kernels/cpu.py) streams a
[ceil(out / 16), in, 16] copy of the weight, prefetched ahead, at close to the memory bandwidth, and keeps up
to 16 rows of x against each panel in registers. All of a step's linears, the paths in turns (the GEMM table
in docs/benchmarks.md, "Where an engine step's time goes"): panels 24 / 26 / 34 / 55 ms at 1 / 8 / 16 / 32
rows, oneDNN with a prepacked weight 32 / 37 / 51 / 61 ms, PyTorch's default fp32 GEMM (F.linear) level with
the panels at one row but 56 / 68 / 68 ms at 8 / 16 / 32 rows. Prefill-sized batches (hundreds of rows) stay on
oneDNN, whose blocking reuses each weight across many rows.
Keeping both layouts doubles the linear weights' memory on the CPU path. Only the layout differs: the
product is the same fp32 arithmetic, summed in another order.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu

PACK_FOR_ROWS = 16  # the row count oneDNN picks the packed layout for; any row count still works
# development sweeps of all of SmolLM2's linears: panels clearly ahead of oneDNN up to 20 rows, level to ahead
# at 24-64 (two or more passes of 16 rows per panel; 82 vs 101 ms at 64 in the recorded table), oneDNN ahead
# from ~96 rows and at prefill sizes
PANEL_MAX_ROWS = 32


def onednn_prepack_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16]: 16 output columns side by side for each input feature."""
    out_features, in_features = weight.shape
    padded = torch.zeros(-(-out_features // 16) * 16, in_features, dtype=weight.dtype)
    padded[:out_features] = weight
    return padded.view(-1, 16, in_features).transpose(1, 2).contiguous()


class CpuLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # plain attributes, not parameters: packed weights are opaque to state_dict
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
        self.bias = linear.bias.detach().clone() if linear.bias is not None else None
        self.ext = cpu.usable(weight)
        self.panels = pack_panels(weight) if self.ext is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and x.dim() == 2 and x.shape[0] <= PANEL_MAX_ROWS and x.stride(-1) == 1:
            return self.ext.panel_linear_cpu(x, self.panels, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def use_cpu_linears(model: nn.Module) -> int:
    """Swap every nn.Linear of a CPU model for CpuLinear; returns how many were swapped."""
    if not onednn_prepack_available():
        return 0
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu":
                setattr(module, name, CpuLinear(child))
                swapped += 1
    return swapped
