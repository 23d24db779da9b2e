"""mpirun, as the RaNNC tutorial launches: ``mpirun -np 2 python examples/tutorial.py 64 512 10``.

Lightning sees an mpirun job through ``MPIEnvironment``, which needs ``mpi4py``: with it the two processes are one
job of 2 ranks. Debian's Open MPI (``openmpi-bin``) is installed by the tier (tests/launchers/system.py); mpi4py
(a manylinux wheel that loads the system's libmpi) is installed by the test into a directory of its own, on the
PYTHONPATH of the mpirun job only: in the test venv itself, Lightning would initialise MPI (and start Open MPI's
``orted``) in every Trainer of the suite, since it probes ``MPI.COMM_WORLD`` to detect mpirun.

What a user needs besides ``pip install mpi4py`` (and what the test sets): as root, ``--allow-run-as-root`` or
``OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``; more processes than cores needs ``--oversubscribe``
(``OMPI_MCA_rmaps_base_oversubscribe=1``); in a container without ptrace, ``OMPI_MCA_btl_vader_single_copy_mechanism
=none`` silences shared memory's warning.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.launch import ROOT, run_session
from tests.launchers.system import ensure_debian_packages

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

#: The mpi4py the mpirun jobs import (its wheels load Open MPI's or MPICH's libmpi at run time).
MPI4PY = "mpi4py==4.1.2"


def _mpi4py_dir() -> Path | None:
    """A directory holding mpi4py for the mpirun jobs, installed once per venv (None: the venv has it)."""
    if importlib.util.find_spec("mpi4py") is not None:
        return None
    target = Path(sys.prefix, "autopart-test-extras", MPI4PY.replace("==", "-"))
    if (target / "mpi4py").is_dir():
        return target
    staging = target.with_name(target.name + f".{os.getpid()}")
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(staging), MPI4PY]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(
            f"`{' '.join(command)}` failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    with contextlib.suppress(OSError):  # a concurrent run may have won: either copy is the same
        staging.rename(target)
    shutil.rmtree(staging, ignore_errors=True)
    return target


def _mpirun(args: list[str], python_path: list[Path], timeout: float = 300.0) -> tuple[int, str, float]:
    """Run ``mpirun *args`` from the repository root, ``python`` being this venv's; return (code, output, seconds).

    The job runs in its own session, killed whole on timeout and afterwards."""
    ensure_debian_packages({"openmpi-bin": "mpirun"})
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    env["OMPI_MCA_btl_vader_single_copy_mechanism"] = "none"
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in [*python_path, ROOT])
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    start = time.monotonic()
    code, out = run_session(["mpirun", *args], env, timeout)
    return code, out, time.monotonic() - start


def test_the_rannc_tutorial_command_trains_one_job_of_two_ranks() -> None:
    """The seed's command: one plan for 1 node x 2 CPU ranks, one job (not one per mpirun rank), both ranks
    finish, and the loss goes down from ~1.0 (docs of ``Net``)."""
    extra = [d for d in [_mpi4py_dir()] if d is not None]
    code, log, seconds = _mpirun(["-np", "2", "python", "examples/tutorial.py", "64", "512", "10"], extra)
    assert code == 0, f"mpirun exited with {code} after {seconds:.0f} s:\n{log[-4000:]}"
    assert log.count("Starting with 2 processes") == 1, f"not one job of 2 ranks:\n{log[-4000:]}"
    assert log.count("Plan for") == 1 and "on 1 node × 2 cpu" in log, "rank 0 prints the plan once"
    assert log.count("Finished on rank0") == 1 and log.count("Finished on rank1") == 1
    final = re.search(r"final train_loss=(\S+)", log)
    assert final is not None and math.isfinite(float(final[1])) and float(final[1]) < 0.9, log[-2000:]


def test_mpirun_without_mpi4py_is_refused_instead_of_running_a_job_per_rank(tmp_path: Path) -> None:
    """With no mpi4py, Lightning cannot see mpirun: each rank would start a whole job of its own (two trainings,
    four processes). Every rank refuses when its Trainer is made, naming the fix, unless mpirun stopped it first:
    mpirun aborts the job when the first rank exits non-zero, which can come before the other rank has printed."""
    hidden = tmp_path / "mpi4py"
    hidden.mkdir()
    (hidden / "__init__.py").write_text('raise ImportError("mpi4py hidden by the test")\n')
    code, log, seconds = _mpirun(
        ["-np", "2", "python", "examples/tutorial.py", "16", "32", "4"], [tmp_path], 120
    )
    assert code != 0 and "Plan for" not in log and seconds < 60, log[-4000:]
    message = (
        "ConfigError: this process is one of the 2 that mpirun started (OMPI_COMM_WORLD_SIZE), but Lightning cannot "
        "see MPI: install mpi4py (pip install mpi4py)"
    )
    refused = log.count(message)
    aborted = "the job has been aborted" in log
    assert refused == 2 or (refused == 1 and aborted), f"{refused} refusals, aborted: {aborted}\n{log[-4000:]}"
