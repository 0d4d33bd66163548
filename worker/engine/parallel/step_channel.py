"""StepChannel: how rank 0 hands each step's inputs to the other ranks, once per step.

A step is two collectives, before its forward: a fixed 16-value header (what comes, and the sizes) and one
packed int64 payload (input ids, positions, slots, block tables, lengths, the rows that sample), which every
rank unpacks into the same tensors rank 0's StepInputs built. Nothing else crosses between ranks until the
next step but the layers' all-reduces and the logits' gather.

The header is an all-reduce (rank 0's values, zeros elsewhere), not a broadcast, so that it needs every rank:
a rank that stopped answering is found at the next step, or at the next keep-alive. While the worker idles
rank 0 sends a no-op header every timeout / 3 seconds, so the others never mistake quiet for a fault.
Rank 0 holds `lock` across a step's collectives (send, forward, logits): a keep-alive never falls between them.
"""

from __future__ import annotations

import threading
import time

import torch

from worker.engine.attention_metadata import AttentionMetadata
from worker.engine.parallel.group import TpGroup
from worker.engine.step_inputs import PreparedStep

HEADER = 16
NOOP, STEP, STOP = 0, 1, 2


class StepChannel:
    def __init__(self, tp: TpGroup) -> None:
        self.tp = tp
        self.lock = threading.Lock()
        self.last_sent = time.monotonic()
        self.broadcast_s = 0.0  # seconds rank 0 spent sending steps (the benchmark's "broadcast" column)
        self._keepalive: threading.Thread | None = None
        self._stopped = threading.Event()

    # ---- rank 0 ---------------------------------------------------------------------------------------------

    def send(self, step: PreparedStep, num_samples: int) -> None:
        """The step's inputs to every other rank (call with `lock` held, before the forward)."""
        started = time.perf_counter()
        meta = step.meta
        parts = [step.input_ids, step.positions, meta.slot_mapping]
        p = 0 if meta.prefill_block_tables is None else meta.prefill_block_tables.shape[0]
        d = 0 if meta.decode_block_tables is None else meta.decode_block_tables.shape[0]
        if p:
            parts += [meta.prefill_block_tables, meta.prefill_cu_seqlens_q, meta.prefill_seq_lens]
        if d:
            parts += [meta.decode_block_tables, meta.decode_seq_lens]
        if step.sample_index is not None:
            parts.append(step.sample_index)
        payload = torch.cat([t.reshape(-1).to(torch.int64) for t in parts])
        header = [STEP, payload.numel(), step.input_ids.numel(), meta.num_prefill_tokens, p,
                  meta.prefill_block_tables.shape[1] if p else 0, d, meta.decode_block_tables.shape[1] if d else 0,
                  num_samples, int(step.sample_index is not None),
                  -1 if step.bucket is None else step.bucket, -1 if step.width is None else step.width]
        self._header(header)
        self.tp.broadcast(payload)
        self.last_sent = time.monotonic()
        self.broadcast_s += time.perf_counter() - started

    def stop(self) -> None:
        """Tell the other ranks to exit (the worker is done with them)."""
        self._stopped.set()
        with self.lock:
            self._header([STOP])

    def start_keepalive(self) -> None:
        self._keepalive = threading.Thread(target=self._keep_alive, name="tp-keepalive", daemon=True)
        self._keepalive.start()

    def _keep_alive(self) -> None:
        period = self.tp.timeout_s / 3
        while not self._stopped.wait(period / 4):
            if time.monotonic() - self.last_sent < period or not self.lock.acquire(blocking=False):
                continue
            try:
                if not self._stopped.is_set():
                    self._header([NOOP])
                    self.last_sent = time.monotonic()
            finally:
                self.lock.release()

    def _header(self, values: list[int]) -> None:
        header = torch.zeros(HEADER, dtype=torch.int64, device=self.tp.device)
        header[: len(values)] = torch.tensor(values, dtype=torch.int64)
        self.tp.all_reduce(header)

    # ---- the other ranks -------------------------------------------------------------------------------------

    def receive(self) -> tuple[int, PreparedStep | None, int]:
        """(what came, the step or None, how many of its rows sample)."""
        header = self.tp.all_reduce(torch.zeros(HEADER, dtype=torch.int64, device=self.tp.device)).tolist()
        op = header[0]
        if op != STEP:
            return op, None, 0
        size, tokens, prefill_tokens, p, wp, d, wd, samples, indexed, bucket, width = header[1:12]
        payload = self.tp.broadcast(torch.empty(size, dtype=torch.int64, device=self.tp.device))
        at = 0

        def take(n: int, dtype: torch.dtype = torch.int64, cols: int = 0) -> torch.Tensor:
            nonlocal at
            t = payload[at : at + n * max(cols, 1)]
            at += n * max(cols, 1)
            t = t.to(dtype) if dtype != torch.int64 else t
            return t.view(n, cols) if cols else t

        ids, positions, slots = take(tokens), take(tokens), take(tokens)
        p_tables = p_cu = p_lens = d_tables = d_lens = None
        if p:
            p_tables, p_cu, p_lens = take(p, torch.int32, wp), take(p + 1, torch.int32), take(p, torch.int32)
        if d:
            d_tables, d_lens = take(d, torch.int32, wd), take(d, torch.int32)
        sample_index = take(samples) if indexed else None
        meta = AttentionMetadata(slot_mapping=slots, num_prefill_tokens=prefill_tokens,
                                 prefill_block_tables=p_tables, prefill_cu_seqlens_q=p_cu, prefill_seq_lens=p_lens,
                                 decode_block_tables=d_tables, decode_seq_lens=d_lens)
        step = PreparedStep(ids, positions, meta, [], [], sample_index,
                            bucket=None if bucket < 0 else bucket, width=None if width < 0 else width)
        return STEP, step, samples
