"""A failing or frozen rank brings every rank down in seconds; every rank says which rank failed and why.

[Note: failing ranks] What kept a job alive after one rank failed (issue 11): gloo cannot cancel an operation.
A receiver of the log channel posts its asynchronous broadcast receive before each step's schedule runs (see
[Note: log channel]). When its own step then raises (the first stage's ``training_step``, an out-of-memory in
its forward), that receive still waits, on a thread of the gloo group, for the last stage's message, while the
last stage waits for this rank's activations. The exception reaches the top, Python finalises, the group's
destructor (``~ProcessGroupGloo``) joins the waiting thread, and nothing moves until the peer's receive times
out: the strategy's ``timeout``, 30 minutes by default. After a frozen peer's timeout, the same destructor
waits for ever on the sends it still holds. ``ProcessGroup.abort()`` does nothing on gloo (torch 2.11 to
2.13), and destroying a group is the very destructor that blocks; any pending asynchronous operation can do
the same (the pre-emption all-reduce posted at each step boundary, a gradient bucket's all-reduce).

So, at the first exception of a fit (``Strategy.on_exception``), :meth:`FaultGuard.on_exception`:

1. When the error is this rank's own, writes ``rank N (stage S) failed first: ErrorType: message`` (of the
   root cause) to the job's store (the default group's c10d store; ``compare_set``: the first report stays),
   before anything can make a peer notice.
2. When the error is a collective that failed because of a peer (gloo's "Connection closed by peer" or its
   timeout, an NCCL or store error), reads that report and puts a line first in the exception's message (and
   on stderr at once: a launcher may kill this process any moment): the first failure and why; or, with no
   report, what this rank waited for (the operation, from the traceback's frames: the pipeline's
   activations/gradients, the log channel broadcast, the gradient all-reduce...), from which ranks (the plan's
   placement) and how their processes are where they run on this host (gone, stopped, killed by a signal;
   when they only wait too, a frozen rank further along is named: the nearest stopped or gone on this host); or
   that the store is gone too, which under Lightning's launcher means that rank 0, its host, ended first. A
   rank writes its report before it goes down, so before a peer can see a closed connection: nobody waits for
   one.
3. Abandons the log channel's pending messages (teardown waits for none) and aborts every process group
   (``_abort_process_group``: NCCL's communicators are aborted; for gloo the world's bookkeeping is cleared,
   so no later barrier or broadcast waits on a dead peer). The group objects are kept: their destructors
   block.
4. Arms the exit guard (``exits.py``): the process exits with code 1 right after its exit handlers, skipping
   the destructors. Its sockets close, every peer waiting on it fails at once with "connection closed", runs
   this same hook and exits; the ranks waiting on a frozen peer fail at ``timeout``, then exit the same way.

Nothing here runs on a healthy step: the guard stores this rank's host and process id once, at setup. Only an
``Exception`` is handled: a ``SystemExit`` (pre-emption's ``Preempted``, ``sys.exit``) or a
``KeyboardInterrupt`` keeps its own way out and exit code.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import threading
import traceback
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning import exits
from lightning_autopart.plan import Plan
from lightning_autopart.runtime.topology import Placement

if TYPE_CHECKING:
    from lightning_autopart.lightning.split import Partition

__all__ = ["STORE_WAIT", "FaultGuard", "peer_failure"]

#: Seconds a store operation may take after a failure (the store's host may be frozen).
STORE_WAIT = 2.0

#: Peer ranks named one by one in a message (more are counted).
_NAMED = 8
#: Other ranks (the nearest) whose processes a rank looks at when its own peers only wait, like it.
_SCANNED = 64
#: How a process that runs is described.
_RUNNING = "is still running"
#: Messages of a collective that failed because of a peer (gloo, NCCL, the store).
_BACKEND = re.compile(
    r"gloo|nccl|connection (?:closed|reset)|closed by peer|broken pipe|processgroup|remote process", re.I
)
_TIMED_OUT = re.compile(r"timed out|timeout", re.I)

#: (a fragment of a traceback frame's path, what the code there waits for, whose part: see :func:`_peers`);
#: the innermost frame that matches names the operation of a failed collective.
_OPERATIONS = (
    (
        "lightning_autopart/lightning/log_channel.py",
        "the log channel broadcast (the last stage's logs)",
        "pipeline",
    ),
    ("lightning_autopart/lightning/preemption.py", "the pre-emption flag's all-reduce", "world"),
    ("lightning_autopart/runtime/buckets.py", "the gradient all-reduce", "replicas"),
    ("lightning_autopart/runtime/gradients.py", "the gradient norm's or overflow's all-reduce", "pipeline"),
    ("lightning_autopart/runtime/wire.py", "the pipeline's first exchange of shapes", "neighbours"),
    ("torch/distributed/pipelining/", "the pipeline's activations/gradients", "neighbours"),
)

#: What the state letter of ``/proc/PID/stat`` says about a peer's process.
_STATES = {
    "T": "is stopped (SIGSTOP, or a debugger)",
    "t": "is stopped by a debugger",
    "D": "is stuck in the kernel (uninterruptible I/O)",
}


def peer_failure(exception: BaseException) -> str | None:
    """``"timeout"`` or ``"closed"`` when ``exception`` (or its cause) is a collective that failed because of
    a peer; None when the error is this rank's own."""
    seen: BaseException | None = exception
    while seen is not None:  # pipelining raises a stage's error as the cause of its own
        if isinstance(seen, getattr(dist, "DistError", ())) or (
            isinstance(seen, RuntimeError) and _BACKEND.search(str(seen))
        ):
            return "timeout" if _TIMED_OUT.search(str(seen)) else "closed"
        seen = seen.__cause__
    return None


