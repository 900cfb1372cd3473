"""The reference implementation's own environment, built once under .cache/ and kept apart from the
project's: `speculators==0.9.0` pins transformers<=5.19.0, older than the project's. Its own
site-packages hold speculators, hs-connectors and transformers 5.19.0 (installed --no-deps) and the
few packages speculators' imports need (loguru, openai, pydantic-settings); a .pth file appends the
project venv's site-packages after them, so torch, safetensors and the rest are shared, and the
older transformers shadows the project's. About half a minute the first time."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV = REPO / ".cache" / "reference-env" / "speculators-0.9.0"
PINNED = ["speculators==0.9.0", "hs-connectors==0.9.0", "transformers==5.19.0"]
IMPORTS_NEED = ["loguru", "openai", "pydantic-settings"]


def python() -> Path:
    """The reference environment's interpreter, built if needed."""
    exe = ENV / "bin" / "python"
    stamp = ENV / ".ready"
    if stamp.is_file() and exe.exists():
        return exe
    ENV.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(ENV)], check=True)
    own = subprocess.run([str(exe), "-c", "import site; print(site.getsitepackages()[0])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    shared = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(own) / "mtp-project-venv.pth").write_text("\n".join(shared) + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(exe), "install", "--quiet",
           "--disable-pip-version-check"]
    env = {**os.environ, "PIP_NO_INPUT": "1"}
    subprocess.run([*pip, "--no-deps", *PINNED], check=True, env=env)
    subprocess.run([*pip, *IMPORTS_NEED], check=True, env=env)
    check = subprocess.run([str(exe), "-c", "import transformers, speculators.models.eagle3; "
                            "print(transformers.__version__)"], capture_output=True, text=True)
    if check.returncode != 0 or check.stdout.strip() != "5.19.0":
        raise RuntimeError(f"reference environment at {ENV} is not usable: {check.stderr[-2000:]}")
    stamp.write_text("ok\n")
    return exe
