"""Systems taking turns, round after round, vLLM's CPU build among them where it is installed: the main body of
the quantization benchmarks (quant/weight_schemes.py, quant/kv_dtype.py). The order rotates each round so that
a position effect or the machine's drift falls on every system; each result carries the 1-minute load average
read before it ran; a row reports its median round."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from bench.harness import redis_url, rotated
from benchmarks.harness.vllm import vllm_row, vllm_turn

# (system name, Redis URL, log folder) -> {"tok/s": ..., ...}
RunTokenbus = Callable[[str, str, str], dict]


@dataclass
class Rotation:
    results: dict[str, list[dict]]  # system: its result per round, in the order they ran

    def median(self, name: str, key: str = "tok/s") -> float:
        return statistics.median(res[key] for res in self.results[name])

    def per_round(self, name: str, key: str) -> str:
        return ", ".join(f"{res[key]:.1f}" for res in self.results[name])

    def vllm_line(self, args: argparse.Namespace, against: tuple[str, ...]) -> str:
        """vllm_row's paragraph: vLLM's median against each of `against` that ran."""
        return vllm_row(args, self.results.get("vllm"),
                        {name: self.median(name) for name in against if self.results.get(name)})


def rotate(args: argparse.Namespace, systems: tuple[str, ...], prompt_ids: list[list[int]], max_tokens: list[int],
           run_tokenbus: RunTokenbus, prefix_caching: bool = True) -> Rotation:
    """args.rounds rounds of `systems` (run_tokenbus runs each) plus vLLM's turn unless it is left out or
    missing, on one Redis (--redis-url or a throwaway redis-server) and one log folder."""
    vllm = vllm_turn(args, prompt_ids, max_tokens, prefix_caching)
    names = list(systems) + (["vllm"] if vllm else [])
    results: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as log_dir, redis_url(getattr(args, "redis_url", None)) as url:
        for r in range(args.rounds):
            for name in rotated(names, r):
                load = os.getloadavg()[0]
                res = vllm(log_dir) if name == "vllm" else run_tokenbus(name, url, log_dir)
                if res is None:  # a skipped run: vllm_turn says why in args.vllm_skipped
                    continue
                results[name].append({**res, "load": load})
                print(f"round {r + 1} {name}: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in res.items() if isinstance(v, int | float)), flush=True)
    return Rotation(results)
