"""Reading one PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) into the weights a slot
takes, refusing at load what tokenbus does not serve: LoraError names the adapter and the field.

Served: LoRA (peft_type LORA) on the targets of targets.py, any rank up to max_lora_rank (per module too:
rank_pattern), lora_alpha with the plain alpha / r or the rsLoRA alpha / sqrt(r) scaling, lora_dropout
(inference ignores it). Refused: DoRA (use_dora), modules_to_save, trainable_token_indices, bias / lora_bias,
fan_in_fan_out, alpha_pattern, layer_replication, a module that is not one of the targets (embeddings,
lm_head, experts), shapes that do not match the base (an adapter for another model), a file that does not
read or holds non-finite values.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from worker.engine.errors import InvalidRequest
from worker.engine.lora.targets import MODULES, Target

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
# config fields whose non-empty value changes the model in a way the slots cannot hold
_REFUSED = {
    "use_dora": "DoRA (weight-decomposed LoRA) is not supported; merge it into the base or retrain as plain LoRA",
    "modules_to_save": "modules_to_save replaces whole modules (often lm_head or the embeddings) per adapter, which "
                       "one shared base cannot serve; merge the adapter into a checkpoint of its own",
    "trainable_token_indices": "trained embedding rows are not supported",
    "lora_bias": "a bias on lora_B is not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layouts, GPT-2) is not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "layer_replication": "layer replication is not supported",
}


class LoraError(InvalidRequest):
    """An adapter tokenbus refuses, named with the field at fault."""

    def __init__(self, name: str, path: str, where: str, why: str) -> None:
        super().__init__(f"LoRA adapter {name!r} ({path}): {where}: {why}")
        self.adapter, self.field = name, where


@dataclass
class LoraAdapter:
    """One adapter's weights as slots take them: per target, per slice, (lora_A [r, in], lora_B times the
    scaling [width, r]), or None for a slice it leaves alone."""

    name: str
    path: str
    rank: int  # the largest rank of its modules
    pieces: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor] | None]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ps in self.pieces.values() for p in ps if p for t in p)


def load_adapter(name: str, path: str, targets: dict[tuple[int, str], Target], max_rank: int,
                 dtype: torch.dtype) -> LoraAdapter:
    """The adapter at `path`, checked against the base's targets; raises LoraError."""

    def refuse(where: str, why: str) -> LoraError:
        return LoraError(name, path, where, why)

    config = _read_config(path, refuse)
    tensors = _read_tensors(path, refuse)
    alpha, rank_pattern = float(config.get("lora_alpha", 8)), config.get("rank_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
    modules: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            where = "use_dora" if "lora_magnitude_vector" in key else "target_modules"
            raise refuse(where, f"tensor {key!r} is not a LoRA weight of a decoder layer's linear; tokenbus serves "
                                f"adapters on {sorted({k.split('.')[1] for k in MODULES})} only")
        modules.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    adapter = LoraAdapter(name, path, 0)
    for (layer, module), ab in sorted(modules.items()):
        where = f"layers.{layer}.{module}"
        if module not in MODULES:
            raise refuse("target_modules", f"{where} is not one of the linears an adapter may change here "
                                           f"({', '.join(MODULES)}): experts, routers and embeddings take none")
        linear, slice_index = MODULES[module]
        target = targets.get((layer, linear))
        if target is None:
            raise refuse("target_modules", f"the base model has no {where} (a layer past its last, or a mixture-of-"
                                           "experts layer): an adapter for another base model")
        if set(ab) != {"A", "B"}:
            raise refuse(WEIGHTS, f"{where} has lora_{''.join(ab)} only: the file is incomplete")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        slices = range(len(target.slices)) if slice_index is None else [slice_index]
        width = sum(target.slices[j][1] for j in slices)
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != target.in_features or b.shape != (width, r):
            raise refuse("base_model_name_or_path",
                         f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the base model's "
                         f"[{target.in_features} -> {width}] linear (rank {r}): an adapter for another base model "
                         f"({config.get('base_model_name_or_path') or 'unnamed'})")
        if r > max_rank:
            raise refuse("r", f"{where} has rank {r}, above this engine's max_lora_rank {max_rank}; raise "
                              "max_lora_rank (each slot's memory grows with it) or serve a lower-rank adapter")
        declared = _pattern_rank(rank_pattern, module, layer, int(config.get("r", r)))
        if declared != r:
            raise refuse("r", f"{where}: the config says rank {declared}, the weights have {r}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise refuse(WEIGHTS, f"{where} holds NaN or infinite values: the file is corrupted")
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        b = b.to(torch.float32) * scaling
        pieces = adapter.pieces.setdefault((layer, linear), [None] * len(target.slices))
        at = 0
        for j in slices:
            offset, w = target.slices[j]
            bj = b[at : at + w]
            if target.row_order is not None:  # Phi-3: the base's q/k rows are permuted; so are these
                bj = bj[target.row_order[offset : offset + w] - offset]
            pieces[j] = (a.to(dtype).contiguous(), bj.to(dtype).contiguous())
            at += w
        adapter.rank = max(adapter.rank, r)
    if not adapter.pieces:
        raise refuse(WEIGHTS, "no LoRA weights in the file")
    return adapter


def _read_config(path: str, refuse) -> dict:
    file = os.path.join(path, CONFIG)
    try:
        with open(file) as f:
            config = json.load(f)
    except FileNotFoundError as err:
        raise refuse(CONFIG, "missing: give the directory PEFT's save_pretrained wrote") from err
    except (OSError, ValueError) as err:
        raise refuse(CONFIG, f"unreadable ({err})") from err
    if not isinstance(config, dict):
        raise refuse(CONFIG, "not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise refuse("peft_type", f"{config.get('peft_type')!r}: only LoRA adapters are served")
    for key, why in _REFUSED.items():
        if config.get(key):
            raise refuse(key, why)
    if config.get("bias", "none") != "none":
        raise refuse("bias", f"{config['bias']!r}: adapters that train biases are not supported (bias must be 'none')")
    return config


def _read_tensors(path: str, refuse) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = os.path.join(path, WEIGHTS)
    if not os.path.isfile(file):
        why = "missing" + (" (adapter_model.bin is not read: pickles run code; re-save with safetensors)"
                           if os.path.isfile(os.path.join(path, "adapter_model.bin")) else "")
        raise refuse(WEIGHTS, why)
    try:
        tensors = load_file(file)
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise refuse(WEIGHTS, f"the file does not read ({err}): corrupted or truncated") from err
    bad = [k for k, t in tensors.items() if not t.is_floating_point()]
    if bad:
        raise refuse(WEIGHTS, f"{bad[0]!r} is not a floating-point tensor")
    return tensors


def _pattern_rank(rank_pattern: dict, module: str, layer: int, default: int) -> int:
    """PEFT's rank for one module: the rank_pattern entry whose key ends its name, else the config's r."""
    full = f"layers.{layer}.{module}"
    for key, r in rank_pattern.items():
        if re.search(rf"(^|\.)({key})$", full):
            return int(r)
    return default
