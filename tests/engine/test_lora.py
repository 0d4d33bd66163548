"""LoRA adapters in the engine, token for token equal to PEFT (greedy, fp32) on the CPU serving path.

One staggered batch mixes base rows with three adapters (ranks 8, 16 and 64; plain and rsLoRA scaling; a
partial target set) on a tiny Llama and a Qwen3, with chunked prefill (a 16-token step budget), preemption (10
KV blocks), two device slots for three adapters (evicted and reloaded mid-run), a base prefix-cache hit, and
one prompt under two adapters in the same steps, the second arriving once the first's blocks are cached:
every step checks that no KV block is held under two adapters (or an adapter and the base model). The other
families (Gemma 2, Phi-3's fused qkv / gate_up, Mixtral's attention) run a short mixed batch; refusals name
the adapter and the field, and the engine serves on.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.engine.lora_cases import ATTENTION, PeftReference, tiny_base, write_adapter, write_adapters
from tests.engine.staggered_batch import ENGINE_KWARGS, PROMPTS
from worker import Engine, SamplingParams
from worker.engine.lora.adapter import LoraError

SAME = torch.randint(3, 1000, (18,), generator=torch.Generator().manual_seed(5)).tolist()
# (prompt, max_tokens, the step before which it arrives, adapter)
WORKLOAD = [
    (PROMPTS[0], 10, 0, None),
    (SAME, 6, 0, "r8"),
    (PROMPTS[1], 8, 1, "r8"),
    (SAME, 6, 3, "r16"),  # r8's two full blocks of SAME are cached by now: it must not take them
    (PROMPTS[2], 6, 3, "r16"),
    (PROMPTS[3], 9, 4, "r64"),  # a third adapter for two slots: r8's goes
    (PROMPTS[4], 5, 5, None),  # starts with prompt 0's two blocks: a base-model prefix hit
    (PROMPTS[2], 4, 6, "r8"),  # r8 again: reloaded; PROMPTS[2]'s blocks under r16 are not its own
]
LORA_KWARGS = dict(ENGINE_KWARGS, max_loras=2, max_lora_rank=64, num_kv_blocks=10)  # 10: the SAME pair overlaps


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """model type -> (base directory, adapter directories, PEFT reference), built on first use."""
    root = str(tmp_path_factory.mktemp("lora"))
    built = {}

    def get(model_type: str, specs=None, key: str = "", **overrides):
        key = model_type + key
        if key not in built:
            base = tiny_base(os.path.join(root, key), model_type, **overrides)
            adapters = write_adapters(base, os.path.join(root, key + "-adapters"), *([specs] if specs else []))
            built[key] = (base, adapters, PeftReference(base, adapters))
        return built[key]

    return get


def shared_across_adapters(engine: Engine) -> list[int]:
    """KV blocks that running sequences of different adapters (or an adapter and the base) hold at once."""
    owners: dict[int, set] = {}
    for seq in engine.scheduler.running:
        for block in seq.block_table:
            owners.setdefault(block, set()).add(seq.lora)
    return [b for b, who in owners.items() if len(who) > 1]


def run(engine: Engine, workload) -> dict:
    outputs: dict[int, list[int]] = {}
    together = False  # did the two SAME rows of different adapters run in one step
    step = 0
    while len(outputs) < len(workload):
        for i, (prompt, max_tokens, at, lora) in enumerate(workload):
            if at == step:
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                engine.add_request(str(i), prompt, params, lora=lora)
        for out in engine.step():
            outputs[int(out.request_id)] = out.token_ids
        shared = shared_across_adapters(engine)
        assert not shared, f"step {step}: KV blocks {shared} are held under two adapters"
        running = {(s.lora, tuple(s.prompt_token_ids)) for s in engine.scheduler.running}
        together |= {("r8", tuple(SAME)), ("r16", tuple(SAME))} <= running
        step += 1
    engine.block_manager.check_invariants([])
    return {"tokens": outputs, "stats": engine.stats(), "together": together}


def expected(reference: PeftReference, workload) -> dict[int, list[int]]:
    return {i: reference.greedy(lora, prompt, m) for i, (prompt, m, _, lora) in enumerate(workload)}


@pytest.mark.parametrize("model_type,static", [("llama", False), ("qwen3", False), ("llama", True)],
                         ids=["llama", "qwen3", "llama-static-decode"])
def test_staggered_mixed_batch_equals_peft(models, model_type, static):
    base, adapters, reference = models(model_type)
    engine = Engine(base, **LORA_KWARGS, static_decode=static)  # static: the graphs' padded decode, eagerly
    for name, path in adapters.items():
        engine.add_lora(name, path)
    result = run(engine, WORKLOAD)
    want = expected(reference, WORKLOAD)
    for i, got in sorted(result["tokens"].items()):
        assert got == want[i], f"{model_type} request {i} ({WORKLOAD[i][3]}): {got} != PEFT {want[i]}"
    base_rows = {tuple(reference.greedy(None, p, m)) for p, m, _, _ in WORKLOAD}
    assert all(tuple(want[i]) not in base_rows for i, w in enumerate(WORKLOAD) if w[3]), "an adapter changed nothing"
    stats = result["stats"]
    assert result["together"], "the two adapters' rows of one prompt never ran in one step"
    assert stats.preemptions > 0 and stats.prefix_hit_tokens >= 16
    assert stats.lora_loads > 3, f"3 adapters in 2 slots were never evicted and reloaded: {stats.lora_loads} loads"
    assert stats.loras_registered == 3 and stats.loras_resident == 2


def test_fused_decode_step_takes_adapter_rows(models, monkeypatch):
    """On the CPU a decode step with adapter rows runs as the one C++ call (decode_layers_cpu given the rows),
    never layer by layer, and the tokens still equal PEFT's."""
    from worker.engine.backends.reference import ReferenceBackend

    base, adapters, reference = models("llama")
    engine = Engine(base, device="cpu", dtype="float32", max_loras=3, max_lora_rank=64, block_size=8)
    for name, path in adapters.items():
        engine.add_lora(name, path)
    fused = engine.backend.fused
    assert fused is not None, "the tiny Llama should take the fused decode step"
    real, adapter_rows = fused.ext, []

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def decode_layers_cpu(self, *args):
            lora = args[-1]
            adapter_rows.append(lora[0].numel() if lora else 0)
            return real.decode_layers_cpu(*args)

    fused.ext = Spy()
    per_layer_decode = []
    layers = ReferenceBackend.run_layers
    monkeypatch.setattr(ReferenceBackend, "run_layers", lambda self, model, x, rotary, kv, meta: (
        per_layer_decode.append(meta.num_prefill_tokens == 0), layers(self, model, x, rotary, kv, meta))[1])
    workload = [(PROMPTS[0], 7, None), (PROMPTS[1], 7, "r8"), (PROMPTS[2], 7, "r16"), (SAME, 7, "r64"),
                (PROMPTS[3], 7, "r16")]
    outs = engine.generate([p for p, _, _ in workload],
                           [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m, _ in workload],
                           loras=[lora for _, _, lora in workload])
    for (prompt, m, lora), out in zip(workload, outs, strict=True):
        assert out.token_ids == reference.greedy(lora, prompt, m), f"request under {lora}"
    assert not any(per_layer_decode), "a pure decode step ran layer by layer"
    assert set(adapter_rows) == {4}, f"adapter rows per fused decode step: {adapter_rows}"


