"""Start a multi-process job the way users do (Lightning's launcher or torchrun) and never leave a process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[2]

#: Exit code reported when the job ran past its timeout and was killed.
TIMED_OUT = -9

T = TypeVar("T")


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The environment variable that makes a test script's rank 0 give the ranks it starts another hash seed.
CHILD_HASHSEED = "AUTOPART_TEST_CHILD_HASHSEED"


def hash_seeds_apart(*groups: tuple[str, ...]) -> tuple[int, int]:
    """Two values of PYTHONHASHSEED under which each of ``groups``, as a set of strings, iterates in another
    order (as two processes started without PYTHONHASHSEED may)."""

    def orders(seed: int) -> list[str]:
        code = f"print(*[list(set(g)) for g in {groups!r}], sep='|')"
        env = {"PYTHONHASHSEED": str(seed)}
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.split("|")

    first = orders(1)
    for seed in range(2, 64):
        if all(a != b for a, b in zip(first, orders(seed), strict=True)):
            return 1, seed
    raise AssertionError(f"no two hash seeds order {groups} differently")


def run_job(args: list[str], world: int, how: str = "lightning", timeout: float = 120.0) -> tuple[int, str]:
    """Run ``python *args`` on ``world`` processes; return (exit code or TIMED_OUT, output).

    ``how="lightning"`` runs the script once and lets Lightning's launcher start the other local ranks;
    ``how="torchrun"`` starts them all with ``torch.distributed.run``. The job runs in its own session, killed
    whole on timeout and afterwards (children of Lightning's launcher may outlive rank 0).
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if how == "torchrun":
        launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={world}", "--master_addr=127.0.0.1"]
        command = [sys.executable, *launcher, f"--master_port={free_port()}", *args]
    else:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        command = [sys.executable, *args]
    return run_session(command, env, timeout)


def run_session(command: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run ``command`` from the repository root in its own session; return (exit code or TIMED_OUT, output).

    The session is killed whole on timeout and afterwards (a launcher's children may outlive it)."""
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        code = TIMED_OUT
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return code, log.decode(errors="replace")


def side_by_side(jobs: Sequence[Callable[[], T]], longest: int = 0) -> list[T]:
    """Run independent ``jobs`` two at a time, ``jobs[longest]`` first beside the others in turn; their results
    in order. A launch leaves a core idle while its processes start and while its ranks wait for each other,
    and what the tests compare (losses, parameters) does not depend on timing."""
    order = [longest, *(i for i in range(len(jobs)) if i != longest)]
    with ThreadPoolExecutor(2) as pool:
        futures = {i: pool.submit(jobs[i]) for i in order}
        return [futures[i].result() for i in range(len(jobs))]
