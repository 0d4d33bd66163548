"""LoRA adapters on the Triton path (the SGMV kernels, tokenbus_kernels/lora.py, under TRITON_INTERPRET=1) equal PEFT.

The engine runs in a child process (Triton reads TRITON_INTERPRET when the kernel modules are first imported:
tests/engine/test_engine_triton.py), whose PyTorch LoRA reference raises, and which counts the kernels' calls.
Kept small (the interpreter runs every program in Python): a base row and two adapters sharing one slot, so
one waits for the slot and the slot is reloaded; chunked prefill over a 16-token budget; the padded decode
path (static_decode: the CUDA graphs' shapes, adapter rows included, run eagerly). PEFT runs here.
Run directly, this file is the child: `python -m tests.engine.test_lora_triton BASE NAME=PATH...` prints JSON.
"""

from __future__ import annotations

import json
import os
import sys

from tests.engine.lora_cases import PeftReference, tiny_base, write_adapters
from tests.engine.staggered_batch import PROMPTS
from tests.support.interpreted_child import run_interpreted

ADAPTERS = {"r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
            "r64": dict(r=64, lora_alpha=32, use_rslora=True,
                        target_modules=["q_proj", "k_proj", "gate_proj", "up_proj", "down_proj"])}
WORKLOAD = [(PROMPTS[0], None), (PROMPTS[1], "r8"), (PROMPTS[2], "r64")]
MAX_TOKENS = 3


def run_child(base: str, adapters: dict[str, str]) -> dict:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import tokenbus_kernels.lora as lora_kernels
    from worker import Engine, SamplingParams
    from worker.engine.backends import reference

    calls = {"shrink": 0, "expand": 0}

    def counted(attr: str, key: str) -> None:
        inner = getattr(lora_kernels, attr)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return inner(*args, **kwargs)

        setattr(lora_kernels, attr, wrapper)

    counted("lora_shrink_triton", "shrink")
    counted("lora_expand_triton", "expand")

    def refuse(*args, **kwargs):
        raise AssertionError("the PyTorch LoRA reference ran although TRITON_INTERPRET=1")

    reference.ReferenceBackend.lora = refuse
    engine = Engine(base, device="cpu", dtype="float32", block_size=8, max_num_seqs=4, max_num_batched_tokens=16,
                    num_kv_blocks=16, max_loras=1, max_lora_rank=64, static_decode=True)
    for name, path in adapters.items():
        engine.add_lora(name, path)
    outs = engine.generate([p for p, _ in WORKLOAD],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                           loras=[lora for _, lora in WORKLOAD])
    stats = engine.stats()
    return {"tokens": [o.token_ids for o in outs], "calls": calls, "backend": engine.backend.name,
            "lora_loads": stats.lora_loads}


def test_triton_path_equals_peft(tmp_path):
    base = tiny_base(str(tmp_path), "llama")
    adapters = write_adapters(base, str(tmp_path / "adapters"), ADAPTERS)
    result = run_interpreted("tests.engine.test_lora_triton", base, json.dumps(adapters))
    assert result["backend"] == "triton-interpreter"
    assert result["calls"]["shrink"] == result["calls"]["expand"] > 0, result["calls"]
    assert result["lora_loads"] == 2, "two adapters through one slot: each loaded once, one after the other"
    reference = PeftReference(base, adapters)
    for (prompt, lora), got in zip(WORKLOAD, result["tokens"], strict=True):
        assert got == reference.greedy(lora, prompt, MAX_TOKENS), f"adapter {lora}: {got}"


if __name__ == "__main__":
    print(json.dumps(run_child(sys.argv[1], json.loads(sys.argv[2]))))
