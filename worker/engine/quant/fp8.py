"""FP8 weights in the model: Fp8Linear, which linears become one, and how an FP8 checkpoint is loaded.

serve FP8   (CUDA sm_89+ with an FP8 checkpoint, or --quantization fp8 anywhere): the decoder's linears
            are Fp8Linear — e4m3 weight [N, K], one fp32 scale per output channel, the activations
            quantized per token at each call, the GEMM through torch._scaled_mm (tokenbus_kernels/fp8_linear.py).
            An FP8 checkpoint's weights are kept bit for bit (a per-tensor scale repeated per channel);
            block-wise ones are dequantized and requantized per channel (logged: not the file's bits).
            An unquantized checkpoint is quantized at load (dynamic). lm_head and MoE routers stay as
            loaded; so does anything the checkpoint left unquantized.
otherwise   an FP8 checkpoint is dequantized at load to the model's dtype (the CPU's fp32 path, with
            --quantization int8 quantizing that again for the C++ kernels), logged once.
"""

from __future__ import annotations

from typing import Any

import structlog
import torch
from torch import nn

from tokenbus_kernels.fp8_linear import FP8, dequantize_weight, fp8_linear, quantize_weight
from worker.engine.quant.fp8_checkpoint import Fp8Checkpoint, read_format, scan
from worker.engine.quant.schemes import fp8_gemm_available, row_max

log = structlog.get_logger("tokenbus.quantization")
UNQUANTIZED_LEAVES = ("lm_head", "gate")  # the logits and an MoE router: small, and the most sensitive
FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}  # checkpoint linears the native models fuse (models/llama.py _FUSED)


