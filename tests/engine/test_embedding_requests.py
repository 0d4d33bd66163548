"""Embedding requests the engine refuses, cuts or cannot serve, each failing alone while the others run on;
truncation equal to sentence-transformers' own; the pooling rule read from the checkpoint or its defaults; the
built-in model unpacked once; an embedding aborted mid-prefill; a decoder checkpoint without its LM head."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from testbed.tiny_embedders import make_tiny_decoder, make_tiny_encoder
from tests.engine.embedding_batch import TEXTS, words
from worker.engine import loader
from worker.engine.errors import UNSUPPORTED_KIND, InvalidRequest
from worker.engine.pooling import EmbedParams
from worker.engine.sampling_params import SamplingParams

KWARGS = dict(device="cpu", dtype="float32", block_size=8, max_num_seqs=4, max_num_batched_tokens=32,
              num_kv_blocks=40)


def engine_for(directory: str, **extra):
    from worker import Engine

    return Engine(directory, **{**KWARGS, **extra})


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory) -> str:
    return make_tiny_encoder(str(tmp_path_factory.mktemp("bert") / "m"), max_seq_length=64)


@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory) -> str:
    return make_tiny_decoder(str(tmp_path_factory.mktemp("qwen3") / "m"))


@pytest.fixture(scope="module")
def encoder(encoder_dir):
    return engine_for(encoder_dir)


def test_bad_inputs_fail_alone(encoder, encoder_dir):
    from sentence_transformers import SentenceTransformer

    engine = encoder
    engine.add_request("before", TEXTS[3], EmbedParams())
    vocab = engine.model.arch.vocab_size
    long_text = words(120, 9)  # past the 64 tokens of its sentence_bert_config.json
    bad = {
        "empty string": ("", EmbedParams(), "empty string"),
        "empty list": ([], EmbedParams(), "empty list"),
        "outside the vocabulary": ([5, vocab, 7], EmbedParams(), "out of the vocabulary"),
        "negative id": ([-1], EmbedParams(), "out of the vocabulary"),
        "chat messages": ([{"role": "user", "content": "hi"}], EmbedParams(), "non-empty string or"),
        "too long": (long_text, EmbedParams(), "embeds at most 64"),
        "too long ids": (list(range(100, 200)), EmbedParams(), "embeds at most 64"),
        "too wide": (TEXTS[1], EmbedParams(dimensions=65), "exceeds this model's embedding width of 64"),
    }
    for rid, (prompt, params, message) in bad.items():
        with pytest.raises(InvalidRequest, match=message) as err:
            engine.add_request(rid, prompt, params)
        assert err.value.code == "invalid_request", rid
        assert rid not in engine.requests
    with pytest.raises(InvalidRequest, match="cannot serve generation requests: it is an encoder") as err:
        engine.add_request("generate", TEXTS[1], SamplingParams(max_tokens=3))
    assert err.value.code == UNSUPPORTED_KIND
    for dims in (0, -3, True, 2.5):
        with pytest.raises(InvalidRequest, match="dimensions must be a positive integer"):
            EmbedParams(dimensions=dims)
    engine.add_request("cut", long_text, EmbedParams(truncate=True))
    engine.add_request("cut ids", list(range(100, 200)), EmbedParams(truncate=True))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    assert set(outputs) == {"before", "cut", "cut ids"}
    assert len(outputs["cut"].prompt_token_ids) == 64 and outputs["cut ids"].prompt_token_ids == list(range(100, 164))
    reference = SentenceTransformer(encoder_dir, device="cpu").encode([TEXTS[3], long_text], convert_to_tensor=True)
    for rid, want in (("before", reference[0]), ("cut", reference[1])):  # sentence-transformers truncates too
        assert (outputs[rid].embedding - want).abs().max() <= 1e-5, rid


def test_offline_embed_leaves_nothing_behind_on_a_bad_input(encoder):
    with pytest.raises(InvalidRequest, match="embed input 2: the input is an empty string"):
        encoder.embed([TEXTS[0], TEXTS[1], "", TEXTS[2]])
    assert not encoder.has_unfinished_requests() and not encoder.requests
    (one,) = encoder.embed(TEXTS[1], EmbedParams(dimensions=16))
    assert one.embedding.shape == (16,) and abs(one.embedding.norm().item() - 1) < 1e-6


def test_abort_mid_prefill_frees_its_blocks(decoder_dir):
    engine = engine_for(decoder_dir)
    engine.add_request("long", words(90, 3), EmbedParams())
    engine.step()  # a 32-token chunk of ~90
    assert engine.block_manager.num_used > 0
    out = engine.abort("long")
    assert out.finish_reason == "abort" and out.embedding is None
    engine.block_manager.check_invariants([])
    assert engine.block_manager.num_used == 0 and not engine.has_unfinished_requests()


def test_defaults_without_sentence_transformers_files(tmp_path, encoder_dir, decoder_dir):
    """No modules.json: an encoder pools its CLS token, a decoder its last, both normalized."""
    from transformers import AutoModel

    for source, index in ((encoder_dir, 0), (decoder_dir, -1)):
        bare = str(tmp_path / os.path.basename(os.path.dirname(source)))
        shutil.copytree(source, bare, ignore=shutil.ignore_patterns("modules.json", "1_Pooling", "sentence_bert*"))
        engine = engine_for(bare)
        assert engine.embeddings.pooling.source == "default"
        (out,) = engine.embed(TEXTS[3])
        with torch.no_grad():
            hidden = AutoModel.from_pretrained(bare).eval()(torch.tensor([out.prompt_token_ids])).last_hidden_state
        want = torch.nn.functional.normalize(hidden[0, index], dim=0)
        assert (out.embedding - want).abs().max() <= 1e-5, source


def test_unsupported_pooling(tmp_path, encoder_dir, decoder_dir):
    """A module tokenbus does not serve: an encoder cannot load at all, a decoder still generates."""
    for source in (encoder_dir, decoder_dir):
        copy = str(tmp_path / os.path.basename(os.path.dirname(source)))
        shutil.copytree(source, copy)
        with open(os.path.join(copy, "modules.json")) as f:
            modules = json.load(f)
        modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
        with open(os.path.join(copy, "modules.json"), "w") as f:
            json.dump(modules, f)
        if source == encoder_dir:
            with pytest.raises(ValueError, match=r"module\(s\) \['Dense'\] after the pooling are not served"):
                engine_for(copy)
            continue
        engine = engine_for(copy)
        assert engine.kinds == ["generate"]
        with pytest.raises(InvalidRequest, match="cannot serve embedding requests: .*Dense") as err:
            engine.add_request("e", TEXTS[1], EmbedParams())
        assert err.value.code == UNSUPPORTED_KIND
        assert len(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


def test_decoder_without_lm_head_embeds_only(tmp_path, decoder_dir):
    from safetensors.torch import load_file, save_file

    copy = str(tmp_path / "no-head")
    shutil.copytree(decoder_dir, copy)
    path = os.path.join(copy, "model.safetensors")
    tensors = load_file(path)
    del tensors["lm_head.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    engine = engine_for(copy)
    assert engine.kinds == ["embed"]
    with pytest.raises(InvalidRequest, match="has no LM head") as err:
        engine.add_request("g", [5, 6], SamplingParams(max_tokens=2))
    assert err.value.code == UNSUPPORTED_KIND
    full = engine_for(decoder_dir)
    assert (engine.embed(TEXTS[2])[0].embedding - full.embed(TEXTS[2])[0].embedding).abs().max() == 0


def test_builtin_model_unpacks_once(tmp_path):
    first = loader.resolve("all-minilm-l6-v2", str(tmp_path))
    assert first.directory.startswith(str(tmp_path)) and os.path.isfile(os.path.join(first.directory, "modules.json"))
    marker = os.path.join(first.directory, loader.COMPLETE)
    stamp = os.stat(marker).st_mtime_ns
    again = loader.resolve("all-minilm-l6-v2", str(tmp_path))
    assert again.directory == first.directory and os.stat(marker).st_mtime_ns == stamp
    assert [n for n in os.listdir(os.path.dirname(first.directory)) if n.startswith(".staging")] == []
