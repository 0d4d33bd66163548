"""`tokenbus bench engine|e2e|queue|embed` (`python -m bench ...`): the benchmarks a user runs to size a deployment.

    tokenbus bench engine                 # the offline engine on the chat workload: tok/s, TTFT, latency
    tokenbus bench e2e                    # the same workload end to end: Client -> Redis -> a worker process
    tokenbus bench queue --jobs 20000     # what one job costs Redis (CPU, commands, bytes), no model
    tokenbus bench embed                  # 10,000 mixed-length inputs: SentenceTransformer, offline, e2e, vLLM

Every subcommand takes the same --model, --num-prompts / --max-tokens (the workload), --rounds and --json
flags where they apply, starts a throwaway redis-server unless --redis-url names one, and prints one table
(each round, then the median). A new subcommand is one entry in COMMANDS.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from bench import commands
from bench.harness import DEFAULT_MODEL, add_flags


@dataclass(frozen=True)
class Command:
    help: str
    flags: dict[str, object]  # the shared flags it takes (harness.add_flags keywords)
    add_arguments: Callable[[argparse.ArgumentParser], None]  # its own flags
    run: Callable[[argparse.Namespace], str]  # returns the table it prints


SYSTEM = dict(model=DEFAULT_MODEL, prompts=64, max_tokens=256, rounds=3)
COMMANDS = {
    "engine": Command("the offline engine (Engine.generate) on a workload", SYSTEM, commands.engine_flags,
                      commands.run_engine),
    "e2e": Command("end to end: producer.Client -> Redis -> `python -m worker` -> job records", SYSTEM | {
        "redis": True}, commands.engine_flags, commands.run_e2e),
    "queue": Command("what one job costs Redis, phase by phase, with no model", {"rounds": 1, "redis": True},
                     commands.queue_flags, commands.run_queue),
    "embed": Command("embeddings in tokens/s: SentenceTransformer, the offline engine, end to end, vLLM's CPU build",
                     {"model": "all-minilm-l6-v2", "prompts": 10_000, "rounds": 3, "redis": True},
                     commands.embed_flags, commands.run_embed),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenbus bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        add_flags(p, **command.flags)
        command.add_arguments(p)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print(COMMANDS[args.command].run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
