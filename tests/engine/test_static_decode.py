"""The fixed-shape padded decode path (what CUDA graphs replay) run eagerly on the CPU: token for token equal
to Hugging Face `generate` (greedy, fp32) while decode batches of changing sizes are padded to buckets, and
padding rows never change a real row's output or cache."""

from __future__ import annotations

import pytest
import torch

from testbed.tiny_models import make_tiny_model
from tests.support.hf_reference import hf_greedy, load_hf
from worker import Engine, SamplingParams
from worker.engine.cuda_graphs import decode_buckets
from worker.engine.loader import resolve
from worker.engine.scheduler import ScheduledBatch

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,", "List three colours:",
    "1, 2, 3, 4,", "Translate to French: good morning", "The quick brown fox", "Q: What is 12 times 12?\nA:",
    "import numpy as np\n", "Dear Sir or Madam,", "In 1969, the first",
]
MAX_TOKENS = [9, 14, 6, 11, 16, 5, 12, 8, 13, 7, 10]


def record_buckets(engine: Engine) -> list[tuple[int, int]]:
    """(real rows, bucket) of every padded step the engine runs from now on."""
    static = engine.runner.static
    seen: list[tuple[int, int]] = []
    execute = static.execute  # both paths (overlap on and off) run a padded step through it

    def observed(step):
        hidden = execute(step)
        seen.append((len(step.order), hidden.shape[0]))
        return hidden

    static.execute = observed
    return seen


