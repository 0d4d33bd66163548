"""Overlap of host and device (worker/engine/overlap.py), and the host's critical path per step.

Part 1, the stand-in: the real engine (SmolLM2's tokenizer, scheduler, StepInputs, postprocess with
detokenizing and stop checks) at batch 256 in steady decode, with the model runner's device work replaced
by a stand-in device that takes a fixed time T per step and releases the GIL meanwhile, as a GPU does: the
forward call enqueues and returns, the host waits (time.sleep) only where it reads the step's ids; it returns
deterministic token ids (real vocabulary entries, so the detokenizer does its ordinary work). For T in
{1, 3, 10} ms, overlap off and on alternated (one engine each, `--rounds` runs, the median): the step period,
the host's wall time per step measured without overlap (period - T), and the main thread's CPU time per step
(the critical path) split into schedule / prepare / postprocess / other. Without overlap the period is
T + host; with it the target is period <= 1.1 x max(T, host) (column ok), host taken from the run without
overlap so that what overlap costs (GIL hand-overs, the forward thread) shows in the period.

Part 2, the real engine on this CPU (the offline bench workload, SmolLM2-135M, fp32), overlap off and on
alternated in one run: tokens/s of each, and whether their tokens agree.

    .venv/bin/python -m benchmarks.engine.overlap [--steps 60] [--rounds 3] [--skip-real] [--no-write]
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from bench.harness import parser
from bench.host_timer import HostTimer
from benchmarks.harness.docs import DOCS, write_section
from worker import Engine, SamplingParams
from worker.engine.block_manager import BlockManager
from worker.engine.sampler import SampledStep

BATCH = 256
RESULTS = os.path.join(DOCS, "overlap.md")


class DeviceStep(SampledStep):
    """A step's sampled ids, ready when the stand-in device is done with the step: result() waits till then
    (time.sleep: the GIL is free, as while a host waits on a CUDA event)."""

    def __init__(self, tokens, done_at: float) -> None:
        super().__init__(tokens, None, None, None, None, None, tokens)
        self.done_at = done_at

    def result(self):
        wait = self.done_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return super().result()


class StandIn:
    """Replaces the runner's device work (forward + sampling) by a device queue: execute() enqueues the step
    and returns at once, as CUDA launches do, and the step is done T after the previous one ends (or after
    its own launch, if later). The ids are a cheap rule of the inputs."""

    def __init__(self, engine: Engine) -> None:
        self.device_s = 0.0
        self.free_at = 0.0  # when the device has finished everything queued so far
        engine.runner.execute = self.execute

    def execute(self, step, prev_tokens=None, resolve_on_device=False):
        if step.carry_rows is not None:  # as the real runner does: the carried ids written on the "device"
            step.input_ids.index_copy_(0, step.carry_rows, prev_tokens.index_select(0, step.carry_src))
        self.free_at = max(time.perf_counter(), self.free_at) + self.device_s
        if not step.sampling_seqs:
            return None
        last = step.input_ids[: len(step.sampling_seqs)] if step.sample_index is None else \
            step.input_ids.index_select(0, step.sample_index)
        tokens = (last * 1103 + 12345) % 20000 + 300  # ordinary vocabulary entries, never EOS
        return DeviceStep(tokens, self.free_at)


def make_engine(overlap: bool) -> Engine:
    engine = Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=BATCH,
                    max_num_batched_tokens=8192, num_kv_blocks=16, overlap=overlap)
    # the stand-in never touches the KV cache: a large pool of block ids for the bookkeeping only
    bm = BlockManager(BATCH * 80, engine.config.block_size, engine.config.enable_prefix_caching)
    engine.block_manager = engine.scheduler.block_manager = bm
    return engine


class Bench:
    """One engine per overlap setting, reused for every T (the model loads once)."""

    def __init__(self, overlap: bool) -> None:
        self.engine = make_engine(overlap)
        self.device = StandIn(self.engine)
        self.timer = HostTimer(self.engine)

    def run(self, device_ms: float, steps: int, warm: int = 8) -> dict[str, float]:
        engine = self.engine
        self.device.device_s = device_ms / 1000
        for i in range(BATCH):
            prompt = [(i * 37 + j * 11) % 20000 + 300 for j in range(16 + i % 17)]
            stop = ["\n\n\n\n\n"] if i % 2 else None  # half the rows check a stop string each token
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True,
                                                               stop=stop))
        for _ in range(warm):  # prefill and the first decode steps
            engine.step()
        assert len(engine.scheduler.running) == BATCH
        waited0 = engine.overlap.wait_s if engine.overlap else 0.0
        breaks0 = engine.overlap.breaks if engine.overlap else 0
        self.timer.take()
        cpu = time.thread_time()
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        period = (time.perf_counter() - started) / steps * 1000
        host_cpu = (time.thread_time() - cpu) / steps * 1000  # the main thread's own work, whatever else runs
        phases = {k: v / steps * 1000 for k, v in self.timer.take().items()}
        if engine.overlap is not None:
            waited = (engine.overlap.wait_s - waited0) / steps * 1000
            breaks = engine.overlap.breaks - breaks0
        else:
            waited, breaks = device_ms, 0  # the device's time is spent inside the step, not beside it
        for rid in list(engine.requests):
            engine.abort(rid)
        while engine.has_unfinished_requests():  # the step in flight (overlap) ends with no one waiting
            engine.step()
        other = host_cpu - sum(phases.values())
        return {"period": period, "host": period - waited, "host_cpu": host_cpu, **phases, "other": other,
                "breaks": breaks}


def stand_in_table(device_ms_list: list[float], steps: int, rounds: int) -> tuple[list[str], bool]:
    """Overlap off and on alternated for each T, `rounds` times; the median round of each is shown. host =
    the step's wall time less its wait for the device, measured with overlap off (period - T): the bound
    with overlap on is max(T, host), honest about what overlap adds (GIL hand-overs, the forward thread)."""
    benches = {o: Bench(o) for o in (False, True)}
    lines = ["| T (ms) | period off | period on | host (off) | T + host | max(T, host) | on / max | ok "
             "| host CPU off | host CPU on | schedule | prepare | postprocess | other | breaks |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ok_all = True
    for device_ms in device_ms_list:
        runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for r in range(rounds):
            for overlap in (False, True) if r % 2 == 0 else (True, False):
                runs[overlap].append(benches[overlap].run(device_ms, steps))
        off, on = (sorted(runs[o], key=lambda x: x["period"])[len(runs[o]) // 2] for o in (False, True))
        host = off["host"]
        bound = max(device_ms, host)
        ok = on["period"] <= 1.1 * bound
        ok_all &= ok
        lines.append(f"| {device_ms:g} | {off['period']:.2f} | {on['period']:.2f} | {host:.2f} | "
                     f"{device_ms + host:.2f} | {bound:.2f} | {on['period'] / bound:.2f} | {'yes' if ok else 'NO'} | "
                     f"{off['host_cpu']:.2f} | {on['host_cpu']:.2f} | {on['schedule']:.2f} | {on['prepare']:.2f} | "
                     f"{on['postprocess']:.2f} | {on['other']:.2f} | {on['breaks']:g} |")
        print(lines[-1], flush=True)
    for b in benches.values():
        if b.engine.overlap is not None:
            b.engine.overlap.close()
    return lines, ok_all


def run_real(rounds: int, num_prompts: int) -> list[tuple[str, float, int, list]]:
    from bench.workload import workload

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
    ap = parser(__doc__, rounds=3, docs=True, steps=60, device_ms="1,3,10", real_prompts=64, skip_real=False)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    lines = [f"CPU: {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, load average {load:.1f} at "
             f"start; batch {BATCH}, steady decode, {args.steps} steps a run, {args.rounds} runs of each (median)", "",
             "period: wall ms per step. host (off): the host's wall ms per step without overlap (period - T). "
             "host CPU: the main thread's CPU ms per step (its critical path, robust to other load); schedule / "
             "prepare / postprocess / other: that, split (overlap on). ok: period on <= 1.1 x max(T, host).", ""]
    table, ok = stand_in_table([float(x) for x in args.device_ms.split(",")], args.steps, args.rounds)
    lines += table
    lines += ["", f"Every T within 1.1 x max(T, host): {ok}"]
    print(lines[-1])
    stamp = f"Written by `python -m benchmarks.engine.overlap` ({time.strftime('%Y-%m-%d %H:%M')})."
    if not args.no_write:
        write_section("overlap.md", "stand-in", stamp + "\n\n" + "\n".join(lines))
    if not args.skip_real:
        rows = run_real(min(args.rounds, 2), args.real_prompts)
        same = all(r[3] == rows[0][3] for r in rows)
        real = ["", f"Real engine on this CPU ({args.real_prompts} chat prompts, 8-256 tokens, greedy, "
                "max_num_seqs 64), overlap off and on alternated:", "",
                "| round | overlap | tokens | tok/s |", "|---|---|---|---|"]
        real += [f"| {i // 2 + 1} | {name} | {tokens} | {tps:.1f} |" for i, (name, tps, tokens, _) in enumerate(rows)]
        for name in ("off", "on"):
            real.append(f"| median | {name} | | {statistics.median(r[1] for r in rows if r[0] == name):.1f} |")
        real.append(f"\nTokens identical across all runs: {same}")
        print("\n".join(real))
        if not args.no_write:
            write_section("overlap.md", "real-engine", stamp + "\n" + "\n".join(real))
    if not args.no_write:
        print("written to", RESULTS)


if __name__ == "__main__":
    main()
