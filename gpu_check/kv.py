"""Stage k of scripts/gpu_check: the fp8 KV cache (--kv-cache-dtype fp8, tokenbus_kernels/kv_quant.py) on the GPU.

  kernel   paged decode attention over an fp8 cache against the PyTorch reference over the same cache
           dequantized (what the kernel must compute: relative error < 2e-2 in bf16), and against the same
           K/V held in a bf16 cache (what fp8 costs in accuracy: reported); both kernels timed
  engine   a Qwen2.5-0.5B-shaped random checkpoint, 64 requests of 1,024 prompt tokens, 64 new tokens each:
           tok/s with a bf16 and an fp8 KV cache, their KV blocks in the same budget, and the share of the
           fp8 run's tokens equal to the bf16 run's before each request's first divergence

The CPU smoke run (TRITON_INTERPRET=1) runs the same code on tiny shapes in float32.
"""

from __future__ import annotations

import time

import torch


def stage_kv_fp8(ctx) -> None:
    kernel_rows(ctx)
    engine_rows(ctx)


def kernel_rows(ctx) -> None:
    from gpu_check.measure import row, time_ms
    from tokenbus_kernels.decode_attention import paged_decode_attention_triton
    from tokenbus_kernels.kv_quant import dequantize, quantize
    from tokenbus_kernels.reference import paged_decode_attention_ref

    dtype = torch.float32 if ctx.smoke else torch.bfloat16
    (hq, hk, d), seqs, context, block = ((4, 2, 32), 3, 40, 16) if ctx.smoke else ((14, 2, 64), 64, 1024, 16)
    gen = torch.Generator().manual_seed(0)
    blocks = seqs * -(-context // block)
    k = torch.randn(blocks, block, hk, d, generator=gen)
    v = torch.randn(blocks, block, hk, d, generator=gen)
    table = torch.randperm(blocks, generator=gen).int().view(seqs, -1).to(ctx.device)
    lens = torch.full((seqs,), context, dtype=torch.int32, device=ctx.device)
    q = torch.randn(seqs, hq, d, generator=gen).to(dtype).to(ctx.device)
    k8, v8 = quantize(k, torch.float8_e4m3fn).to(ctx.device), quantize(v, torch.float8_e4m3fn).to(ctx.device)
    kb, vb = k.to(dtype).to(ctx.device), v.to(dtype).to(ctx.device)
    out8 = paged_decode_attention_triton(q, k8, v8, table, lens, d**-0.5).float()
    outb = paged_decode_attention_triton(q, kb, vb, table, lens, d**-0.5).float()
    ref = paged_decode_attention_ref(q, dequantize(k8).to(dtype), dequantize(v8).to(dtype), table, lens, d**-0.5)
    err = ((out8 - ref.float()).norm() / ref.float().norm()).item()
    vs_bf16 = ((out8 - outb).norm() / outb.norm()).item()
    ms8 = time_ms(ctx, lambda: paged_decode_attention_triton(q, k8, v8, table, lens, d**-0.5))
    msb = time_ms(ctx, lambda: paged_decode_attention_triton(q, kb, vb, table, lens, d**-0.5))
    shape = f"{seqs} seqs x ctx {context}, heads {hq}/{hk}, head_dim {d}"
    ctx.emit(row(f"decode attention, fp8 KV vs reference on it dequantized ({shape})", f"rel err {err:.1e}",
                 "< 2e-2", err < 2e-2, f"vs the same K/V in a {str(dtype)[6:]} cache: rel err {vs_bf16:.1e}"))
    ctx.emit(row(f"decode attention time, fp8 KV vs {str(dtype)[6:]} KV ({shape})",
                 f"{ms8:.3f} ms vs {msb:.3f} ms", "fp8 <= bf16 (half the bytes)", None if ctx.smoke else ms8 <= msb,
                 f"x{msb / ms8:.2f}"))


def engine_rows(ctx) -> None:
    from gpu_check.measure import checkpoint, model_name, row, sync
    from worker import Engine, SamplingParams

    path = checkpoint(ctx, model_name(ctx))
    count, prompt_len, n_new = (2, 24, 4) if ctx.smoke else (64, 1024, 64)
    gen = torch.Generator().manual_seed(24)
    prompts = [torch.randint(3, 49152, (prompt_len,), generator=gen).tolist() for _ in range(count)]
    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    runs = {}
    for kv in ("auto", "fp8"):
        engine = Engine(path, device=ctx.device, dtype=ctx.dtype, max_num_seqs=count, kv_cache_dtype=kv,
                        kv_cache_gb=0.25 if ctx.smoke else 8, cpu_kernels=not ctx.smoke,
                        max_model_len=None if ctx.smoke else 2048)
        engine.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm
        sync(ctx)
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        sync(ctx)
        runs[kv] = (count * n_new / (time.perf_counter() - start), [o.token_ids for o in outs],
                    engine.block_manager.num_blocks)
        del engine
        if not ctx.smoke:
            torch.cuda.empty_cache()
    (tok_b, out_b, blocks_b), (tok_8, out_8, blocks_8) = runs["auto"], runs["fp8"]
    prefix = sum(next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(y))
                 for x, y in zip(out_8, out_b, strict=True)) / sum(map(len, out_b))
    same = sum(x == y for x, y in zip(out_8, out_b, strict=True))
    blocks = f"KV blocks in the same budget: {blocks_8} vs {blocks_b} (x{blocks_8 / blocks_b:.2f})"
    ctx.emit(row(f"engine tok/s, fp8 KV vs {ctx.dtype} KV ({count} x {prompt_len} prompt tokens, {n_new} new)",
                 f"{tok_8:,.0f} vs {tok_b:,.0f} (x{tok_8 / tok_b:.2f})", "fp8 >= bf16",
                 None if ctx.smoke else tok_8 >= tok_b, blocks))
    ctx.emit(row("engine greedy tokens, fp8 KV vs bf16 KV (random weights: near-ties)",
                 f"{same}/{count} identical, {prefix:.0%} before the first divergence", "reported", None))
