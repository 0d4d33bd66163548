"""The engine with the Triton kernels forced on (CPU, TRITON_INTERPRET=1) equals Hugging Face `generate`.

The engine run happens in a child process because Triton reads TRITON_INTERPRET when the kernel modules
are first imported (see tests/kernels/test_kernels.py); the child refuses the PyTorch references outright and
counts every Triton kernel's calls, so a pass means every attention call, KV write, norm, RoPE and SiLU·mul
went through the Triton kernels (none fell back silently). The HF reference runs here.
Run directly, this file is the child: `python -m tests.engine.test_engine_triton MODEL_DIR MODE...` prints JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# chunked prefill (prompts longer than the 16-token step budget), block boundaries (block_size 16),
# sequences joining and leaving a running decode batch; the last prompt starts with the second one's first
# full block, so its prefill starts mid-sequence over a prefix-cache hit
PROMPTS = [
    "Hello there",
    "The capital of France is a city that many people like to visit because of its museums and food",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,",
    "def f(x):\n    return",
    "The capital of France is a city that many people like to visit because of its museums and its old parks",
]
# prompts of 2, 19, 34, 7 and 21 tokens: the first and the fourth cross a block edge while decoding; few tokens,
# since the interpreter's cost is per step (at max_num_seqs 4 the decode batch runs at 3, padded to 4, on its
# way out)
MAX_TOKENS = [16, 6, 8, 12, 6]


def instrument() -> dict[str, int]:
    """Child side, once a process: the references raise, every Triton kernel's calls are counted (returned)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import tokenbus_kernels.activation as activation
    import tokenbus_kernels.cascade_attention as cascade_attention
    import tokenbus_kernels.decode_attention as decode
    import tokenbus_kernels.norm as norm
    import tokenbus_kernels.prefill_attention as prefill
    import tokenbus_kernels.rope as rope
    from worker.engine.backends import reference

    calls = {"rotary_write_kv": 0, "decode": 0, "cascade": 0, "prefill": 0, "rms_norm": 0, "add_rms_norm": 0,
             "silu_and_mul": 0}

    def counted(module, attr, key):
        inner = getattr(module, attr)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return inner(*args, **kwargs)

        setattr(module, attr, wrapper)

    def refuse(*args, **kwargs):
        raise AssertionError("a PyTorch reference ran although TRITON_INTERPRET=1")

    for name in ("write_kv_ref", "paged_decode_attention_ref", "cascade_decode_attention_ref",
                 "paged_prefill_attention_ref", "rms_norm_ref", "add_rms_norm_ref", "rotary_ref", "silu_and_mul_ref"):
        setattr(reference, name, refuse)
    counted(rope, "rotary_write_kv_triton", "rotary_write_kv")
    counted(decode, "paged_decode_attention_triton", "decode")
    counted(cascade_attention, "cascade_decode_attention_triton", "cascade")
    counted(prefill, "paged_prefill_attention_triton", "prefill")
    counted(norm, "rms_norm_triton", "rms_norm")
    counted(norm, "add_rms_norm_triton", "add_rms_norm")
    counted(activation, "silu_and_mul_triton", "silu_and_mul")
    return calls


def run_engine_with_triton(directory: str, calls: dict[str, int], static_decode: bool = False,
                           cascade: bool = False) -> dict:
    """Child side: the engine on CPU with the interpreted Triton kernels (after instrument()); calls counts
    this engine's kernel calls only."""
    from worker import Engine, SamplingParams

    calls.update(dict.fromkeys(calls, 0))
    # static_decode: pure decode steps padded to buckets 1, 2, 4 with full-width tables (the graphs' path)
    engine = Engine(directory, device="cpu", dtype="float32", block_size=16, max_num_seqs=4 if static_decode else 3,
                    max_num_batched_tokens=16, kv_cache_gb=0.01, static_decode=static_decode,
                    cascade_attention="on" if cascade else "off")
    padded = []
    if static_decode:
        execute = engine.runner.static.execute  # with overlap on or off

        def observed(step):
            hidden = execute(step)
            padded.append(hidden.shape[0] > len(step.order))
            return hidden

        engine.runner.static.execute = observed
    for i, (prompt, max_tokens) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = {"prompt": out.prompt_token_ids, "tokens": out.token_ids}
    engine.block_manager.check_invariants([])
    return {"outputs": outputs, "calls": dict(calls), "steps": engine.steps, "layers": engine.model.arch.num_layers,
            "prefix_hit_tokens": engine.block_manager.stats.hit_tokens, "padded_steps": sum(padded)}


