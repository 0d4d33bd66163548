"""Guided decoding: an llguidance matcher per constrained sequence, its token bitmask on that row's logits.

    add_request ─▶ add: compile on the pool (cached by grammar hash) ─▶ is_ready: the scheduler admits it
    ModelRunner.run: compute_logits ─▶ apply (constrained rows only) ─▶ Sampler
    Scheduler.postprocess ─▶ advance (the accepted token);  preemption ─▶ reset (replayed from the tokens)

The tokenizer table is built once per engine, on first use. A compiled grammar is a template matcher kept
per grammar hash; each sequence takes a deep copy (microseconds). Compiling runs on a small thread pool
(llguidance releases the GIL while it builds) so a slow schema never stalls the running batch: its sequence
waits in the queue meanwhile. EOS is in the mask only where the grammar accepts, so a constrained output
that ends with "stop" is complete; one cut by max_tokens ("length") may not be.

Cost: the parser limits and the per-mask CPU budget are protocol/constraints.py's LIMITS, the same the
submit check uses. A grammar whose mask takes more than mask_budget_ms of CPU (thread time, so a loaded
machine does not trip it) fails alone with code grammar_too_costly: at compile (its first mask) or at the
step where one of its masks goes over, before any sequence changed.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import numpy as np
import structlog
import torch

from protocol.constraints import LIMITS, ConstraintLimits
from protocol.errors import ErrorCode
from worker.engine.errors import EngineError, EngineFault, InvalidRequest, fault
from worker.engine.sequence import Sequence

if TYPE_CHECKING:
    import llguidance

log = structlog.get_logger("tokenbus.guided")

CACHE_SIZE = 256  # compiled grammars kept (least recently used go first)
TOO_COSTLY = ErrorCode.grammar_too_costly.value  # the error code, and the first word of the reason


class GrammarError(InvalidRequest):
    """The engine could not compile a request's grammar against its tokenizer (code invalid_request), or its
    first mask took more CPU than the budget (code grammar_too_costly)."""


class GrammarTooCostly(InvalidRequest):
    """One sequence's mask took more CPU than the budget mid-run: that request fails alone (request_id)."""

    code = TOO_COSTLY


def too_costly(what: str, ms: float, limits: ConstraintLimits) -> str:
    return (f"{TOO_COSTLY}: {what} took {ms:.1f} ms of CPU, over the limit mask_budget_ms = "
            f"{limits.mask_budget_ms:g}; simplify the constraint (fewer or smaller repeats, a shorter choice list)")


