"""Weight quantization at load (`--quantization`, EngineConfig.quantization): which schemes exist, how a
model's linears are quantized, and the on-disk cache of the result.

    int8   CPU, float32 activations. Weight-only, symmetric, one fp32 scale per output channel:
           q = round(W / s), s = max|W_row| / 127. Every linear of the decoder and lm_head (untied from the
           embedding, which stays fp32: a lookup reads one row per token). The C++ panel kernel reads the int8
           panels and widens them in registers (tokenbus_kernels/csrc/cpu_quant.cpp); prefill-sized batches run oneDNN
           on the dequantized weight, so both paths compute the same model: W ≈ q · s.

    w8a8   CPU, float32. int8's weights (the same cache), and each linear's input rounded to int8 at each
           call, dynamically, per row (token) and group of 64 features: sx = max|x_group| / 127,
           qx = round(x / sx). The kernel multiplies int8 by int8 with VNNI (tokenbus_kernels/csrc/cpu_w8a8.cpp: 4
           products per 32-bit lane, int32 sums per group, scaled into fp32) where int8's kernel runs one
           fp32 FMA per weight, at every batch size, prefill included; without VNNI, prefill-sized batches
           run oneDNN on the rounded activations and the dequantized weight: the same model,
           y ≈ (qx · sx)(q · s)ᵀ. On a CPU without VNNI the kernel's plain C++ sums are slower than int8's
           (a warning at load).

    fp8    FP8 (e4m3) weights with per-output-channel scales through torch._scaled_mm, activations quantized
           per token (worker/engine/quant/fp8.py, tokenbus_kernels/fp8_linear.py). CUDA sm_89+ (Ada, Hopper); the CPU
           runs the same code on PyTorch's CPU _scaled_mm (slow: for checking). An unquantized checkpoint is
           quantized at load; an FP8 checkpoint (fp8_checkpoint.py) is served FP8 on CUDA even without it.

Quantizing SmolLM2-135M takes about a second; the result is still cached on disk beside the dequantized
GGUF (tokenbus_kernels.cpu.cache_root()/quantized), keyed by the checkpoint's files, so a restart reads it back.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from torch import nn

from tokenbus_kernels.cpu import cache_root, cpu_flags

SCHEMES = ("int8", "fp8", "w8a8")
INT8_MAX = 127
# w8a8: input features per activation scale. Per row (token) cost SmolLM2-135M +4.6 % perplexity, 64 +0.6 %,
# 32 +0.55 %, 128 +1.6 % (docs/quantization.md); 64 is a whole number of the kernel's 4-feature lanes
W8A8_GROUP = 64
CACHE_VERSION = "int8-v1"  # bump when the int8 recipe changes: old cache entries are then ignored

log = structlog.get_logger("tokenbus.quantization")


@dataclass
class Int8Weight:
    qweight: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out]: W[o] ≈ qweight[o] * scale[o]

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scale[:, None]


def quantize_int8(weight: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Int8Weight:
    """Symmetric per-output-channel int8 of an [out, in] weight (an all-zero row gets scale 1). reduce: the
    rows' max |w| over the tensor-parallel ranks, for a row-parallel shard (each rank holds part of each row):
    the scale is then the whole row's, and the shard's codes the unsharded codes' slice."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    if reduce is not None:
        amax = reduce(amax)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q, scale.contiguous())


