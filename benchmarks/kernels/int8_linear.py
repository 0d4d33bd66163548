"""CPU cost of one decode-sized linear in the three panel kernels (issue 24): fp32 panels
(tokenbus_kernels/csrc/cpu_kernels.cpp), weight-only int8 (cpu_quant.cpp) and W8A8 on VNNI (cpu_w8a8.cpp, the
activation quantization included), SmolLM2-135M's shapes, at a decode step's row counts.

Timed in CPU time (time.process_time) on one thread, so that other processes on a shared machine inflate it
less than wall time; the kernels are interleaved within each round (rotating order) and the median of the
rounds is reported. Writes the table to docs/quantization.md (section w8a8-kernel) unless --no-write.

    .venv/bin/python -m benchmarks.kernels.int8_linear            # ~1-2 min
    .venv/bin/python -m benchmarks.kernels.int8_linear --rounds 3 --no-write   # smoke
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from bench.harness import cpu_name, parser
from benchmarks.harness.docs import publish
from tokenbus_kernels import cpu
from worker.engine.backends.cpu_linear import pack_panels, pack_panels_w8a8
from worker.engine.quant.schemes import quantize_int8

SHAPES = {"qkv/up 576→1536": (576, 1536), "down 1536→576": (1536, 576), "lm_head 576→49152": (576, 49152)}
ROWS = (1, 4, 16, 32, 64)
KINDS = ("fp32", "int8", "w8a8")


def kernels(ext, in_features: int, out_features: int):
    """kind -> f(x): the three kernels on the same random weight."""
    weight = torch.randn(out_features, in_features) * 0.05
    q = quantize_int8(weight)
    fp32 = pack_panels(weight)
    int8, scales = pack_panels(q.qweight), torch.ones(fp32.shape[0] * 16)
    scales[:out_features] = q.scale
    w8a8, w8a8_scales = pack_panels_w8a8(q.qweight, q.scale)
    return {
        "fp32": lambda x: ext.panel_linear_cpu(x, fp32, out_features, None),
        "int8": lambda x: ext.panel_linear_int8_cpu(x, int8, scales, out_features, None),
        "w8a8": lambda x: ext.panel_linear_w8a8_cpu(x, w8a8, w8a8_scales, out_features, None),
    }


def cpu_us(f, x, calls: int) -> float:
    started = time.process_time()
    for _ in range(calls):
        f(x)
    return (time.process_time() - started) / calls * 1e6


def main() -> None:
    args = parser(__doc__, docs=True, rounds=9, min_cpu_ms=20.0).parse_args()  # min-cpu-ms: per kernel per round
    torch.set_num_threads(1)
    ext = cpu.extension()
    assert ext is not None, "the C++ CPU kernels did not build"
    load_before = os.getloadavg()[0]
    rows_out = []
    for name, (k, n) in SHAPES.items():
        fns = kernels(ext, k, n)
        for rows in ROWS:
            x = torch.randn(rows, k)
            once = cpu_us(fns["fp32"], x, 3)  # warm-up, and how many calls fill min_cpu_ms
            calls = max(3, int(args.min_cpu_ms * 1e3 / max(once, 1.0)))
            times: dict[str, list[float]] = {kind: [] for kind in KINDS}
            for r in range(args.rounds):
                for kind in KINDS[r % 3:] + KINDS[: r % 3]:
                    times[kind].append(cpu_us(fns[kind], x, calls))
            med = {kind: statistics.median(v) for kind, v in times.items()}
            rows_out.append(f"| {name} | {rows} | {med['fp32']:.0f} | {med['int8']:.0f} | {med['w8a8']:.0f} | "
                            f"×{med['fp32'] / med['int8']:.2f} | ×{med['fp32'] / med['w8a8']:.2f} |")
            print(rows_out[-1], flush=True)
    load_after = os.getloadavg()[0]
    body = "\n".join([
        f"One linear, µs of CPU time per call (median of {args.rounds} interleaved rounds), 1 thread, "
        f"{cpu_name()}; 1-min load average {load_before:.1f} before, {load_after:.1f} after; run "
        f"{time.strftime('%Y-%m-%d %H:%M')} with `python -m benchmarks.kernels.int8_linear`. W8A8 includes "
        "quantizing x per row; × is fp32's time over the kernel's.",
        "",
        "| linear | rows | fp32 µs | int8 (weight-only) µs | W8A8 µs | int8 × | W8A8 × |",
        "|---|---|---|---|---|---|---|",
        *rows_out,
    ])
    publish(body, "quantization.md", "w8a8-kernel", not args.no_write)


if __name__ == "__main__":
    main()
