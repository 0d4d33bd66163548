"""Warm-up covers serving (issue #21 item 3): every Triton kernel specialization a served mixed workload
launches is one the start-up warm-up already produced, so no request waits for a compile on the GPU.

Triton compiles one variant per specialization: the constexprs and launch options, and per other argument
its type plus whether an int is 1 or a multiple of 16 and whether a pointer is 16-byte aligned (strides are
ints). The child process runs the engine on the CPU with the kernels under TRITON_INTERPRET=1, records that
key (Triton's own native_specialize_impl) at every launch, first during warmup.warm_up (with the padded
decode shapes the CUDA graphs would capture), then during a workload: a prefill of several sequences (one
chunked), decodes joining and leaving, a prefix-cache hit, n = 2 and a guided (choice) request. Block tables
are kept the GPU's way (device_updates: row views of the [rows, max_blocks_per_seq] table).
Run directly, this file is the child: `python tests/engine/test_warmup_coverage.py MODEL_DIR` prints JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def record_launches(log: list) -> None:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recorded(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        bound = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
        annotations = self.fn.__annotations__
        key = []
        for name in names:
            if name not in bound:
                continue
            value = bound[name]
            if "constexpr" in str(annotations.get(name, "")):
                key.append(f"{name}={value!r}")
            else:
                key.append(f"{name}:{native_specialize_impl(BaseBackend, value, False, True, True)}")
        options = sorted(f"{k}={v!r}" for k, v in kwargs.items() if k not in names)
        log.append(f"{self.__name__}({', '.join(key + options)})")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recorded


def child(directory: str) -> dict:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    launches: list[str] = []
    record_launches(launches)
    from worker import Engine, SamplingParams
    from worker.engine import warmup

    engine = Engine(directory, device="cpu", dtype="float32", block_size=16, max_num_seqs=4,
                    max_num_batched_tokens=32, kv_cache_gb=0.01, static_decode=True)
    assert engine.backend.name == "triton-interpreter"
    runner = engine.runner
    runner.inputs.device_updates = True  # the GPU's block tables: row views, row stride max_blocks_per_seq
    warmup.warm_up(engine.model, runner.kv_caches, runner.pad_block, 16, runner.max_blocks_per_seq,
                   engine.max_num_seqs, engine.config.max_num_batched_tokens, runner.static.shapes())
    warm = set(launches)
    launches.clear()

    greedy = dict(temperature=0.0, ignore_eos=True)
    shared = list(range(100, 134))  # 34 tokens: two full blocks for the prefix cache
    engine.add_request("a", list(range(200, 205)), SamplingParams(max_tokens=3, **greedy))
    engine.add_request("b", list(range(300, 308)), SamplingParams(max_tokens=3, **greedy))
    engine.add_request("c", shared, SamplingParams(max_tokens=4, **greedy))  # 5 + 8 + 34 > 32: chunked
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 4:  # joins a running decode batch: mixed steps; its first 32 tokens are cached
            engine.add_request("d", [*shared[:33], 7, 8], SamplingParams(max_tokens=3, n=2, **greedy))
        if steps == 5:
            engine.add_request("e", list(range(400, 406)), SamplingParams(max_tokens=3, choice=["yes", "no"],
                                                                          temperature=0.0))
        for out in engine.step():
            finished[out.request_id] = out
    stats = engine.stats()
    served = set(launches)
    return dict(warm=sorted(warm), served=sorted(served), missing=sorted(served - warm), steps=steps,
                hit_tokens=stats.prefix_hit_tokens, choices_d=len(finished["d"].choices),
                text_e=finished["e"].text, finished=sorted(finished))


@pytest.mark.slow
def test_every_served_kernel_variant_was_warmed_up(tmp_path):
    from testbed.tiny_models import make_tiny_model

    # max_position 256: 16 blocks a row, two width buckets (the warm-up runs each)
    directory = make_tiny_model(str(tmp_path / "tiny"), "llama", max_position_embeddings=256)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, directory], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["finished"] == ["a", "b", "c", "d", "e"]
    assert report["hit_tokens"] >= 32, "no prefix-cache hit: the workload lost a case"
    assert report["choices_d"] == 2 and report["text_e"] in ("yes", "no")
    kernels = {s.split("(")[0] for s in report["served"]}
    assert {"_prefill_kernel", "_decode_partition_kernel", "_rotary_kernel", "_rms_norm_kernel",
            "_silu_and_mul_kernel"} <= kernels, kernels
    assert not report["missing"], "served but never warmed up:\n" + "\n".join(report["missing"])


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1])))
