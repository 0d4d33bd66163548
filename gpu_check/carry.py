"""The carry for a lent GPU (.whl/: wheels of what the engine imports and the image lacks) and the rehearsal
environment that stands in for that image on this machine.

    python -m gpu_check.carry check [DIR]     # the carry installs on CPython 3.12 x86-64 and is complete
    python -m gpu_check.carry venv DIR        # a venv exposing only the image's distributions (rehearsal)

CARRIED names what the engine and scripts/gpu_check import that gpu_check/image_packages.txt lacks;
scripts/gpu_check_wheels downloads them at this checkout's versions. `check` verifies each wheel's tags against
CPython 3.12 on manylinux x86-64 (any ABI tag: abi3 and none too), one version per distribution, every
Requires-Dist (evaluated for Linux, Python 3.12.3) met by the carry or the image, the SmolLM2 tokenizer and
all-MiniLM-L6-v2 there, <= 64 MiB in all.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent
IMAGE_LIST = Path(__file__).resolve().parent / "image_packages.txt"
CARRIED = ("structlog", "pydantic", "pydantic_core", "annotated-types", "typing-inspection", "typing_extensions",
           "redis", "llguidance", "pyahocorasick")
# manylinux_2_31 is the only tag llguidance ships (cp39-abi3); the image is glibc 2.39 (Ubuntu 24.04)
PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
LIMIT = 64 << 20
NEVER_ON_IMAGE = ("redis", "pydantic", "structlog", "gguf", "llguidance", "pyahocorasick")


def image_packages() -> set[str]:
    words = " ".join(line for line in IMAGE_LIST.read_text().splitlines() if not line.startswith("#")).split()
    names = {canonicalize_name(w) for w in words}
    assert not names & {canonicalize_name(n) for n in NEVER_ON_IMAGE}, "the image list holds a carried package"
    return names


def gpu_tags() -> set[str]:
    platforms = [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)] + ["manylinux2014_x86_64", "linux_x86_64"]
    tags = list(cpython_tags((3, 12), platforms=platforms)) + list(compatible_tags((3, 12), "cp312", platforms))
    return {str(t) for t in tags}


def check(directory: Path) -> list[str]:
    """What is wrong with the carry in `directory` (empty when it is fit to travel)."""
    problems = []
    wheels = sorted(directory.glob("*.whl"))
    if not wheels:
        return [f"{directory} holds no wheels: run scripts/gpu_check_wheels"]
    tags, versions = gpu_tags(), {}
    for w in wheels:
        name, version, _, wheel_tags = parse_wheel_filename(w.name)
        if not {str(t) for t in wheel_tags} & tags:
            problems.append(f"{w.name} does not install on CPython 3.12 x86-64 (tags {sorted(map(str, wheel_tags))})")
        versions.setdefault(name, []).append(str(version))
    problems += [f"{n}: {len(v)} versions {v} (pip stops on two)" for n, v in versions.items() if len(v) > 1]
    missing = [n for n in CARRIED if canonicalize_name(n) not in versions]
    problems += [f"{n} is not carried (the image lacks it)" for n in missing]
    have = set(versions) | image_packages()
    env = default_environment() | {"python_version": "3.12", "python_full_version": "3.12.3",
                                   "sys_platform": "linux", "platform_system": "Linux",
                                   "platform_machine": "x86_64", "extra": ""}
    for w in wheels:
        for req in _requires(w):
            if req.marker is None or req.marker.evaluate(env):
                if canonicalize_name(req.name) not in have:
                    problems.append(f"{w.name} needs {req}, neither carried nor on the image")
    for folder, what in (("tokenizer", "the SmolLM2 tokenizer"), ("minilm", "all-MiniLM-L6-v2 (stage v)")):
        if not (directory / folder / "tokenizer.json").is_file():
            problems.append(f"{what} is not carried ({directory / folder})")
    total = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    if total > LIMIT:
        problems.append(f"the carry takes {total / 2**20:.1f} MiB; the run tool carries 64 MiB in all")
    return problems


def _requires(wheel: Path) -> list[Requirement]:
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines()
            if line.startswith("Requires-Dist:")]


def make_venv(directory: Path) -> Path:
    """A venv of this interpreter's base Python whose site-packages exposes (by symbolic links) only the
    distributions installed here that the image holds too; returns its python. Takes well under a second:
    no copy, no pip install of torch."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", "--clear", str(directory)], check=True)
    site = next((directory / "lib").glob("python3*/site-packages"))
    # the image's list, plus what torch, triton and transformers need at the versions installed here (the image
    # holds those three with their own dependencies, at its versions)
    allowed = image_packages() | _closure(("torch", "triton", "transformers"))
    for dist in md.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in allowed or dist.files is None:
            continue
        base = Path(dist.locate_file(""))
        tops = {f.parts[0] for f in dist.files if f.parts and f.parts[0] != ".." and not f.parts[0].endswith(".pth")}
        for top in tops:
            src, dst = base / top, site / top
            if src.exists() and not dst.exists():
                dst.symlink_to(src)
    if not (site / "torch").exists():
        raise SystemExit("the rehearsal venv has no torch: run it from the project's .venv")
    return directory / "bin" / "python"


def _closure(roots: tuple[str, ...]) -> set[str]:
    # newer releases here than on the image need some of the packages the image lacks (typer: pydantic):
    # those stay out, as they are on the image
    never = {canonicalize_name(n) for n in NEVER_ON_IMAGE} | {"pydantic-core"}
    seen, todo = set(), [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name in never:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def rehearsal_wheels(carry: Path, directory: Path) -> Path:
    """The carry as the rehearsal installs it: every wheel linked as it is, except that a wheel built for
    CPython 3.12 alone (pydantic_core) is replaced by its twin for this Python from carry/rehearse/."""
    directory.mkdir(parents=True, exist_ok=True)
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    twins = {parse_wheel_filename(w.name)[0]: w for w in (carry / "rehearse").glob("*.whl")}
    for w in carry.glob("*.whl"):
        name, _, _, tags = parse_wheel_filename(w.name)
        fits = any(t.interpreter in (here, "py3") or t.abi in ("abi3", "none") for t in tags)
        src = w if fits else twins.get(name)
        if src is None:
            raise SystemExit(f"{w.name} does not install on {here} and carry/rehearse has no twin of it: run "
                             "scripts/gpu_check_wheels")
        (directory / src.name).symlink_to(src)
    for folder in ("tokenizer", "minilm"):  # the SmolLM2 tokenizer, all-MiniLM-L6-v2 (gpu_check/env.py)
        if (carry / folder).is_dir():
            (directory / folder).symlink_to(carry / folder)
    return directory


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"]:
        directory = Path(argv[1]) if len(argv) > 1 else ROOT / ".whl"
        problems = check(directory)
        for p in problems:
            print(f"carry: {p}", file=sys.stderr)
        if not problems:
            total = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
            print(f"carry ok: {len(list(directory.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB, CPython 3.12 "
                  "x86-64")
        return 1 if problems else 0
    if argv[:1] == ["venv"] and len(argv) == 2:
        print(make_venv(Path(argv[1])))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
