"""Tensor parallelism on the CPU (gloo, 2 ranks: this process and one follower process): greedy fp32 tokens
with TP=2 equal TP=1 and Hugging Face `generate` for Llama with GQA (one KV head, so fewer KV heads than
ranks: replicated), Qwen3 (q/k norms), Gemma 2 (soft-caps, sliding layers) and Mixtral (experts split within
each expert), over the staggered batch (chunked prefill, preemption, a prefix-cache hit), then n > 1 with a
seed sampled at temperature 1: the same tokens as TP=1. Each rank's weight memory is at most 1/N of the
checkpoint plus what it replicates. int8 and w8a8 shard with their scales (the same tokens as TP=1). What
cannot shard is refused before any process starts."""

from __future__ import annotations

import pytest

from testbed.tiny_models import make_tiny_model
from tests.engine.staggered_batch import ENGINE_KWARGS, PROMPTS, TINY, check, hf_tokens, run_staggered
from worker import Engine, SamplingParams
from worker.engine import loader
from worker.engine.models import registry
from worker.engine.parallel import sharded_loading

TP = 2
FAMILIES = {
    # one KV head for two ranks: replicated; the padded decode path (its bucket and width cross the channel)
    "llama": ({}, dict(static_decode=True)),
    "qwen3": ({}, dict(overlap=True)),  # the forward thread sends each step
    "gemma2": ({}, {}),
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2), {}),
}
SAMPLED = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=11, n=3, ignore_eos=True)


def _sampled(engine: Engine) -> list[list[int]]:
    out = engine.generate([PROMPTS[1]], SAMPLED)[0]
    return [c.token_ids for c in out.choices]


def _weights_within_share(engine: Engine, directory: str) -> None:
    shard = engine.parallel.group.shard
    total, replicated = sharded_loading.checkpoint_bytes(directory, shard)
    for rank, held in enumerate(engine.weight_bytes):
        assert held <= total / TP + replicated, f"rank {rank} holds {held} B of {total} (replicated {replicated})"
        assert held < total, f"rank {rank} holds the whole model"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_equals_tp1_and_hf(tmp_path, family):
    fields, options = FAMILIES[family]
    directory = make_tiny_model(str(tmp_path), family, **{**TINY, **fields})
    expected = hf_tokens(directory)
    one = Engine(directory, **ENGINE_KWARGS)
    single = run_staggered(one)
    single_sampled = _sampled(one)
    with Engine(directory, **ENGINE_KWARGS, **options, tensor_parallel_size=TP) as engine:
        result = run_staggered(engine)
        check(result, expected, f"{family} TP={TP}")
        assert result["tokens"] == single["tokens"]
        assert _sampled(engine) == single_sampled, f"{family}: seeded n=3 sampling differs from TP=1"
        _weights_within_share(engine, directory)
        assert getattr(engine.backend, "fused", None) is None  # the one-call decode step is off under TP


@pytest.mark.parametrize("scheme", ["int8", "w8a8"])
def test_quantized_weights_shard_with_their_scales(tmp_path, scheme):
    """Two KV heads split one per rank; o_proj / down_proj shards take the whole rows' scales (an all-reduce of
    each row's max), so every rank's codes are the unsharded codes' slice and the tokens are TP=1's."""
    directory = make_tiny_model(str(tmp_path), "llama", rope_scaling=None, vocab_size=1024, hidden_size=128,
                                intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    options = dict(ENGINE_KWARGS, quantization=scheme)
    single = run_staggered(Engine(directory, **options))
    with Engine(directory, **options, tensor_parallel_size=TP) as engine:
        assert not engine.parallel.group.shard.kv_replicated
        assert engine.quantized_cache is None  # no int8 cache file under TP
        assert run_staggered(engine)["tokens"] == single["tokens"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tp-refusals")), "llama", **TINY)


def _shardable(directory: str, size: int, **source_fields):
    source = loader.resolve(directory)
    config = loader.load_config(source)
    for name, value in source_fields.items():
        setattr(source, name, value)
    arch = registry.model_arch(config, directory)
    return sharded_loading.check_shardable(source, arch, registry.model_path(arch), config, size)


def test_what_cannot_shard_is_refused_before_any_rank_starts(tiny_llama):
    with pytest.raises(ValueError, match="2 attention heads do not split over 4 ranks"):
        Engine(tiny_llama, **ENGINE_KWARGS, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="GGUF file .*cannot be read a slice at a time"):
        _shardable(tiny_llama, TP, gguf_file="model.gguf")
    with pytest.raises(ValueError, match="transformers' own modeling code"):
        Engine(tiny_llama, **ENGINE_KWARGS, model_impl="transformers", tensor_parallel_size=TP)
    with pytest.raises(ValueError, match="w8a8 with tensor_parallel_size 2 needs .* multiple of 64"):
        Engine(tiny_llama, **ENGINE_KWARGS, quantization="w8a8", tensor_parallel_size=TP)


def test_shard_slices_cover_each_tensor_once(tiny_llama):
    """The ranks' slices of q/k/v, o_proj, gate/up, down and the vocabulary tile each tensor exactly (KV heads
    replicated here: each rank reads the one whole)."""
    shards = [_shardable(tiny_llama, TP)]
    shards.append(type(shards[0]).of(registry.model_arch(loader.load_config(loader.resolve(tiny_llama))), 1, TP))
    for name, rows in (("q_proj.weight", 64), ("lm_head.weight", 1024), ("gate_proj.weight", 128)):
        spans = [s.cut(f"layers.0.mlp.{name}" if "gate" in name else f"self_attn.{name}" if "q_" in name
                       else name, [rows, 64])[1][0] for s in shards]
        assert spans == [(0, rows // 2), (rows // 2, rows)], name
    assert [s.kv_span() for s in shards] == [(0, 32), (0, 32)]
    assert shards[0].cut("layers.0.self_attn.o_proj.weight", [64, 64]) == (1, [(0, 32)])
    assert shards[1].cut("layers.0.input_layernorm.weight", [64]) is None
