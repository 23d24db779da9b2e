"""Real launchers for the launcher tier: install Debian's packages a test needs (SLURM, munge, OpenMPI) once.

CI runs as root on a Debian machine with the package mirror reachable, so the tier installs what it needs
itself (``apt-get install``), as the guide asks. Elsewhere (no root, no apt) a missing launcher skips the test
with the command that would install it.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

__all__ = ["ensure_debian_packages"]

#: Packages installed (or found) in this session, so that apt runs once per package.
_READY: set[str] = set()


def ensure_debian_packages(packages: dict[str, str], timeout: float = 900.0) -> None:
    """Make every ``binary`` of ``packages`` (Debian package -> a binary it provides) be on the PATH.

    Installs the missing packages with ``apt-get`` (as root); skips the calling test where that is not possible,
    and fails it where apt itself fails (a real error the developer must see).
    """
    missing = [p for p, binary in packages.items() if p not in _READY and shutil.which(binary) is None]
    if not missing:
        _READY.update(packages)
        return
    command = "apt-get install -y --no-install-recommends " + " ".join(missing)
    lock = ["-o", "DPkg::Lock::Timeout=300"]  # another install (a parallel job) waits for the lock, not fails
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"needs {', '.join(missing)}: run `sudo {command}`")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for args in (["apt-get", *lock, "update", "-qq"], [*command.split()[:1], *lock, *command.split()[1:]]):
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            pytest.fail(
                f"`{' '.join(args)}` failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
    still = [p for p in missing if shutil.which(packages[p]) is None]
    if still:
        pytest.fail(
            f"installed {', '.join(missing)} but {', '.join(packages[p] for p in still)} is not on the PATH"
        )
    _READY.update(packages)
