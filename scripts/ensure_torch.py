"""Make sure the current interpreter has torch without ever replacing one or pulling CUDA packages by accident.

- torch already importable (system site packages, a user install): keep it, whatever its version.
- otherwise, on a machine with an NVIDIA driver: install torch from PyPI (CUDA build, the user asked for GPUs).
- otherwise (CPU only): install torch==$TORCH_VERSION (default 2.13.0) from a local wheel directory when pip has one
  configured (find-links), else from PyTorch's CPU-only index, so no CUDA wheels are downloaded.
- only when AUTOPART_TORCH_FROM_PYPI=1 (``make test-torch`` sets it: the user asked for that version by name) and
  neither of those has it: PyPI's build, a CUDA build of several GB on x86_64 that also runs on a CPU.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import sys


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.check_call(cmd)


def _local_wheel_dirs() -> list[str]:
    links = os.environ.get("PIP_FIND_LINKS", "")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
        ).stdout
    except OSError:
        out = ""
    for line in out.splitlines():
        if "find-links" in line:
            links += " " + line.split("=", 1)[1].strip("'\" ")
    return [d for d in links.split() if os.path.isdir(d)]


def main() -> int:
    if importlib.util.find_spec("torch") is not None:
        import torch

        print(f"keeping the installed torch {torch.__version__}")
        return 0
    version = os.environ.get("TORCH_VERSION", "2.13.0")
    if shutil.which("nvidia-smi"):
        _pip(f"torch=={version}")
        return 0
    if any(glob.glob(os.path.join(d, f"torch-{version}*.whl")) for d in _local_wheel_dirs()):
        _pip(f"torch=={version}")
        return 0
    try:
        _pip(f"torch=={version}", "--index-url", "https://download.pytorch.org/whl/cpu")
    except subprocess.CalledProcessError:
        if os.environ.get("AUTOPART_TORCH_FROM_PYPI") != "1":
            print(
                f"torch=={version} is neither in a local wheel directory nor on PyTorch's CPU index here; "
                "install it yourself, or set AUTOPART_TORCH_FROM_PYPI=1 to take PyPI's (CUDA) build",
                file=sys.stderr,
            )
            raise
        _pip(f"torch=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
