"""StepInputs: the flat input tensors of one step, built from persistent buffers.

    table     int32 [max_num_seqs + 1, max_blocks_per_seq] on the device: row r holds the block ids of the
              sequence seated in batch row r; the last row is the padding row (every entry the pad block)
    staging   int64 host buffer (pinned on CUDA): input ids, positions, slot mapping, table rows, table
              updates and the int32 lengths of a step, packed back to back and sent in ONE host-to-device copy

A sequence keeps its row while it runs; each step writes only the block ids it gained since the last step
(on CUDA as (flat index, value) pairs in the packed copy, scattered on the device). A sequence that stopped
running (finished, preempted, aborted) gives its row back; a block table that is a new list (BlockManager.free
resets it) is written from the start. The step's block tables are then a gather of the table's rows.

With `pad_to` a pure decode step is padded to a fixed row count: padding rows feed token 0 at position 0,
write their K/V into the pad slot (block `pad_block`, never handed to a sequence), attend over that one token
and read the padding row of the table, so they never touch a real sequence's cache.

With LoRA slots (lora_slots > 0) each row carries its sequence's adapter slot: the rows that have one, grouped
by slot (LoraBatch), travel in the same packed copy; padding rows have none. So does a cascade step's layout
(the decode rows sharing a cached prefix, cascade.py), padded to a cascade graph's capacity when it replays one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenbus_kernels.cascade import CascadeLayout
from worker.engine.attention_metadata import AttentionMetadata
from worker.engine.cascade import CascadePlanner
from worker.engine.lora.layer import LoraBatch
from worker.engine.pooling import PooledRows
from worker.engine.scheduler import Ahead, ScheduledBatch
from worker.engine.sequence import Sequence, SequenceStatus


@dataclass
class _Seat:
    row: int
    table: list[int]  # the sequence's block_table list this row mirrors
    synced: int  # how many of its ids the device row holds


@dataclass
class PreparedStep:
    input_ids: torch.Tensor  # int64 [num_tokens (+ padding)]
    positions: torch.Tensor  # int64, same length
    meta: AttentionMetadata
    order: list[tuple[Sequence, int]]  # (sequence, tokens fed), prefill first: the rows of input_ids
    sampling_seqs: list[Sequence]  # those whose last pending token is in this step (a mid-prompt chunk is not)
    sample_index: torch.Tensor | None  # int64 rows of the hidden states they sample from; None = the first
    # len(sampling_seqs) rows (a decode step)
    # overlap (overlap.py): rows of input_ids whose token the step in flight samples, and which of its sampled
    # rows each takes; the forward thread writes them on the device (carry_rows None: every id is known)
    carry_rows: torch.Tensor | None = None
    carry_src: torch.Tensor | None = None
    bucket: int | None = None  # the padded decode bucket (StaticDecode), None for an eager step
    width: int | None = None  # the padded decode step's table width (StaticDecode)
    lora: LoraBatch | None = None  # its adapter rows grouped by slot; None when no row uses an adapter
    pooled: list[PooledRows] = field(default_factory=list)  # embedding sequences' rows, pooled after the forward



class StepInputs:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, pad_block: int,
                 device: torch.device, cascade: CascadePlanner | None = None) -> None:
        self.block_size = block_size
        self.cascade = cascade  # decode rows sharing a cached prefix: the step's layout (cascade.py)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.pad_block = pad_block
        self.pad_row = max_num_seqs
        self.lora_slots = 0  # LoRA adapter slots (ModelRunner.use_lora); 0 = none: rows carry no slot
        # the device-side way (updates scattered from the packed copy, whole-row gathers): on for a GPU; a
        # test turns it on for the CPU to run that logic there
        self.device_updates = device.type != "cpu"
        self.table = torch.zeros(max_num_seqs + 1, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.table[self.pad_row] = pad_block
        # the table's host copy (on the CPU the table itself): decode rows' slots are looked up in it at once
        self.host_table = self.table.numpy() if device.type == "cpu" else self.table.cpu().numpy()
        self.seats: dict[Sequence, _Seat] = {}
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        # (pinned staging, device buffer, the last H2D copy out of that staging) x 2, used in turn
        empty = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64, device=device), None)
        self._buffers: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = [empty, empty]
        self._turn = 0

    # ---- seats ----------------------------------------------------------------------------------------------

    def _release_stopped(self) -> None:
        stopped = [s for s in self.seats if s.status is not SequenceStatus.RUNNING]
        for seq in stopped:
            self.free_rows.append(self.seats.pop(seq).row)

    def _seat(self, seq: Sequence, updates: list[int], values: list[int]) -> int:
        """seq's row, with its new block ids appended as (flat index, value) pairs (CUDA) or written (CPU)."""
        seat = self.seats.get(seq)
        table = seq.block_table
        if seat is None:
            seat = self.seats[seq] = _Seat(self.free_rows.pop(), table, 0)
        elif seat.table is not table or seat.synced > len(table):
            seat.table, seat.synced = table, 0
        n = len(table)
        if n > seat.synced:
            if n > self.max_blocks_per_seq:
                raise ValueError(f"a sequence holds {n} KV blocks; the table has {self.max_blocks_per_seq} per row")
            self.host_table[seat.row, seat.synced : n] = table[seat.synced : n]  # on the CPU: the table itself
            if self.device_updates:
                base = seat.row * self.max_blocks_per_seq
                updates += range(base + seat.synced, base + n)
                values += table[seat.synced : n]
            seat.synced = n
        return seat.row

    # ---- one step -------------------------------------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch, pad_to: int | None = None, width: int | None = None,
                ahead: Ahead | None = None, cascade_groups: int | None = None) -> PreparedStep:
        """The step's tensors. pad_to (pure decode steps only): pad to that many rows, tables `width` blocks
        wide (default max_blocks_per_seq; at least the longest sequence's table).
        ahead: the step still in flight (overlap); its sequences start past the tokens it feeds, and a row
        whose input is the token it samples gets a placeholder that the device fills (carry_rows).
        cascade_groups: the cascade layout padded to that many groups (a cascade graph's, cuda_graphs.py)."""
        self._release_stopped()
        if max(batch.num_new_tokens, default=1) == 1:  # pure decode (most steps)
            prefill: list[tuple[Sequence, int]] = []
            decode = batch.seqs
        else:
            pairs = list(zip(batch.seqs, batch.num_new_tokens, strict=True))
            prefill = [(s, n) for s, n in pairs if n > 1]
            decode = [s for s, n in pairs if n == 1]
        if pad_to is not None and prefill:
            raise ValueError("only a pure decode step can be padded")
        order = prefill + [(s, 1) for s in decode]
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        updates: list[int] = []
        values: list[int] = []
        sample_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        carry_rows: list[int] = []
        carry_src: list[int] = []
        prefill_lens: list[int] = []
        pooled: list[PooledRows] = []
        none = (0, -1)
        for seq, n in prefill:  # a few sequences, many tokens each
            start, end = seq.num_computed_tokens, len(seq.token_ids)
            start += ahead.get(seq, none)[0] if ahead else 0  # never a carried row: that is one token
            if seq.pool_state is not None:  # an embedding: its rows are pooled, nothing is sampled
                pooled.append((seq, len(ids), n, start, start + n == end))
            elif start + n == end:
                sample_rows.append(len(ids) + n - 1)
                sampling_seqs.append(seq)
            ids += seq.token_ids[start : start + n]
            prefill_lens.append(start + n)
            table = seq.block_table
            pos += range(start, start + n)
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            rows.append(self._seat(seq, updates, values))
        p = len(prefill)
        cu = _cumsum([n for _, n in prefill]) if prefill else []
        # decode rows (one token each), many sequences: a few list comprehensions over them and array maths
        seats = self.seats
        for seq in [s for s in decode if (seat := seats.get(s)) is None or seat.table is not s.block_table
                    or seat.synced != len(s.block_table)]:
            self._seat(seq, updates, values)  # new to its row, or blocks gained since the last step
        d_rows = np.array([seats[s].row for s in decode], dtype=np.int64)
        if ahead:
            fed_src = [ahead.get(s, none) for s in decode]
            d_starts = np.array([s.num_computed_tokens + f for s, (f, _) in zip(decode, fed_src, strict=True)],
                                dtype=np.int64)
            d_src = np.array([src for _, src in fed_src], dtype=np.int64)
        else:
            d_starts = np.array([s.num_computed_tokens for s in decode], dtype=np.int64)
            d_src = None
        lens = [len(s.token_ids) for s in decode]
        # a carried row's start is one past its known tokens: its id is the placeholder 0
        d_ids = [s.token_ids[i] if i < n else 0 for s, i, n in zip(decode, d_starts.tolist(), lens, strict=True)]
        d_end = np.array(lens, dtype=np.int64)
        base = len(ids)
        if d_src is not None and (carried := d_src >= 0).any():
            d_end += carried
            at = np.flatnonzero(carried)
            carry_rows += (at + base).tolist()
            carry_src += d_src[at].tolist()
        samples = d_starts + 1 == d_end  # a mid-prompt chunk of one token samples nothing
        if batch.pooled and decode:  # an embedding's one-token chunk (or input): pooled, not sampled
            pool = np.array([s.pool_state is not None for s in decode], dtype=bool)
            for i in np.flatnonzero(pool).tolist():
                pooled.append((decode[i], base + i, 1, int(d_starts[i]), bool(samples[i])))
            samples &= ~pool
        if samples.all():
            sampling_seqs += decode
            d_sample = np.arange(base, base + len(decode), dtype=np.int64)
        else:
            at = np.flatnonzero(samples)
            sampling_seqs += [decode[i] for i in at.tolist()]
            d_sample = at + base
        d_slots = self.host_table[d_rows, d_starts // bs].astype(np.int64) * bs + d_starts % bs
        decode_lens = d_starts + 1
        if pad_to is not None:
            pad = pad_to - len(decode)
            d_ids += [0] * pad
            d_starts = np.concatenate([d_starts, np.zeros(pad, np.int64)])
            d_slots = np.concatenate([d_slots, np.full(pad, self.pad_block * bs, np.int64)])
            d_rows = np.concatenate([d_rows, np.full(pad, self.pad_row, np.int64)])
            decode_lens = np.concatenate([decode_lens, np.ones(pad, np.int64)])
        lora = self._lora_plan(order, pad_to)
        l_rows, l_starts, l_counts = lora if lora is not None else ([], [], [])
        # the decode rows sharing a cached prefix (cascade.py): their layout travels in the same copy
        chosen = self.cascade.choose(decode, decode_lens) if self.cascade is not None and decode else []
        c_values, *c_shape = CascadeLayout.pack(chosen, len(decode_lens), cascade_groups) if chosen else ([],)
        all_sample = np.concatenate([np.array(sample_rows, np.int64), d_sample])
        if len(all_sample) and all_sample[-1] == len(all_sample) - 1:  # sorted rows, so: 0, 1, 2, ...
            all_sample = all_sample[:0]  # the leading rows: a slice, no index needed
        # int64 segments start on 16 bytes, int32 ones too: Triton specialises a kernel on its pointers'
        # alignment, so unaligned views would compile new variants mid-serving
        longs_part, (s_ids, s_pos, s_slots, s_rows, s_sample, s_upd, s_cdst, s_csrc, s_lrows) = _pack(
            [ids + d_ids, pos, d_starts, slots, d_slots, rows, d_rows, all_sample, updates, carry_rows, carry_src,
             l_rows], 2, joined=((1, 2), (3, 4), (5, 6)))
        ints_part, (s_plens, s_cu, s_dlens, s_vals, s_lstarts, s_lcounts, s_cascade) = _pack(
            [prefill_lens, cu, decode_lens, values, l_starts, l_counts, c_values], 4)
        buf = self._send(np.concatenate([longs_part, ints_part]))
        cut = len(longs_part)
        longs, ints = buf[:cut], buf[cut:].to(torch.int32)
        row_index = longs[s_rows]
        has_decode = s_rows.stop - s_rows.start > p
        if updates:
            self.table.view(-1).index_copy_(0, longs[s_upd], ints[s_vals])
        meta = AttentionMetadata(
            slot_mapping=longs[s_slots],
            num_prefill_tokens=sum(n for _, n in prefill),
            prefill_block_tables=self._tables(row_index[:p], [s for s, _ in prefill]) if p else None,
            prefill_seq_lens=ints[s_plens] if p else None,
            prefill_cu_seqlens_q=ints[s_cu] if p else None,
            decode_block_tables=self._tables(row_index[p:], decode,
                                             (width or self.max_blocks_per_seq) if pad_to is not None else None)
            if has_decode else None,
            decode_seq_lens=ints[s_dlens] if has_decode else None,
            cascade=CascadeLayout.views(ints[s_cascade], *c_shape) if chosen else None,
        )
        sample_index = longs[s_sample] if len(all_sample) else None
        input_ids, positions = longs[s_ids], longs[s_pos]
        step = PreparedStep(input_ids, positions, meta, order, sampling_seqs, sample_index, bucket=pad_to,
                            pooled=pooled)
        if carry_rows:
            step.carry_rows, step.carry_src = longs[s_cdst], longs[s_csrc]
        if lora is not None:
            groups = [(s, int(st), int(c)) for s, (st, c) in enumerate(zip(l_starts, l_counts, strict=True)) if c]
            step.lora = LoraBatch(longs[s_lrows], ints[s_lstarts], ints[s_lcounts], int(l_counts.max()), groups)
        return step

    def _lora_plan(self, order: list[tuple[Sequence, int]], pad_to: int | None):
        """(rows, starts, counts) of the step's adapter rows (LoraBatch.plan), None when it has none."""
        if not self.lora_slots or all(s.lora_slot < 0 for s, _ in order):
            return None
        slots = np.repeat(np.array([s.lora_slot for s, _ in order], np.int64), [n for _, n in order])
        if pad_to is not None:
            slots = np.concatenate([slots, np.full(pad_to - len(order), -1, np.int64)])
        return LoraBatch.plan(slots, self.lora_slots)

    def _tables(self, row_index: torch.Tensor, seqs: list[Sequence], width: int | None = None) -> torch.Tensor:
        # entries past a sequence's last block are stale ids of the row's earlier users: valid blocks the
        # kernels never read (every kernel stops at the sequence's length)
        width = width or max(map(len, [s.block_table for s in seqs]))
        if not self.device_updates:
            return self.table[:, :width].index_select(0, row_index)
        # on a GPU whole rows (a few KiB) and a view: the row stride stays fixed, one kernel variant
        return self.table.index_select(0, row_index)[:, :width]

    def _send(self, packed: np.ndarray) -> torch.Tensor:
        """The packed values as one int64 tensor on the device: on CUDA through a pinned staging buffer.
        Two staging/device buffer pairs take turns: with overlap the step in flight may still be reading the
        previous step's device buffer while this one is written."""
        if self.device.type == "cpu":
            return torch.from_numpy(packed)
        n = len(packed)
        self._turn ^= 1
        staging, device_buf, copied = self._buffers[self._turn]
        if copied is not None:
            copied.synchronize()  # the copy two steps ago has left this staging buffer
        if n > staging.numel():
            size = max(n, 2 * staging.numel(), 4096)
            staging = torch.empty(size, dtype=torch.int64, pin_memory=True)
            device_buf = torch.empty(size, dtype=torch.int64, device=self.device)
        staging.numpy()[:n] = packed
        out = device_buf[:n]
        out.copy_(staging[:n], non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._buffers[self._turn] = (staging, device_buf, copied)
        return out


def _pack(segments: list, align: int, joined: tuple[tuple[int, int], ...] = ()) -> tuple[np.ndarray, list[slice]]:
    """The segments (lists or int64 arrays) back to back in one int64 array, each starting at a multiple of
    `align` elements, and where each lies. joined: pairs (i, i + 1) that are written back to back as one
    segment (a step's prefill part and its decode part)."""
    glue = {i for i, _ in joined}
    offsets = []
    at = 0
    for i, seg in enumerate(segments):
        if i - 1 not in glue:
            at += -at % align
        offsets.append(at)
        at += len(seg)
    at += -at % align
    out = np.zeros(at, dtype=np.int64)
    for seg, start in zip(segments, offsets, strict=True):
        if len(seg):
            out[start : start + len(seg)] = seg
    spans = []
    i = 0
    while i < len(segments):
        end = i + 1 if i in glue else i
        spans.append(slice(offsets[i], offsets[end] + len(segments[end])))
        i = end + 1
    return out, spans


def _cumsum(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out
