"""The tree says what each part is: no import cycle, each part imports only the parts below it on the data path,
and docs/architecture.md names every module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "producer", "gateway", "worker", "tokenbus_kernels", "testbed", "bench", "gpu_check",
            "benchmarks")
# who may import whom: the contract is at the bottom; the client, the gateway and the worker sit on it side by
# side; tokenbus_kernels knows nothing of the rest; testbed (throwaway Redis servers, tiny models, a gateway's
# processes) sits on the worker; bench (`tokenbus bench`) and the GPU check measure the worker with testbed's parts;
# benchmarks may use anything that ships. Nothing imports tests/ (test_nothing_outside_tests_imports_tests).
ALLOWED = {
    "protocol": {"protocol"},
    "producer": {"protocol", "producer"},
    "gateway": {"protocol", "producer", "gateway"},
    "worker": {"protocol", "worker", "tokenbus_kernels"},
    "tokenbus_kernels": {"tokenbus_kernels"},
    "testbed": {"testbed", "protocol", "worker"},
    "bench": {"bench", "protocol", "producer", "worker", "tokenbus_kernels", "testbed"},
    "gpu_check": {"gpu_check", "bench", "protocol", "worker", "tokenbus_kernels", "testbed"},
    "benchmarks": set(PACKAGES),
}


def modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """Every project module `path` imports, anywhere in the file (a lazy import or one under TYPE_CHECKING
    still ties the two modules together)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, name, known) for name, path in known.items()}


def test_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            # a package's own __init__ re-exporting its submodules is how packages work, not a cycle
            if nxt == node.rpartition(".")[0] or node == nxt.rpartition(".")[0]:
                continue
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_each_part_imports_only_what_is_below_it():
    wrong = [f"{name} imports {dep}" for name, deps in graph().items() for dep in sorted(deps)
             if dep.split(".")[0] not in ALLOWED[name.split(".")[0]]]
    assert not wrong, "\n".join(wrong)


