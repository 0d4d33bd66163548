"""One benchmark command in two trees side by side: rounds interleaved, a paired table.

    python -m benchmarks.harness.ab BASE_REV -- -m bench engine --num-prompts 16 --max-tokens 64
    python -m benchmarks.harness.ab BASE_REV --rounds 5 -- -m bench e2e
    python -m benchmarks.harness.ab HEAD --b-args "--engine overlap=true" -- -m bench engine   # one setting

BASE_REV (any git revision) is checked out into a temporary worktree (A); this checkout is B. Every round runs
the command once in each tree, in alternating order (A B, B A, ...), each in a fresh `python` whose imports
come from its own tree (cwd and PYTHONPATH), with `--json PATH` appended: every `tokenbus bench` subcommand
and every benchmark built on bench.harness's parser writes its figures there. The table pairs each numeric
figure of the JSON's top level round by round: A, B, B / A, and the median ratio (drift and load fall on both
sides of a pair alike). With BASE_REV HEAD and --b-args, one tree runs against itself with and without a
setting. --a-args / --b-args add arguments to one side only (shlex-split). Prints the table and the two
commits it compares; writes nothing under docs/ (paste the table and name the commits).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import machine, markdown_table, parser

ROOT = Path(__file__).resolve().parents[2]


def run_side(tree: Path, command: list[str], out: Path) -> dict[str, float]:
    """The command in `tree`, its --json figures: the top level's numbers (the rest is left out)."""
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([sys.executable, *command, "--json", str(out)], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=7200)
    if done.returncode != 0:
        raise RuntimeError(f"`python {shlex.join(command)}` failed in {tree} (exit {done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    figures = json.loads(out.read_text())
    return {k: float(v) for k, v in figures.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def commit_of(tree: Path) -> str:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree,
                           capture_output=True, text=True).stdout.strip()
    return rev.stdout.strip() + (" + uncommitted changes" if dirty else "")


def paired_table(runs: dict[str, list[dict[str, float]]]) -> list[str]:
    """Per figure: each round's A, B and B / A, then the median ratio."""
    a, b = runs["A"], runs["B"]
    lines = []
    for key in sorted(set(a[0]) & set(b[0])):
        ratios = [y[key] / x[key] for x, y in zip(a, b, strict=True) if x[key]]
        cells = "; ".join(f"{x[key]:.4g} → {y[key]:.4g}" for x, y in zip(a, b, strict=True))
        median = f"{statistics.median(ratios):.3f}" if ratios else "–"
        lines.append(f"| {key} | {cells} | {median} |")
    return markdown_table(["figure", "A → B, round by round", "median B / A"], lines)


def main() -> None:
    ap = parser(__doc__, rounds=3)
    ap.add_argument("base", help="the git revision of side A (B is this checkout)")
    ap.add_argument("--a-args", default="", help="arguments for side A only")
    ap.add_argument("--b-args", default="", help="arguments for side B only")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # after --: what `python` runs, e.g. -m bench e2e
    a, command = ap.parse_args(argv[:cut]), argv[cut + 1:]
    if not command:
        ap.error("give the command after --, e.g. -- -m bench engine --num-prompts 16")
    tmp = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    same = a.base == "HEAD" and not subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                                   cwd=ROOT, capture_output=True, text=True).stdout.strip()
    tree_a = ROOT if same else tmp / "a"
    if not same:
        subprocess.run(["git", "worktree", "add", "--detach", str(tree_a), a.base], cwd=ROOT, check=True,
                       capture_output=True)
    sides = {"A": (tree_a, command + shlex.split(a.a_args)), "B": (ROOT, command + shlex.split(a.b_args))}
    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    try:
        for r in range(a.rounds):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                tree, cmd = sides[name]
                runs[name].append(run_side(tree, cmd, tmp / f"{name}-{r}.json"))
                print(f"round {r + 1} {name}: {runs[name][-1]}", flush=True)
    finally:
        if not same:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree_a)], cwd=ROOT, capture_output=True)
    print("\n".join([
        f"A: {commit_of(tree_a) if same else a.base} `python {shlex.join(sides['A'][1])}`; "
        f"B: {commit_of(ROOT)} `python {shlex.join(sides['B'][1])}`; {a.rounds} rounds, alternating order; "
        f"{machine()}.", "", *paired_table(runs)]))


if __name__ == "__main__":
    main()
