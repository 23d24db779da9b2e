"""Run a job in which a fault is injected and time the exit of every process it started.

:func:`watch_job` (what tests call) runs this file as a script in a fresh process, which makes itself the
"child subreaper" of the job (``prctl(PR_SET_CHILD_SUBREAPER)``): a rank orphaned by its launcher's exit is
reparented to it, so it reaps every rank and reads its exit code, as well as timing it. Each rank writes
``OUT/pid{rank}`` (see ``_faults_script.py``); a rank that is stopped (SIGSTOP) once every other process has
exited, or anything still alive at the bound, is killed (SIGKILL) by its process id and reported so; a process
still running then is first sent SIGUSR2, on which the fault script prints every thread's stack, so the log
says where it waited. The bound runs from the launch, and at least ``after`` seconds past the fault (a slow
start-up on a loaded machine is not a hang). Only the processes the job started are ever signalled.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.distributed.launch import free_port  # noqa: E402

__all__ = ["Exit", "Watched", "watch_job"]

#: ``prctl`` option that makes orphaned descendants children of the caller.
_PR_SET_CHILD_SUBREAPER = 36
#: Seconds between two looks at the processes.
_POLL = 0.02
#: Seconds a process that is still running at the bound has to print its stacks (SIGUSR2) before it is killed.
_DUMP_WAIT = 1.0


@dataclass
class Exit:
    """How one process ended: when (``time.time()``), exit code (negative: killed by that signal; None: reaped
    by someone else, e.g. torchrun's agent), and whether the watcher had to kill it."""

    pid: int
    at: float | None = None
    code: int | None = None
    killed_by_watcher: str | None = None


@dataclass
class Watched:
    """A watched job: its launcher's exit, each rank's exit by rank, the output of every process, and when
    the fault struck (``time.time()`` written by the rank it hit to ``OUT/fault``; None if it never did)."""

    launcher: Exit
    ranks: dict[int, Exit] = field(default_factory=dict)
    log: str = ""
    fault_at: float | None = None

    def after_fault(self, rank: int | None = None) -> float:
        """Seconds from the fault to the exit of ``rank`` (None: of the last process to exit on its own)."""
        assert self.fault_at is not None, "the fault never struck:\n" + self.log[-3000:]
        if rank is not None:
            at = self.ranks[rank].at
            assert at is not None
            return at - self.fault_at
        ends = [
            e.at
            for e in (self.launcher, *self.ranks.values())
            if not e.killed_by_watcher and e.at is not None
        ]
        return max(ends) - self.fault_at


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat from the state (field 3) on, None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _reap_rest(exits: dict[int, Exit], until: float) -> None:
    """Reap the ranks that a launcher left behind as zombies (reparented here when it exited)."""
    while time.time() < until:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(_POLL)
        elif pid in exits:
            exits[pid].code = os.waitstatus_to_exitcode(status)


def _command(script: list[str], how: str, world: int) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if how == "torchrun":
        launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={world}", "--master_addr=127.0.0.1"]
        return [sys.executable, *launcher, f"--master_port={free_port()}", *script], env
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return [sys.executable, *script], env


def _fault_at(out: Path) -> float | None:
    """When the fault struck (``OUT/fault``), None before."""
    with contextlib.suppress(OSError, ValueError):
        return float((out / "fault").read_text())
    return None


def _watch(script: list[str], how: str, out: Path, world: int, bound: float, after: float) -> Watched:
    """Launch and watch (in the subreaper process)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    command, env = _command(script, how, world)
    log_path = out / "job.log"
    start = time.time()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    watched = Watched(Exit(proc.pid))
    exits = {proc.pid: watched.launcher}
    deadline = start + bound
    while True:
        now = time.time()
        while True:  # reap the launcher and every orphaned rank
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in exits:
                exits[pid].code = os.waitstatus_to_exitcode(status)
                exits[pid].at = exits[pid].at if exits[pid].at is not None else now
        for rank in range(world):
            path = out / f"pid{rank}"
            if rank not in watched.ranks and path.exists() and path.read_text().strip():
                watched.ranks[rank] = exits.setdefault(int(path.read_text()), Exit(int(path.read_text())))
        stats = {pid: _stat(pid) for pid, e in exits.items() if e.at is None}
        states = {pid: stat[0] if stat else None for pid, stat in stats.items()}
        for pid, stat in stats.items():
            if stat is None or stat[0] == "Z":
                exits[pid].at = now
            if stat and stat[0] == "Z" and len(stat) > 49:  # field 52: a zombie's wait status (before a reap)
                exits[pid].code = os.waitstatus_to_exitcode(int(stat[49]))
        running = [pid for pid, state in states.items() if state not in (None, "Z", "T", "t")]
        stopped = [pid for pid, state in states.items() if state in ("T", "t")]
        if not running and stopped:  # a frozen rank outlives the others: end it, as an operator would
            for pid in stopped:
                os.kill(pid, signal.SIGKILL)
                exits[pid].killed_by_watcher = "stopped"
        if not running and not stopped and exits[proc.pid].code is not None:
            break
        struck = _fault_at(out)
        if struck is not None:
            deadline = max(deadline, struck + after)
        if now > deadline:
            for pid in running:  # where it waits, in the log
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR2)
            time.sleep(_DUMP_WAIT if running else 0.0)
            for pid in running + stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                exits[pid].killed_by_watcher = f"alive {now - start:.0f} s after the launch"
        time.sleep(_POLL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything left in the job's session
    _reap_rest(exits, time.time() + 2.0)
    proc.returncode = watched.launcher.code  # reaped above: keep Popen from waiting on it again
    watched.log = log_path.read_text(errors="replace")
    if how == "torchrun":  # the agent reaped the ranks: its summary has their exit codes
        for rank, code in re.findall(
            r"rank\s*:\s*(\d+) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)", watched.log
        ):
            if int(rank) in watched.ranks and watched.ranks[int(rank)].code is None:
                watched.ranks[int(rank)].code = int(code)
    return watched


def watch_job(
    script: list[str], out: Path, how: str = "lightning", world: int = 2, bound: float = 60.0, after: float = 60.0
) -> Watched:
    """Run ``python *script`` on ``world`` processes (Lightning's launcher or torchrun) and time every exit;
    anything alive ``bound`` seconds after the launch and ``after`` seconds after the fault is killed (and
    reported so)."""
    config = {"script": script, "how": how, "out": str(out), "world": world, "bound": bound, "after": after}
    done = subprocess.run(
        [sys.executable, __file__, json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=bound + after + 60,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    ranks = {int(r): Exit(**e) for r, e in result["ranks"].items()}
    return Watched(Exit(**result["launcher"]), ranks, (out / "job.log").read_text(errors="replace"), _fault_at(out))


if __name__ == "__main__":
    given = json.loads(sys.argv[1])
    seen = _watch(
        given["script"], given["how"], Path(given["out"]), given["world"], given["bound"], given["after"]
    )
    print(
        json.dumps(
            {"launcher": asdict(seen.launcher), "ranks": {r: asdict(e) for r, e in seen.ranks.items()}}
        )
    )
