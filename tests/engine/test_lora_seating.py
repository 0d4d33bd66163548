"""How the scheduler seats adapters' sequences in too few slots (worker/engine/lora/manager.py, scheduler.py).

Rows are grouped by resident adapter: a waiting sequence whose adapter is in a slot joins it, even behind one
that waits for a slot, so each adapter is loaded once however its requests interleave (the tokens still equal
PEFT's). Fairness: while requests for the resident adapters keep arriving, an adapter waiting for a slot gets
one within a bounded number of steps, because one slot drains for it; without the drain it never would (the
check can fail).
"""

from __future__ import annotations

import os

import pytest

from tests.engine.lora_cases import PeftReference, tiny_base, write_adapters
from tests.engine.staggered_batch import PROMPTS
from worker import Engine, SamplingParams


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(base directory, adapter directories r8 / r16 / r64)."""
    root = str(tmp_path_factory.mktemp("lora-seating"))
    base = tiny_base(os.path.join(root, "llama"), "llama")
    return base, write_adapters(base, os.path.join(root, "adapters"))


def engine_for(llama, max_loras: int) -> Engine:
    base, adapters = llama
    engine = Engine(base, device="cpu", dtype="float32", max_loras=max_loras, max_lora_rank=64, block_size=8,
                    max_num_seqs=32)
    for name, path in adapters.items():
        engine.add_lora(name, path)
    return engine


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_resident_adapters_join_their_slots(llama):
    """Three adapters, two slots, requests interleaved: r8's and r16's later requests join the first ones'
    slots instead of waiting behind r64's, so each adapter is loaded once."""
    engine = engine_for(llama, max_loras=2)
    loras = ["r8", "r16", "r64", "r8", "r16", "r64", "r8", "r16"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    outs = engine.generate(prompts, greedy(5), loras=loras)
    assert engine.stats().lora_loads == 3, "an adapter was loaded more than once"
    reference = PeftReference(*llama)
    for prompt, lora, out in zip(prompts, loras, outs, strict=True):
        assert out.token_ids == reference.greedy(lora, prompt, 5), f"request under {lora}"


def seated_at(engine: Engine, steps: int) -> int | None:
    """Two requests for the resident adapters arrive every step; the step at which r64's request, which arrives
    at step 1 with both slots pinned, first has a slot (None: not within `steps`)."""
    engine.add_request("r8-long", PROMPTS[0], greedy(10), lora="r8")
    engine.add_request("r16-long", PROMPTS[1], greedy(30), lora="r16")
    for step in range(steps):
        if step == 1:
            engine.add_request("late", PROMPTS[2], greedy(3), lora="r64")
        if step >= 1:
            engine.add_request(f"r8-{step}", PROMPTS[3], greedy(4), lora="r8")
            engine.add_request(f"r16-{step}", PROMPTS[4], greedy(4), lora="r16")
        engine.step()
        if any(s.request_id == "late" and s.lora_slot >= 0 for s in engine.scheduler.running):
            return step
    return None


def test_a_waiting_adapter_gets_a_slot_within_bounded_steps(llama):
    """r8's slot drains for r64 (its users have the fewest tokens left): r8's requests that arrive after that
    wait, r16's still join theirs, and r64 is seated once r8-long's 10 tokens and r8-1's 4 are done."""
    engine = engine_for(llama, max_loras=2)
    step = seated_at(engine, steps=40)
    assert step is not None and step <= 14, f"the waiting adapter was seated at step {step}"
    assert sum(s.lora == "r16" for s in engine.scheduler.running) > 1, "r16's requests did not join its slot"


def test_without_the_drain_the_waiting_adapter_starves(llama, monkeypatch):
    """The check above can fail: with no slot draining, the resident adapters' steady requests keep both slots
    pinned and r64's request never gets one."""
    from worker.engine.lora.manager import LoraManager

    monkeypatch.setattr(LoraManager, "wait_for_slot", lambda self, running, waiting: None)
    engine = engine_for(llama, max_loras=2)
    assert seated_at(engine, steps=40) is None
