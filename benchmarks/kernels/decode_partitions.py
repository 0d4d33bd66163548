"""Split-KV decode: the share of stage-1 programs that exit at once, read from the launch plan on the CPU.

For a uniform decode batch (every sequence at `context` tokens) the padded decode step of a CUDA-graph engine
hands the kernel a block table either max_model_len wide (before issue #21) or cut to DecodeWidths' bucket of
the step's longest table (now). The plan is tokenbus_kernels/decode_attention.plan_decode as a GPU with 132
multiprocessors (an H200) would get it; nothing is launched. Also the number of (rows, width) graph shapes
the engine captures at max_num_seqs 256.

    python -m benchmarks.kernels.decode_partitions        # prints the table, writes docs/gpu/decode_partitions.md
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bench.harness import parser
from benchmarks.harness.docs import DOCS
from tokenbus_kernels.decode_attention import plan_decode
from tokenbus_kernels.partitions import cdiv
from worker.engine.cuda_graphs import DecodeWidths, decode_buckets

H200_SMS = 132
BLOCK = 16
SMOLLM2 = (9, 3, 64)  # q heads, kv heads, head_dim


def idle_share(batch: int, context: int, max_model_len: int, cut: bool, heads=SMOLLM2) -> tuple[float, int]:
    """(idle share of stage-1 programs, partitions) of one decode call at this shape."""
    hq, hk, d = heads
    max_blocks = cdiv(max_model_len, BLOCK)
    blocks = cdiv(context, BLOCK)
    width = DecodeWidths(max_blocks, BLOCK, hk, H200_SMS).pick(batch, blocks) if cut else max_blocks
    table = torch.zeros(batch + 1, max_blocks, dtype=torch.int32)  # StepInputs' table: rows of max_blocks
    q = torch.empty(batch, hq, d, dtype=torch.bfloat16)
    cache = torch.empty(4, BLOCK, hk, d, dtype=torch.bfloat16)
    lens = torch.full((batch,), context, dtype=torch.int32)
    launches = plan_decode(q, cache, cache, table[:batch, :width], lens, d**-0.5, torch.empty_like(q), on_gpu=True,
                           num_sms=H200_SMS)
    stage1 = launches[0]
    named = dict(zip(stage1.kernel.arg_names, stage1.args, strict=False))  # by name: the signature grows
    size, parts = named["partition_size"], named["num_partitions"]
    used = min(parts, cdiv(context, size))
    return (parts - used) / parts, parts


def graph_count(max_num_seqs: int, max_model_len: int, hk: int = SMOLLM2[1]) -> int:
    widths = DecodeWidths(cdiv(max_model_len, BLOCK), BLOCK, hk, H200_SMS)
    return sum(len(widths.for_bucket(b)) for b in decode_buckets(max_num_seqs))


def main() -> None:
    parser(__doc__, docs=True).parse_args()
    rows = []
    for max_len in (32768, 131072):
        for batch, context in ((256, 1024), (256, 1090), (64, 1024), (1, 1024), (256, 5000), (1, 20000)):
            before, p_before = idle_share(batch, context, max_len, cut=False)
            after, p_after = idle_share(batch, context, max_len, cut=True)
            rows.append((batch, context, max_len, before, p_before, after, p_after))
    lines = ["| batch | context | max_model_len | idle, full-width table | partitions | idle, cut table | "
             "partitions |", "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {b} | {c} | {m} | {x:.0%} | {px} | {y:.0%} | {py} |" for b, c, m, x, px, y, py in rows]
    graphs = [(m, graph_count(256, m)) for m in (2048, 32768, 131072)]
    note = ("CUDA graphs captured at max_num_seqs 256 (15 row buckets x width buckets): "
            + ", ".join(f"{n} at max_model_len {m}" for m, n in graphs) + " (before: 15).")
    print("\n".join(lines) + "\n\n" + note)
    out = Path(DOCS) / "gpu" / "decode_partitions.md"
    out.write_text(
        "# Split-KV decode: idle programs from the launch plan\n\n"
        f"`python -m benchmarks.kernels.decode_partitions`, {time.strftime('%Y-%m-%d')}: SmolLM2-135M heads "
        "(9 q, 3 kv, head_dim 64), bf16, block 16, a GPU of 132 SMs (H200), every sequence at `context` tokens. "
        "Computed from `plan_decode` on the CPU; never launched on a GPU.\n\n"
        + "\n".join(lines) + "\n\n" + note + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
