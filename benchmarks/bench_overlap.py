"""Overlap of host and device (worker/engine/overlap.py), and the host's critical path per step.

Part 1, the stand-in: the real engine (SmolLM2's tokenizer, scheduler, StepInputs, postprocess with
detokenizing and stop checks) at batch 256 in steady decode, with the model runner's device work replaced
by a stand-in that takes a fixed time T and releases the GIL, as a GPU call does (time.sleep), and returns
deterministic token ids (real vocabulary entries, so the detokenizer does its ordinary work). For T in
{1, 3, 10} ms, overlap off and on: the step period and the host's time per step (schedule + prepare +
postprocess and the rest of the main thread's work, i.e. the step's wall time less its wait for the device).
Without overlap the period is T + host; with it, max(T, host) is the floor.

Part 2, the real engine on this CPU (the offline bench workload, SmolLM2-135M, fp32), overlap off and on
alternated in one run: tokens/s of each, and whether their tokens agree.

    .venv/bin/python -m benchmarks.bench_overlap [--steps 60] [--rounds 2] [--skip-real] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from worker import Engine, SamplingParams  # noqa: E402
from worker.engine.block_manager import BlockManager  # noqa: E402
from worker.engine.sampler import SampledStep  # noqa: E402

BATCH = 256
RESULTS = os.path.join(ROOT, "docs", "overlap.md")


def stand_in(engine: Engine, device_s: float) -> None:
    """Replace the runner's device work (forward + sampling) by a sleep of device_s and a cheap id rule."""
    runner = engine.runner

    def execute(step, prev_tokens=None, resolve_on_device=False):
        if step.carry_rows is not None:  # as the real runner does: the carried ids written on the "device"
            step.input_ids.index_copy_(0, step.carry_rows, prev_tokens.index_select(0, step.carry_src))
        time.sleep(device_s)  # the device's time; the GIL is free meanwhile
        if not step.sampling_seqs:
            return None
        last = step.input_ids[: len(step.sampling_seqs)] if step.sample_index is None else \
            step.input_ids.index_select(0, step.sample_index)
        tokens = (last * 1103 + 12345) % 20000 + 300  # ordinary vocabulary entries, never EOS
        return SampledStep(tokens, None, None, None, None, None, tokens)

    runner.execute = execute


def make_engine(overlap: bool) -> Engine:
    engine = Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=BATCH,
                    max_num_batched_tokens=8192, num_kv_blocks=16, overlap=overlap)
    # the stand-in never touches the KV cache: a large pool of block ids for the bookkeeping only
    bm = BlockManager(BATCH * 80, engine.config.block_size, engine.config.enable_prefix_caching)
    engine.block_manager = engine.scheduler.block_manager = bm
    return engine


class HostTimer:
    """Seconds in the engine's host phases, by wrapping them (nothing in worker/ changes)."""

    def __init__(self, engine: Engine) -> None:
        self.totals = {"schedule": 0.0, "prepare": 0.0, "postprocess": 0.0}
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner.inputs, "prepare", "prepare")  # both paths (with and without overlap)
        self._wrap(engine, "finish_step", "postprocess")

    def _wrap(self, obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.thread_time()  # CPU time of this thread: the machine's other load does not count
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[key] += time.thread_time() - t

        setattr(obj, name, timed)

    def take(self) -> dict[str, float]:
        out = dict(self.totals)
        self.totals = dict.fromkeys(self.totals, 0.0)
        return out


def run_stand_in(overlap: bool, device_ms: float, steps: int, warm: int = 8) -> dict[str, float]:
    engine = make_engine(overlap)
    stand_in(engine, device_ms / 1000)
    timer = HostTimer(engine)
    for i in range(BATCH):
        prompt = [(i * 37 + j * 11) % 20000 + 300 for j in range(16 + i % 17)]
        stop = ["\n\n\n\n\n"] if i % 2 else None  # half the rows check a stop string each token
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True,
                                                           stop=stop))
    for _ in range(warm):  # prefill and the first decode steps
        engine.step()
    assert len(engine.scheduler.running) == BATCH
    waited0 = engine.overlap.wait_s if engine.overlap else 0.0
    timer.take()
    walls = []
    cpu = time.thread_time()
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    host_cpu = (time.thread_time() - cpu) / steps * 1000  # the main thread's own work, whatever else runs
    phases = {k: v / steps * 1000 for k, v in timer.take().items()}
    period = statistics.mean(walls) * 1000
    if engine.overlap is not None:
        waited = (engine.overlap.wait_s - waited0) / steps * 1000
        breaks = engine.overlap.breaks
    else:
        waited, breaks = device_ms, 0  # the device's time is spent inside the step, not beside it
    for rid in list(engine.requests):
        engine.abort(rid)
    if engine.overlap is not None:
        engine.overlap.close()
    return {"period": period, "host": period - waited, "host_cpu": host_cpu, **phases, "breaks": breaks}