def _summary(exception: BaseException) -> str:
    """``ErrorType: first line of the message`` of the root cause, shortened (pipelining wraps a stage's error
    in a ``RuntimeError`` naming the stage)."""
    while exception.__cause__ is not None:
        exception = exception.__cause__
    lines = str(exception).strip().splitlines()
    text = lines[0] if lines else ""
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(exception).__name__}: {text}" if text else type(exception).__name__


def _who(rank: int, plan: Plan | None) -> str:
    """``rank 1 (stage 1)``, or ``rank 1`` before there is a plan."""
    stages = [s.index for s in plan.stages if rank in s.ranks] if plan is not None else []
    if not stages:
        return f"rank {rank}"
    return f"rank {rank} ({'stage' if len(stages) == 1 else 'stages'} {', '.join(map(str, stages))})"


def _operation(exception: BaseException) -> tuple[str, str]:
    """What the failed collective was for, and whose part it waited for, from the innermost frame of the
    traceback that names it."""
    for frame in reversed(traceback.extract_tb(exception.__traceback__)):
        path = frame.filename.replace(os.sep, "/")
        for fragment, what, over in _OPERATIONS:
            if fragment in path:
                return what, over
    return "a collective of every rank", "world"


def _peers(over: str, placement: Placement | None, rank: int, world: int) -> list[int]:
    """The ranks this rank waits on in an operation over ``over``: its pipeline ``"neighbours"``, the rest of
    its ``"pipeline"``, its stage's ``"replicas"``, or the ``"world"``."""
    if placement is None or over == "world":
        return [r for r in range(world) if r != rank]
    if over == "replicas":
        return [r for r in placement.dp_ranks if r != rank]
    ranks = list(placement.pp_ranks)
    if over == "neighbours" and len(placement.stages) == 1 and rank in ranks:
        i = ranks.index(rank)
        return [ranks[j] for j in (i - 1, i + 1) if 0 <= j < len(ranks)]
    return [r for r in ranks if r != rank]


def _process_state(pid: int) -> str:
    """How a process on this host is: running, stopped, gone or, while its parent has not reaped it yet (a
    launcher reaps its ranks within a fraction of a second), how it ended."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return "is gone (killed, e.g. by kill -9 or the out-of-memory killer, or crashed)"
    if fields[0] != "Z":
        return _STATES.get(fields[0], _RUNNING)
    if len(fields) < 50 or not fields[49].isdigit():  # field 52: the wait status (Linux 3.5 and later)
        return "has ended"
    status = int(fields[49])
    if os.WIFEXITED(status):
        return f"exited with code {os.WEXITSTATUS(status)}"
    try:
        return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    except ValueError:
        return f"was killed by signal {os.WTERMSIG(status)}"


def _rewrite(exception: BaseException, message: str) -> None:
    """Put ``message`` first in ``exception``'s message (the backend's follows), as Lightning's DDP does."""
    if exception.args and isinstance(exception.args[0], str):
        exception.args = (f"{message}\n{exception.args[0]}", *exception.args[1:])
    else:
        exception.args = (message, *exception.args)


