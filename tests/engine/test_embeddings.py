"""Embeddings equal sentence-transformers' SentenceTransformer.encode (float32: max abs diff <= 1e-5, or cosine
>= 0.99999) over a staggered mixed batch (embedding_batch.py), for the real all-MiniLM-L6-v2 (the built-in
default embedding model), tiny random-weight encoders (BERT mean-pooled, RoBERTa CLS-pooled) and a tiny
Qwen3-style decoder (last-token, and mean) that serves generation requests in the same engine, with and without
overlap. No KV block outlives its sequence unless the prefix cache keeps it, and only the poolings that may read
that cache do."""

from __future__ import annotations

import pytest

from testbed.tiny_embedders import make_tiny_decoder, make_tiny_encoder
from tests.engine.embedding_batch import check_vectors, mixed_batch, run, st_vectors
from worker.engine import loader

# a 32-token budget: the long inputs take several steps (a decoder) or a step alone (an encoder)
ENGINE_KWARGS = dict(device="cpu", dtype="float32", block_size=8, max_num_seqs=4, max_num_batched_tokens=32)


def engine_for(directory: str, **extra):
    from worker import Engine

    return Engine(directory, **ENGINE_KWARGS, **extra)


def check_blocks(engine, reads_cache: bool, writes_cache: bool) -> None:
    bm = engine.block_manager
    bm.check_invariants([])
    assert bm.num_free == bm.num_blocks, "a block is still held after every request ended"
    stats = engine.stats()
    if writes_cache:
        assert bm.num_cached > 0
    else:
        assert bm.num_cached == 0, "an encoder's blocks were kept in the prefix cache"
    if reads_cache:
        assert stats.prefix_hit_tokens > 0, "the shared prefixes did not hit the cache"


@pytest.fixture(scope="module")
def minilm_dir() -> str:
    return loader.resolve("all-minilm-l6-v2").directory


def test_all_minilm_l6_v2_equals_sentence_transformers(minilm_dir):
    engine = engine_for("all-minilm-l6-v2", num_kv_blocks=40)
    assert engine.kinds == ["embed"] and engine.embeddings.pooling.mode == "mean"
    assert engine.embeddings.max_len == 256  # its sentence_bert_config.json's max_seq_length, not 512
    batch = mixed_batch(engine.tokenizer, generation=False, dims=128)
    outputs = run(engine, batch)
    check_vectors(outputs, batch, st_vectors(minilm_dir), normalized=True)
    check_blocks(engine, reads_cache=False, writes_cache=False)
    assert max(len(o.prompt_token_ids) for o in outputs.values()) > ENGINE_KWARGS["max_num_batched_tokens"]


@pytest.mark.parametrize("model_type,pooling", [("bert", "mean"), ("roberta", "cls"), ("bert", "max")])
def test_tiny_encoder_equals_sentence_transformers(tmp_path, model_type, pooling):
    directory = make_tiny_encoder(str(tmp_path / model_type), model_type, pooling=pooling, normalize=pooling != "max")
    engine = engine_for(directory, num_kv_blocks=40)
    assert engine.kinds == ["embed"] and not engine.causal
    batch = mixed_batch(engine.tokenizer, generation=False, dims=48)
    outputs = run(engine, batch)
    check_vectors(outputs, batch, st_vectors(directory), normalized=pooling != "max")
    check_blocks(engine, reads_cache=False, writes_cache=False)
    assert max(len(o.prompt_token_ids) for o in outputs.values()) > ENGINE_KWARGS["max_num_batched_tokens"]


@pytest.mark.parametrize("pooling,overlap", [("lasttoken", False), ("lasttoken", True), ("mean", False)])
def test_tiny_decoder_embeds_and_generates(tmp_path, pooling, overlap):
    """Embeddings chunked across steps beside generation requests (one starting with an embedded input), in a
    cache small enough to preempt; the generations equal Hugging Face's greedy tokens."""
    from tests.support.hf_reference import hf_greedy, load_hf

    directory = make_tiny_decoder(str(tmp_path / "qwen3"), pooling=pooling)
    engine = engine_for(directory, num_kv_blocks=12, overlap=overlap)  # 96 tokens: the longest input is 90
    assert engine.kinds == ["generate", "embed"] and engine.embeddings.pooling.mode == pooling
    batch = mixed_batch(engine.tokenizer, generation=True, dims=64)
    outputs = run(engine, batch)
    check_vectors(outputs, batch, st_vectors(directory), normalized=True)
    hf = load_hf(directory)
    for rid in ("g0", "g1"):
        req = batch.requests[rid]
        assert outputs[rid].token_ids == hf_greedy(hf, req.prompt, req.params.max_tokens, ignore_eos=True), rid
        assert outputs[rid].embedding is None
    check_blocks(engine, reads_cache=True, writes_cache=True)
    assert engine.stats().preemptions > 0, "the batch did not preempt"
    if pooling == "mean":  # its sequences never take cached blocks: only the generations may
        assert all(outputs[rid].num_cached_tokens == 0 for rid in batch.requests if rid.startswith("e"))
    else:
        assert any(outputs[rid].num_cached_tokens > 0 for rid in batch.requests if rid.startswith("e"))
