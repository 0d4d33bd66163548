"""Embeddings' speed, for the docs: all-MiniLM-L6-v2 over 10,000 inputs of mixed length in tokens/s, through
SentenceTransformer.encode at its best batch size, tokenbus's offline engine, tokenbus end to end through Redis
and (where .venv-vllm exists) vLLM's CPU build, the systems taking turns each round (bench/embed.py: the same
run as `tokenbus bench embed`). Writes docs/embeddings.md, section "embeddings-speed", unless --no-write.

    .venv/bin/python -m benchmarks.engine.embeddings [--num-prompts 10000] [--rounds 3] [--threads N] [--no-write]

Targets (issue 35): offline >= 2x SentenceTransformer, >= 1.2x vLLM CPU; end to end >= 0.9x offline.
"""

from __future__ import annotations

from bench.commands import embed_flags, run_embed
from bench.harness import parser
from benchmarks.harness.docs import publish


def main() -> None:
    ap = parser(__doc__, model="all-minilm-l6-v2", prompts=10_000, rounds=3, redis=True, docs=True)
    embed_flags(ap)
    args = ap.parse_args()
    publish(run_embed(args), "embeddings.md", "embeddings-speed", not args.no_write)


if __name__ == "__main__":
    main()