def run_staggered(engine: Engine, prompts, max_tokens, arrive_every: int) -> dict[str, list[int]]:
    pending = [(f"r{i}", p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]
    outputs: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % arrive_every == 0:
            rid, prompt, m = pending.pop(0)
            engine.add_request(rid, prompt, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
        step += 1
    assert engine.block_manager.num_free == engine.block_manager.num_blocks, "KV blocks leaked"
    return outputs


def assert_padded_sizes(seen: list[tuple[int, int]]) -> None:
    sizes = {n for n, _ in seen}
    assert any(b > n for n, b in seen), f"no decode step was padded: {seen}"
    assert {5, 11} & sizes and len(sizes) >= 4, f"decode batches did not change size enough: {sorted(sizes)}"


def test_buckets():
    assert decode_buckets(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    assert decode_buckets(11) == [1, 2, 4, 8, 11]
    assert decode_buckets(1) == [1]


def test_smollm2_padded_decode_equals_hf():
    engine = Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=16, max_num_batched_tokens=128,
                    static_decode=True)
    assert engine.runner.static is not None and engine.runner.static.buckets == [1, 2, 4, 8, 16]
    seen = record_buckets(engine)
    outputs = run_staggered(engine, PROMPTS, MAX_TOKENS, arrive_every=1)
    assert_padded_sizes(seen)
    hf = load_hf(resolve("smollm2-135m").directory)
    for i, (prompt, m) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        assert outputs[f"r{i}"] == hf_greedy(hf, engine.tokenize(prompt), m, ignore_eos=True), f"prompt {i} differs"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("static-llama")), "llama")


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpu-cpp", "torch-reference"])
def test_tiny_padded_decode_equals_hf(tiny_dir, cpu_kernels):
    engine = Engine(tiny_dir, device="cpu", dtype="float32", max_num_seqs=12, max_num_batched_tokens=32,
                    static_decode=True, cpu_kernels=cpu_kernels)
    seen = record_buckets(engine)
    max_tokens = [m + 6 for m in MAX_TOKENS]
    outputs = run_staggered(engine, PROMPTS, max_tokens, arrive_every=1)
    assert_padded_sizes(seen)
    hf = load_hf(tiny_dir)
    for i, (prompt, m) in enumerate(zip(PROMPTS, max_tokens, strict=True)):
        assert outputs[f"r{i}"] == hf_greedy(hf, engine.tokenize(prompt), m, ignore_eos=True), f"prompt {i} differs"


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpu-cpp", "torch-reference"])
def test_padding_rows_change_no_real_row(tiny_dir, cpu_kernels):
    """The same 3 decoding sequences stepped unpadded and padded to 8 rows: the same logits, and the padded
    step writes no cache slot but the real rows' own and the pad block's."""
    engine = Engine(tiny_dir, device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
                    static_decode=True, cpu_kernels=cpu_kernels)
    for i in range(3):
        engine.add_request(str(i), PROMPTS[i], SamplingParams(max_tokens=40, temperature=0.0))
    for _ in range(6):  # prefill, then a few decode steps
        engine.step()
    seqs = list(engine.scheduler.running)
    assert len(seqs) == 3 and all(s.num_pending_tokens == 1 for s in seqs)
    for s in seqs:
        engine.block_manager.allocate(s, 1)
    batch = ScheduledBatch(seqs, [1, 1, 1])
    runner = engine.runner

    def logits(pad_to):
        step = runner.inputs.prepare(batch, pad_to=pad_to)
        with torch.inference_mode():
            hidden = runner.model(step.input_ids, step.positions, runner.kv_caches, step.meta)
            return runner.model.compute_logits(hidden[:3]), step

    unpadded, _ = logits(None)
    exact, _ = logits(3)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    padded, step = logits(8)
    assert step.input_ids.shape[0] == 8 and step.meta.decode_block_tables.shape == (8, runner.max_blocks_per_seq)
    if cpu_kernels:  # the panel GEMV and C++ kernels compute each row alone: bit for bit
        assert torch.equal(padded, exact) and torch.equal(padded, unpadded)
    else:  # oneDNN/MKL block a GEMM by its row count: the same rows may round differently at 8 rows than at 3
        torch.testing.assert_close(padded, unpadded, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(padded, exact, rtol=1e-5, atol=1e-5)
    bs, pad = engine.config.block_size, runner.pad_block
    own = {s.block_table[s.num_computed_tokens // bs] * bs + s.num_computed_tokens % bs for s in seqs}
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches, strict=True):
        for old, new in ((k0, k1), (v0, v1)):
            changed = (old != new).flatten(2).any(-1).nonzero().tolist()  # [block, offset] pairs
            slots = {b * bs + o for b, o in changed if b != pad}
            assert slots <= own, f"the padded step wrote slots {sorted(slots - own)} of no real row"
    engine.abort("0"), engine.abort("1"), engine.abort("2")


def test_warm_up_writes_only_the_pad_block(tiny_dir):
    """The start-up warm-up (run on CUDA before the first job) runs every decode variant and padded bucket
    here too, on the CPU, and leaves every block but the pad block as it was."""
    from worker.engine import warmup

    engine = Engine(tiny_dir, device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
                    static_decode=True, cpu_kernels=False)
    engine.generate(PROMPTS[:2], SamplingParams(max_tokens=5, temperature=0.0))  # real K/V in some blocks
    runner = engine.runner
    for k, v in runner.kv_caches:
        k[-1].zero_(), v[-1].zero_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    warmup.warm_up(engine.model, runner.kv_caches, runner.pad_block, engine.config.block_size,
                   runner.max_blocks_per_seq, engine.max_num_seqs, engine.config.max_num_batched_tokens,
                   runner.static.shapes())
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches, strict=True):
        assert torch.equal(k0[:-1], k1[:-1]) and torch.equal(v0[:-1], v1[:-1])
        assert k1[-1].abs().sum() > 0, "the warm-up wrote nothing into the pad block"


def test_device_side_table_updates_equal_hf(tiny_dir):
    """The GPU's way of keeping the block table (new block ids scattered from the packed copy, whole rows
    gathered then narrowed) run on the CPU: staggered arrivals, finishes and reused rows, equal to HF."""
    engine = Engine(tiny_dir, device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
                    cpu_kernels=False, num_kv_blocks=7)  # too few: preemption frees and rewrites rows
    engine.runner.inputs.device_updates = True
    max_tokens = [m + 20 for m in MAX_TOKENS[:7]]
    outputs = run_staggered(engine, PROMPTS[:7], max_tokens, arrive_every=1)
    assert engine.scheduler.num_preemptions > 0
    hf = load_hf(tiny_dir)
    for i, (prompt, m) in enumerate(zip(PROMPTS[:7], max_tokens, strict=True)):
        assert outputs[f"r{i}"] == hf_greedy(hf, engine.tokenize(prompt), m, ignore_eos=True), f"prompt {i} differs"
