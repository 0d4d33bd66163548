"""The stages of scripts/gpu_check, one function each: (a) kernels against their references, (b) kernel
bandwidth, (c) decode step time against its floor, kernel launches and host syncs per step, (d) engine tok/s
against transformers' continuous batching, (e) a tiny model's tokens against HF `generate` and with CUDA
graphs on against off (gpu_check/graphs.py). Opt-in: k, q (gpu_check/kv.py, fp8.py), m, t (tp.py), and l, s
(LoRA and cascade under CUDA graphs: gpu_check/graph_rows.py), v (embeddings: gpu_check/embed.py).

Each takes a Ctx and hands each row to ctx.emit as soon as it is measured: {check, value, reference, ok,
note}; ok is True/False against the issue's target, or None where a number has no target. With ctx.smoke the
same code runs on the CPU on tiny shapes (kernels under TRITON_INTERPRET=1), so the table, the files and the
imports are checked without a GPU.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from gpu_check import embed, fp8, graph_rows, kv, tp
from gpu_check.measure import (
    SYNC_CALLS,
    Ctx,
    checkpoint,
    copy_bandwidth,
    hf_greedy,
    model_name,
    prefix_share,
    profile_counts,
    row,
    sync,
    time_ms,
)

ROOT = Path(__file__).resolve().parent.parent
QWEN_HEADS = (14, 2, 64)  # Qwen2.5-0.5B: q heads, kv heads, head_dim


# ---------------------------------------------------------------- (a) kernels against their references

# A representative third of tests/kernels/test_kernels*.py's 154 CUDA tests, sized for stage a's cap with a cold
# Triton cache: every kernel test in bfloat16 and float32 (float16, which the engine never picks, dropped),
# the decode/prefill block x GQA grid at block 16 for every group and at blocks 32/64 for one group
STAGE_A_TESTS = ["tests/kernels/test_kernels.py", "tests/kernels/test_kernels_fused.py",
                 "tests/kernels/test_fused_checks.py"]
STAGE_A_SELECT = ("not interpreter_suite and not sm90 and not bench_script and not (float16 and not bfloat16) "
                  "and not -32-2-2-32 and not -32-16-2-32 and not -64-2-2-32 and not -64-16-2-32")


def stage_kernels(ctx: Ctx) -> None:
    from gpu_check import kernel_bench

    cases = kernel_bench.correctness_cases(torch, smoke=False)
    if ctx.smoke:  # the interpreter runs every program in Python: one small case, still several partitions
        cases = [(torch.float32, (4, 2, 32), 16, [1, 17, 40], 16)]
    results = kernel_bench.check_correctness(torch, ctx.device, cases)
    bad = [case for case, _, ok in results if not ok]
    worst = max(err for _, err, _ in results)
    ctx.emit(row("paged decode (multi-partition) / prefill / write_kv vs reference",
                 f"{len(results) - len(bad)}/{len(results)} cases", "all", not bad,
                 f"max abs err {worst:.1e}" + (f"; failed: {bad[:3]}" if bad else "")))
    for sliding in sliding_window_rows(ctx):
        ctx.emit(sliding)
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *STAGE_A_TESTS, "-k",
                  STAGE_A_SELECT]
    if ctx.smoke:  # the fused-kernel suite under the interpreter takes minutes: collect it (imports, conftest)
        proc = subprocess.run([*pytest_cmd, "--collect-only"], cwd=ROOT, capture_output=True, text=True)
        summary = (proc.stdout.strip().splitlines() or ["no output"])[-1]
        ctx.emit(row("stage a's CUDA test selection collects (conftest + imports)", summary[:60], "collects",
                     proc.returncode == 0, "" if proc.returncode == 0 else proc.stdout[-300:].replace("\n", " ")))
        return
    proc = subprocess.run(pytest_cmd, cwd=ROOT, capture_output=True, text=True)
    summary = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    ctx.emit(row("tests/kernels/test_kernels*.py on CUDA, bf16/fp32 selection", summary[:60], "all pass",
                 proc.returncode == 0, "" if proc.returncode == 0 else proc.stdout[-400:].replace("\n", " ")))


def sliding_window_rows(ctx: Ctx) -> list[dict]:
    """Windowed, soft-capped decode and prefill (Gemma 2's switches) against the reference at Gemma-2-like
    shapes (16 q / 8 kv heads, head_dim 256; window 4096 over 8k contexts and 100 over 2k ones), and what the
    window saves: windowed decode time against the same decode without one."""
    from tokenbus_kernels.decode_attention import paged_decode_attention_triton
    from tokenbus_kernels.prefill_attention import paged_prefill_attention_triton
    from tokenbus_kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref

    dtype = torch.float32 if ctx.smoke else torch.bfloat16
    hq, hk, d = (4, 2, 16) if ctx.smoke else (16, 8, 256)
    cases = [(3, 40, 7)] if ctx.smoke else [(16, 8192, 4096), (16, 2048, 100)]  # (batch, context, window)
    worst, ok, rows, softcap = 0.0, True, [], 50.0
    for batch, ctx_len, window in cases:
        blocks = -(-ctx_len // 16)
        k_cache = torch.randn(batch * blocks, 16, hk, d, device=ctx.device, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(batch * blocks, device=ctx.device).to(torch.int32).view(batch, blocks)
        lens = torch.randint(ctx_len // 2, ctx_len + 1, (batch,), device=ctx.device, dtype=torch.int32)
        q = torch.randn(batch, hq, d, device=ctx.device, dtype=dtype)
        args = (q, k_cache, v_cache, table, lens, d**-0.5)
        out = paged_decode_attention_triton(*args, window=window, softcap=softcap)
        err = (out.float() - paged_decode_attention_ref(*args, window, softcap).float()).abs().max().item()
        q_len = 8 if ctx.smoke else 512  # each sequence's newest q_len tokens: a prefill chunk
        cu = torch.arange(batch + 1, device=ctx.device, dtype=torch.int32) * q_len
        qp = torch.randn(batch * q_len, hq, d, device=ctx.device, dtype=dtype)
        pargs = (qp, k_cache, v_cache, table, cu, lens, d**-0.5)
        pout = paged_prefill_attention_triton(*pargs, window=window, softcap=softcap)
        err = max(err, (pout.float() - paged_prefill_attention_ref(*pargs, window, softcap).float()).abs().max().item())
        worst, ok = max(worst, err), ok and err < (1e-4 if ctx.smoke else 2e-2)
        windowed = time_ms(ctx, partial(paged_decode_attention_triton, *args, window=window))
        full = time_ms(ctx, partial(paged_decode_attention_triton, *args))
        rows.append(row(f"windowed decode batch {batch} ctx <= {ctx_len} window {window}",
                        f"{windowed * 1e3:.1f} us vs {full * 1e3:.1f} us full", "faster than full",
                        None if ctx.smoke else windowed < full, "time: the window skips whole partitions"))
        del k_cache, v_cache
    rows.insert(0, row("sliding window + soft-cap decode/prefill vs reference", f"max abs err {worst:.1e}",
                       "bf16 2e-2", ok, f"{len(cases)} shapes, head_dim {d}"))
    return rows


# ---------------------------------------------------------------- (b) kernel bandwidth, prefill vs SDPA

def stage_bandwidth(ctx: Ctx) -> None:
    from tokenbus_kernels.decode_attention import paged_decode_attention_triton

    bw = copy_bandwidth(ctx)
    ctx.emit(row("device copy bandwidth (read + write)", f"{bw / 1e9:,.0f} GB/s"))
    if ctx.smoke:
        hq, hk, d = 4, 2, 32
        grid = [(2, 64)]
    else:
        hq, hk, d = QWEN_HEADS
        grid = [(b, c) for b in (1, 64, 256) for c in (1024, 4096)]
    dtype = torch.float32 if ctx.smoke else torch.bfloat16
    for batch, ctx_len in grid:
        blocks = ctx_len // 16
        k_cache = torch.randn(batch * blocks, 16, hk, d, device=ctx.device, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(batch * blocks, device=ctx.device).to(torch.int32).view(batch, blocks)
        seq_lens = torch.full((batch,), ctx_len, dtype=torch.int32, device=ctx.device)
        q = torch.randn(batch, hq, d, device=ctx.device, dtype=dtype)
        ms = time_ms(ctx, partial(paged_decode_attention_triton, q, k_cache, v_cache, table, seq_lens, d**-0.5))
        gbps = 2 * k_cache.numel() * k_cache.element_size() / (ms * 1e-3)
        share = gbps / bw
        ctx.emit(row(f"decode attention batch {batch} ctx {ctx_len}", f"{gbps / 1e9:,.0f} GB/s = {share:.0%}",
                     ">= 80% at batch >= 64", (share >= 0.8) if batch >= 64 and not ctx.smoke else None,
                     f"{ms * 1e3:.1f} us"))
        del k_cache, v_cache
    if not ctx.smoke:
        from triton.testing import do_bench

        from gpu_check import kernel_bench

        for batch, ctx_len in ((16, 1024), (16, 4096)):
            r = kernel_bench.bench_config(torch, do_bench, "0.5B", QWEN_HEADS, batch, ctx_len, bw)
            ours, sdpa = r[7], r[9]
            ctx.emit(row(f"prefill batch {batch} ctx {ctx_len} (512-token chunk)", f"{ours:,.0f} us",
                         "SDPA " + ("n/a" if sdpa is None else f"{sdpa:,.0f} us"),
                         None if sdpa is None else ours <= 1.5 * sdpa, f"{r[8]:.0f} TFLOP/s"))


# ---------------------------------------------------------------- (c) decode step time against the floor

def stage_decode(ctx: Ctx) -> None:
    from bench.host_timer import HostTimer
    from worker import Engine, SamplingParams
    from worker.engine.model_runner import kv_bytes_per_block

    bw = copy_bandwidth(ctx)
    batches, context = ((1, 2), 16) if ctx.smoke else ((1, 64, 256), 1024)
    path = checkpoint(ctx, model_name(ctx))
    for graphs in (True,) if ctx.smoke else (True, False):  # no graphs on a CPU
        for batch in batches:
            # max_model_len 2048 (not the model's 32k): the same kernels, 5 table widths to capture, not 9
            engine = Engine(path, device=ctx.device, dtype=ctx.dtype, max_num_seqs=batch,
                            max_num_batched_tokens=max(8192 if not ctx.smoke else 256, batch),
                            kv_cache_gb=0.25 if ctx.smoke else 16, cuda_graphs=graphs,
                            cpu_kernels=not ctx.smoke, max_model_len=None if ctx.smoke else 2048)
            gen = torch.Generator().manual_seed(batch)
            for i in range(batch):
                prompt = torch.randint(3, 49152, (context,), generator=gen).tolist()
                engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=64, temperature=0.0,
                                                                   ignore_eos=True))
            while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or \
                    engine.scheduler.waiting:
                engine.step()
            for _ in range(3):  # warm: every decode kernel variant compiled
                engine.step()
            sync(ctx)
            times = []
            host = HostTimer(engine)  # the main thread's CPU time in engine.step(), split by phase
            for _ in range(3 if ctx.smoke else 20):
                t = time.perf_counter()
                cpu = time.thread_time()
                engine.step()
                host.totals["step"] = host.totals.get("step", 0.0) + time.thread_time() - cpu
                sync(ctx)
                times.append(time.perf_counter() - t)
            step_ms = 1000 * statistics.median(times)
            phases = {k: 1000 * v / len(times) for k, v in host.take().items()}
            launches, syncs = profile_counts(ctx, engine, 3)
            weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
            kv = batch * (context + 30) * kv_bytes_per_block(engine.model, 1, engine.kv_dtype)
            floor_ms = 1000 * (weights + kv) / bw
            ratio = step_ms / floor_ms
            mode = f"batch {batch} ctx {context} graphs {'on' if graphs else 'off'}"
            ctx.emit(row(f"decode step {mode}", f"{step_ms:.2f} ms = {ratio:.1f}x floor",
                         f"floor {floor_ms:.2f} ms; <= 1.5x at batch 256", (ratio <= 1.5) if batch == 256 else None))
            other = phases["step"] - phases["schedule"] - phases["prepare"] - phases["postprocess"]
            ctx.emit(row(f"host critical path per decode step, {mode}", f"{phases['step']:.2f} ms",
                         "<= 1.5 ms at batch 256", (phases["step"] <= 1.5) if batch == 256 else None,
                         f"main thread CPU: schedule {phases['schedule']:.2f} / prepare {phases['prepare']:.2f} / "
                         f"postprocess {phases['postprocess']:.2f} / other {other:.2f} ms"))
            ctx.emit(row(f"kernel launches / host syncs per decode step, {mode} (torch.profiler)",
                         f"{launches:.0f} / {syncs:.1f}", "<= 1 host sync per step",
                         None if ctx.smoke else syncs <= 1,
                         "launches: cuda*LaunchKernel + cudaGraphLaunch; syncs: " + ", ".join(SYNC_CALLS)))
            del engine
            if not ctx.smoke:
                torch.cuda.empty_cache()


# ---------------------------------------------------------------- (d) engine against transformers CB

def stage_throughput(ctx: Ctx) -> None:
    import argparse

    from gpu_check import engine_bench
    # on the CPU transformers' continuous batching sizes its cache from the host's memory (the OOM killer
    # ended the smoke run): the smoke run times the engine alone
    args = argparse.Namespace(smoke=ctx.smoke, requests=2 if ctx.smoke else 64, skip_transformers=ctx.smoke)
    bw = copy_bandwidth(ctx)
    name = model_name(ctx)
    r = engine_bench.bench_model(name, args, ctx.device, ctx.dtype, bw, checkpoint_dir=checkpoint(ctx, name))
    ours, theirs = r["ours"], r["theirs"]
    ctx.emit(row(f"engine tok/s, engine_bench workload ({args.requests} requests)", f"{ours.tok_s:,.0f}",
                 note=f"decode step {ours.extra['decode_step_ms']:.2f} ms, floor {ours.extra['decode_floor_ms']:.2f}"))
    if theirs.output_tokens:
        ratio = ours.tok_s / theirs.tok_s
        ctx.emit(row("transformers continuous batching tok/s", f"{theirs.tok_s:,.0f}",
                     "engine >= 5x", None if ctx.smoke else ratio >= 5, f"engine / CB = {ratio:.2f}x"))
    else:
        ctx.emit(row("transformers continuous batching tok/s", "failed" if theirs.error else "not run",
                     "engine >= 5x", None, theirs.error[:150] or "skipped in the CPU smoke run"))


# ---------------------------------------------------------------- (e) tokens against HF generate

def stage_parity(ctx: Ctx) -> None:
    from transformers import AutoModelForCausalLM

    from testbed import tiny_models
    from worker import Engine, SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 17, 40, 63)]
    n_new = 12 if ctx.smoke else 32
    with tempfile.TemporaryDirectory(prefix="gpu-check-tiny-") as tmp:
        path = tiny_models.make_tiny_model(tmp, "llama")
        for dtype in ("float32",) if ctx.smoke else ("float32", "bfloat16"):
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(ctx.device).eval()
            want = [hf_greedy(hf, p, n_new, ctx.device) for p in prompts]
            del hf
            # the smoke run keeps to the PyTorch references: building the C++ kernels takes minutes
            engine = Engine(path, device=ctx.device, dtype=dtype, max_num_seqs=8, max_num_batched_tokens=256,
                            kv_cache_gb=0.25, cpu_kernels=not ctx.smoke)
            got = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=n_new, temperature=0.0,
                                                                                ignore_eos=True))]
            same = sum(a == b for a, b in zip(got, want, strict=True))
            agree = statistics.mean(prefix_share(a, b) for a, b in zip(got, want, strict=True))
            exact = dtype == "float32"
            ctx.emit(row(f"tiny llama {dtype} tokens vs HF generate ({ctx.device})",
                         f"{same}/{len(prompts)} identical, {agree:.0%} agreement",
                         "identical" if exact else "agreement rate", (same == len(prompts)) if exact else None))
            del engine
        from gpu_check import graphs

        graphs.compare_graphs(ctx, path)


# the modules each stage imports on the GPU (its smoke run skips some): the rehearsal imports them all
STAGE_IMPORTS = {
    "a": ("gpu_check.kernel_bench", "pytest", "triton.testing", "tokenbus_kernels.decode_attention"),
    "b": ("gpu_check.kernel_bench", "triton.testing", "tokenbus_kernels.decode_attention",
          "tokenbus_kernels.prefill_attention"),
    "c": ("worker", "worker.engine.model_runner", "worker.engine.cuda_graphs", "torch.profiler",
          "bench.host_timer"),
    "d": ("gpu_check.engine_bench", "worker", "transformers"),
    "e": ("testbed.tiny_models", "worker", "transformers", "gpu_check.graphs", "worker.engine.guided",
          "protocol.constraints"),
    "m": ("tokenbus_kernels.moe", "tokenbus_kernels.moe_reference", "triton.testing"),
    "k": ("gpu_check.kv", "tokenbus_kernels.kv_quant", "tokenbus_kernels.decode_attention", "worker",
          "gpu_check.engine_bench"),
    "q": ("gpu_check.fp8", "tokenbus_kernels.fp8_linear", "worker.engine.quant.fp8", "testbed.fp8_checkpoints",
          "worker", "triton.testing"),
    "t": ("gpu_check.tp", "torch.distributed", "worker.engine.parallel.follower", "testbed.tiny_models", "worker"),
    "l": ("gpu_check.graph_rows", "testbed.lora_adapters", "worker.engine.cuda_graphs", "worker", "transformers"),
    "s": ("gpu_check.graph_rows", "worker.engine.cascade", "tokenbus_kernels.cascade_attention", "worker"),
    "v": ("gpu_check.embed", "testbed.tiny_embedders", "worker.engine.pooling", "worker", "transformers"),
}


def check_imports(key: str, ctx: Ctx) -> None:
    import importlib

    failed = []
    for name in STAGE_IMPORTS[key]:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - every failure is the finding
            failed.append(f"{name}: {type(err).__name__}: {err}")
    ctx.emit(row(f"stage {key}'s GPU-path imports", f"{len(STAGE_IMPORTS[key]) - len(failed)}/"
                 f"{len(STAGE_IMPORTS[key])}", "all import", not failed, "; ".join(failed)[:300]))


def stage_overrun_selftest(ctx: Ctx) -> None:
    """Stage z (never in the default list; tests/deploy/test_gpu_rehearsal.py): one row, then a grandchild and
    itself both outlive the cap. The runner must keep the row and kill the whole process group."""
    ctx.emit(row("self-test row measured before the overrun", "kept"))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    Path(os.environ["GPU_CHECK_SELFTEST_PID"]).write_text(str(child.pid))
    time.sleep(120)


# ---------------------------------------------------------------- (m) fused-MoE kernel vs its reference

def stage_moe(ctx: Ctx) -> None:
    """The fused-MoE kernel (tokenbus_kernels/moe.py) on one Mixtral-8x7B and one Qwen3-30B-A3B layer: error against
    the PyTorch reference, time against it, and the expert weights it touches read at what share of the copy
    bandwidth (a decode-sized batch reads each chosen expert once: the floor)."""
    from tokenbus_kernels.moe import fused_moe_triton
    from tokenbus_kernels.moe_reference import fused_moe_ref, route_topk_ref

    dtype = torch.float32 if ctx.smoke else torch.bfloat16
    # (name, experts, top_k, hidden, inter, token counts)
    shapes = [("tiny", 4, 2, 64, 32, (3, 20))] if ctx.smoke else [
        ("Mixtral-8x7B", 8, 2, 4096, 14336, (1, 64, 512)), ("Qwen3-30B-A3B", 128, 8, 2048, 768, (1, 64, 512))]
    bw = copy_bandwidth(ctx)
    for name, experts, top_k, hidden, inter, token_counts in shapes:
        gen = torch.Generator(device=ctx.device).manual_seed(0)
        w13 = (torch.randn(experts, 2 * inter, hidden, device=ctx.device, generator=gen) * hidden**-0.5).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, device=ctx.device, generator=gen) * inter**-0.5).to(dtype)
        for n in token_counts:
            x = torch.randn(n, hidden, device=ctx.device, generator=gen).to(dtype)
            weights, ids = route_topk_ref(torch.randn(n, experts, device=ctx.device, generator=gen), top_k, True)
            out = fused_moe_triton(x, w13, w2, weights, ids)
            ref = fused_moe_ref(x, w13, w2, weights, ids)
            err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()
            ms = time_ms(ctx, partial(fused_moe_triton, x, w13, w2, weights, ids))
            ref_ms = time_ms(ctx, partial(fused_moe_ref, x, w13, w2, weights, ids))
            touched = int(torch.unique(ids).numel()) * 3 * inter * hidden * w13.element_size()
            share = touched / (ms * 1e-3) / bw
            ctx.emit(row(f"fused MoE {name} tokens {n}", f"{ms:.3f} ms, weights at {share:.0%} of copy bw",
                            f"reference {ref_ms:.3f} ms", err < (1e-5 if ctx.smoke else 2e-2),
                            f"relative error {err:.1e}"))


# caps in seconds on the GPU with a cold Triton cache (runner.py: the calls they are run in)
STAGES = {
    "a": ("kernels vs reference", stage_kernels, 70),
    "b": ("kernel bandwidth", stage_bandwidth, 50),
    "c": ("decode step vs floor, launches and syncs", stage_decode, 120),
    "d": ("engine vs transformers CB", stage_throughput, 115),
    "e": ("tokens vs HF generate; graphs on vs off", stage_parity, 105),
    "m": ("fused MoE vs reference", stage_moe, 20),
    "k": ("fp8 KV cache vs bf16: attention error, engine tok/s", kv.stage_kv_fp8, 60),  # issue 24
    "q": ("FP8 weights vs bf16", fp8.stage_fp8_weights, 150),  # issue 24
    "t": ("tensor parallel TP=2 vs TP=1 (skipped on 1 GPU)", tp.stage_tensor_parallel, 120),  # issue 37, alone
    "l": ("LoRA under CUDA graphs: graphs on vs off, tok/s vs base", graph_rows.stage_lora, 120),  # issue 36
    "s": ("cascade under CUDA graphs: on vs off tokens, step time", graph_rows.stage_cascade, 110),  # issue 39
    "v": ("embeddings vs the CPU path, tokens/s", embed.stage_embeddings, 70),  # issue 35
}
SMOKE_CAPS = {"a": 240, "b": 240, "c": 240, "d": 240, "e": 240, "m": 240, "k": 240, "q": 240, "t": 240,
              "l": 240, "s": 240, "v": 240, "z": 8}  # a loaded 2-core CI box
HIDDEN_STAGES = {"z": ("self-test: overrun", stage_overrun_selftest, 8)}


def tokenizer_setup() -> None:
    """Point the tiny models' and engine_bench's tokenizer at the carried copy where the GGUF package is absent."""
    from transformers import AutoTokenizer

    from gpu_check import env as gpu_env
    from testbed import tiny_models

    directory = gpu_env.tokenizer_dir()
    tiny_models._tokenizer = lambda: AutoTokenizer.from_pretrained(directory)
