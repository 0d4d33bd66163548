"""Turns a scheduled batch into flat tensors (StepInputs), runs the model once, and samples (and pools the rows
of embedding sequences: pooling.py).

Owns the model weights and the paged KV cache (per layer a K and a V tensor of shape
[num_blocks + 1, block_size, num_kv_heads, head_dim] (+ 4 per row for int8/fp8: tokenbus_kernels/kv_quant.py); the
last block is the padding rows' scratch block).
"""

from __future__ import annotations

import torch

from worker.engine import kv_cache
from worker.engine.cascade import CascadePlanner
from worker.engine.cuda_graphs import StaticDecode
from worker.engine.guided import GuidedDecoding
from worker.engine.lora.layer import LoraState
from worker.engine.models.llama import LlamaForCausalLM
from worker.engine.parallel.step_channel import StepChannel
from worker.engine.pooling import Pooler
from worker.engine.sampler import SampledStep, Sampler
from worker.engine.scheduler import ScheduledBatch
from worker.engine.sequence import Sequence
from worker.engine.step_inputs import Ahead, PreparedStep, StepInputs


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    """dtype: the cache's (EngineConfig.kv_cache_dtype's storage, tokenbus_kernels/kv_quant.py)."""
    return kv_cache.bytes_per_block(model.arch, block_size, dtype)


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, sampler: Sampler | None, num_blocks: int, block_size: int,
        device: torch.device, kv_dtype: torch.dtype, max_num_seqs: int, max_model_len: int,
        static_decode: bool = False, guided: GuidedDecoding | None = None, pooler: Pooler | None = None,
        cascade: CascadePlanner | None = None,
    ) -> None:
        self.model = model
        self.guided = guided
        self.pooler = pooler  # None: the engine serves no embedding requests
        self.sampler = sampler
        self.block_size = block_size
        self.device = device
        arch = model.arch
        # one block past the pool, never handed to a sequence: padding rows of a padded step write there
        self.pad_block = num_blocks
        # zeros, not empty: on the CPU an untouched page faults on its first write, and a decode step writing
        # into fresh blocks took ~700 such faults (~7 ms at 64 sequences); touching the cache once at start-up
        # moves that cost out of serving
        self.kv_caches = kv_cache.allocate(arch, num_blocks + 1, block_size, kv_dtype, device)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.inputs = StepInputs(max_num_seqs, self.max_blocks_per_seq, block_size, self.pad_block, device,
                                 cascade)
        # pure decode steps padded to fixed shapes (cuda_graphs.py); capture() turns them into graph replays
        self.static = StaticDecode(model, self.kv_caches, self.inputs, max_num_seqs) if static_decode else None
        # rank 0 of a tensor-parallel worker: each step's inputs go to the other ranks through it (parallel/)
        self.channel: StepChannel | None = None
        self.lora: LoraState | None = None  # the adapters' shared state (use_lora), None without LoRA

    def use_lora(self, state: LoraState, num_slots: int) -> None:
        """Serve LoRA adapters: each step's rows carry their slots, and the forward sees them (before capture)."""
        self.lora = state
        self.inputs.lora_slots = num_slots
        if self.static is not None:
            self.static.lora = state

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list | None]:
        """One forward pass. Returns the sequences that produced a token, their tokens and logprob rows."""
        step = self.prepare(batch)
        sampled = self.execute(step)
        if sampled is None:
            return [], [], None
        tokens, logprobs = sampled.result()
        return step.sampling_seqs, tokens, logprobs

    def prepare(self, batch: ScheduledBatch, ahead: Ahead | None = None) -> PreparedStep:
        """The step's inputs (host work, and their one copy to the device). ahead: the step in flight."""
        if self.static is not None and self.static.serves(batch):
            return self.static.prepare(batch, ahead)
        return self.inputs.prepare(batch, ahead=ahead)

    @torch.inference_mode()
    def execute(self, step: PreparedStep, prev_tokens: torch.Tensor | None = None,
                resolve_on_device: bool = False) -> SampledStep | None:
        """The device work of a prepared step: forward and sampling, queued; None when no row samples.
        prev_tokens: the device ids the previous step sampled, for the rows the step carries over (overlap)."""
        if step.carry_rows is not None:
            assert prev_tokens is not None, "a step that carries tokens over needs the previous step's ids"
            step.input_ids.index_copy_(0, step.carry_rows, prev_tokens.index_select(0, step.carry_src))
        if self.channel is None:
            return self._pool_and_sample(self.forward(step), step, resolve_on_device)
        with self.channel.lock:  # the step's collectives, the send first, with no keep-alive between them
            self.channel.send(step, len(step.sampling_seqs))
            return self._pool_and_sample(self.forward(step), step, resolve_on_device)

    def forward(self, step: PreparedStep) -> torch.Tensor:
        """The step's final hidden states: padded and maybe replayed as a graph (static), or eager."""
        if step.bucket is not None:
            assert self.static is not None
            return self.static.execute(step)
        if self.lora is not None:
            self.lora.batch = step.lora
        return self.model(step.input_ids, step.positions, self.kv_caches, step.meta)

    @torch.inference_mode()
    def follow(self, step: PreparedStep, num_samples: int) -> None:
        """Another rank's side of a step rank 0 sent: the forward, and the logits' gather (rank 0 samples)."""
        hidden = self.forward(step)
        if num_samples:
            self.model.compute_logits(_sample_rows(hidden, step, num_samples))

    def _pool_and_sample(self, hidden: torch.Tensor, step: PreparedStep,
                         resolve_on_device: bool) -> SampledStep | None:
        if step.pooled:  # embedding rows: folded into their vectors (rank 0 only: the hidden states are whole)
            self.pooler(hidden, step.pooled)
        return self._sample(hidden, step, resolve_on_device)

    def _sample(self, hidden: torch.Tensor, step: PreparedStep, resolve_on_device: bool) -> SampledStep | None:
        if not step.sampling_seqs:
            return None
        logits = self.model.compute_logits(_sample_rows(hidden, step, len(step.sampling_seqs)))
        if self.guided is not None:  # structured output: forbidden tokens of constrained rows to -inf
            self.guided.apply(logits, step.sampling_seqs)
        return self.sampler(logits, step.sampling_seqs, resolve_on_device)


def _sample_rows(hidden: torch.Tensor, step: PreparedStep, num_samples: int) -> torch.Tensor:
    """The hidden rows the step samples from: the first num_samples (a decode step), or its sample_index."""
    return hidden[:num_samples] if step.sample_index is None else hidden.index_select(0, step.sample_index)
