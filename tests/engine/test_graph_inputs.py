"""What a CUDA graph of the padded decode step takes as inputs (worker/engine/cuda_graphs.py), run on the CPU:
StaticDecode.capture's loop with eager stand-ins for the graphs (tests/support/eager_graphs.py), so every
padded decode step replays a "graph" that reads only the static buffers execute() filled.

    cascade (#39)   a second graph per shape over a static CascadeLayout padded to the planner's group
                    capacity: steps whose planner chose groups replay it, the others the plain one; tokens
                    equal HF generate (fp32, the PyTorch references in process)
    LoRA (#36)      the adapter rows as static buffers and the SGMV grid fixed at the bucket, with cascade
                    on too: the Triton kernels under TRITON_INTERPRET=1 in a child process (the references
                    read host group lists a graph cannot carry), tokens equal PEFT's
Run directly, this file is the LoRA child: `python -m tests.engine.test_graph_inputs BASE ADAPTERS_JSON`.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from testbed.tiny_models import make_tiny_model
from tests.engine.test_prefix_cache_smollm2 import run_staggered
from tests.support import eager_graphs
from tests.support.hf_reference import hf_greedy, load_hf
from tests.support.interpreted_child import run_interpreted
from tokenbus_kernels.cascade import CascadeLayout
from worker import Engine
from worker.engine.cascade import group_capacity

SHARED = [(i * 37) % 500 + 3 for i in range(85)]  # 5 full blocks of 16 and a part of one: a pair pays (> 64)


def captured_engine(directory: str, **kwargs) -> Engine:
    engine = Engine(directory, device="cpu", dtype="float32", static_decode=True, max_model_len=192, **kwargs)
    static = engine.runner.static
    eager_graphs.install(static)
    static.capture()
    return engine


def watch_layouts(engine: Engine) -> list[tuple[int, CascadeLayout | None]]:
    """(bucket, layout) of every padded step the engine executes from now on."""
    static, seen = engine.runner.static, []
    execute = static.execute

    def observed(step):
        seen.append((step.bucket, step.meta.cascade))
        return execute(step)

    static.execute = observed
    return seen


def test_group_capacity_bounds_what_each_mode_chooses():
    assert [group_capacity("auto", b) for b in (1, 2, 5, 8)] == [0, 1, 2, 4]
    assert [group_capacity("on", b) for b in (1, 5)] == [1, 5] and group_capacity("off", 8) == 0


def test_padded_layout_keeps_the_groups_and_pads_to_fixed_shapes():
    layout = CascadeLayout.build([([3, 1], 32), ([0], 16)], 6, capacity=4)
    assert layout.group_rows.tolist() == [3, 1, 0, 0, 0, 0] and layout.group_starts.tolist() == [0, 2, 3, 3, 3]
    assert layout.prefix_lens.tolist() == [32, 16, 0, 0] and layout.suffix_starts.tolist() == [16, 32, 0, 32, 0, 0]
    assert layout.max_prefix_len == 32 and layout.packed.shape == (2 * 6 + 2 * 4 + 1,)
    again = CascadeLayout.views(layout.packed, 6, 4, 999)
    assert again.group_starts.tolist() == layout.group_starts.tolist() and again.max_prefix_len == 999
    with pytest.raises(ValueError, match="do not fit"):
        CascadeLayout.build([([0], 16), ([1], 16)], 4, capacity=1)


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_cascade_graphs_replay_the_planner_layouts_and_equal_hf(tmp_path, mode):
    directory = make_tiny_model(str(tmp_path / "llama"), "llama")
    engine = captured_engine(directory, max_num_seqs=6, max_num_batched_tokens=128, cpu_kernels=False,
                             cascade_attention=mode)
    static = engine.runner.static
    assert static.graphs and set(static.cascade_graphs) == {k for k in static.graphs if group_capacity(mode, k[0])}
    seen = watch_layouts(engine)
    prompts = [SHARED + [11 + i] * (1 + i % 3) for i in range(5)] + [[9, 8, 7]]
    max_tokens = [12, 20, 7, 15, 18, 10]
    outputs = run_staggered(engine, prompts, max_tokens, every=1)
    layouts = [(b, lay) for b, lay in seen if lay is not None]
    assert layouts, "no padded step cascaded"
    for b, lay in layouts:  # each at its bucket's fixed shapes
        assert lay.group_rows.shape == (b,) and lay.num_groups == group_capacity(mode, b)
    assert any(int((lay.prefix_lens == 0).sum()) for _, lay in layouts), "no layout was padded with empty groups"
    assert static.replays["cascade"] == len(layouts) and static.replays["plain"] == len(seen) - len(layouts)
    if mode == "auto":  # "on" groups every row with a full block: each step here cascades
        assert static.replays["plain"] > 0, "every step cascaded: the plain graphs were never replayed"
    hf = load_hf(directory)
    for i, (ids, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        assert outputs[i] == hf_greedy(hf, ids, m), f"prompt {i} differs"


def test_cascade_off_captures_no_cascade_graph(tmp_path):
    directory = make_tiny_model(str(tmp_path / "llama"), "llama")
    engine = captured_engine(directory, max_num_seqs=4, max_num_batched_tokens=64, cpu_kernels=False,
                             cascade_attention="off")
    assert engine.runner.static.graphs and not engine.runner.static.cascade_graphs


# ---------------------------------------------------------------- LoRA and cascade on the Triton kernels (child)

ADAPTERS = {"r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
            "r16": dict(r=16, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj", "up_proj"])}
# (prompt, adapter): the three share SHARED's blocks (a cascade group), adapters mixed in one decode batch
WORKLOAD = [(SHARED[:40] + [21, 22], "r8"), (SHARED[:40] + [31], None), (SHARED[:40] + [41, 42, 43], "r16")]
MAX_TOKENS = 4


def run_child(base: str, adapters: dict[str, str]) -> dict:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from worker import SamplingParams
    from worker.engine.backends import reference

    def refuse(*args, **kwargs):
        raise AssertionError("the PyTorch LoRA reference ran although TRITON_INTERPRET=1")

    reference.ReferenceBackend.lora = refuse
    engine = Engine(base, device="cpu", dtype="float32", block_size=8, max_num_seqs=4, max_num_batched_tokens=64,
                    num_kv_blocks=24, max_loras=2, max_lora_rank=16, static_decode=True, max_model_len=64,
                    cascade_attention="on")
    static = engine.runner.static
    eager_graphs.install(static)
    for name, path in adapters.items():
        engine.add_lora(name, path)
    static.capture()
    outs = engine.generate([p for p, _ in WORKLOAD], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                    ignore_eos=True),
                           loras=[lora for _, lora in WORKLOAD])
    return {"tokens": [o.token_ids for o in outs], "backend": engine.backend.name, "replays": static.replays,
            "graphs": len(static.graphs), "cascade_graphs": len(static.cascade_graphs)}


def test_lora_rows_and_cascade_layouts_as_graph_inputs_equal_peft(tmp_path):
    from tests.engine.lora_cases import PeftReference, tiny_base, write_adapters

    base = tiny_base(str(tmp_path), "llama")
    adapters = write_adapters(base, str(tmp_path / "adapters"), ADAPTERS)
    result = run_interpreted("tests.engine.test_graph_inputs", base, json.dumps(adapters))
    assert result["backend"] == "triton-interpreter" and result["cascade_graphs"] == result["graphs"] > 0
    assert result["replays"]["cascade"] > 0, result
    reference = PeftReference(base, adapters)
    for (prompt, lora), got in zip(WORKLOAD, result["tokens"], strict=True):
        assert got == reference.greedy(lora, prompt, MAX_TOKENS), f"adapter {lora}: {got}"


if __name__ == "__main__":
    print(json.dumps(run_child(sys.argv[1], json.loads(sys.argv[2]))))
