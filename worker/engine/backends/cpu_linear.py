"""CpuLinear: nn.Linear for the CPU serving path — a panel GEMV for decode-sized batches, prepacked oneDNN
for the rest.

At a few rows a linear layer is a read of its whole weight. The C++ panel kernel streams a
[ceil(out / 16), in, 16] copy of the weight, prefetched ahead, and keeps a tile of rows of x against each
panel in registers (16 rows with AVX-512, 6 with AVX2). Prefill-sized batches (hundreds of rows) go to
oneDNN, whose blocking reuses each weight across many rows. Keeping both layouts doubles the linear weights'
memory on the CPU path; the product is the same fp32 arithmetic, summed in another order.
docs/kernels.md has the measurements behind PANEL_MAX_ROWS.

An int8-quantized linear (worker/engine/quant/schemes.py: the nn.Linear carries an `int8` attribute and its
weight is the dequantized value) packs its int8 weight into the panels instead, with the per-channel scales
padded alongside: the C++ kernel widens them in registers. oneDNN keeps the dequantized fp32 weight. A W8A8
linear (`w8a8` attribute too) packs for the VNNI kernel (pack_panels_w8a8), which quantizes x per row and group
itself, and on a CPU with VNNI serves every batch, prefill included, from its int8 panels alone (no oneDNN copy).
Without VNNI, batches over PANEL_MAX_ROWS go to oneDNN on x rounded the same way (round_activations_int8): the
same model either way.
"""

from __future__ import annotations

import os
from types import ModuleType

import structlog
import torch
from torch import nn

from worker.engine.quant.schemes import W8A8_GROUP, round_activations_int8

PACK_FOR_ROWS = 16  # the row count oneDNN picks the packed layout for; any row count still works
# the widest batch the panels serve: they were ahead of oneDNN up to 64 rows on every machine measured, and 64
# is the CPU's default max_num_seqs, so every decode step of a default engine runs on them
PANEL_MAX_ROWS = 64
# oneDNN keeps a primitive per input shape it meets (1,024 by default), and ideep (PyTorch's wrapper) an LRU of
# its own: at a step width that never repeats (an embedding worker's) that took the 500,000-input run's worker
# to 4.65 GB.
# 64 entries each: all-MiniLM over 10,000 inputs flat at ~2.0 GB against 2.26 GB and rising, at the same speed
# (65 s either way, Xeon). Read when the first primitive is made, so set before any; a user's value wins.
ONEDNN_CACHE_ENTRIES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}


