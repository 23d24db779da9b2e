"""A throwaway SLURM cluster on this machine: munged, slurmctld and one slurmd per "node", all in one directory.

Debian's ``slurm-wlm`` (22.05) and ``munge`` run as root in the foreground (no systemd), on free ports, with
every file (config, key, socket, state, spool, logs) under one directory, so they touch nothing of the machine's
own and leave nothing behind. Several nodes on one machine: each ``slurmd -N nodeK`` listens on its own port
(``NodeName=nodeK NodeHostname=HOST NodeAddr=127.0.0.1 Port=...``), which Debian's build allows
(``scontrol show config``: ``MULTIPLE_SLURMD = Yes``), so ``sbatch --nodes=2`` starts a real 2-node job here.
The names ``node1``... resolve nowhere: a job's rendezvous needs ``MASTER_ADDR=127.0.0.1`` in its environment.

By hand, from the repository root (as root; ``apt-get install slurm-wlm munge`` first)::

    python -m tests.launchers.slurm_cluster /tmp/slurm --nodes 2 --cpus 2
    # then, in another shell: export SLURM_CONF=/tmp/slurm/etc/slurm.conf; sinfo; sbatch ...; Ctrl+C stops it
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

__all__ = ["SlurmCluster", "SlurmError", "main"]

#: The environment variable every process of the cluster carries (the daemons, and jobs submitted with
#: :meth:`SlurmCluster.env`), set to its directory: teardown finds and kills exactly these.
MARKER = "AUTOPART_SLURM_CLUSTER"

#: Seconds a requeued job waits before it may start again (SLURM's ``cred_expire``; 120 by default).
REQUEUE_DELAY = 5

#: Binaries of Debian's ``slurm-wlm`` and ``munge`` packages that the cluster runs.
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "scancel")


class SlurmError(RuntimeError):
    """The cluster could not start (the message holds the daemons' logs) or a SLURM command failed."""


def _free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports nobody listens on now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


class SlurmCluster:
    """A SLURM cluster of ``nodes`` nodes with ``cpus`` CPUs each, living in ``root`` (a context manager).

    Args:
        root: An empty or missing directory that holds everything the cluster writes.
        nodes: How many ``slurmd`` (nodes ``node1``...), each on its own port.
        cpus: CPUs each node declares (more than the machine has is fine: ``config_overrides``).
    """

    def __init__(self, root: Path | str, nodes: int = 2, cpus: int = 2) -> None:
        self.root = Path(root).resolve()
        self.nodes = [f"node{k}" for k in range(1, nodes + 1)]
        self.cpus = cpus
        self.conf = self.root / "etc" / "slurm.conf"
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}

    # -- configuration -------------------------------------------------------------------------------------

    def slurm_conf(self, controller_port: int, node_ports: list[int]) -> str:
        """The ``slurm.conf`` text: no cgroups, no accounting, no task binding, fast requeue and job purge."""
        r, host = self.root, socket.gethostname().split(".")[0]
        lines = [
            "ClusterName=autopart",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={controller_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # socket: our own munged; cred_expire: how long a requeued job waits before it starts again
            f"AuthInfo=socket={r}/munge/munge.socket,cred_expire={REQUEUE_DELAY}",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd.%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd.%n.log",
            f"PlugStackConfig={r}/etc/plugstack.conf",
            "ProctrackType=proctrack/linuxproc",  # finds a job's processes by parentage: no cgroups
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1",  # a requeued job starts when eligible, not up to 60 s later
            "SlurmdParameters=config_overrides",  # nodes may declare more CPUs than the machine has
            "ReturnToService=2",
            "MinJobAge=4",  # sbatch --wait polls every 2 s (not 8, then 32) when this is at most 4
            "KillWait=30",  # seconds between a job end's SIGTERM and SIGKILL (SLURM's default)
            "MessageTimeout=20",
            "InactiveLimit=0",
            "SlurmdTimeout=60",
            "SlurmctldTimeout=60",
        ]
        for name, port in zip(self.nodes, node_ports, strict=True):
            lines.append(
                f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} "
                "State=UNKNOWN"
            )
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment for SLURM commands (``sbatch``, ``srun``...) of this cluster; jobs inherit it."""
        env = dict(os.environ if base is None else base)
        for key in [k for k in env if k.startswith("SLURM_")]:
            env.pop(key)
        return env | {"SLURM_CONF": str(self.conf), MARKER: str(self.root)}

    # -- lifecycle -----------------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        """Write the files, start munged, slurmctld and every slurmd, and wait until every node is idle."""
        missing = [b for b in BINARIES if shutil.which(b) is None]
        if missing:
            raise SlurmError(f"{', '.join(missing)} not found: apt-get install slurm-wlm munge")
        for sub in ("etc", "munge", "state", "run", "log", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o755)  # munged wants its socket's directory to be reachable
        key = self.root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        ports = _free_ports(1 + len(self.nodes))
        self.conf.write_text(self.slurm_conf(ports[0], ports[1:]))
        (self.root / "etc" / "plugstack.conf").write_text("")
        try:
            m = self.root / "munge"
            self._spawn(
                "munged",
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--socket={m}/munge.socket",
                    f"--key-file={key}",
                    f"--log-file={m}/munged.log",
                    f"--pid-file={m}/munged.pid",
                    f"--seed-file={m}/munged.seed",
                ],
            )
            self._wait(lambda: (m / "munge.socket").exists(), timeout, "munged to open its socket")
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            self._wait(
                lambda: self.run("scontrol", "ping", check=False).returncode == 0,
                timeout,
                "slurmctld to answer",
            )
            for name in self.nodes:
                self._spawn(f"slurmd.{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])
            self._wait(self._all_idle, timeout, f"nodes {', '.join(self.nodes)} to be idle")
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, command: list[str]) -> None:
        log = (self.root / "log" / f"{name}.out").open("wb")
        with log:
            self._daemons[name] = subprocess.Popen(
                command, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = {n: p.returncode for n, p in self._daemons.items() if p.poll() is not None}
            if dead or time.monotonic() > deadline:
                why = f"exited: {dead}" if dead else f"not after {timeout:.0f} s"
                raise SlurmError(f"waiting for {what}: {why}\n{self.logs()}")
            time.sleep(0.1)

    def _all_idle(self) -> bool:
        done = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return all(states.get(n, "").rstrip("*") == "idle" for n in self.nodes)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel every job, stop the daemons (munged last: the others authenticate through it), then kill any
        process still carrying this cluster's marker (a job's tasks, a slurmstepd) until none is left."""
        controller = self._daemons.get("slurmctld")
        if controller is not None and controller.poll() is None:
            self.run("scancel", "--full", "--signal=KILL", "--user=root", check=False, timeout=10)
        munged = self._daemons.pop("munged", None)
        for process in self._daemons.values():
            if process.poll() is None:
                process.terminate()
        for process in [*self._daemons.values(), *([munged] if munged is not None else [])]:
            if process is munged and process.poll() is None:
                process.terminate()
            _reap(process)
        self._daemons = {}
        deadline = time.monotonic() + timeout
        while (left := self.leftovers()) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def leftovers(self) -> list[int]:
        """Processes still running that belong to this cluster: its environment marker or its SLURM_CONF."""
        found, me = [], os.getpid()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            mine = {f"{MARKER}={self.root}".encode(), f"SLURM_CONF={self.conf}".encode()}
            if state != "Z" and mine.intersection(environ):
                found.append(int(entry.name))
        return found

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    # -- use -----------------------------------------------------------------------------------------------

    def run(
        self, *command: str, check: bool = True, timeout: float = 30.0, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a SLURM command of this cluster; raises :class:`SlurmError` on failure when ``check``."""
        done = subprocess.run(
            list(command), env=self.env(env), capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise SlurmError(f"`{' '.join(command)}` failed ({done.returncode}): {done.stdout}{done.stderr}")
        return done

    def job(self, job_id: int | str) -> dict[str, str]:
        """``scontrol show job``'s fields (``JobState``, ``Restarts``, ``ExitCode``...); empty once purged."""
        done = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        fields: dict[str, str] = {}
        for word in done.stdout.split():
            key, _, value = word.partition("=")
            fields.setdefault(key, value)
        return fields

    def logs(self, tail: int = 3000) -> str:
        """The last ``tail`` characters of every daemon's log, for a failure message."""
        parts = []
        for path in sorted([*(self.root / "log").glob("*"), self.root / "munge" / "munged.log"]):
            if path.is_file():
                parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)


def _reap(process: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """Wait for ``process`` (already sent SIGTERM); SIGKILL its whole session after ``grace`` seconds."""
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def main(argv: list[str] | None = None) -> None:
    """Start a cluster by hand and keep it up until Ctrl+C (or SIGTERM), then tear it down."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", type=Path, help="directory for its config, keys, state and logs")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=2, help="CPUs each node declares")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with SlurmCluster(args.root, args.nodes, args.cpus) as cluster:
        print(
            f"SLURM is up: {', '.join(cluster.nodes)}.\n  export SLURM_CONF={cluster.conf}\nCtrl+C stops it."
        )
        sys.stdout.flush()
        with contextlib.suppress(KeyboardInterrupt):
            while all(p.poll() is None for p in cluster._daemons.values()):
                time.sleep(1)
    print("SLURM stopped.")


if __name__ == "__main__":
    main()