def rooms_tree() -> set[str]:
    """The paths the tree in docs/architecture.md's "Rooms" section names: two spaces of indent per folder,
    the names of a line before the first run of two spaces ("a.py, b.py" names both)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = doc[doc.index("## Rooms"):].split("```")[1]
    named, stack = set(), []  # stack: (indent, folder path)
    for line in block.splitlines():
        if not line.strip() or not (line.lstrip()[0].isalnum() or line.lstrip()[0] == "_"):
            continue
        indent = len(line) - len(line.lstrip())
        head = line.strip().split("  ")[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        folder = stack[-1][1] if stack else ""
        for name in (n.strip() for n in head.split(",")):
            path = folder + name
            named.add(path.rstrip("/"))
            if name.endswith("/"):
                stack.append((indent, path))
    return named


def test_architecture_doc_names_every_module():
    named = rooms_tree()
    missing = [rel for path in modules().values()
               if (rel := path.relative_to(ROOT).as_posix()).split("/")[0] != "benchmarks"
               and path.name != "__init__.py" and rel not in named]
    assert not missing, "docs/architecture.md's Rooms tree does not name: " + ", ".join(sorted(missing))


def imports_tests(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(n == "tests" or n.startswith("tests.") for n in names):
            return True
    return False


def test_nothing_outside_tests_imports_tests():
    # tests/ is the one part that never ships: what a benchmark, a script or a shipped package needs from it
    # belongs in testbed/ (or the benchmarks' harness)
    python_scripts = [p for p in (ROOT / "scripts").iterdir() if p.is_file() and (
        p.suffix == ".py" or p.read_text(errors="replace").startswith("#!/usr/bin/env python"))]
    offenders = [path.relative_to(ROOT).as_posix() for path in [*modules().values(), *python_scripts]
                 if imports_tests(path)]
    assert not offenders, "these import tests/: " + ", ".join(sorted(offenders))


def test_benchmarks_top_level_holds_only_its_readme_and_init():
    top = sorted(p.name for p in (ROOT / "benchmarks").iterdir()
                 if p.is_file() or (p.is_dir() and p.name != "__pycache__" and not (p / "__init__.py").exists()))
    assert top == ["README.md", "__init__.py"], f"benchmarks/ keeps its scripts in subject folders: {top}"


def benchmark_modules() -> list[str]:
    """Every runnable benchmark: the modules under benchmarks/ with a __main__ block, and the GPU check's two
    (gpu_check/*_bench.py: the GPU stages measure with them)."""
    found = []
    for pkg, pattern in (("benchmarks", "*.py"), ("gpu_check", "*_bench.py")):
        for path in sorted((ROOT / pkg).rglob(pattern)):
            if path.name != "__main__.py" and "__main__" in path.read_text():
                found.append(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return found


FOREIGN = ("benchmarks.harness.vllm_cpu",)  # runs inside vLLM's own venv: only imported here


def test_every_benchmark_starts_from_its_place():
    """`python -m NAME --help` for every benchmark (benchmarks/ by subject, the GPU check's two, and
    `tokenbus bench`'s subcommands) in one process: each imports from its package (no sys.path edits) and
    parses its arguments. --help must stop a script before it measures anything (a run here would rewrite its
    docs/ results)."""
    import subprocess
    import sys

    scripts = benchmark_modules()
    assert len(scripts) >= 20, scripts
    no_parser = [s for s in scripts if s not in FOREIGN and not any(
        parser in (ROOT / (s.replace(".", "/") + ".py")).read_text()
        for parser in ("argparse", "parser(", "bench_parser("))]
    assert not no_parser, f"benchmarks without an argument parser (--help would run them): {no_parser}"
    code = "\n".join([
        "import importlib, runpy, sys",
        f"for name in {scripts!r}:",
        f"    if name in {FOREIGN!r}:",
        "        importlib.import_module(name); continue",
        "    sys.argv = [name, '--help']",
        "    try:",
        "        runpy.run_module(name, run_name='__main__', alter_sys=True)",
        "    except SystemExit as e:",
        "        assert e.code in (0, None), (name, e.code)",
    ])
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # `tokenbus bench SUB --help`: through the CLI, which hands off to `python -m bench` (a process of its own)
    from bench.__main__ import COMMANDS

    for sub in COMMANDS:
        cli = subprocess.run([sys.executable, "-c", "from producer.cli import main; main()", "bench", sub, "--help"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert cli.returncode == 0 and f"tokenbus bench {sub}" in cli.stdout, (sub, cli.stderr[-2000:])
        assert all(flag in cli.stdout for flag in ("--rounds", "--json")), (sub, cli.stdout)


ROUTE_METHODS = {"get", "post", "put", "patch", "delete", "head", "options", "trace", "api_route", "route",
                 "websocket", "add_api_route", "add_route", "add_websocket_route", "add_api_websocket_route"}


def routes_in(path: Path) -> list[int]:
    """Lines of `path` that declare an HTTP route: a route decorator (`@router.get(...)`, `@app.post(...)`)
    or a call adding one (`app.add_api_route(...)`)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        decorators = getattr(node, "decorator_list", [])
        calls = [d for d in decorators if isinstance(d, ast.Call)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("add_"):
            calls.append(node)
        lines += [c.lineno for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr in ROUTE_METHODS]
    return lines


def test_every_gateway_route_lives_in_api():
    """A newcomer finds an endpoint by its resource under gateway/api/. The dashboard's pages are their own
    room (gateway/ui/: HTML for people, not the API)."""
    gateway = ROOT / "gateway"
    outside = [f"{path.relative_to(ROOT)}:{line}" for path in sorted(gateway.rglob("*.py"))
               if path.relative_to(gateway).parts[0] not in ("api", "ui") for line in routes_in(path)]
    assert not outside, "gateway routes outside gateway/api/: " + ", ".join(outside)
    assert routes_in(gateway / "api" / "files.py"), "the route finder finds no route where there are some"
