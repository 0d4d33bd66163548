"""A decode step's input preparation: StepInputs (persistent block table, one packed copy) against rebuilding
every tensor from Python lists each step (what ModelRunner did before), side by side in one run.

Sequences hold `--blocks` KV blocks each and gain one token a step (a new block every block_size steps), as
in serving. Prints a table and writes it to docs/gpu.md (section "step-inputs").

    .venv/bin/python -m benchmarks.engine.step_inputs [--seqs 64 256] [--blocks 128 2048] [--device cpu]
"""

from __future__ import annotations

import time

import torch

from bench.harness import parser
from benchmarks.harness.docs import write_section
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import ScheduledBatch
from worker.engine.sequence import Sequence, SequenceStatus
from worker.engine.step_inputs import StepInputs

BLOCK_SIZE = 16


def rebuild_from_lists(batch: ScheduledBatch, device: torch.device) -> list[torch.Tensor]:
    """The list-based preparation: ids, positions, slots, lengths and a padded table, tensor by tensor."""
    def tensor(values, dtype):
        t = torch.tensor(values, dtype=dtype)
        return t.to(device, non_blocking=True) if device.type != "cpu" else t

    ids, pos, slots = [], [], []
    for seq in batch.seqs:
        p = seq.num_computed_tokens
        ids.append(seq.token_ids[p])
        pos.append(p)
        slots.append(seq.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
    width = max(len(s.block_table) for s in batch.seqs)
    table = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]
    return [tensor(ids, torch.int64), tensor(pos, torch.int64), tensor(slots, torch.int64),
            tensor([s.num_computed_tokens + 1 for s in batch.seqs], torch.int32), tensor(table, torch.int32)]


def make_batch(num_seqs: int, num_blocks: int) -> ScheduledBatch:
    seqs = []
    for i in range(num_seqs):
        n = num_blocks * BLOCK_SIZE - BLOCK_SIZE  # room to grow by a block
        seq = Sequence(f"s{i}", list(range(n)), SamplingParams(max_tokens=1), 0.0, None)
        seq.block_table = list(range(i * num_blocks, i * num_blocks + num_blocks - 1))
        seq.num_computed_tokens = n - 1
        seq.status = SequenceStatus.RUNNING
        seqs.append(seq)
    return ScheduledBatch(seqs, [1] * num_seqs)


def advance(batch: ScheduledBatch, num_blocks: int) -> None:
    """One token more per sequence; a block more when the next token would not fit."""
    for i, seq in enumerate(batch.seqs):
        seq.num_computed_tokens += 1
        seq.token_ids.append(1)
        if seq.num_computed_tokens + 1 > len(seq.block_table) * BLOCK_SIZE:
            seq.block_table.append(i * num_blocks + len(seq.block_table) % num_blocks)


def timed(fn, batch, num_blocks, steps: int, device: torch.device) -> float:
    """ms per call: this process's CPU time on the CPU (a shared, loaded machine deschedules it at random),
    wall time up to the device's finishing on CUDA."""
    for _ in range(3):
        fn(batch)
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    spent = 0.0
    for _ in range(steps):
        start = clock()
        fn(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        spent += clock() - start
        advance(batch, num_blocks)
    return spent / steps * 1e3


def main() -> None:
    ap = parser(__doc__, docs=True, steps=50, device="cpu")
    ap.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--blocks", type=int, nargs="+", default=[128, 2048])
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = ["| sequences | blocks each | rebuilt from lists (ms) | StepInputs (ms) | × |", "|---:|---:|---:|---:|---:|"]
    for num_seqs in args.seqs:
        for num_blocks in args.blocks:
            width = num_blocks + args.steps // BLOCK_SIZE + 2
            inputs = StepInputs(num_seqs, width, BLOCK_SIZE, num_seqs * num_blocks, device)
            old = timed(lambda b: rebuild_from_lists(b, device), make_batch(num_seqs, num_blocks), num_blocks,
                        args.steps, device)
            new = timed(inputs.prepare, make_batch(num_seqs, num_blocks), num_blocks, args.steps, device)
            rows.append(f"| {num_seqs} | {num_blocks} | {old:.2f} | {new:.2f} | {old / new:.1f}× |")
            print(rows[-1], flush=True)
    table = "\n".join([f"One decode step's inputs on {device.type} (process CPU time on the CPU), "
                       f"{args.steps} steps each; run {time.strftime('%Y-%m-%d %H:%M')} with "
                       "`benchmarks/engine/step_inputs.py`.", "", *rows])
    print("\n" + table)
    if not args.no_write:
        print("written to", write_section("gpu.md", "step-inputs", "## Step inputs, measured\n\n" + table))


if __name__ == "__main__":
    main()
