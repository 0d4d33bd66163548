"""FP8 checkpoints: which formats load, how their weight scales are laid out, and the checkpoint's tensor
stream rewritten into what the model loads (docs/quantization.md "FP8").

Two formats, told apart by config.json's `quantization_config.quant_method`:

    compressed-tensors   (llm-compressor) config_groups[*].weights = {type: float, num_bits: 8, strategy}:
                         `X.weight` float8_e4m3fn [N, K] and `X.weight_scale` fp32: [N, 1] for strategy
                         "channel", [1] (or a scalar) for "tensor", [ceil(N / bn), ceil(K / bk)] for "block"
                         (block_structure [bn, bk])
    fp8                  (the `fp8` quantization_config: DeepSeek-V3, Qwen3-FP8, transformers' FP8 writer):
                         `X.weight` float8_e4m3fn with `X.weight_scale_inv` [ceil(N / bn), ceil(K / bk)] when
                         `weight_block_size` [bn, bk] is set, else `X.weight_scale` per tensor

In every case W = weight · scale (the `_inv` in DeepSeek's name is what the quantizer divided by, so the
loader multiplies). A static `input_scale` is read past and unused: activations are always quantized per
token at run time, which is at least as accurate. Which linears are quantized is read from the files (the
dtype of each `X.weight` in the safetensors headers), so the formats' ignore lists need no parsing.

Any other quant_method (GPTQ, AWQ, bitsandbytes, int compressed-tensors, ...) is refused at load; so is a scale
whose shape does not fit its strategy, before any weight is read.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenbus_kernels.fp8_linear import FP8

STRATEGIES = ("channel", "tensor", "block")
SCALE_NAMES = ("weight_scale", "weight_scale_inv")
SAFETENSORS_FP8 = "F8_E4M3"


@dataclass
class Fp8Format:
    method: str  # "compressed-tensors" or "fp8"
    strategy: str  # one of STRATEGIES, for every quantized linear
    block: tuple[int, int] | None = None  # [bn, bk] for strategy "block"


@dataclass
class QuantizedLinear:
    prefix: str  # the checkpoint's module name, e.g. "model.layers.0.self_attn.q_proj"
    shape: tuple[int, int]  # the weight's [N, K]
    scale_name: str  # which of SCALE_NAMES the checkpoint uses


@dataclass
class Fp8Checkpoint:
    format: Fp8Format
    linears: dict[str, QuantizedLinear] = field(default_factory=dict)  # by prefix

    def weights(self, stream: Iterator[tuple[str, torch.Tensor]], keep: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as the model loads them: each quantized linear whose prefix is in `keep`
        as `X.weight` float8_e4m3fn [N, K] + `X.weight_scale` fp32 [N] (per channel; a per-tensor scale is
        repeated); every other one dequantized to fp32 `X.weight`. Input scales are dropped."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in stream:
            prefix, _, leaf = name.rpartition(".")
            linear = self.linears.get(prefix)
            if linear is None or leaf not in ("weight", linear.scale_name, "input_scale"):
                yield name, tensor
                continue
            if leaf == "input_scale":
                continue
            parts = pending.setdefault(prefix, {})
            parts[leaf] = tensor
            if len(parts) == 2:
                del pending[prefix]
                yield from self._converted(linear, parts["weight"], parts[linear.scale_name], prefix in keep)
        if pending:
            prefix, parts = next(iter(pending.items()))
            raise ValueError(
                f"the FP8 checkpoint has {prefix}.{next(iter(parts))} without its partner tensor "
                f"({len(pending)} linear(s) incomplete): the checkpoint's files are incomplete"
            )

    def _converted(
        self, linear: QuantizedLinear, weight: torch.Tensor, scale: torch.Tensor, keep: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        strategy, (n, k) = self.format.strategy, linear.shape
        scale = scale.float()
        if strategy == "block":
            bn, bk = self.format.block
            full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
            yield f"{linear.prefix}.weight", weight.float() * full
            return
        per_channel = scale.reshape(-1).expand(n).contiguous() if strategy == "tensor" else scale.reshape(n)
        if keep:
            yield f"{linear.prefix}.weight", weight
            yield f"{linear.prefix}.weight_scale", per_channel
        else:
            yield f"{linear.prefix}.weight", weight.float() * per_channel[:, None]


def _as_dict(qc: Any) -> dict[str, Any]:
    if isinstance(qc, dict):
        return qc
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


UNQUANTIZED_HINT = (
    "tokenbus loads unquantized (fp32/bf16/fp16) checkpoints and FP8 ones (compressed-tensors "
    "float8, or quant_method 'fp8'): load one of those (on the CPU, --quantization int8 quantizes "
    "an unquantized one; on the GPU, --quantization fp8)"
)


def read_format(hf_config: Any) -> Fp8Format | None:
    """The checkpoint's FP8 format from its quantization_config; None for an unquantized checkpoint (or a
    GGUF, dequantized by the loader); ValueError naming the scheme for anything tokenbus cannot load."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = _as_dict(qc)
    method = str(qc.get("quant_method"))
    if method in ("gguf", "QuantizationMethod.GGUF"):
        return None
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"the checkpoint's fp8 quantization_config has fmt {fmt!r}; only 'e4m3' is supported")
        block = qc.get("weight_block_size")
        if block is not None:
            return Fp8Format("fp8", "block", _block(block, "weight_block_size"))
        return Fp8Format("fp8", "tensor")
    raise ValueError(
        f"the checkpoint's weights are quantized with {method!r} (its quantization_config), which "
        f"tokenbus does not support; {UNQUANTIZED_HINT}"
    )