def quantize_activations_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 of x [..., k] per row (token) and group of W8A8_GROUP consecutive features (the last
    group may be shorter): (codes [..., k], scale [..., ceil(k / W8A8_GROUP)]) with scale = max|x_group| / 127 and
    codes = round(x · (127 / max|x_group|)) in fp32, the ops the C++ W8A8 kernel runs (csrc/cpu_w8a8.cpp);
    an all-zero group gets scale 0 and codes 0."""
    x = x.float()
    k = x.shape[-1]
    groups = -(-k // W8A8_GROUP)
    padded = torch.nn.functional.pad(x, (0, groups * W8A8_GROUP - k)).view(*x.shape[:-1], groups, W8A8_GROUP)
    amax = padded.abs().amax(dim=-1, keepdim=True)
    # a tensor over a tensor: `127 / amax` would be amax.reciprocal() * 127, one rounding more than the kernel's
    inv = torch.where(amax > 0, torch.full_like(amax, INT8_MAX) / amax, torch.zeros_like(amax))
    codes = torch.round(padded * inv).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes.view(*x.shape[:-1], groups * W8A8_GROUP)[..., :k], (amax / INT8_MAX).squeeze(-1)


def round_activations_int8(x: torch.Tensor) -> torch.Tensor:
    """x with each row's groups rounded to their dynamic int8 values (quantized, then dequantized): what a W8A8
    linear multiplies its weight with."""
    codes, scale = quantize_activations_int8(x)
    return (codes.float() * scale.repeat_interleave(W8A8_GROUP, dim=-1)[..., : x.shape[-1]]).to(x.dtype)


def check_int8_layout(name: str, qweight: torch.Tensor, scale: torch.Tensor, shape: torch.Size) -> None:
    """ValueError unless (qweight, scale) is the int8 of an [out, in] weight: int8 [out, in] and fp32 [out]."""
    problems = []
    if qweight.dtype != torch.int8 or tuple(qweight.shape) != tuple(shape):
        problems.append(f"weight is {qweight.dtype} {list(qweight.shape)}, expected torch.int8 {list(shape)}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (shape[0],):
        problems.append(
            f"scale is {scale.dtype} {list(scale.shape)}, expected torch.float32 [{shape[0]}] "
            "(one per output channel: int8 is symmetric per-channel only)"
        )
    if problems:
        raise ValueError(f"int8 weights of {name!r} have a mismatched layout: " + "; ".join(problems))


def quantizable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every nn.Linear of the model by name: the decoder layers' four and lm_head."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def check_scheme(scheme: str | None, device: torch.device, dtype: torch.dtype) -> None:
    if scheme is None:
        return
    if scheme not in SCHEMES:
        raise ValueError(f"quantization {scheme!r} is not supported; choose one of {list(SCHEMES)} or leave it unset")
    if scheme in ("int8", "w8a8") and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(
            f"quantization {scheme!r} is the CPU float32 path (got {device.type}, {dtype}): "
            "use --device cpu --dtype float32"
        )
    if scheme == "w8a8" and not vnni_available():
        log.warning("w8a8_without_vnni", why="this CPU has no AVX512_VNNI or AVX_VNNI: the W8A8 kernel runs "
                    "plain C++ integer sums, slower than --quantization int8 (same weights, fp32 activations)")
    if scheme == "fp8" and device.type == "cuda" and not fp8_gemm_available(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"quantization 'fp8' needs a GPU with FP8 tensor cores (sm_89+: Ada, Hopper); this one "
            f"is sm_{major}{minor}: leave --quantization unset to serve bf16"
        )
    if scheme == "fp8" and device.type == "cpu":
        log.warning(
            "fp8_on_cpu",
            why="--quantization fp8 is the GPU path: on the CPU it runs PyTorch's CPU "
            "_scaled_mm, slower than float32 (for checking); --quantization int8 is the CPU's scheme",
        )


def vnni_available() -> bool:
    """Whether the CPU multiplies int8 by int8 in vector registers (what makes w8a8 fast): the C++ kernels are
    compiled for the CPU they run on (-march=native), so its flags decide which path they take."""
    flags = set(cpu_flags().split(":", 1)[-1].split())
    return bool(flags & {"avx512_vnni", "avx_vnni"})


def fp8_gemm_available(device: torch.device) -> bool:
    """Whether torch._scaled_mm has FP8 tensor cores here: CUDA sm_89+ (the CPU build emulates it)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