class GuidedDecoding:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], device: torch.device,
                 threads: int = 2, limits: ConstraintLimits = LIMITS) -> None:
        self.hf_tokenizer = tokenizer
        self.limits = limits
        self._time_rows = False  # the parallel masks went over budget: time each row on the next step
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenbus-grammar")
        self._compiled: OrderedDict[str, Future] = OrderedDict()  # grammar hash -> Future[template matcher]
        self._pending: dict[Sequence, Future] = {}  # sequences whose grammar is compiling
        self.matchers: dict[Sequence, llguidance.LLMatcher] = {}
        # masks of many rows in parallel (llguidance's executor) only where there are cores to spare: on a
        # small CPU its threads wait for the cores the model runs on (32 rows: ~30 ms vs ~2 ms one by one)
        cores = os.cpu_count() or 1
        self._executor_threads = min(8, cores // 2) if cores >= 8 else 0
        self._executor: llguidance.LLExecutor | None = None  # made with the first mask of many rows
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)
        self._bits = word_bits(device)

    # ---- requests ---------------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Start (or reuse) the compile of seq's grammar. GrammarError when the same grammar failed before."""
        grammar = seq.params.grammar
        if grammar is None:
            return
        key = hashlib.sha256(grammar.encode()).hexdigest()
        future = self._compiled.get(key)
        if future is None:
            future = self._pool.submit(self._compile, grammar)
            self._compiled[key] = future
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
            if future.done() and future.exception() is not None:
                failed = fault(future.exception(), "compiling the grammar")
                raise type(failed)(str(failed), code=failed.code)  # a fresh one: the cached one keeps no trace
        self._pending[seq] = future

    def is_ready(self, seq: Sequence) -> bool:
        """True when seq may run: unconstrained, or its matcher is built (it gets it here)."""
        future = self._pending.get(seq)
        if future is None:
            return True
        if not future.done() or future.exception() is not None:
            return False  # a failed one leaves through take_failed
        self.matchers[seq] = future.result().deep_copy()
        del self._pending[seq]
        return True

    def take_failed(self) -> list[tuple[Sequence, EngineError]]:
        """Sequences whose grammar did not compile, with why: a GrammarError (the client's), or an EngineFault
        when the compile itself broke. They are forgotten here."""
        failed = [(seq, fault(f.exception(), "compiling the grammar")) for seq, f in self._pending.items()
                  if f.done() and f.exception() is not None]
        for seq, _ in failed:
            del self._pending[seq]
        return failed

    def wait(self, timeout: float) -> None:
        """Block up to timeout for a pending compile (when nothing else can run)."""
        if self._pending:
            wait(set(self._pending.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    def remove(self, seq: Sequence) -> None:
        self._pending.pop(seq, None)
        self.matchers.pop(seq, None)

    # ---- per step ---------------------------------------------------------------------------------------

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Set to -inf, in place, every token the grammar forbids in the constrained rows of logits
        (row i is seqs[i]). Unconstrained rows are not touched; with none constrained this does nothing."""
        rows = [(i, m, s) for i, s in enumerate(seqs) if (m := self.matchers.get(s)) is not None]
        if not rows:
            return
        for _, matcher, seq in rows:
            if matcher.is_error():  # raised before any sequence changed: the serve loop fails this job alone
                raise EngineFault(f"guided decoding failed for request {seq.request_id!r}: "
                                  f"{matcher.get_error()}", request_id=seq.request_id)
        n, vocab = len(rows), logits.shape[1]
        words = (vocab + 31) // 32
        if self._bitmask.shape[0] < n or self._bitmask.shape[1] != words:
            self._bitmask = torch.empty(max(n, 2 * self._bitmask.shape[0]), words, dtype=torch.int32)
        bitmask = self._bitmask[:n]
        # llguidance.torch's fill_next_token_bitmask(_par) without that module (it imports torch.compile)
        budget_ms = self.limits.mask_budget_ms
        if self._executor_threads and n > 1 and not self._time_rows:
            if self._executor is None:
                import llguidance  # loaded by the first grammar, not at engine start

                self._executor = llguidance.LLExecutor(num_threads=self._executor_threads)
            start = time.perf_counter()
            self._executor.unsafe_compute_mask_ptr(
                [(m, k) for k, (_, m, _) in enumerate(rows)], bitmask.data_ptr(), words * 4, n)
            # rows in parallel cannot be timed one by one: over budget as a whole, the next step finds who
            self._time_rows = (time.perf_counter() - start) * 1000 > budget_ms
        else:
            self._time_rows = False
            for k, (_, m, seq) in enumerate(rows):
                start = time.thread_time()
                m.unsafe_compute_mask_ptr(bitmask[k].data_ptr(), words * 4)
                ms = (time.thread_time() - start) * 1000
                if ms > budget_ms:  # raised before any sequence changed, as is_error above
                    raise GrammarTooCostly(too_costly(f"the grammar mask of request {seq.request_id!r}", ms,
                                                      self.limits), request_id=seq.request_id)
        if logits.device.type == "cpu":
            forbidden = forbidden_numpy(bitmask, vocab)
        else:  # the packed mask travels (4 KiB a row at 32k tokens), the device unpacks it
            forbidden = forbidden_torch(bitmask.to(logits.device), self._bits, vocab)
        if n == logits.shape[0]:
            logits.masked_fill_(forbidden, float("-inf"))
        else:
            index = torch.tensor([i for i, _, _ in rows], device=logits.device)
            logits[index] = logits[index].masked_fill(forbidden, float("-inf"))

    def advance(self, seq: Sequence, token: int) -> None:
        """Feed seq's newly accepted token to its matcher. A token the grammar refuses puts the matcher in its
        error state; the next apply() fails that request."""
        matcher = self.matchers.get(seq)
        if matcher is not None and not matcher.consume_token(token):
            log.warning("guided_token_refused", request_id=seq.request_id, token=token,
                        error=matcher.get_error())

    def reset(self, seq: Sequence) -> None:
        """Preemption by recompute: rebuild the matcher's state from seq's own output tokens."""
        matcher = self.matchers.get(seq)
        if matcher is not None:
            matcher.reset()
            if seq.output_token_ids:
                matcher.consume_tokens(seq.output_token_ids)

    # ---- compiling (pool threads) -----------------------------------------------------------------------

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        import llguidance  # loaded by the first grammar, not at engine start

        try:
            matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0,
                                           limits=self.limits.parser_limits())
        except Exception as err:  # llguidance raises for some grammar errors, flags others (below)
            raise GrammarError(f"the grammar cannot be compiled: {' '.join(str(err).split())[:400]}") from None
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be compiled: {' '.join(matcher.get_error().split())[:400]}")
        start = time.thread_time()
        matcher.compute_bitmask()  # the first mask builds the lexer's start state; every copy then shares it
        ms = (time.thread_time() - start) * 1000
        if ms > self.limits.mask_budget_ms:
            raise GrammarError(too_costly("the grammar's first mask", ms, self.limits), code=TOO_COSTLY)
        return matcher

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._lltokenizer is None:
                import llguidance.hf  # its HF glue imports transformers' tokenizer stack: only for a grammar job

                self._lltokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids))
            return self._lltokenizer


# A bitmask row holds one bit per token: bit j of int32 word w is token 32 w + j (llguidance's layout).

def word_bits(device: torch.device) -> torch.Tensor:
    """The 32 single-bit int32 values, bit 31 as the negative one."""
    return torch.tensor([1 << j for j in range(31)] + [-(1 << 31)], dtype=torch.int32, device=device)


def forbidden_numpy(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, vocab] bool, True where the CPU bitmask [n, words] forbids the token (numpy's unpackbits: on the
    CPU about twice as fast as the tensor ops below)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")  # int32s are little-endian
    return torch.from_numpy(bits)[:, :vocab] == 0


def forbidden_torch(mask: torch.Tensor, bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """forbidden_numpy on any device: one AND per word and bit."""
    n, words = mask.shape
    return ((mask.unsqueeze(-1) & bits) == 0).view(n, words * 32)[:, :vocab]