def onednn_prepack_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16]: 16 output columns side by side for each input feature."""
    out_features, in_features = weight.shape
    padded = torch.zeros(-(-out_features // 16) * 16, in_features, dtype=weight.dtype)
    padded[:out_features] = weight
    return padded.view(-1, 16, in_features).transpose(1, 2).contiguous()


def pack_panels_w8a8(qweight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The W8A8 kernel's operands (tokenbus_kernels/csrc/cpu_w8a8.cpp) from int8 [out, in] and its scales [out]:
    panels int8 [ceil(out / 16), ceil(in / 4), 16, 4] (4 consecutive inputs of each of 16 columns side by side,
    zeros past in and out) and fp32 [1 + ceil(in / W8A8_GROUP), ceil(out / 16) * 16]: the scales, then for each
    activation group of W8A8_GROUP inputs each column's sum of codes over it."""
    out_features, in_features = qweight.shape
    cols, k = -(-out_features // 16) * 16, -(-in_features // 4) * 4
    groups = -(-in_features // W8A8_GROUP)
    padded = torch.zeros(cols, groups * W8A8_GROUP, dtype=torch.int8)
    padded[:out_features, :in_features] = qweight
    panels = padded[:, :k].reshape(cols // 16, 16, k // 4, 4).transpose(1, 2).contiguous()
    scales = torch.zeros(1 + groups, cols)
    scales[0] = 1.0
    scales[0, :out_features] = scale
    # |sum| <= 127 * W8A8_GROUP: exact in fp32
    scales[1:] = padded.view(cols, groups, W8A8_GROUP).sum(dim=2, dtype=torch.int64).T.float()
    return panels, scales


class CpuLinear(nn.Module):
    def __init__(self, linear: nn.Linear, ext: ModuleType | None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.bias = linear.bias.detach().clone() if linear.bias is not None else None
        self.ext = ext if weight.dtype == torch.float32 else None
        # scales: None for fp32 panels, fp32 [ceil(out / 16) * 16] for int8, [1 + groups, ceil(out / 16) * 16] for W8A8
        self.panels = self.scales = None
        int8 = getattr(linear, "int8", None)
        # W8A8 (quantization.py): x is rounded to int8 per row and group before the product, on every path
        self.w8a8 = int8 is not None and getattr(linear, "w8a8", False)
        if self.ext is not None and self.w8a8:
            self.panels, self.scales = pack_panels_w8a8(int8.qweight, int8.scale)
        elif self.ext is not None and int8 is not None:
            self.panels = pack_panels(int8.qweight)
            self.scales = torch.ones(self.panels.shape[0] * 16)
            self.scales[: self.out_features] = int8.scale
        elif self.ext is not None:
            self.panels = pack_panels(weight)
        # W8A8 on VNNI serves every batch from its panels (packed_weight None): at prefill sizes it beat oneDNN on
        # the rounded activations by 1.5-2x (the rounding alone cost a third of oneDNN's time), and then no fp32
        # copy of the weight is kept at all. Plain attributes, not parameters: packed weights are opaque to
        # state_dict.
        panels_only = self.panels is not None and self.w8a8 and self.ext.w8a8_native_cpu()
        self.packed_weight = None if panels_only else torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3 and x.shape[0] == 1:  # transformers' modules (the fallback) keep a batch dim of 1
            return self.forward(x[0]).unsqueeze(0)
        if self.panels is not None and x.dim() == 2 and x.stride(-1) == 1 and (
                self.packed_weight is None or x.shape[0] <= PANEL_MAX_ROWS):
            return self.panel_linear(x)
        if self.packed_weight is None:  # panels only: any other shape as the rows the kernel takes
            rows = x.reshape(-1, self.in_features).contiguous()
            return self.panel_linear(rows).view(*x.shape[:-1], self.out_features)
        if self.w8a8:  # the same model in fp32: the rounded activations times the dequantized weight
            x = round_activations_int8(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def fused(self, x: torch.Tensor, op: str, residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """oneDNN's product with a post-op in the same pass, where forward() would run oneDNN: op "gelu" gives
        gelu(linear(x)) (exact erf), "add" linear(x) + residual; None where forward() takes another path (the
        caller then runs it and the op apart). Measured equal to the bit to the unfused ops (oneDNN's erf GELU is
        PyTorch's), and one pass less over the output: an encoder's feed-forward is 1,536 wide."""
        if self.packed_weight is None or self.w8a8 or x.dim() != 2 or (
                self.panels is not None and x.stride(-1) == 1 and x.shape[0] <= PANEL_MAX_ROWS):
            return None
        if op == "gelu":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "gelu", [], "none")
        if residual is None or residual.shape != (x.shape[0], self.out_features) or not residual.is_contiguous():
            return None
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed_weight, self.bias, "add")

    def panel_linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] (last dim contiguous) through the C++ panel kernel of this linear's weight type."""
        if self.w8a8:
            return self.ext.panel_linear_w8a8_cpu(x, self.panels, self.scales, self.out_features, self.bias)
        if self.scales is not None:
            return self.ext.panel_linear_int8_cpu(x, self.panels, self.scales, self.out_features, self.bias)
        return self.ext.panel_linear_cpu(x, self.panels, self.out_features, self.bias)


def use_cpu_linears(model: nn.Module, ext: ModuleType | None) -> int:
    """Swap every nn.Linear of a CPU model for CpuLinear; returns how many were swapped."""
    if not onednn_prepack_available():
        return 0
    for name, entries in ONEDNN_CACHE_ENTRIES.items():
        os.environ.setdefault(name, entries)
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu":
                try:
                    setattr(module, name, CpuLinear(child, ext))
                except RuntimeError as err:
                    # oneDNN refuses some dtypes on some CPUs (bf16 without AVX-512 BW/VL/DQ or AVX-NE-CONVERT):
                    # those linears stay nn.Linear, which PyTorch runs on any CPU
                    structlog.get_logger("tokenbus.engine").info(
                        "cpu_linear_prepack_unavailable", dtype=str(child.weight.dtype), reason=str(err)[:200])
                    return swapped
                swapped += 1
    return swapped
