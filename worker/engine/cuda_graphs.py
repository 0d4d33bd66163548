"""StaticDecode: pure decode steps on fixed shapes, replayed as CUDA graphs on a GPU.

A decode step of n sequences is padded to the smallest bucket b >= n (DECODE_BUCKETS, then every 32, up to
max_num_seqs): StepInputs pads it (padding rows write into the pad block and read nothing else) and gives
every row the full-width block table, so the decode kernel's partition count and the partials it uses
(the backend's DecodeWorkspace) are the same every step. Prefill and mixed steps stay eager.

    graphs off (CPU; static_decode=True)   the padded step runs eagerly: the same shapes and padding, tested
                                           token for token against Hugging Face on the CPU
    graphs on (CUDA, cuda_graphs=True)     capture(): per bucket one graph of the model forward over static
                                           buffers (ids, positions, slots, seq lens, tables); run() copies the
                                           step's inputs into them and replays; the logits stay eager
"""

from __future__ import annotations

import time

import structlog
import torch

from worker.engine.attention_metadata import AttentionMetadata
from worker.engine.scheduler import ScheduledBatch
from worker.engine.step_inputs import Ahead, PreparedStep, StepInputs

log = structlog.get_logger("tokenbus.engine")

DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes a decode step is padded to: DECODE_BUCKETS, then every 32, the last one max_num_seqs."""
    buckets = [b for b in DECODE_BUCKETS if b < max_num_seqs]
    b = 96
    while b < max_num_seqs:
        buckets.append(b)
        b += 32
    return [*buckets, max_num_seqs]


class StaticDecode:
    def __init__(self, model: torch.nn.Module, kv_caches: list, inputs: StepInputs, max_num_seqs: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.inputs = inputs
        self.buckets = decode_buckets(max_num_seqs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> (graph, its output)
        self.static: dict[str, torch.Tensor] = {}

    def serves(self, batch: ScheduledBatch) -> bool:
        return len(batch.seqs) <= self.buckets[-1] and all(n == 1 for n in batch.num_new_tokens)

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, PreparedStep]:
        """The padded step's final hidden states [bucket, hidden] (rows past the batch are padding)."""
        step = self.prepare(batch)
        return self.execute(step), step

    def prepare(self, batch: ScheduledBatch, ahead: Ahead | None = None) -> PreparedStep:
        return self.inputs.prepare(batch, pad_to=self.bucket(len(batch.seqs)), ahead=ahead)

    def execute(self, step: PreparedStep) -> torch.Tensor:
        b = step.bucket
        assert b is not None
        graph = self.graphs.get(b)
        if graph is None:
            return self.model(step.input_ids, step.positions, self.kv_caches, step.meta)
        s, meta = self.static, step.meta
        s["ids"][:b].copy_(step.input_ids)
        s["positions"][:b].copy_(step.positions)
        s["slots"][:b].copy_(meta.slot_mapping)
        s["seq_lens"][:b].copy_(meta.decode_seq_lens)
        s["tables"][:b].copy_(meta.decode_block_tables)
        graph[0].replay()
        return graph[1]

    # ---- CUDA graphs ----------------------------------------------------------------------------------------

    def _static_meta(self, b: int) -> AttentionMetadata:
        s = self.static
        return AttentionMetadata(
            slot_mapping=s["slots"][:b], num_prefill_tokens=0, prefill_block_tables=None,
            prefill_cu_seqlens_q=None, prefill_seq_lens=None, decode_block_tables=s["tables"][:b],
            decode_seq_lens=s["seq_lens"][:b],
        )

    @torch.inference_mode()
    def capture(self) -> float:
        """One graph per bucket, largest first, sharing one memory pool. Returns the seconds it took."""
        started = time.perf_counter()
        device, n = self.inputs.device, self.buckets[-1]
        pad = self.inputs
        # every row starts as a padding row: capture and warm-up write only into the pad block
        self.static = {
            "ids": torch.zeros(n, dtype=torch.int64, device=device),
            "positions": torch.zeros(n, dtype=torch.int64, device=device),
            "slots": torch.full((n,), pad.pad_block * pad.block_size, dtype=torch.int64, device=device),
            "seq_lens": torch.ones(n, dtype=torch.int32, device=device),
            "tables": torch.full((n, pad.max_blocks_per_seq), pad.pad_block, dtype=torch.int32, device=device),
        }
        pool = None
        for b in reversed(self.buckets):
            args = (self.static["ids"][:b], self.static["positions"][:b], self.kv_caches, self._static_meta(b))
            self.model(*args)  # compiles the kernels' variants for this shape outside the capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(*args)
            pool = graph.pool()
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - started
        log.info("cuda_graphs_captured", buckets=self.buckets, seconds=round(seconds, 2))
        return seconds