class Fp8Linear(nn.Module):
    """nn.Linear with an e4m3 weight and per-output-channel scales (tokenbus_kernels/fp8_linear.py has the shapes)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # parameters, so the models' load_weights fills them (fused shards row by row) like any weight
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8, device=device), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.empty(out_features, dtype=torch.float32, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    @classmethod
    def quantized(cls, linear: nn.Linear, reduce: Any = None) -> Fp8Linear:
        """The per-channel e4m3 of a loaded nn.Linear (dynamic quantization). reduce: a row-parallel shard's
        max |w| per row over the tensor-parallel ranks (schemes.row_max), so its scales are the whole rows'."""
        w = linear.weight.detach()
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, w.device)
        qweight, scale = quantize_weight(w, reduce)
        out.weight.data, out.weight_scale.data = qweight, scale
        if linear.bias is not None:
            out.bias.data = linear.bias.detach()
        return out

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_weight(self.weight, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel"


def _quantizable(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and name.rpartition(".")[2] not in UNQUANTIZED_LEAVES


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _output_heads(model: nn.Module) -> set[int]:
    """The logits' projection however the model names it (transformers' fallback: get_output_embeddings)."""
    heads = set()
    for module in model.modules():
        head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
        if head is not None:
            heads.add(id(head))
    return heads


@torch.no_grad()
def quantize_model(model: nn.Module, only: set[str] | None = None) -> int:
    """Swap the loaded model's linears (those named in `only`, else every decoder linear) for their
    per-channel e4m3; returns how many."""
    heads = _output_heads(model)
    names = [
        n for n, m in model.named_modules() if _quantizable(n, m) and id(m) not in heads and (only is None or n in only)
    ]
    tp = getattr(getattr(model, "backend", None), "tp", None)
    for name in names:
        _replace(model, name, Fp8Linear.quantized(model.get_submodule(name), row_max(tp, name)))
    return len(names)


def model_linear(prefix: str) -> str:
    """A checkpoint linear's module name in a native model: `model.` dropped, q/k/v and gate/up fused."""
    parts = prefix.removeprefix("model.").split(".")
    parts[-1] = FUSED.get(parts[-1], parts[-1])
    return ".".join(parts)


class Fp8Loading:
    """An FP8 checkpoint's way into a native model: `prepare` swaps the target linears for Fp8Linear on the
    meta model (before any memory is allocated), `weights` rewrites the checkpoint's tensor stream, and
    `requantize` names the linears to quantize once loaded (block-wise ones, served as FP8)."""

    def __init__(self, checkpoint: Fp8Checkpoint | None, serve_fp8: bool) -> None:
        self.checkpoint, self.serve_fp8 = checkpoint, serve_fp8
        self.keep: set[str] = set()  # checkpoint prefixes loaded as e4m3
        self.requantize: set[str] = set()  # model linears quantized after the load

    def prepare(self, model: nn.Module) -> None:
        if self.checkpoint is None or not self.serve_fp8:
            return
        by_target: dict[str, list[str]] = {}
        for prefix in self.checkpoint.linears:
            by_target.setdefault(model_linear(prefix), []).append(prefix)
        modules = dict(model.named_modules())
        for target, prefixes in by_target.items():
            module = modules.get(target)
            if not _quantizable(target, module):  # experts, or no such linear: dequantized in the stream
                continue
            if self.checkpoint.format.strategy == "block":
                self.requantize.add(target)
                continue
            self.keep.update(prefixes)
            dtype = module.bias.dtype if module.bias is not None else torch.float32
            _replace(
                model,
                target,
                Fp8Linear(module.in_features, module.out_features, module.bias is not None, dtype, "meta"),
            )

    def weights(self, load: Any) -> Any:
        """`load` (the loader's iter_weights) with the checkpoint's FP8 tensors rewritten (Fp8Checkpoint)."""
        if self.checkpoint is None:
            return load
        return lambda source: self.checkpoint.weights(load(source), self.keep)

    def finish(self, model: nn.Module, device: torch.device) -> None:
        """After the load: quantize what the plan left to quantize, and say what was done."""
        fmt = self.checkpoint.format if self.checkpoint else None
        if not self.serve_fp8:
            if fmt is not None:
                log.info(
                    "fp8_checkpoint_dequantized",
                    format=fmt.method,
                    strategy=fmt.strategy,
                    linears=len(self.checkpoint.linears),
                    device=device.type,
                    dtype=str(next(model.parameters()).dtype),
                    why="no FP8 GEMM serves here (CPU, or a GPU before sm_89): the weights are the "
                    "checkpoint's values, dequantized; --quantization fp8 keeps them FP8",
                )
            return
        if fmt is None:
            swapped = quantize_model(model)
            log.info("fp8_quantized", source="unquantized checkpoint", linears=swapped, scheme="e4m3 per channel")
            return
        quantize_model(model, self.requantize)
        if self.requantize:
            log.warning(
                "fp8_block_scales_requantized",
                linears=len(self.requantize),
                block=list(fmt.block),
                why="the FP8 GEMM takes per-channel scales: block-wise weights were dequantized and "
                "quantized again per output channel, so they differ from the file's by e4m3 rounding",
            )
        log.info(
            "fp8_checkpoint_loaded",
            format=fmt.method,
            strategy=fmt.strategy,
            kept_bits=len(self.keep),
            requantized=len(self.requantize),
            device=device.type,
        )


def plan(hf_config: Any, directory: str, config: Any, device: torch.device, model_path: str) -> Fp8Loading:
    """How FP8 enters the engine's model: an FP8 checkpoint's format checked (a clear error for any other
    quantized one) and its scales read from the headers before any weight is; whether it serves FP8."""
    fmt = read_format(hf_config)
    if fmt is not None and model_path == "transformers":
        raise ValueError(
            f"model {config.model!r} is an FP8 checkpoint of a type tokenbus serves through "
            "transformers' modeling code, which does not take its FP8 weights: load the "
            "unquantized checkpoint"
        )
    checkpoint = scan(directory, fmt) if fmt is not None else None
    # an FP8 checkpoint serves FP8 where the GEMM has tensor cores for it, unless int8 was asked for
    serve = config.quantization == "fp8" or (
        fmt is not None and config.quantization is None and device.type == "cuda" and fp8_gemm_available(device)
    )
    return Fp8Loading(checkpoint, serve)