def run_real(rounds: int, num_prompts: int) -> list[tuple[str, float, int, list]]:
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_workload import workload

    items = workload(num_prompts)
    engines = {o: Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=64,
                         max_num_batched_tokens=512, overlap=o) for o in (False, True)}
    prompts = [m for m, _ in items]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in items]
    for e in engines.values():
        e.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    rows = []
    for r in range(rounds):
        for overlap in (False, True) if r % 2 == 0 else (True, False):
            t = time.perf_counter()
            outs = engines[overlap].generate(prompts, params)
            seconds = time.perf_counter() - t
            tokens = sum(len(o.token_ids) for o in outs)
            rows.append(("on" if overlap else "off", tokens / seconds, tokens, [o.token_ids for o in outs]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--device-ms", default="1,3,10")
    ap.add_argument("--rounds", type=int, default=2, help="real-engine rounds (each runs off and on)")
    ap.add_argument("--real-prompts", type=int, default=64)
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    lines = [f"CPU: {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; batch {BATCH}, steady decode,"
             f" {args.steps} steps each", "",
             "host wall = period less the main thread's wait for the device; host CPU = the main thread's CPU time "
             "per step (the critical path, robust to other load); schedule / prepare / postprocess: CPU ms", "",
             "| T (ms) | overlap | period (ms) | host wall | host CPU | schedule | prepare | postprocess "
             "| max(T, host wall) | period / that | breaks |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for device_ms in [float(x) for x in args.device_ms.split(",")]:
        for overlap in (False, True):
            r = run_stand_in(overlap, device_ms, args.steps)
            bound = max(device_ms, r["host"])
            lines.append(f"| {device_ms:g} | {'on' if overlap else 'off'} | {r['period']:.2f} | {r['host']:.2f} | "
                         f"{r['host_cpu']:.2f} | "
                         f"{r['schedule']:.2f} | {r['prepare']:.2f} | {r['postprocess']:.2f} | {bound:.2f} | "
                         f"{r['period'] / bound:.2f} | {r['breaks']} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    if not args.skip_real:
        rows = run_real(args.rounds, args.real_prompts)
        same = all(r[3] == rows[0][3] for r in rows)
        real = ["", f"Real engine on this CPU ({args.real_prompts} chat prompts, 8-256 tokens, greedy, "
                "max_num_seqs 64), overlap off and on alternated:", "",
                "| round | overlap | tokens | tok/s |", "|---|---|---|---|"]
        real += [f"| {i // 2 + 1} | {name} | {tokens} | {tps:.1f} |" for i, (name, tps, tokens, _) in enumerate(rows)]
        for name in ("off", "on"):
            real.append(f"| median | {name} | | {statistics.median(r[1] for r in rows if r[0] == name):.1f} |")
        real.append(f"\nTokens identical across all runs: {same}")
        print("\n".join(real))
        text += "\n" + "\n".join(real)
    if not args.no_write:
        with open(RESULTS, "w") as f:
            f.write("# Overlap of host and device: measured\n\nWritten by `python -m benchmarks.bench_overlap` "
                    f"({time.strftime('%Y-%m-%d %H:%M')}).\n\n{text}\n")
        print("written to", RESULTS)


if __name__ == "__main__":
    main()