def _block(block: Any, what: str) -> tuple[int, int]:
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(int(b) > 0 for b in block)):
        raise ValueError(f"the checkpoint's {what} is {block!r}; expected two positive sizes [rows, columns]")
    return int(block[0]), int(block[1])


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Format:
    groups = qc.get("config_groups") or {}
    formats = set()
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
        if kind != "float" or bits != 8:
            raise ValueError(
                f"compressed-tensors group {name!r} quantizes weights to {kind} {bits}-bit "
                f"(format {qc.get('format')!r}); tokenbus loads only float 8-bit (FP8 e4m3) "
                f"weights; {UNQUANTIZED_HINT}"
            )
        if strategy not in STRATEGIES:
            raise ValueError(
                f"compressed-tensors group {name!r} has weight strategy {strategy!r}; tokenbus loads {list(STRATEGIES)}"
            )
        block = _block(weights.get("block_structure"), "block_structure") if strategy == "block" else None
        formats.add((strategy, block))
    if len(formats) != 1:
        raise ValueError(
            f"compressed-tensors config_groups use {len(formats)} weight layouts {sorted(formats)}; "
            "tokenbus loads checkpoints whose quantized linears share one"
        )
    strategy, block = formats.pop()
    return Fp8Format("compressed-tensors", strategy, block)


def expected_scale_shapes(fmt: Fp8Format, n: int, k: int) -> list[tuple[int, ...]]:
    if fmt.strategy == "channel":
        return [(n, 1), (n,)]
    if fmt.strategy == "tensor":
        return [(), (1,)]
    bn, bk = fmt.block
    return [(-(-n // bn), -(-k // bk))]


def scan(directory: str, fmt: Fp8Format) -> Fp8Checkpoint:
    """Every quantized linear of the checkpoint's safetensors (headers only), each scale's shape checked
    against the format's strategy: ValueError naming the tensor, its shape and the expected one."""
    from safetensors import safe_open

    dtypes: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                dtypes[name], shapes[name] = piece.get_dtype(), tuple(piece.get_shape())
    checkpoint = Fp8Checkpoint(fmt)
    for name, dtype in dtypes.items():
        if dtype != SAFETENSORS_FP8:
            continue
        prefix, _, leaf = name.rpartition(".")
        scale_name = next((s for s in SCALE_NAMES if f"{prefix}.{s}" in shapes), None)
        if leaf != "weight" or len(shapes[name]) != 2 or scale_name is None:
            raise ValueError(
                f"the checkpoint's tensor {name!r} is float8_e4m3fn {list(shapes[name])} without a "
                f"weight scale ({prefix}.weight_scale or .weight_scale_inv): tokenbus reads FP8 "
                "linear weights [out, in] with their scales only"
            )
        n, k = shapes[name]
        got, expected = shapes[f"{prefix}.{scale_name}"], expected_scale_shapes(fmt, n, k)
        if got not in expected:
            block = f" {list(fmt.block)}" if fmt.block else ""
            raise ValueError(
                f"mismatched scale layout: {prefix}.{scale_name} is {list(got)} for the weight [{n}, {k}], but the "
                f"checkpoint's {fmt.method} config says strategy {fmt.strategy!r}{block}, whose scale is "
                f"{' or '.join(str(list(e)) for e in expected)}: the config and the files disagree"
            )
        checkpoint.linears[prefix] = QuantizedLinear(prefix, (n, k), scale_name)
    if not checkpoint.linears:
        raise ValueError(
            f"the checkpoint's config says {fmt.method} FP8, but no *.safetensors file in "
            f"{directory!r} holds a float8_e4m3fn weight"
        )
    return checkpoint


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype == FP8
