"""StaticDecode: pure decode steps on fixed shapes, replayed as CUDA graphs on a GPU.

A decode step of n sequences is padded to the smallest bucket b >= n (DECODE_BUCKETS, then every 32, up to
max_num_seqs): StepInputs pads it (padding rows write into the pad block and read nothing else). Its block
tables are cut to a width bucket of the step's longest table (DecodeWidths: powers of two from one minimal
partition up to max_model_len), so the decode kernel launches partitions for the contexts the step has,
not for max_model_len; widths that all fit one partition share the widest of them. Each (b, width) pair
has a fixed partition count and fixed partials (the backend's DecodeWorkspace): one graph each. Prefill
and mixed steps stay eager.

    graphs off (CPU; static_decode=True)   the padded step runs eagerly: the same shapes and padding, tested
                                           token for token against Hugging Face on the CPU
    graphs on (CUDA, cuda_graphs=True)     capture(): per bucket one graph of the model forward over static
                                           buffers (ids, positions, slots, seq lens, tables); run() copies the
                                           step's inputs into them and replays; the logits stay eager

With LoRA the adapter rows (LoraBatch: sorted rows, per-slot starts and counts) are static buffers too, and the
kernels' grid is sized for the bucket: one graph per (b, width) serves every mix of adapters, base-only steps
included (their counts are 0: each LoRA program exits at once).

With cascade attention on (worker/engine/cascade.py, mode not "off") each (b, width) with room for a group
has a second graph, captured over a static CascadeLayout padded to the planner's group capacity for b, its
prefix bound the table width: a step whose planner chose groups copies its padded layout (one packed tensor)
into it and replays that graph; a step with none replays the plain one. `replays` counts both.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog
import torch

from tokenbus_kernels.cascade import CascadeLayout
from tokenbus_kernels.partitions import num_partitions, table_widths
from worker.engine.attention_metadata import AttentionMetadata
from worker.engine.lora.layer import LoraBatch, LoraState
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


class DecodeWidths:
    """The block-table widths a padded decode step of b rows is cut to. A width whose contexts all fit one
    partition joins the widest such width (same launch, no idle program); every other power of two keeps
    its own, so a uniform batch launches fewer than twice the partitions it uses."""

    def __init__(self, max_blocks_per_seq: int, block_size: int, num_kv_heads: int, num_sms: int) -> None:
        self.block_size = block_size
        self.all = table_widths(max_blocks_per_seq, block_size)
        self.num_kv_heads = num_kv_heads
        self.num_sms = num_sms
        self._cache: dict[int, list[int]] = {}

    def for_bucket(self, b: int) -> list[int]:
        widths = self._cache.get(b)
        if widths is None:
            widths, single = [], False
            for w in self.all:
                one = num_partitions(w * self.block_size, b, self.num_kv_heads, self.num_sms) == 1
                if one and single:
                    widths[-1] = w
                else:
                    widths.append(w)
                single = one
            self._cache[b] = widths
        return widths

    def pick(self, b: int, blocks: int) -> int:
        """The narrowest width of bucket b holding `blocks` blocks."""
        return next(w for w in self.for_bucket(b) if w >= blocks)


class StaticDecode:
    def __init__(self, model: torch.nn.Module, kv_caches: list, inputs: StepInputs, max_num_seqs: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.inputs = inputs
        self.buckets = decode_buckets(max_num_seqs)
        self.widths = DecodeWidths(inputs.max_blocks_per_seq, inputs.block_size, model.arch.num_kv_heads,
                                   _num_sms(inputs.device))
        # (bucket, width) -> (graph, its output): plain decode, and cascade decode over a static layout
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.cascade_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.static: dict[str, torch.Tensor] = {}
        self.static_cascade: dict[int, torch.Tensor] = {}  # bucket -> its packed static layout
        self.lora: LoraState | None = None  # set by ModelRunner.use_lora
        self.replays = {"plain": 0, "cascade": 0}  # graph replays since capture (gpu_check's cascade row)

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, table width) a padded decode step runs at: one graph each."""
        return [(b, w) for b in self.buckets for w in self.widths.for_bucket(b)]

    def serves(self, batch: ScheduledBatch) -> bool:
        return not batch.pooled and len(batch.seqs) <= self.buckets[-1] and all(n == 1 for n in batch.num_new_tokens)

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def cascade_capacity(self, b: int) -> int:
        """Groups the cascade graphs of bucket b hold (0: none is captured for it)."""
        planner = self.inputs.cascade
        return planner.group_capacity(b) if planner is not None else 0

    def prepare(self, batch: ScheduledBatch, ahead: Ahead | None = None) -> PreparedStep:
        b = self.bucket(len(batch.seqs))
        w = self.widths.pick(b, max(len(s.block_table) for s in batch.seqs))
        groups = self.cascade_capacity(b) if (b, w) in self.cascade_graphs else None
        step = self.inputs.prepare(batch, pad_to=b, width=w, ahead=ahead, cascade_groups=groups)
        step.width = w
        if groups is None and (b, w) in self.graphs:  # the plain graph replays the decode it captured
            step.meta.cascade = None
        return step

    def execute(self, step: PreparedStep) -> torch.Tensor:
        b, w = step.bucket, step.width
        assert b is not None and w is not None
        s, meta = self.static, step.meta
        layout = meta.cascade
        graph = (self.graphs if layout is None else self.cascade_graphs).get((b, w))
        if graph is None:
            if self.lora is not None:
                self.lora.batch = step.lora
            return self.model(step.input_ids, step.positions, self.kv_caches, meta)
        if self.lora is not None:
            self._fill_lora(step.lora)
        if layout is not None:  # the step's layout, padded to the graph's capacity, into the static one
            assert layout.packed is not None, "a cascade graph replays a layout that CascadeLayout.build packed"
            self.static_cascade[b].copy_(layout.packed)
        s["ids"][:b].copy_(step.input_ids)
        s["positions"][:b].copy_(step.positions)
        s["slots"][:b].copy_(meta.slot_mapping)
        s["seq_lens"][:b].copy_(meta.decode_seq_lens)
        s["tables"][:b, :w].copy_(meta.decode_block_tables)
        graph[0].replay()
        self.replays["plain" if layout is None else "cascade"] += 1
        return graph[1]

    # ---- CUDA graphs ----------------------------------------------------------------------------------------

    def _fill_lora(self, lora: LoraBatch | None) -> None:
        s = self.static
        if lora is None:
            s["lora_counts"].zero_()
            return
        s["lora_rows"][: lora.rows.shape[0]].copy_(lora.rows)
        s["lora_starts"].copy_(lora.starts)
        s["lora_counts"].copy_(lora.counts)

    def _static_meta(self, b: int, w: int, cascade: bool) -> AttentionMetadata:
        s = self.static
        layout = None
        if cascade:  # every prefix fits the table: its width bounds the prefix stage's partitions
            layout = CascadeLayout.views(self.static_cascade[b], b, self.cascade_capacity(b),
                                         w * self.inputs.block_size)
        return AttentionMetadata(
            slot_mapping=s["slots"][:b], num_prefill_tokens=0, prefill_block_tables=None,
            prefill_cu_seqlens_q=None, prefill_seq_lens=None, decode_block_tables=s["tables"][:b, :w],
            decode_seq_lens=s["seq_lens"][:b], cascade=layout,
        )

    def _static_forward(self, b: int, w: int, cascade: bool) -> Callable[[], torch.Tensor]:
        """The forward a graph of shape (b, w) captures, over the static buffers."""
        args = (self.static["ids"][:b], self.static["positions"][:b], self.kv_caches,
                self._static_meta(b, w, cascade))
        lora = None
        if self.lora is not None:
            s = self.static
            lora = LoraBatch(s["lora_rows"][:b], s["lora_starts"], s["lora_counts"], b, [])

        def forward() -> torch.Tensor:
            if self.lora is not None:
                self.lora.batch = lora
            return self.model(*args)

        return forward

    def _record(self, forward: Callable[[], torch.Tensor], pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, object]:
        """(graph, its output, the memory pool) of one capture of forward into the shared pool (tests on the
        CPU put an eager stand-in here: tests/support/eager_graphs.py)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
        return graph, out, graph.pool()

    @torch.inference_mode()
    def capture(self) -> float:
        """One graph per (bucket, width), largest first, sharing one memory pool. Returns the seconds it took."""
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
        if self.lora is not None:  # no adapter row until a step fills them
            slots = self.inputs.lora_slots
            self.static["lora_rows"] = torch.zeros(n, dtype=torch.int64, device=device)
            self.static["lora_starts"] = torch.zeros(slots, dtype=torch.int32, device=device)
            self.static["lora_counts"] = torch.zeros(slots, dtype=torch.int32, device=device)
        # zeros: every group empty (prefix 0), every row's own part from token 0, until a step fills them
        self.static_cascade = {b: torch.zeros(2 * b + 2 * g + 1, dtype=torch.int32, device=device)
                               for b in self.buckets if (g := self.cascade_capacity(b))}
        pool = None
        for b, w in reversed(self.shapes()):
            for cascade in (False, True) if b in self.static_cascade else (False,):
                forward = self._static_forward(b, w, cascade)
                forward()  # compiles the kernels' variants for this shape outside the capture
                _sync(device)
                graph, out, pool = self._record(forward, pool)
                (self.cascade_graphs if cascade else self.graphs)[(b, w)] = (graph, out)
        if self.lora is not None:
            self.lora.batch = None
        _sync(device)
        seconds = time.perf_counter() - started
        log.info("cuda_graphs_captured", buckets=self.buckets, graphs=len(self.graphs),
                 cascade_graphs=len(self.cascade_graphs), seconds=round(seconds, 2))
        return seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _num_sms(device: torch.device) -> int:
    """What the decode kernel plans with: the GPU's multiprocessors, 1 off it (tokenbus_kernels/decode_attention)."""
    if device.type != "cuda":
        return 1
    from tokenbus_kernels.decode_attention import num_sms

    return num_sms(device.index if device.index is not None else torch.cuda.current_device())
