"""Stage e of scripts/gpu_check, second half: a tiny random Llama's greedy tokens with CUDA graphs on against off.

Graphs on replays the padded decode step (rows padded to a bucket, tables cut to a width bucket); graphs off
runs every step eagerly at exact shapes, so the decode kernel splits contexts differently and sums in
another order. Float32: every token equal. Bfloat16: at least 99 % of the tokens equal, position by position,
over 64 requests. In the CPU smoke run the padded path (static_decode) stands in for the graphs.
"""

from __future__ import annotations

import torch


def compare_graphs(ctx, path: str) -> None:
    """Rows: the tiny checkpoint at `path`, graphs on against off, per dtype."""
    from gpu_check.measure import row
    from worker import Engine, SamplingParams

    count, n_new, longest = (4, 6, 40) if ctx.smoke else (64, 32, 300)
    gen = torch.Generator().manual_seed(21)
    lengths = torch.randint(4, longest, (count,), generator=gen).tolist()
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    for dtype in ("float32",) if ctx.smoke else ("float32", "bfloat16"):
        got = {}
        for graphs in (True, False):
            # off the GPU no graphs: the padded path they replay against the eager one
            mode = dict(static_decode=graphs) if ctx.smoke else dict(cuda_graphs=graphs)
            engine = Engine(path, device=ctx.device, dtype=dtype, max_num_seqs=count,
                            max_num_batched_tokens=2048, kv_cache_gb=0.25, cpu_kernels=False, **mode)
            got[graphs] = [o.token_ids for o in engine.generate(prompts, params)]
            del engine
        pairs = list(zip(got[True], got[False], strict=True))
        total = sum(len(b) for _, b in pairs)
        same = sum(x == y for a, b in pairs for x, y in zip(a, b, strict=False))
        identical = sum(a == b for a, b in pairs)
        share = same / max(total, 1)
        exact = dtype == "float32"
        label = "padded static decode vs eager" if ctx.smoke else "graphs on vs off"
        ctx.emit(row(f"tiny llama {dtype} tokens, {label} ({count} requests x {n_new})",
                     f"{share:.2%} equal, {identical}/{count} requests identical",
                     "all equal" if exact else ">= 99% equal", share == 1.0 if exact else share >= 0.99,
                     f"{same}/{total} tokens"))
