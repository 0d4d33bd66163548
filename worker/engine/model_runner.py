"""Turns a scheduled batch into flat tensors, runs the model once, and samples.

Owns the model weights and the paged KV cache (per layer a K and a V tensor of shape
[num_blocks, block_size, num_kv_heads, head_dim]).
"""

from __future__ import annotations

import torch

from worker.engine.attention_metadata import AttentionMetadata
from worker.engine.guided import GuidedDecoding
from worker.engine.models.llama import LlamaForCausalLM
from worker.engine.sampler import Sampler
from worker.engine.scheduler import ScheduledBatch
from worker.engine.sequence import Sequence


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    arch = model.arch
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, sampler: Sampler, num_blocks: int, block_size: int,
        device: torch.device, dtype: torch.dtype, guided: GuidedDecoding | None = None,
    ) -> None:
        self.model = model
        self.guided = guided
        self.sampler = sampler
        self.block_size = block_size
        self.device = device
        arch = model.arch
        shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        # zeros, not empty: on the CPU an untouched page faults on its first write, and a decode step writing
        # into fresh blocks took ~700 such faults (~7 ms at 64 sequences); touching the cache once at start-up
        # moves that cost out of serving
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(arch.num_layers)
        ]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list | None]:
        """One forward pass. Returns the sequences that produced a token, their tokens and logprob rows."""
        input_ids, positions, meta, order = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        # Only a sequence whose last pending token is in this step samples (a mid-prompt chunk does not).
        sample_rows, sampling_seqs = [], []
        row = 0
        for seq, n in order:
            row += n
            if seq.num_computed_tokens + n == seq.num_tokens:
                sample_rows.append(row - 1)
                sampling_seqs.append(seq)
        if not sampling_seqs:
            return [], [], None
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        if self.guided is not None:  # structured output: forbidden tokens of constrained rows to -inf
            self.guided.apply(logits, sampling_seqs)
        tokens, logprobs = self.sampler(logits, sampling_seqs).result()
        return sampling_seqs, tokens, logprobs

    def _prepare(self, batch: ScheduledBatch):
        prefill = [(s, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True) if n > 1]
        decode = [(s, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True) if n == 1]
        order = prefill + decode
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq, n in order:
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            table, bs = seq.block_table, self.block_size
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        num_prefill_tokens = sum(n for _, n in prefill)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            num_prefill_tokens=num_prefill_tokens,
            prefill_block_tables=self._block_tables([s for s, _ in prefill]) if prefill else None,
            prefill_cu_seqlens_q=self._tensor(_cumsum([n for _, n in prefill]), torch.int32) if prefill else None,
            prefill_seq_lens=self._tensor([s.num_computed_tokens + n for s, n in prefill], torch.int32)
            if prefill else None,
            decode_block_tables=self._block_tables([s for s, _ in decode]) if decode else None,
            decode_seq_lens=self._tensor([s.num_computed_tokens + 1 for s, _ in decode], torch.int32)
            if decode else None,
        )
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta, order

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        return self._tensor(rows, torch.int32)

    def _tensor(self, values, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t


def _cumsum(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out
