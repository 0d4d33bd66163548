"""gpu_check stage q: FP8 weights (issue 24) on the GPU, against bf16.

    the GEMM     tokenbus_kernels/fp8_linear.py's torch._scaled_mm (rowwise scales) against its fp32
                 reference on Llama-3-8B's linear shapes at 1, 64 and 256 tokens, and its time against the
                 bf16 F.linear of the same weights
    a checkpoint an FP8 checkpoint (compressed-tensors, per channel) of the tiny llama loads as Fp8Linear with
                 the file's e4m3 bits, and its tokens against the bf16 engine on its dequantized weights
    the engine   `--quantization fp8` against bf16 on Qwen2.5-0.5B's shapes (random weights: stage c/d's
                 checkpoint): greedy agreement, and tok/s of both on the same workload, in the same run

With ctx.smoke the same code runs on the CPU (PyTorch's CPU _scaled_mm, float32, tiny shapes), which checks
the code and the rows, not the numbers. Imports stay inside the GPU image's packages (torch, triton,
transformers) and this repository.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from functools import partial

import torch

from gpu_check.measure import Ctx, checkpoint, model_name, prefix_share, row, sync, time_ms

# (name, K, N) of Llama-3-8B's linears: qkv, o, gate_up, down
GEMM_SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
SMOKE_GEMM_SHAPES = [("qkv", 128, 256), ("down", 256, 128)]


def stage_fp8_weights(ctx: Ctx) -> None:
    gemm_rows(ctx)
    checkpoint_rows(ctx)
    engine_rows(ctx)


def gemm_rows(ctx: Ctx) -> None:
    import torch.nn.functional as F

    from tokenbus_kernels.fp8_linear import fp8_linear, fp8_linear_reference, quantize_weight

    dtype = torch.float32 if ctx.smoke else torch.bfloat16
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    for name, k, n in SMOKE_GEMM_SHAPES if ctx.smoke else GEMM_SHAPES:
        w = (torch.randn(n, k, device=ctx.device, generator=gen) * k**-0.5).to(dtype)
        qweight, w_scale = quantize_weight(w)
        for m in (1, 64, 256):
            x = torch.randn(m, k, device=ctx.device, generator=gen).to(dtype)
            out = fp8_linear(x, qweight, w_scale).float()
            ref = fp8_linear_reference(x.float(), qweight, w_scale)
            err = ((out - ref).norm() / ref.norm()).item()
            quant_err = ((ref - F.linear(x.float(), w.float())).norm() / ref.norm()).item()
            ms = time_ms(ctx, partial(fp8_linear, x, qweight, w_scale))
            bf16_ms = time_ms(ctx, partial(F.linear, x, w))
            ctx.emit(
                row(
                    f"fp8 GEMM {name} [{m}x{k}] x [{k}x{n}] vs fp32 reference",
                    f"rel err {err:.1e}; {ms:.3f} ms vs {dtype_name(dtype)} {bf16_ms:.3f} ms ({bf16_ms / ms:.2f}x)",
                    "err < 1e-2 (bf16 output rounding)",
                    err < (1e-5 if ctx.smoke else 1e-2),
                    f"e4m3 quantization error vs the unquantized linear {quant_err:.1e}",
                )
            )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _generate(engine, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float]:
    from worker import SamplingParams

    sync_ctx = engine.device.type == "cuda"
    t = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    if sync_ctx:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    return [o.token_ids for o in outs], sum(len(o.token_ids) for o in outs) / seconds


def _agreement(got: list[list[int]], want: list[list[int]]) -> tuple[int, float]:
    same = sum(a == b for a, b in zip(got, want, strict=True))
    return same, statistics.mean(prefix_share(a, b) for a, b in zip(got, want, strict=True))


def checkpoint_rows(ctx: Ctx) -> None:
    from safetensors.torch import load_file

    from testbed import tiny_models
    from testbed.fp8_checkpoints import write_fp8
    from worker import Engine
    from worker.engine.quant.fp8 import Fp8Linear

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 17, 40, 63)]
    n_new = 12 if ctx.smoke else 32
    with tempfile.TemporaryDirectory(prefix="gpu-check-fp8-") as tmp:
        base = tiny_models.make_tiny_model(os.path.join(tmp, "base"), "llama")
        fp8_dir, twin = write_fp8(base, os.path.join(tmp, "fp8"), "compressed-tensors", "channel")
        options = dict(
            device=ctx.device,
            dtype=ctx.dtype,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            kv_cache_gb=0.25,
            cpu_kernels=not ctx.smoke,
        )
        # on the CPU the checkpoint is dequantized unless fp8 is asked for; on the GPU it serves FP8 as it is
        engine = Engine(fp8_dir, quantization="fp8" if ctx.smoke else None, **options)
        linears = {n: m for n, m in engine.model.named_modules() if isinstance(m, Fp8Linear)}
        files = load_file(os.path.join(fp8_dir, "model.safetensors"))
        want_bits = files["model.layers.0.mlp.down_proj.weight"].view(torch.uint8)
        down = linears.get("layers.0.mlp.down_proj")
        kept = down is not None and torch.equal(down.weight.cpu().view(torch.uint8), want_bits)
        got, _ = _generate(engine, prompts, n_new)
        del engine
        bf16, _ = _generate(Engine(twin, **options), prompts, n_new)
        same, agree = _agreement(got, bf16)
        ctx.emit(
            row(
                f"FP8 checkpoint (compressed-tensors, channel) served on {ctx.device}",
                f"{len(linears)}/8 linears FP8, file bits {'kept' if kept else 'NOT kept'}; tokens vs "
                f"{ctx.dtype} on its dequantized weights: {same}/{len(prompts)} identical, {agree:.0%} agreement",
                "8/8 FP8 with the file's bits",
                len(linears) == 8 and kept,
                "agreement has no target: FP8 activations change the arithmetic",
            )
        )


def engine_rows(ctx: Ctx) -> None:
    from worker import Engine

    path = checkpoint(ctx, model_name(ctx))
    count, prompt_len, n_new = (2, 16, 8) if ctx.smoke else (64, 256, 128)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 49152, (prompt_len,), generator=gen).tolist() for _ in range(count)]
    results = {}
    for scheme in (None, "fp8"):
        engine = Engine(
            path,
            device=ctx.device,
            dtype=ctx.dtype,
            max_num_seqs=count,
            max_num_batched_tokens=256 if ctx.smoke else 8192,
            kv_cache_gb=0.25 if ctx.smoke else 16,
            cpu_kernels=not ctx.smoke,
            max_model_len=None if ctx.smoke else 2048,
            quantization=scheme,
        )
        _generate(engine, prompts[:2], 4)  # warm: kernels compiled, graphs captured before the clock
        sync(ctx)
        results[scheme] = _generate(engine, prompts, n_new)
        del engine
        if not ctx.smoke:
            torch.cuda.empty_cache()
    (base, base_tps), (fp8, fp8_tps) = results[None], results["fp8"]
    same, agree = _agreement(fp8, base)
    name = model_name(ctx)
    ctx.emit(
        row(
            f"engine --quantization fp8 vs {ctx.dtype} tokens, {name} random weights ({count} prompts)",
            f"{same}/{count} identical, {agree:.0%} of tokens before the first divergence",
            note="random weights: near-ties everywhere, so this bounds agreement from below; real weights: "
            "benchmarks.quant.quality",
        )
    )
    ctx.emit(
        row(
            f"engine tok/s fp8 vs {ctx.dtype}, {name} ({count} x {prompt_len}-token prompts, {n_new} new)",
            f"{fp8_tps:,.0f} vs {base_tps:,.0f} ({fp8_tps / base_tps:.2f}x)",
            "fp8 >= bf16",
            None if ctx.smoke else fp8_tps >= base_tps,
            f"same workload, same run, {ctx.dtype} first",
        )
    )
