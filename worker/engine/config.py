"""EngineConfig: every engine setting in one object, checked once. The worker's settings hold it whole
(worker/settings.py: `WorkerSettings.engine`, set as TOKENBUS_<FIELD> / --<field>); the offline Engine takes the
same fields as keywords.

Imports no torch, so the worker's settings and CLI can use its defaults without paying for torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_NAMES = ("float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")  # tokenbus_kernels/kv_quant.py
KV_CACHE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8_e4m3": "fp8"}
QUANTIZATIONS = ("int8", "fp8", "w8a8")  # worker/engine/quant/schemes.py
CASCADE_MODES = ("auto", "on", "off")  # worker/engine/cascade.py


def bulk_min_seats(fraction: float, seats: int) -> int:
    """Seats kept for bulk requests: the fraction of the seats, rounded up (one at least when fraction > 0)."""
    return min(seats, math.ceil(round(fraction * seats, 6))) if fraction > 0 else 0


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"  # a built-in name, a local HF dir, a hub id or a .gguf file
    device: str = "auto"  # "auto" = cuda when available, else cpu
    dtype: str = "auto"  # "auto" = bfloat16 on cuda, float32 on cpu
    block_size: int = 16  # tokens per KV-cache block
    max_num_seqs: int | None = None  # sequences in one batch; None = 256 on cuda, 64 on the cpu (the Engine
    # resolves it once the device is known)
    max_num_batched_tokens: int = 2048  # token budget of one step (prompt chunks + one per decoding sequence)
    max_model_len: int | None = None  # None = the model's own context
    kv_cache_gb: float | None = None  # KV-cache size; None = from gpu_memory_utilization (cuda) or 1 GiB (cpu)
    gpu_memory_utilization: float = 0.9  # CUDA: share of the card the engine may fill (weights + KV cache)
    num_kv_blocks: int | None = None  # a fixed block count (tests, benchmarks); overrides both sizes above
    cpu_kernels: bool = True  # CPU float32: the C++ kernels; False = the PyTorch references
    cache_dir: str | None = None  # dequantised GGUF weights, built CPU kernels; None = TOKENBUS_CACHE_DIR or
    # ~/.cache/tokenbus
    model_impl: str = "auto"  # "auto" = tokenbus's own code where it has the family, else transformers';
    # "transformers" forces transformers' modeling code (the fallback) on any model; "native" refuses the fallback
    bulk_min_fraction: float = 0.0  # share of max_num_seqs kept for bulk (priority rank 2) requests whenever
    # some wait: interactive traffic cannot starve a batch (the worker's default is 0.25)
    enable_prefix_caching: bool = True  # reuse cached full KV blocks of a shared prompt prefix
    cuda_graphs: bool = True  # CUDA: replay captured graphs for pure decode steps (prefill/mixed stay eager)
    static_decode: bool | None = None  # the fixed-shape padded decode path graphs replay; None = on with graphs
    # (CUDA), off on the CPU; True on the CPU runs it eagerly (tests)
    overlap: bool | None = None  # schedule and prepare step N+1 while step N runs (overlap.py); None = on for
    # cuda, off on the cpu (there the forward and the host share the same cores)
    quantization: str | None = None  # weights: None = as loaded; "int8" (CPU fp32, weight-only per-channel);
    # "w8a8" (CPU fp32: int8's weights and each linear's input rounded to int8 per token and group of 64, VNNI kernels);
    # "fp8" (CUDA sm_89+, e4m3 per-channel through torch._scaled_mm); worker/engine/quant/schemes.py
    tensor_parallel_size: int = 1  # processes (one per GPU) one worker's model is sharded over; rank 0 runs the
    # serve loop, scheduler and sampler (worker/engine/parallel/); NCCL on CUDA, gloo on the CPU
    tensor_parallel_timeout_s: float = 30.0  # a collective (a step's all-reduce, the idle keep-alive) waiting this
    # long means a rank hangs: the worker exits (code 3) and its jobs go to other workers
    kv_cache_dtype: str = "auto"  # "auto" = the model dtype; "bfloat16", "float32"; "int8" (CPU: the C++
    # kernels, a scale per token and KV head); "fp8" (CUDA sm_89+: e4m3, the same scales). tokenbus_kernels/kv_quant.py
    max_loras: int = 0  # LoRA adapter slots on the device (0 = no LoRA: no wrapped linears, no cost);
    # docs/adapters.md. Each slot holds one adapter at max_lora_rank for every target linear
    max_lora_rank: int = 16  # the largest adapter rank a slot holds; a higher one is refused at load
    max_cpu_loras: int | None = None  # adapters kept in host memory (LRU) for reloading into slots; None =
    # max_loras. Adapters of requests inside the engine are always kept
    cascade_attention: str = "auto"  # rows sharing a cached prefix read it once a step (tokenbus_kernels/cascade):
    # "auto" where the cost rule says it pays (worker/engine/cascade.py), "off" never, "on" every row (tests)

    def __post_init__(self) -> None:
        problems = []
        self.kv_cache_dtype = KV_CACHE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)} (or bf16, fp32, fp16), "
                            f"got {self.kv_cache_dtype!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            problems.append(f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            problems.append(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_seqs is not None and self.max_num_batched_tokens < self.max_num_seqs:
            problems.append(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): each running sequence needs one token of the budget"
            )
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            problems.append(f"dtype must be 'auto' or one of {list(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            problems.append(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            problems.append(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.max_model_len is not None and self.max_model_len < 2:
            problems.append(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.model_impl not in ("auto", "native", "transformers"):
            problems.append(f"model_impl must be 'auto', 'native' or 'transformers', got {self.model_impl!r}")
        if not 0 <= self.bulk_min_fraction <= 1:
            problems.append(f"bulk_min_fraction must be in [0, 1], got {self.bulk_min_fraction}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            problems.append(f"quantization must be unset or one of {list(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.max_loras < 0 or not 1 <= self.max_lora_rank <= 512:
            problems.append(f"max_loras must be >= 0 and max_lora_rank in [1, 512]; got {self.max_loras}, "
                            f"{self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            problems.append(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.cascade_attention not in CASCADE_MODES:
            problems.append(f"cascade_attention must be one of {list(CASCADE_MODES)}, got {self.cascade_attention!r}")
        if self.tensor_parallel_size < 1:
            problems.append(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_timeout_s <= 0:
            problems.append(f"tensor_parallel_timeout_s must be > 0, got {self.tensor_parallel_timeout_s}")
        if problems:
            raise ValueError("invalid engine config: " + "; ".join(problems))
