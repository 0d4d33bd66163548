"""The model one engine rank serves, set up: backend, weights (sharded under tensor parallelism), quantization,
the KV cache's size, and on CUDA the warm-up.

Engine (rank 0, or the only rank) and the other ranks of a tensor-parallel worker (parallel/follower.py) both
start through here, so they run the same start-up: every forward in it (the CUDA memory profile, the warm-up,
the graph capture) is a collective under TP and must come in the same order on every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from worker.engine import kv_cache, loader, warmup
from worker.engine.backends import ReferenceBackend, select_backend
from worker.engine.cascade import group_capacity
from worker.engine.config import EngineConfig
from worker.engine.lora.manager import LoraManager
from worker.engine.model_runner import ModelRunner, kv_bytes_per_block
from worker.engine.models import registry
from worker.engine.parallel import sharded_loading
from worker.engine.quant import fp8, schemes

log = structlog.get_logger("tokenbus.engine")

CUDA_MAX_NUM_SEQS = 256  # max_num_seqs when the config leaves it None: a GPU step is cheap per row
CPU_MAX_NUM_SEQS = 64  # the CPU's panel linears serve up to 64 rows (backends/cpu_linear.py)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelSpec:
    """What the config names, resolved the same way on every rank."""

    source: loader.ModelSource
    hf_config: Any
    arch: Any  # the whole model's (a rank's shard: TpShard.local_arch)
    model_path: str  # "native" or "transformers"
    dtype: torch.dtype
    max_model_len: int


def resolve(cfg: EngineConfig, device: torch.device) -> ModelSpec:
    dtype = DTYPES[cfg.dtype] if cfg.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    source = loader.resolve(cfg.model, cfg.cache_dir)
    hf_config = loader.load_config(source)
    arch = registry.model_arch(hf_config, cfg.model, cfg.model_impl)
    max_model_len = min(cfg.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
    return ModelSpec(source, hf_config, arch, registry.model_path(arch), dtype, max_model_len)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available here")
    return torch.device(device)


@dataclass
class ModelSetup:
    model: torch.nn.Module
    backend: ReferenceBackend
    kv_dtype: torch.dtype
    quantized_cache: str | None  # the int8 cache file read or written (None: none)
    num_blocks: int  # KV blocks for the sequences (the runner adds a pad block); the same on every rank
    max_num_seqs: int
    cuda_graphs: bool
    static_decode: bool
    weight_bytes: int  # this rank's weights and buffers as loaded
    loras: LoraManager | None = None  # the LoRA slots (max_loras > 0), sized before the KV cache is


def set_up(cfg: EngineConfig, device: torch.device, spec: ModelSpec, tp: Any = None) -> ModelSetup:
    """tp: this rank's TpGroup (its shard set) under tensor parallelism, else None."""
    source, hf_config, arch, model_path = spec.source, spec.hf_config, spec.arch, spec.model_path
    dtype, max_model_len = spec.dtype, spec.max_model_len
    schemes.check_scheme(cfg.quantization, device, dtype)
    fp8_loading = fp8.plan(hf_config, source.directory, cfg, device, model_path)
    backend = select_backend(device, dtype, cfg.cpu_kernels, cfg.cache_dir)
    backend.tp = tp
    backend.check_model(arch, cfg.model)
    kv_dtype = kv_cache.storage_dtype(cfg.kv_cache_dtype, device, dtype, backend.name)
    max_num_seqs = cfg.max_num_seqs or (CUDA_MAX_NUM_SEQS if device.type == "cuda" else CPU_MAX_NUM_SEQS)
    if cfg.max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({cfg.max_num_batched_tokens}) must be >= max_num_seqs "
            f"({max_num_seqs}) on {device.type}: each running sequence needs one token of the budget"
        )
    # graphs replay the padded decode path, so they need it; static_decode None follows the graphs;
    # transformers' own modeling code was never checked under graph capture: the fallback runs eagerly
    cuda_graphs = device.type == "cuda" and cfg.cuda_graphs and cfg.static_decode is not False \
        and model_path == "native" and getattr(arch, "causal", True)  # an encoder never decodes
    static_decode = cfg.static_decode if cfg.static_decode is not None else cuda_graphs
    weights = sharded_loading.weights(tp) if tp is not None else loader.iter_weights
    model_arch = tp.shard.local_arch(arch) if tp is not None else arch
    model = registry.build_model(model_arch, hf_config, source, backend, dtype, device, max_model_len,
                                 fp8_loading.weights(weights), prepare=fp8_loading.prepare)
    fp8_loading.finish(model, device)
    weight_bytes = sharded_loading.model_bytes(model)
    quantized_cache = None
    if cfg.quantization in ("int8", "w8a8"):
        quantized_cache = schemes.apply_int8(model, source.directory, cfg.cache_dir, w8a8=cfg.quantization == "w8a8")
        model.eval().requires_grad_(False)
    backend.prepare(model)
    loras = LoraManager.for_engine(cfg, model, backend, model_path, dtype, device, tp) if cfg.max_loras else None
    max_blocks_per_seq = -(-max_model_len // cfg.block_size)
    backend.reserve(model_arch, max_num_seqs, max_blocks_per_seq * cfg.block_size, device)
    setup = ModelSetup(model, backend, kv_dtype, quantized_cache, 0, max_num_seqs, cuda_graphs, static_decode,
                       weight_bytes, loras)
    setup.num_blocks = num_kv_blocks(setup, cfg, max_model_len, device)
    if tp is not None:  # one block table serves every rank: each holds what the smallest can
        setup.num_blocks = tp.agree_min(setup.num_blocks)
    return setup


def num_kv_blocks(setup: ModelSetup, cfg: EngineConfig, max_model_len: int, device: torch.device) -> int:
    """Blocks for the sequences: a fixed count, kv_cache_gb (per rank: each holds the KV of its own heads), or on
    CUDA what the card has left after the profiled peak of the largest step and the graphs' pool."""
    per_block = kv_bytes_per_block(setup.model, cfg.block_size, setup.kv_dtype)
    if cfg.num_kv_blocks:
        return cfg.num_kv_blocks
    if cfg.kv_cache_gb is not None:
        budget = cfg.kv_cache_gb * 1024**3
    elif device.type == "cuda":
        budget = _cuda_kv_budget(setup, cfg, max_model_len, device)
    else:
        budget = 1024**3
    blocks = int(budget // per_block) - 1
    if blocks < 1:
        raise ValueError("no memory left for the KV cache: raise kv_cache_gb / gpu_memory_utilization")
    return blocks


def _cuda_kv_budget(setup: ModelSetup, cfg: EngineConfig, max_model_len: int, device: torch.device) -> float:
    width = -(-max_model_len // cfg.block_size)
    args = (cfg.block_size, setup.kv_dtype, device)
    peak = warmup.profile_peak(setup.model, cfg.max_num_batched_tokens, setup.max_num_seqs, max_model_len, *args)
    graphs = warmup.decode_peak(setup.model, setup.max_num_seqs, width, *args) if setup.cuda_graphs else 0
    groups = group_capacity(cfg.cascade_attention, setup.max_num_seqs) if cfg.tensor_parallel_size == 1 else 0
    if setup.cuda_graphs and groups:  # the cascade graphs share the pool (cuda_graphs.py)
        graphs = max(graphs, warmup.decode_peak(setup.model, setup.max_num_seqs, width, *args, cascade_groups=groups))
    free, total = torch.cuda.mem_get_info(device)
    budget = total * cfg.gpu_memory_utilization - peak - graphs
    # another process on the card shrinks what is really free
    budget = min(budget, free - graphs - (peak - torch.cuda.memory_allocated(device)))
    log.info("kv_cache_plan", total_gib=round(total / 1024**3, 2), peak_gib=round(peak / 1024**3, 3),
             graph_pool_gib=round(graphs / 1024**3, 3), kv_gib=round(max(budget, 0) / 1024**3, 2))
    return max(budget, 0)


def make_runner(setup: ModelSetup, cfg: EngineConfig, device: torch.device, max_model_len: int,
                sampler: Any = None, guided: Any = None, pooler: Any = None, cascade: Any = None) -> ModelRunner:
    """The rank's ModelRunner (KV cache allocated); on CUDA warmed up (and its graphs captured). pooler: rank
    0's, when the engine embeds; cascade: its CascadePlanner (worker/engine/cascade.py)."""
    runner = ModelRunner(setup.model, sampler, setup.num_blocks, cfg.block_size, device, setup.kv_dtype,
                         setup.max_num_seqs, max_model_len, setup.static_decode, guided=guided, pooler=pooler,
                         cascade=cascade)
    if setup.loras is not None:  # before the graphs are captured: they take the adapter rows as inputs
        runner.use_lora(setup.loras.state, cfg.max_loras)
    if device.type == "cuda":
        _warm_up(setup, runner, cfg, device)
    return runner


def _warm_up(setup: ModelSetup, runner: ModelRunner, cfg: EngineConfig, device: torch.device) -> None:
    """Every kernel variant the serve loop hits, compiled before the first request; then the graphs."""
    started = time.perf_counter()
    shapes = runner.static.shapes() if runner.static is not None and not setup.cuda_graphs else None
    warmup.warm_up(setup.model, runner.kv_caches, runner.pad_block, cfg.block_size, runner.max_blocks_per_seq,
                   setup.max_num_seqs, cfg.max_num_batched_tokens, shapes)
    torch.cuda.synchronize(device)
    warm_s = time.perf_counter() - started
    graph_s = runner.static.capture() if setup.cuda_graphs else 0.0
    log.info("engine_warmed_up", kernels_s=round(warm_s, 2), graphs_s=round(graph_s, 2))
