"""Embedding requests: an input checked, tokenized as sentence-transformers would, and seated as a prefill-only
Sequence whose rows are pooled (pooling.py) instead of sampled.

    input      a non-empty string, or a non-empty list of token ids inside the vocabulary
    length     at most the embedding context: the model's, or the shorter max_seq_length its sentence-transformers
               config was trained to; a longer input is refused, or cut to it when the request asks (`truncate`:
               text as the tokenizer truncates, keeping its special tokens, so the vector is what
               SentenceTransformer.encode computes for it)
    dimensions at most the model's width
Each refusal is an InvalidRequest of that request alone; the engine and the other requests go on.
"""

from __future__ import annotations

import time
from typing import Any

from worker.engine.errors import UNSUPPORTED_KIND, InvalidRequest
from worker.engine.pooling import EmbedParams, Pooling, PoolState, load_pooling
from worker.engine.prompts import check_token_ids, is_token_ids
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Sequence

# what Sequence reads of its params; an embedding samples nothing, so none of it applies
PREFILL_ONLY = SamplingParams(max_tokens=1)


class Embeddings:
    """How one engine serves embedding requests: its pooling rule, context and model kind."""

    def __init__(self, pooling: Pooling, causal: bool, max_model_len: int, tokenizer: Any, vocab_size: int,
                 kv_tokens: int) -> None:
        self.pooling = pooling
        self.causal = causal
        self.max_len = min(max_model_len, pooling.max_seq_length or max_model_len)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.kv_tokens = kv_tokens  # what the whole KV cache holds: an input past it could never run

    def sequence(self, request_id: str, prompt: Any, params: EmbedParams, priority: int = 0) -> Sequence:
        """The request's Sequence, or InvalidRequest saying what to change."""
        width = self.pooling.dimension
        if params.dimensions is not None and params.dimensions > width:
            raise InvalidRequest(f"dimensions {params.dimensions} exceeds this model's embedding width of {width}")
        ids = self.token_ids(prompt, params.truncate)
        if len(ids) > self.kv_tokens:
            raise InvalidRequest(f"the input's {len(ids)} tokens can never fit the KV cache ({self.kv_tokens} "
                                 "tokens); raise kv_cache_gb")
        return Sequence(request_id, ids, PREFILL_ONLY, time.time(), None, priority=priority,
                        pool_state=PoolState(params), reads_prefix_cache=self.pooling.reads_prefix_cache(self.causal),
                        writes_prefix_cache=self.causal, whole_prompt=not self.causal)

    def token_ids(self, prompt: Any, truncate: bool) -> list[int]:
        limit = self.max_len
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the input is an empty string")
            text = prompt.lower() if self.pooling.lowercase else prompt
            ids = self.tokenizer.encode(text, truncation=True, max_length=limit) if truncate else \
                self.tokenizer.encode(text)
        elif is_token_ids(prompt):
            ids = check_token_ids(prompt, self.vocab_size, "input")
            ids = ids[:limit] if truncate else ids
        else:
            raise InvalidRequest("an embedding input is a non-empty string or a non-empty list of token ids")
        if not ids:  # a tokenizer that made nothing of the text (and adds no special tokens)
            raise InvalidRequest("the input has no tokens once tokenized")
        if len(ids) > limit:
            raise InvalidRequest(f"the input has {len(ids)} tokens; this model embeds at most {limit} (ask for "
                                 "truncate to cut it to that)")
        return ids


def embeddings_for(model_path: str, directory: str, arch: Any, causal: bool, max_model_len: int, tokenizer: Any,
                   kv_tokens: int) -> tuple[Embeddings | None, str]:
    """How an engine embeds, or None and why it cannot (an encoder that cannot embeds nothing: ValueError)."""
    if model_path != "native":
        return None, "embeddings are served by tokenbus's own model code, not the transformers fallback"
    try:
        rule = load_pooling(directory, arch.hidden_size, causal)
    except ValueError as err:
        if not causal:
            raise
        return None, str(err)
    return Embeddings(rule, causal, max_model_len, tokenizer, arch.vocab_size, kv_tokens), ""


def refuse_kind(model: str, kind: str, reason: str) -> InvalidRequest:
    """A request of a kind (generation, embedding) this engine's model cannot serve."""
    return InvalidRequest(f"model {model!r} cannot serve {kind} requests: {reason}", code=UNSUPPORTED_KIND)
