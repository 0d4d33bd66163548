"""What the stages of scripts/gpu_check (gpu_check/stages.py) measure with: the run's context (GPU or the CPU
smoke), a report row, device timing and copy bandwidth, the model checkpoints in real shapes, the profiler's
launch and sync counts, and HF generate's greedy tokens."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Ctx:
    smoke: bool
    rehearsal: bool = False  # inside the rehearsal venv (scripts/gpu_check --rehearse)
    emit: Callable[[dict], None] = print  # appends a row to the report the moment it is measured

    @property
    def device(self) -> str:
        return "cpu" if self.smoke else "cuda"

    @property
    def dtype(self) -> str:
        return "float32" if self.smoke else "bfloat16"


def row(check: str, value: str, reference: str = "", ok: bool | None = None, note: str = "") -> dict:
    return dict(check=check, value=value, reference=reference, ok=ok, note=note)


def sync(ctx: Ctx) -> None:
    if not ctx.smoke:
        torch.cuda.synchronize()


def time_ms(ctx: Ctx, fn) -> float:
    """Median milliseconds of fn: CUDA events via do_bench on the GPU, a few host-timed calls on the CPU."""
    if not ctx.smoke:
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(2):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def copy_bandwidth(ctx: Ctx) -> float:
    """Bytes read + written per second by a large device copy (64 MiB on the CPU smoke, 2 GiB on the GPU)."""
    src = torch.empty((64 << 20) if ctx.smoke else (2 << 30), dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    ms = time_ms(ctx, lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def model_name(ctx: Ctx) -> str:
    # the smoke run takes SmolLM2's shape (engine_bench's SMOKE sizes): a 151,936-token vocabulary costs a
    # minute of random init on a CPU
    return "SmolLM2-135M" if ctx.smoke else "Qwen2.5-0.5B"


def checkpoint(ctx: Ctx, name: str) -> str:
    """A random-weight checkpoint in `name`'s shapes, made once per gpu_check run (stages c and d share it)."""
    from gpu_check import engine_bench
    directory = Path(os.environ.get("GPU_CHECK_CACHE") or tempfile.mkdtemp(prefix="gpu-check-")) / name
    if not (directory / "config.json").is_file():
        shape = engine_bench.SHAPES[name] | (engine_bench.SMOKE if ctx.smoke else {})
        engine_bench.make_checkpoint(str(directory), shape, ctx.device)
    return str(directory)


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def profile_counts(ctx: Ctx, engine, steps: int) -> tuple[float, float]:
    """(kernel launches, host syncs) per engine step, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([] if ctx.smoke else [ProfilerActivity.CUDA])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
    events = prof.events()
    launches = sum(1 for e in events if "LaunchKernel" in e.name or e.name == "cudaGraphLaunch")
    syncs = sum(1 for e in events if e.name in SYNC_CALLS)
    return launches / steps, syncs / steps


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int, device: str) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def prefix_share(a: list[int], b: list[int]) -> float:
    """How much of b a agrees with before their first difference."""
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return n / max(len(b), 1)
