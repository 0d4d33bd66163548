"""Two (or more) builds of the C++ CPU kernels in one process, their paged decode attention timed in turns on
bench_kv_dtype --kernel-only's inputs (16 sequences × 560 tokens, SmolLM2's heads, fp32/bf16/int8 KV): an A/B
of a kernel change that a loaded machine cannot blur as much as separate wall-clock runs do.

Why CPU time on one thread: at 2 threads on a shared machine the wall clock of a ~0.5 ms call read 4-390 ms
(at::parallel_for waits for a descheduled thread); one thread's CPU time (time.process_time) counts only the
call's own work. Cache contention from other processes still inflates it, equally for every build, since the
builds alternate every 20 calls.

    # build each tree's kernels first (TOKENBUS_CACHE_DIR per tree), then, from any tree:
    .venv/bin/python -m benchmarks.kernels.kv_kernel_ab main=/tmp/a/cpu_kernels/X/X.so branch=/tmp/b/cpu_kernels/Y/Y.so
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from types import ModuleType

import torch

from bench.harness import cpu_name
from benchmarks.quant.kv_dtype import kernel_inputs


def load_build(path: str) -> ModuleType:
    """A built extension (.so) by path; each build has its own module name (kernels/cpu.py hashes the source)."""
    spec = importlib.util.spec_from_file_location(os.path.basename(path).split(".")[0], path)
    assert spec is not None and spec.loader is not None, f"not a loadable extension: {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("builds", nargs="+", help="NAME=PATH of a built tokenbus_cpu_*.so; the first is the base")
    parser.add_argument("--rounds", type=int, default=20, help="turns of 20 calls per build, dtype and layout")
    args = parser.parse_args()
    torch.set_num_threads(1)
    builds = {name: load_build(path) for name, path in (b.split("=", 1) for b in args.builds)}
    base = next(iter(builds))
    print(f"CPU ms per call (median of {args.rounds} turns of 20 calls; min in brackets), 1 thread, {cpu_name()}, "
          f"1-min load average {os.getloadavg()[0]:.1f} at the start; run {time.strftime('%Y-%m-%d %H:%M')}\n")
    print("| context | KV dtype | " + " | ".join(builds) + " | " +
          " | ".join(f"{base} / {name}" for name in list(builds)[1:]) + " | max |Δout| |")
    print("|---" * (3 + 2 * len(builds) - 1) + "|")
    for layout, q, caches, table, lens in kernel_inputs():
        for dtype, (kc, vc) in caches.items():
            outs = [m.paged_decode_attention_cpu(q, kc, vc, table, lens, 0.125, 0, 0.0) for m in builds.values()]
            diff = max(float((out - outs[0]).abs().max()) for out in outs)
            times: dict[str, list[float]] = {name: [] for name in builds}
            for _ in range(args.rounds):
                for name, module in builds.items():
                    start = time.process_time()
                    for _ in range(20):
                        module.paged_decode_attention_cpu(q, kc, vc, table, lens, 0.125, 0, 0.0)
                    times[name].append((time.process_time() - start) / 20 * 1e3)
            med = {name: statistics.median(ts) for name, ts in times.items()}
            cells = [f"{med[name]:.3f} ({min(times[name]):.3f})" for name in builds]
            ratios = [f"×{med[base] / med[name]:.2f}" for name in list(builds)[1:]]
            print(f"| {layout} | {dtype} | " + " | ".join(cells + ratios) + f" | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