@torch.no_grad()
def apply_int8(model: nn.Module, directory: str, cache_dir: str | None = None, w8a8: bool = False) -> str | None:
    """Quantize the loaded fp32 model's linears to int8 in place (or read them back from the cache): each
    nn.Linear's weight becomes its dequantized value and gains an `int8` attribute (Int8Weight) that
    backends/cpu_linear.py packs for the C++ kernel; w8a8 also marks it (`w8a8 = True`) to round its input per
    token and group to int8 (the W8A8 kernel). Returns the cache file's path (None: no cache)."""
    linears = quantizable_linears(model)
    tp = getattr(getattr(model, "backend", None), "tp", None)
    # no cache under tensor parallelism: every rank would have to hit or miss it alike (quantizing a shard
    # takes a collective per row-parallel linear), and a shard quantizes in a fraction of the model's second
    path = _cache_path(directory, model, cache_dir) if tp is None else None
    quantized = _read_cache(path, linears) if path and os.path.isfile(path) else None
    if quantized is None:
        quantized = {name: quantize_int8(m.weight, row_max(tp, name)) for name, m in linears.items()}
        if path:
            _write_cache(path, quantized)
    embed = getattr(model, "embed_tokens", None)
    for name, linear in linears.items():
        deq = quantized[name].dequantize()
        if embed is not None and linear.weight is embed.weight:  # tied lm_head: the embedding stays fp32
            linear.weight = nn.Parameter(deq, requires_grad=False)
        else:
            linear.weight.copy_(deq)
        linear.int8 = quantized[name]
        linear.w8a8 = w8a8
    log.info("quantized", scheme="w8a8" if w8a8 else "int8", linears=len(linears), cache=path)
    return path


def row_max(tp: Any, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A row-parallel shard's reduction of its rows' max |w| over the ranks (None: its rows are whole)."""
    from worker.engine.parallel.shard import ROW_PARALLEL

    if tp is None or name.rpartition(".")[2] not in ROW_PARALLEL:
        return None
    return lambda amax: tp.all_reduce(amax, torch.distributed.ReduceOp.MAX)


def _cache_path(directory: str, model: nn.Module, cache_dir: str | None) -> str | None:
    """cache_root/quantized/<key>.safetensors, keyed by the checkpoint's files (name, size, mtime) and the
    model's linear shapes; None where the directory cannot be listed."""
    try:
        files = sorted(f for f in os.listdir(directory) if f.endswith((".safetensors", ".gguf", ".bin")))
        stats = [(f, os.stat(os.path.join(directory, f))) for f in files]
        stamp = [f"{f}:{st.st_size}:{int(st.st_mtime)}" for f, st in stats]
    except OSError:
        return None
    shapes = [f"{n}:{tuple(m.weight.shape)}" for n, m in quantizable_linears(model).items()]
    key = hashlib.sha256("\n".join([CACHE_VERSION, os.path.abspath(directory), *stamp, *shapes]).encode()).hexdigest()
    return os.path.join(cache_root(cache_dir), "quantized", f"{key[:24]}.safetensors")


def _read_cache(path: str, linears: dict[str, nn.Linear]) -> dict[str, Int8Weight] | None:
    from safetensors.torch import load_file

    tensors = load_file(path)
    out = {}
    for name, linear in linears.items():
        if f"{name}.qweight" not in tensors or f"{name}.scale" not in tensors:
            log.warning("int8_cache_incomplete", path=path, missing=name, action="quantizing again")
            return None
        qweight, scale = tensors[f"{name}.qweight"], tensors[f"{name}.scale"]
        try:
            check_int8_layout(name, qweight, scale, linear.weight.shape)
        except ValueError as err:
            raise ValueError(f"{err} (in the cache file {path}: delete it to quantize again)") from None
        out[name] = Int8Weight(qweight, scale)
    return out


def _write_cache(path: str, quantized: dict[str, Int8Weight]) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for name, q in quantized.items():
        tensors[f"{name}.qweight"], tensors[f"{name}.scale"] = q.qweight.contiguous(), q.scale.contiguous()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=".staging-", dir=os.path.dirname(path))
        os.close(fd)
        save_file(tensors, staging)
        os.chmod(staging, 0o644)  # mkstemp makes it owner-only; a shared cache is read by other users' workers
        os.replace(staging, path)  # atomic: a concurrent reader sees the old file or the whole new one
    except OSError as err:  # read-only cache: quantize at each load instead
        log.warning("int8_cache_unavailable", error=str(err))