# (static_decode, cascade) of each mode: all three run in one interpreter child (one start-up: importing torch,
# transformers and triton costs ~7 CPU-s a process) over one tiny model, against one HF reference
MODES = {"eager": (False, False), "static-decode": (True, False), "cascade-forced": (False, True)}


def test_engine_with_triton_kernels_equals_hf(tmp_path):
    from testbed.tiny_models import make_tiny_model
    from tests.support.hf_reference import hf_greedy, load_hf

    directory = make_tiny_model(str(tmp_path / "llama"), "llama")  # 4 q / 2 kv heads, head_dim 32
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "tests.engine.test_engine_triton", directory, *MODES],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"engine child failed:\n{(proc.stdout + proc.stderr)[-6000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(results) == list(MODES), list(results)
    hf = load_hf(directory)
    expected: dict[tuple[int, ...], list[int]] = {}  # the same prompts in every mode: HF runs once for each
    for mode, (static_decode, cascade) in MODES.items():
        result = results[mode]
        calls, per_step = result["calls"], result["steps"] * result["layers"]
        assert (result["padded_steps"] > 0) == static_decode, (mode, result["padded_steps"])
        # every layer of every step: one fused RoPE + KV write, one SiLU·mul, two residual-add norms (the first
        # layer's input norm is a plain one, the final norm an add); attention once or twice (prefill + decode)
        assert calls["rotary_write_kv"] == calls["silu_and_mul"] == per_step, (mode, calls)
        assert calls["rms_norm"] == result["steps"] and calls["add_rms_norm"] == 2 * per_step, (mode, calls)
        assert (calls["decode"] > 0 or cascade) and calls["prefill"] > 0, (mode, calls)
        assert (calls["cascade"] > 0) == cascade, (mode, calls)  # forced on: every row with a full block, Triton
        assert calls["decode"] + calls["cascade"] + calls["prefill"] >= per_step, (mode, calls)
        assert result["prefix_hit_tokens"] >= 16, f"{mode}: the last prompt did not reuse the second one's block"
        for i, max_tokens in enumerate(MAX_TOKENS):
            out = result["outputs"][str(i)]
            key = (*out["prompt"], max_tokens)
            if key not in expected:
                expected[key] = hf_greedy(hf, out["prompt"], max_tokens, ignore_eos=True)
            assert out["tokens"] == expected[key], \
                f"{mode}, prompt {PROMPTS[i]!r}: Triton engine {out['tokens']} != HF {expected[key]}"


def test_head_dim_the_kernels_cannot_serve_fails_at_start(tmp_path):
    """head_dim 12 (below the 16 a tensor-core dot needs): Engine.__init__ refuses it on the Triton path,
    naming model and limit."""
    from testbed.tiny_models import make_tiny_model

    directory = make_tiny_model(str(tmp_path / "odd"), "llama", hidden_size=48, head_dim=12)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = f"from worker import Engine; Engine({directory!r}, device='cpu', dtype='float32')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"model {directory!r} has head_dim 12" in proc.stderr and "from 16 to 256" in proc.stderr, \
        proc.stderr[-3000:]


def run_modes(directory: str, modes: list[str]) -> dict:
    """Child side: each mode's engine in turn, in this one process (the kernel call counts are per engine)."""
    calls = instrument()
    return {mode: run_engine_with_triton(directory, calls, *MODES[mode]) for mode in modes}


if __name__ == "__main__":
    print(json.dumps(run_modes(sys.argv[1], sys.argv[2:])))
