"""The CPU prefill attention, old against new, on the shared-prefix workload's prefill step (issue 24): the
C++ prefill kernel (paged_prefill_attention_cpu) against prefill as one decode per query token
(paged_decode_attention_cpu over each token's prefix, the block table repeated per token: what CpuBackend ran
before), both from one build, called in turns, one thread's CPU time (benchmarks/bench_kv_kernel_ab.py says
why CPU time on one thread).

Shape: 16 sequences × 32 new query tokens after a 496-token cached shared prefix (seq_len 528), SmolLM2's
heads (9 q, 3 KV, head_dim 64), block 16, causal, no window.

    .venv/bin/python -m benchmarks.bench_prefill_ab            # ~1 min
    .venv/bin/python -m benchmarks.bench_prefill_ab --avx2     # the -mno-avx512f build
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.bench_common import cpu_name
from kernels import cpu
from kernels.kv_quant import quantize


def inputs():
    """(q, {dtype: (k_cache, v_cache)}, block_tables, cu_seqlens_q, seq_lens): the shared prefix's 31 blocks
    in every table, then each sequence's own 2."""
    gen = torch.Generator().manual_seed(0)
    seqs, new, hq, hk, d, bs, shared = 16, 32, 9, 3, 64, 16, 496
    prefix, own = shared // bs, -(-new // bs)
    blocks = prefix + seqs * own
    k, v = torch.randn(blocks, bs, hk, d, generator=gen), torch.randn(blocks, bs, hk, d, generator=gen)
    perm = torch.randperm(blocks, generator=gen).int()
    table = torch.cat([perm[:prefix].repeat(seqs, 1), perm[prefix:].view(seqs, own)], 1)
    q = torch.randn(seqs * new, hq, d, generator=gen)
    cu = torch.arange(0, seqs * new + 1, new, dtype=torch.int32)
    lens = torch.full((seqs,), shared + new, dtype=torch.int32)
    caches = {"float32": (k, v), "bfloat16": (k.bfloat16(), v.bfloat16()),
              "int8": (quantize(k, torch.int8), quantize(v, torch.int8))}
    return q, caches, table, cu, lens


def as_decodes(ext, q, kc, vc, table, cu, lens):
    """The old CpuBackend.prefill_attention: a decode per query token over its own prefix."""
    q_lens = (cu[1:] - cu[:-1]).long()
    seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
    index_in_seq = torch.arange(q.shape[0]) - cu[:-1].long()[seq_of_token]
    token_lens = (lens.long() - q_lens)[seq_of_token] + index_in_seq + 1
    token_tables = table.index_select(0, seq_of_token)
    return ext.paged_decode_attention_cpu(q, kc, vc, token_tables, token_lens.int(), 0.125, 0, 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20, help="turns of 5 calls per path and dtype")
    parser.add_argument("--avx2", action="store_true", help="the AVX2 build (-mno-avx512f)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ext = cpu.extension(avx2_only=args.avx2)
    assert ext is not None, "the C++ CPU kernels did not build"
    q, caches, table, cu, lens = inputs()
    paths = {
        "as decodes": lambda kc, vc: as_decodes(ext, q, kc, vc, table, cu, lens),
        "prefill kernel": lambda kc, vc: ext.paged_prefill_attention_cpu(q, kc, vc, table, cu, lens, 0.125, 0, 0.0,
                                                                         True),
    }
    print(f"CPU ms per call (median of {args.rounds} turns of 5 calls; min in brackets), 1 thread, {cpu_name()}"
          f"{' (AVX2 build)' if args.avx2 else ''}, 1-min load average {os.getloadavg()[0]:.1f} at the start; "
          f"run {time.strftime('%Y-%m-%d %H:%M')}\n")
    print("| KV dtype | as decodes | prefill kernel | as decodes / prefill kernel | µs per query token (new) "
          "| max |Δout| |")
    print("|---|---|---|---|---|---|")
    for dtype, (kc, vc) in caches.items():
        outs = [path(kc, vc) for path in paths.values()]
        diff = float((outs[0] - outs[1]).abs().max())
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, path in paths.items():
                start = time.process_time()
                for _ in range(5):
                    path(kc, vc)
                times[name].append((time.process_time() - start) / 5 * 1e3)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        old, new = med["as decodes"], med["prefill kernel"]
        cells = [f"{med[name]:.3f} ({min(times[name]):.3f})" for name in paths]
        print(f"| {dtype} | " + " | ".join(cells) + f" | ×{old / new:.2f} | {new / q.shape[0] * 1e3:.2f} "
              f"| {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