def test_salts_are_what_keeps_adapters_apart(models, monkeypatch):
    """Without the per-adapter salt the later SAME row takes the earlier one's cached blocks, which the
    per-step check above catches: the check can fail."""
    from worker.engine.lora.manager import LoraManager

    base, adapters, _ = models("llama")
    added = LoraManager.request_added
    monkeypatch.setattr(LoraManager, "request_added", lambda self, name: (added(self, name), None)[1])
    engine = Engine(base, **LORA_KWARGS)
    for name, path in adapters.items():
        engine.add_lora(name, path)
    with pytest.raises(AssertionError, match="held under two adapters"):
        run(engine, WORKLOAD)


def test_n_choices_and_structured_output_under_adapters(models):
    from testbed.tiny_models import SMOLLM2_VOCAB

    base, adapters, reference = models("llama", key="-full-vocab", vocab_size=SMOLLM2_VOCAB)  # grammars need it
    engine = Engine(base, device="cpu", dtype="float32", max_loras=2, max_lora_rank=64, block_size=8)
    for name, path in adapters.items():
        engine.add_lora(name, path)
    prompt = PROMPTS[0]
    outs = engine.generate(
        [prompt, prompt, "Say yes or no:"],
        [SamplingParams(n=2, max_tokens=7, temperature=0.0, ignore_eos=True),
         SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
         SamplingParams(choice=["yes please", "no thanks"], max_tokens=8)],
        loras=["r16", None, "r64"])
    want = reference.greedy("r16", prompt, 7)
    assert [c.token_ids for c in outs[0].choices] == [want, want]
    assert outs[1].token_ids == reference.greedy(None, prompt, 7)
    assert outs[2].text in ("yes please", "no thanks")