class FaultGuard:
    """One strategy's failure handling (see [Note: failing ranks]): :meth:`arm` once the process group is up,
    :meth:`on_exception` from ``Strategy.on_exception``."""

    def __init__(self) -> None:
        self.rank = 0
        self.world = 1
        self.timeout: timedelta | None = None
        #: Whether this process has seen a failure (its process groups are aborted).
        self.failed = False
        self._store: Any = None
        self._prefix = "autopart/"
        self._trouble: str | None = None  # what is wrong with the store, once known
        self._probed = False
        self._kept: list[Any] = []  # aborted process groups: destroyed at exit, which the exit guard skips

    def arm(self, rank: int, world: int, timeout: timedelta | None) -> None:
        """Keep the job's store, publish this rank's host and process id (for a peer's diagnosis) and install
        the exit guard."""
        self.rank, self.world, self.timeout = rank, world, timeout
        self.failed, self._trouble, self._probed = False, None, False
        # An elastic restart reuses torchrun's store: keep each attempt's reports apart.
        self._prefix = f"autopart/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        try:
            self._store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError):
            self._store = None
        if self._store is not None:  # every rank is healthy now: a plain call
            with contextlib.suppress(Exception):
                self._store.set(f"{self._prefix}pid/{rank}", f"{socket.gethostname()} {os.getpid()}")
        exits.install()
        exits.patient_launcher()

    def on_exception(self, exception: BaseException, part: Partition | None = None) -> None:
        """Report or explain ``exception`` (``part``: this rank's split, None before the plan exists),
        abandon the log channel's pending messages, abort the process groups and arm the exit guard."""
        if self.failed or self.world < 2 or not isinstance(exception, Exception):
            return
        if isinstance(exception, ConfigError) and (part is None or part.steps.channel.idle):
            # A refusal of bad input, raised alike on every rank by the up-front checks with nothing posted:
            # no peer waits on this rank, and the script may catch it and go on with the process group.
            return
        self.failed = True
        plan = part.plan if part is not None else None
        placement = part.steps.runner.placement if part is not None else None
        if part is not None:
            part.steps.channel.abandon()
        who = _who(self.rank, plan)
        kind = peer_failure(exception)
        if kind is None:
            self._report(f"{who} failed first: {_summary(exception)}")
        else:
            message = self._explain(exception, kind, who, plan, placement)
            print(message, file=sys.stderr, flush=True)  # now: a launcher may kill this process any moment
            _rewrite(exception, message)
        self._abort()
        exits.arm()

    def _explain(
        self, exception: BaseException, kind: str, who: str, plan: Plan | None, placement: Placement | None
    ) -> str:
        """Why this rank's collective failed, as far as it can know."""
        operation, over = _operation(exception)
        peers = _peers(over, placement, self.rank, self.world)
        named = ", ".join(_who(r, plan) for r in peers) if len(peers) <= _NAMED else f"{len(peers)} ranks"
        waited = f"while it waited for {operation} from {named or 'its peers'}"
        if kind == "timeout":
            cause = f"nothing came within the timeout ({_seconds(self.timeout)}) {waited}"
        else:
            cause = f"a peer closed the connection {waited}"
        report = self._get("first")  # written before its rank went down, so before any peer could notice
        if report is not None:
            return f"autopart: {report.rstrip('.')}. This rank, {who}, stopped because {cause}"
        trouble = self._store_trouble()
        if trouble is not None:
            host = "the process that hosts it (rank 0 under Lightning's launcher)"
            verdict = "ended first; its output says why" if trouble == "is gone" else "is frozen too"
            why = f"No rank could report why: the job's store {trouble}, so {host} {verdict}"
            return f"autopart: {who} stopped: {cause}. {why}"
        states = self._states(peers[:_NAMED], plan)
        diagnosis = f"{who} stopped first: {cause}, and no rank reported an error.{states}"
        first = self._report(diagnosis)
        if first is not None and first != diagnosis:  # another rank, seeing the same failure, wrote first
            return f"autopart: {first.rstrip('.')}. This rank, {who}, stopped because {cause}"
        if kind == "timeout":
            return (
                f"autopart: {diagnosis} A peer that freezes (a stopped or swapping process, a deadlock, a "
                "lost node) says nothing; every rank that can still run stops now. If a step can take that "
                "long, raise AutoPartitionStrategy(timeout=...)"
            )
        return (
            f"autopart: {diagnosis} A process that is killed (kill -9, the out-of-memory killer) or crashes "
            "says nothing: look at its node's system log (dmesg)"
        )

    def _states(self, peers: list[int], plan: Plan | None) -> str:
        """How ``peers`` are, where they run on this host; when none of them is stopped or gone (they wait too,
        on a rank further along), how the nearest other ranks on this host that are."""
        seen = {r: self._peer_state(r) for r in peers}
        states = "".join(f" {_who(r, plan).capitalize()}{s}." for r, s in seen.items() if s)
        if any(s and not s.endswith(_RUNNING) for s in seen.values()):
            return states
        others = sorted(
            (r for r in range(self.world) if r != self.rank and r not in seen), key=lambda r: abs(r - self.rank)
        )
        found = [
            f" {_who(r, plan).capitalize()}{s}."
            for r in others[:_SCANNED]
            if (s := self._peer_state(r)) and not s.endswith(_RUNNING)
        ]
        return states + (" Elsewhere on this host:" + "".join(found[:_NAMED]) if found else "")

    def _peer_state(self, rank: int) -> str:
        """``", pid 12, is stopped (SIGSTOP...)"`` for a rank on this host; "" for one elsewhere."""
        entry = (self._get(f"pid/{rank}") or "").split()
        if len(entry) != 2 or not entry[1].isdigit() or entry[0] != socket.gethostname():
            return ""
        return f", pid {entry[1]}, {_process_state(int(entry[1]))}"

    def _abort(self) -> None:
        """Abort every process group, keeping the objects alive until exit (see [Note: failing ranks])."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        c10d = dist.distributed_c10d
        with contextlib.suppress(Exception):
            self._kept = list(c10d._world.pg_map)
            c10d._abort_process_group()

    # The store after a failure. One whose server is gone fails at once, logging a C++ stack trace, so its
    # port is probed first; a frozen one never answers, so each call runs on a helper thread for STORE_WAIT s.

    def _store_trouble(self) -> str | None:
        """None while the store answers; else what is wrong with it ("is gone", "does not answer")."""
        if self._trouble is None and self._store is None:
            self._trouble = "is gone"
        if self._trouble is None and not self._probed:
            self._probed = True
            address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            if address and port and port.isdigit():
                try:
                    socket.create_connection((address, int(port)), timeout=STORE_WAIT).close()
                except OSError:
                    self._trouble = "is gone"
        return self._trouble

    def _call(self, operation: str, *args: Any) -> Any:
        """``store.operation(*args)``, or None when the store is gone, fails or does not answer in time."""
        if self._store_trouble() is not None:
            return None
        result: list[Any] = []
        failed: list[BaseException] = []

        def run() -> None:
            try:
                result.append(getattr(self._store, operation)(*args))
            except Exception as error:  # the store went away meanwhile
                failed.append(error)

        worker = threading.Thread(target=run, name="autopart-store", daemon=True)
        worker.start()
        worker.join(STORE_WAIT)
        if worker.is_alive():
            self._trouble = "does not answer"
        elif failed:
            self._trouble = "is gone"
        return result[0] if result else None

    def _get(self, key: str) -> str | None:
        if not self._call("check", [self._prefix + key]):
            return None
        value = self._call("get", self._prefix + key)
        return None if value is None else bytes(value).decode(errors="replace")

    def _report(self, text: str) -> str | None:
        """Publish the first failure (``compare_set``: a report already there stays); returns the report there
        now (None if the store does not answer)."""
        first = self._call("compare_set", self._prefix + "first", "", text)
        return None if first is None else bytes(first).decode(errors="replace")


def _seconds(timeout: timedelta | None) -> str:
    return "the default timeout" if timeout is None else f"{timeout.total_seconds():g} s"
