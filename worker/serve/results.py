"""The `result` a finished engine request writes into its job record: a protocol JobResult."""

from __future__ import annotations

from typing import Any

from protocol.models import JobResult, ResultChoice, TokenText, Usage
from worker.engine.token_text import logprob_token_ids, token_info


def job_result(out: Any, model_name: str, tokenizer: Any) -> JobResult:
    """The top-level fields are choice 0's (what a reader of a single result expects); `choices` holds all n,
    and usage counts the tokens of every choice, as OpenAI does."""
    prompt_tokens = len(out.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in out.choices) if out.choices else len(out.token_ids)
    logprob_tokens = None
    if out.logprobs is not None:  # the producer has no tokenizer: name each token for OpenAI's shape
        ids = logprob_token_ids([e for c in out.choices for e in c.logprobs or []] or out.logprobs)
        logprob_tokens = {int(i): TokenText(**t) for i, t in token_info(tokenizer, ids).items()}
    return JobResult(
        text=out.text,
        token_ids=list(out.token_ids),
        finish_reason=out.finish_reason,
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens,
                    cached_tokens=out.num_cached_tokens),
        logprobs=out.logprobs,
        logprob_tokens=logprob_tokens,
        model=model_name,
        choices=[ResultChoice(index=c.index, text=c.text, token_ids=list(c.token_ids),
                              finish_reason=c.finish_reason, logprobs=c.logprobs) for c in out.choices],
    )