@pytest.mark.parametrize("model_type,overrides,targets", [
    ("gemma2", {}, None),
    ("phi3", dict(hidden_size=192, head_dim=96), ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), list(ATTENTION)),
])
def test_other_families_equal_peft(models, model_type, overrides, targets):
    specs = {"r8": dict(r=8, lora_alpha=16, target_modules=targets or ["q_proj", "v_proj", "gate_proj", "down_proj"]),
             "r16": dict(r=16, lora_alpha=8, use_rslora=True,
                         target_modules=targets or [*ATTENTION, "gate_proj", "up_proj", "down_proj"])}
    base, adapters, reference = models(model_type, specs, **overrides)
    engine = Engine(base, device="cpu", dtype="float32", max_loras=2, max_lora_rank=16, block_size=8,
                    max_num_batched_tokens=16, max_num_seqs=4)
    for name, path in adapters.items():
        engine.add_lora(name, path)
    workload = [(PROMPTS[0], 6, None), (PROMPTS[1], 6, "r8"), (PROMPTS[2], 6, "r16"), (PROMPTS[1], 5, "r16")]
    outs = engine.generate([p for p, _, _ in workload],
                           [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m, _ in workload],
                           loras=[lora for _, _, lora in workload])
    for (prompt, m, lora), out in zip(workload, outs, strict=True):
        assert out.token_ids == reference.greedy(lora, prompt, m), f"{model_type} under {lora}"


def test_refusals_name_the_adapter_and_field(models, tmp_path):
    base, adapters, _ = models("llama")
    engine = Engine(base, device="cpu", dtype="float32", max_loras=1, max_lora_rank=16, block_size=8)
    other = tiny_base(str(tmp_path), "llama", intermediate_size=96)
    corrupted = shutil.copytree(adapters["r8"], tmp_path / "corrupted")
    weights = corrupted / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cases = {
        "dora": (write_adapter(base, str(tmp_path / "dora"), 3, r=4, target_modules=["q_proj"], use_dora=True),
                 "use_dora"),
        "saved": (write_adapter(base, str(tmp_path / "saved"), 3, r=4, target_modules=["q_proj"],
                                modules_to_save=["lm_head"]), "modules_to_save"),
        "other-base": (write_adapter(other, str(tmp_path / "other"), 3, r=4, target_modules=["down_proj"]),
                       "base_model_name_or_path"),
        "too-big": (adapters["r64"], "r"),
        "corrupted": (str(corrupted), "adapter_model.safetensors"),
        "empty-dir": (str(tmp_path), "adapter_config.json"),
    }
    for name, (path, field) in cases.items():
        with pytest.raises(LoraError, match=rf"adapter '{name}' .*{field}") as err:
            engine.add_lora(name, path)
        assert err.value.field == field
    engine.add_lora("r8", adapters["r8"])  # the engine serves on, with what did load
    out = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=4, temperature=0.0), loras=["r8"])
    assert len(out[0].token_ids) == 4
    assert engine.lora_names() == ["r8"]
    with pytest.raises(ValueError, match="no LoRA adapter named 'dora'"):
        engine.add_request("x", PROMPTS[1], lora="dora")


def test_remove_and_readd(models):
    """An adapter in use cannot be removed; removed, its requests are refused; added again under the same
    name it gets a new prefix-cache salt (its old blocks are never served)."""
    base, adapters, reference = models("llama")
    engine = Engine(base, device="cpu", dtype="float32", max_loras=1, max_lora_rank=64, block_size=8)
    engine.add_lora("a", adapters["r8"])
    engine.add_request("1", SAME, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), lora="a")
    with pytest.raises(ValueError, match="in use"):
        engine.remove_lora("a")
    while engine.has_unfinished_requests():
        engine.step()
    engine.remove_lora("a")
    engine.add_lora("a", adapters["r64"])  # another adapter under the old name
    out = engine.generate([SAME], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), loras=["a"])
    assert out[0].num_cached_tokens == 0
    assert out[0].token_ids == reference.greedy("r64", SAME, 5)
