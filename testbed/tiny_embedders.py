"""Tiny random-weight embedding checkpoints in sentence-transformers layout, built by the tests.

Each is what SentenceTransformer(directory) loads and the engine serves through its ordinary directory path: a
Hugging Face checkpoint (config.json, model.safetensors, a tokenizer), modules.json naming Transformer, Pooling
(1_Pooling/config.json, in the pre-5 boolean format most hub checkpoints carry) and, when asked, Normalize; and
sentence_bert_config.json with the max_seq_length sentence-transformers truncates to.

    make_tiny_encoder   BERT (or RoBERTa / XLM-R: the same layers, positions from padding_idx + 1), with
                        all-MiniLM-L6-v2's WordPiece tokenizer (the built-in embedding model's)
    make_tiny_decoder   a Qwen3-style decoder with its LM head (it generates too), the SmolLM2 tokenizer;
                        last-token pooling by default, as Qwen3-Embedding and gte-Qwen2 pool
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from testbed.tiny_models import make_tiny_model

POOLING_KEYS = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens",
                "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens", "lasttoken": "pooling_mode_lasttoken"}


def write_sentence_transformers_files(directory: str, width: int, pooling: str, normalize: bool,
                                      max_seq_length: int) -> None:
    """modules.json, 1_Pooling/config.json and sentence_bert_config.json for a checkpoint in `directory`."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    os.makedirs(os.path.join(directory, "1_Pooling"), exist_ok=True)
    config: dict[str, Any] = {"word_embedding_dimension": width}
    config.update({key: mode == pooling for mode, key in POOLING_KEYS.items()})
    for name, value in (("modules.json", modules), ("1_Pooling/config.json", config),
                        ("sentence_bert_config.json", {"max_seq_length": max_seq_length, "do_lower_case": False})):
        with open(os.path.join(directory, name), "w") as f:
            json.dump(value, f, indent=2)


def make_tiny_encoder(directory: str, model_type: str = "bert", pooling: str = "mean", normalize: bool = True,
                      max_seq_length: int = 128, **overrides: Any) -> str:
    """A random-weight BERT-shaped encoder (hidden 64, 2 layers, 4 heads of 16) in sentence-transformers layout."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from worker.engine import loader

    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    offset = 2 if model_type != "bert" else 0  # RoBERTa's positions start at padding_idx + 1
    fields = dict(vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=max_seq_length + offset, type_vocab_size=2 if model_type == "bert" else 1,
                  layer_norm_eps=1e-12, hidden_act="gelu", pad_token_id=0 if model_type == "bert" else 1)
    fields.update(overrides)
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(4321)
    model = AutoModel.from_config(config, dtype=torch.float32, add_pooling_layer=False)
    with torch.no_grad():  # default init is flat: every token's vector would look alike
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
            elif "LayerNorm" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(loader.resolve("all-minilm-l6-v2").directory).save_pretrained(directory)
    write_sentence_transformers_files(directory, fields["hidden_size"], pooling, normalize, max_seq_length)
    return directory


def make_tiny_decoder(directory: str, pooling: str = "lasttoken", normalize: bool = True,
                      max_seq_length: int = 256, **overrides: Any) -> str:
    """A random-weight Qwen3 (hidden 128, 2 layers, QK-norm) that generates and embeds."""
    if os.path.isfile(os.path.join(directory, "modules.json")):
        return directory
    make_tiny_model(directory, "qwen3", **overrides)
    with open(os.path.join(directory, "config.json")) as f:
        width = json.load(f)["hidden_size"]
    write_sentence_transformers_files(directory, width, pooling, normalize, max_seq_length)
    return directory
