"""Iteration-level scheduling: who runs in the next forward pass, and how many of their tokens.

Every step the running sequences go first (one token each while decoding, the next chunk while their
prompt is being prefilled), then waiting requests are admitted while seats, token budget and KV blocks
last; an admitted sequence first takes the cached blocks its tokens start with (prefix caching) and
computes only the rest. When blocks run out the newest running sequence is preempted by recompute: its blocks are freed
and it goes back to the front of the waiting queue to be prefilled again later. After the forward pass,
postprocess() is the one place sequences take their new tokens and those that are done leave.

Embedding sequences (pool_state set) are prefill only: they take the same budget and chunks, sample nothing, and
leave in the postprocess of the step that computed their last token (its pooling finished the vector). An
encoder's (whole_prompt) bidirectional attention needs all its tokens in every layer, so it is never chunked: it
is admitted when its whole input fits the budget left, or alone, first in a step, when it is longer than the
budget.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol.priority import Priority
from worker.engine.block_manager import BlockManager
from worker.engine.sequence import Sequence, SequenceStatus
from worker.engine.stop_checker import StopChecker

if TYPE_CHECKING:
    from worker.engine.guided import GuidedDecoding
    from worker.engine.lora.manager import LoraManager

# overlap: per sequence of the step in flight, (tokens it feeds, index among its sampled rows or -1)
Ahead = dict[Sequence, tuple[int, int]]


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence, tokens fed in this step
    pooled: bool = False  # an embedding sequence is among them (its rows are pooled, not sampled)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


BULK = Priority.bulk.rank  # bulk requests' rank: the seats kept for them (bulk_min_seats)


class Scheduler:
    def __init__(self, block_manager: BlockManager, stop_checker: StopChecker, max_num_seqs: int,
                 max_num_batched_tokens: int, guided: GuidedDecoding | None = None,
                 bulk_min_seats: int = 0, loras: LoraManager | None = None) -> None:
        self.block_manager = block_manager
        self.stop_checker = stop_checker
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.guided = guided  # structured output: admits a constrained sequence once its grammar is compiled
        # While fewer bulk sequences run than this, a waiting bulk one is admitted before more urgent ones:
        # a batch keeps a guaranteed share of the seats however much interactive traffic waits.
        self.bulk_min_seats = bulk_min_seats
        # LoRA: a sequence is seated only when its adapter is resident or a slot can take it
        self.loras = loras

    def add(self, seq: Sequence, first_of_its_priority: bool = False) -> None:
        """Queue seq behind every waiting sequence of a more urgent priority and, unless
        `first_of_its_priority`, of its own, so a request of a lower priority number never waits behind one of
        a higher number."""
        if not first_of_its_priority and (not self.waiting or self.waiting[-1].priority <= seq.priority):
            self.waiting.append(seq)
            return
        behind = (lambda w: w.priority >= seq.priority) if first_of_its_priority else \
            (lambda w: w.priority > seq.priority)
        at = next((i for i, w in enumerate(self.waiting) if behind(w)), len(self.waiting))
        self.waiting.insert(at, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, ahead: Ahead | None = None) -> ScheduledBatch | None:
        """The next step's batch. ahead (overlap): the step still in flight, whose tokens count as fed and
        whose sampled tokens as pending; a sequence that ends in it for sure (length) is left out. With ahead,
        None instead of a preemption: the caller finishes the step in flight first (blocks taken so far stay
        with their sequences, which need them next)."""
        batch = ScheduledBatch([], [])
        budget = self.max_num_batched_tokens
        preempted = False
        # Oldest first; the victims of preemption are taken from the end, so none of them is in `batch`.
        i = 0
        bs = self.block_manager.block_size
        none = (0, -1)
        running, seqs, num_new = self.running, batch.seqs, batch.num_new_tokens
        while i < len(running) and budget > 0:
            seq = running[i]
            fed, src = ahead.get(seq, none) if ahead else none
            if src >= 0:
                # the token in flight ends seq whatever it is (the length rule): it is not in this step
                if len(seq.token_ids) + 1 >= seq.max_num_tokens:
                    i += 1
                    continue
                n = 1
            else:
                n = min(len(seq.token_ids) - seq.num_computed_tokens - fed, budget)
                if n <= 0:  # an embedding sequence whose last chunk is in flight: nothing is left to feed
                    i += 1
                    continue
            if seq.pool_state is not None:
                batch.pooled = True
            if seq.num_computed_tokens + fed + n <= len(seq.block_table) * bs:  # room already (most decodes)
                seqs.append(seq)
                num_new.append(n)
                budget -= n
                i += 1
                continue
            while not self.block_manager.can_allocate(seq, fed + n):
                if ahead is not None:
                    return None
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            self.block_manager.allocate(seq, fed + n)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1
        # Admitting while we just preempted would only thrash the same blocks.
        waiting_for_slot = False
        for seq in self._admission_order():
            if budget <= 0 or preempted or len(self.running) >= self.max_num_seqs:
                break
            if self.guided is not None and not self.guided.is_ready(seq):
                continue  # its grammar is still compiling: those behind it go first
            if seq.lora is not None and not self._lora_may_seat(seq, waiting_for_slot):
                waiting_for_slot |= not self.loras.resident(seq.lora)
                continue
            hits = self.block_manager.match_prefix(seq)
            n = min(seq.num_tokens - len(hits) * self.block_manager.block_size, budget)
            if seq.whole_prompt and n < seq.num_tokens:  # an encoder's input is never split
                if batch.seqs:
                    break  # it goes first in a later step
                n = seq.num_tokens
            if not self.block_manager.can_admit(seq, hits, n):
                break
            self.waiting.remove(seq)
            self.block_manager.admit(seq, hits)
            self.block_manager.allocate(seq, n)
            if seq.lora is not None:
                self.loras.seat(seq, lambda: {w.lora for w in self.waiting if w.lora is not None})
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            batch.pooled |= seq.pool_state is not None
            budget -= n
        return batch

    def _lora_may_seat(self, seq: Sequence, waiting_for_slot: bool) -> bool:
        """An adapter's sequence joins its adapter's slot when the adapter is resident (rows grouped by adapter,
        as S-LoRA seats them: no load), unless that slot drains for a sequence waiting for one and seq came after
        the drain began. Else it takes an idle slot, in arrival order: once one waits for a slot, those behind it
        that need one wait too, while base requests and resident adapters' still go. The draining slot
        (LoraManager.wait_for_slot) bounds the wait."""
        loras = self.loras
        if loras.resident(seq.lora):
            return loras.may_join(seq)
        if waiting_for_slot:
            return False
        if loras.idle_slots:
            return True
        loras.wait_for_slot(self.running, self.waiting)
        return False

    def _admission_order(self) -> list[Sequence]:
        """The waiting queue in priority order, except that bulk sequences short of their reserved seats
        (bulk_min_seats) come first."""
        short = self.bulk_min_seats - sum(1 for s in self.running if s.priority >= BULK)
        if short <= 0:
            return list(self.waiting)
        bulk = [s for s in self.waiting if s.priority >= BULK][:short]
        first = {id(s) for s in bulk}
        return bulk + [s for s in self.waiting if id(s) not in first]

    def postprocess(self, batch: ScheduledBatch, sampled: list[Sequence], tokens: list[int],
                    logprob_rows: list | None, now: float) -> list[Sequence]:
        """After the forward pass of `batch`: its tokens are in the KV cache; each sampled sequence takes its
        token (and logprobs, and text), and those that are done leave, their blocks freed. Returns those."""
        bm = self.block_manager
        bs = bm.block_size
        finished = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens // bs > len(seq.block_keys):  # a block filled up: key it
                bm.commit(seq)
            if seq.pool_state is not None and seq.num_computed_tokens == seq.num_tokens:
                self.finish(seq, "stop")  # its last position is pooled: the vector is done
                finished.append(seq)
        # One pass over the batch does what every token needs; the rest is for the few it may concern: rows
        # whose text is read each step (stop strings), and those whose token may end them (StopChecker).
        eos = self.stop_checker.eos_token_ids
        ends: list[tuple[Sequence, int | None]] = []  # rows that may end now, and where their new text starts
        texts: list[Sequence] = []  # the other rows with stop strings: only a stop string in the text can
        for seq, token in zip(sampled, tokens, strict=True):
            ids = seq.token_ids
            ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if token in eos or token in seq.stop_ids or len(ids) >= seq.max_num_tokens:
                ends.append((seq, None))  # not detokenized yet
            elif seq.text_each_step:
                texts.append(seq)
        if self.guided is not None and self.guided.matchers:
            for seq, token in zip(sampled, tokens, strict=True):
                self.guided.advance(seq, token)
        if logprob_rows is not None:
            for seq, token, row in zip(sampled, tokens, logprob_rows, strict=True):
                if row is not None:
                    top_ids, top_vals, token_logprob = row
                    entry = dict(zip(top_ids, top_vals, strict=True))
                    entry[token] = token_logprob
                    seq.logprobs.append(entry)
        for seq in texts:
            text_from = len(seq.text)
            if seq.detokenize() and self.stop_checker.finds_stop_string(seq, text_from):
                ends.append((seq, text_from))
        for seq, text_from in ends:
            if text_from is None:
                text_from = len(seq.text)
                if seq.text_each_step:
                    seq.detokenize()
            reason = self.stop_checker.check(seq, text_from)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _release(self, seq: Sequence) -> None:
        """seq gives back what it holds while seated: its KV blocks and its adapter's slot."""
        self.block_manager.free(seq)
        if self.loras is not None:
            self.loras.unseat(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        if seq.pool_state is not None:  # its rows are pooled again from the first
            seq.pool_state.reset()
        if self.guided is not None:
            self.guided.reset(seq)
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._release(seq)
        self.running.remove(seq)
        if self.guided is not None:
            self.guided.remove(seq)

    def remove(self, seq: Sequence) -> None:
        """Take seq out wherever it is (abort): its blocks are freed at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        if self.guided is not None:
            self.guided.remove(seq)
