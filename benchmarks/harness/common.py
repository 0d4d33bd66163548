"""Shared pieces of the CPU benchmarks: the Hugging Face baselines, agreement, and the results file."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs")


def bench_parser(doc: str, **defaults: int | float | str) -> argparse.ArgumentParser:
    """A benchmark's argument parser: its docstring as the help, `--name-with-dashes` for each default given
    (typed as the default is), and --no-write (print the table, leave docs/ alone)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in defaults.items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    ap.add_argument("--no-write", action="store_true", help="print the results; write nothing under docs/")
    return ap


@dataclass
class SystemResult:
    name: str
    seconds: float
    outputs: list[list[int]]
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def hf_one_at_a_time(model, prompt_ids, max_tokens) -> SystemResult:
    outs = []
    start = time.perf_counter()
    with torch.inference_mode():
        for ids, m in zip(prompt_ids, max_tokens, strict=True):
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=m, min_new_tokens=m,
                               do_sample=False, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return SystemResult("HF generate, one request at a time", time.perf_counter() - start, outs)


def hf_static_batches(model, prompt_ids, max_tokens, batch_size: int = 16) -> SystemResult:
    """Left-padded static batches: every row runs as long as the batch's longest request."""
    outs: list[list[int]] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(prompt_ids), batch_size):
            rows, lens = prompt_ids[b : b + batch_size], max_tokens[b : b + batch_size]
            width = max(len(r) for r in rows)
            x = torch.tensor([[0] * (width - len(r)) + r for r in rows])
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
            n = max(lens)
            y = model.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)
            outs += [y[i, width : width + m].tolist() for i, m in enumerate(lens)]
    return SystemResult(f"HF generate, static batches of {batch_size}", time.perf_counter() - start, outs)


def hf_continuous_batching(model, prompt_ids, max_tokens) -> SystemResult:
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(max_tokens), eos_token_id=None, pad_token_id=0)
    results: dict[str, list[int]] = {}
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
        for i, (ids, m) in enumerate(zip(prompt_ids, max_tokens, strict=True)):
            manager.add_request(ids, request_id=f"r{i}", max_new_tokens=m)
        while len(results) < len(prompt_ids):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = list(r.generated_tokens)
    seconds = time.perf_counter() - start
    outs = [results[f"r{i}"] for i in range(len(prompt_ids))]
    return SystemResult("transformers continuous batching (generate_batch's manager)", seconds, outs)


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[float, int]:
    """(share of reference tokens reproduced before the first divergence, requests identical)."""
    matched = total = identical = 0
    for out, ref in zip(outputs, reference, strict=True):
        prefix = 0
        for a, b in zip(out, ref, strict=False):
            if a != b:
                break
            prefix += 1
        matched += prefix
        total += len(ref)
        identical += out == ref
    return matched / max(total, 1), identical


def write_section(filename: str, marker: str, body: str) -> str:
    """Replace the text between <!-- marker:start --> and <!-- marker:end --> in docs/filename."""
    path = os.path.join(DOCS, filename)
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    block = f"<!-- {marker}:start -->\n{body.rstrip()}\n<!-- {marker}:end -->"
    pattern = re.compile(rf"<!-- {marker}:start -->.*?<!-- {marker}:end -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)
    return path


def table(columns: list[str], rows: list[str]) -> list[str]:
    """A Markdown table's lines: the header of `columns`, its rule, then `rows` (each already `| a | b |`)."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *rows]


def publish(body: str, filename: str, marker: str, write: bool) -> None:
    """Print a benchmark's section and, with `write` (no --no-write), put it into docs/filename at `marker`."""
    print(body)
    if write:
        write_section(filename, marker, body)


def rotating_rounds(systems: tuple[str, ...], rounds: int,
                    run_one: Callable[[str], dict | None]) -> dict[str, list[dict]]:
    """{system: [its result per round]}: every round runs each system once through run_one, the order rotated
    by one each round so that a position effect or drift falls on every system; a None result (a skipped run)
    is left out. Prints each result's numbers as it comes."""
    results: dict[str, list[dict]] = {name: [] for name in systems}
    for r in range(rounds):
        for name in systems[r % len(systems):] + systems[: r % len(systems)]:
            res = run_one(name)
            if res is None:
                continue
            results[name].append(res)
            print(f"round {r + 1} {name}: " + ", ".join(
                f"{k} {v:.1f}" for k, v in res.items() if isinstance(v, int | float)), flush=True)
    return results


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM (the workers drain or shut down warm), then SIGKILL if it has not exited within grace_s."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cpu_name() -> str:
    """The CPU model and its widest vector ISA: the CPU kernels compile for it, and the numbers depend on it."""
    import platform

    from kernels.cpu import cpu_flags

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    flags = set(cpu_flags().split(":", 1)[-1].split())
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    name = model or platform.processor() or platform.machine()
    return f"{name}, {isa}" if isa else name
