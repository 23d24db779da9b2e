"""How a process gets out: after a failure promptly, with code 1, whatever its groups' destructors do; else
with its process groups ended while the interpreter is whole.

See [Note: failing ranks] in ``faults.py``. :func:`install` (at setup) registers the last exit handler, which
does nothing unless :func:`arm` (at a failure) was called: it then flushes the output and ends the process
with ``os._exit(1)``, skipping the interpreter's teardown, which takes 1-3 s with Lightning imported and runs
the destructors of process groups that can wait for ever on an operation a peer will never answer. :func:`arm`
also registers a first exit handler that starts a ``faulthandler`` watchdog (a C thread, which needs no GIL),
so the process ends within :data:`EXIT_GRACE` seconds even if another exit handler blocks. The exception's
traceback is printed before the exit handlers run.

[Note: groups end before the interpreter] A process that saw no failure ends its process groups itself, in an
exit handler that :func:`install` registers right after the exit guard (so it runs after every handler
registered later, a logger's or the user's), while the interpreter is whole. Left to the interpreter's
teardown, gloo groups (the world, the pipelines', the replicas') are destroyed in whatever order finalization
releases them: once in five CI runs of the suite, a torchrun rank that had finished training died there with
SIGABRT ("terminate called without an active exception", a C++ thread destroyed unjoined), turning a good
job's exit code into 1. Lightning ends the groups at exit for NCCL only, so a job whose default group uses
NCCL is left to Lightning's handler. A watchdog bounds ours: if ending the groups blocks for :data:`END_GRACE`
seconds (a bug: gloo only joins its own threads there), the process exits with code 1 and prints where it
blocked. After a failure the groups are left alone (a peer may still hold an operation open on them) and
:func:`_exit_now` skips the teardown.

Lightning's launcher kills its rank 0 within 5 s of another local rank's nonzero exit (its child-process
observer), possibly while rank 0 is printing which rank failed: :func:`patient_launcher` gives rank 0
:data:`LAUNCHER_GRACE` seconds to exit by itself first.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

__all__ = ["END_GRACE", "EXIT_GRACE", "LAUNCHER_GRACE", "arm", "install", "patient_launcher"]

#: Seconds the exit handlers of a process that saw a failure may take before the process is ended.
EXIT_GRACE = 5.0
#: Seconds that ending a finished process's groups may take before the process is ended with code 1.
END_GRACE = 30.0
#: Seconds Lightning's launcher gives rank 0 to exit by itself once another local rank failed, before killing.
LAUNCHER_GRACE = 3.0


class _Guard:
    """This process's exit guard (one per process)."""

    #: Whether a failure was seen: the process then exits with code 1 once its exit handlers ran.
    failed = False
    installed = False
    watched = False
    sink: Any = None  # where the watchdog writes its thread dump: nowhere, the exception was printed already


def install() -> None:
    """Register :func:`_exit_now`, then :func:`_end_groups`, once per process (at setup): they run after every
    exit handler registered later (a logger's, the user's); the first ends the process only after :func:`arm`,
    the second ends the process groups only if not (see [Note: groups end before the interpreter])."""
    if not _Guard.installed:
        _Guard.installed = True
        atexit.register(_exit_now)
        atexit.register(_end_groups)


def _end_groups(grace: float = END_GRACE) -> None:
    """Destroy every process group of a process that saw no failure, within ``grace`` seconds or exit 1
    (NCCL jobs: Lightning's own exit handler does it)."""
    if _Guard.failed or not (dist.is_available() and dist.is_initialized()):
        return
    if "nccl" in str(dist.get_backend()):
        return
    faulthandler.dump_traceback_later(grace, exit=True)
    try:
        dist.destroy_process_group()
    except Exception as error:  # ending is best effort: say so, never turn a good run's exit into a traceback
        print(f"autopart: could not end the process groups at exit: {error}", file=sys.stderr, flush=True)
    finally:
        faulthandler.cancel_dump_traceback_later()


def arm() -> None:
    """After a failure: exit with code 1 once the exit handlers ran, within :data:`EXIT_GRACE` s whatever they
    do."""
    install()  # a no-op after setup
    _Guard.failed = True
    if not _Guard.watched:
        _Guard.watched = True
        _Guard.sink = open(os.devnull, "w")  # noqa: SIM115 (open until the process ends)
        atexit.register(_watch, EXIT_GRACE)  # registered last, so it runs first


def _watch(grace: float) -> None:
    """The first exit handler after a failure: a watchdog calls ``_exit(1)`` ``grace`` seconds later."""
    faulthandler.dump_traceback_later(grace, exit=True, file=_Guard.sink)


def _exit_now() -> None:
    """The last exit handler: after a failure, flush the output and exit with code 1 at once."""
    if not _Guard.failed:
        return
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1)


def patient_launcher(grace: float = LAUNCHER_GRACE) -> None:
    """In rank 0 under Lightning's launcher: wait ``grace`` seconds before the launcher's child-process
    observer kills this process and the other ranks after one of them failed (the observer is a daemon
    thread: if this process exits meanwhile, nothing is killed). Elsewhere, nothing to do."""
    for thread in threading.enumerate():
        kill = getattr(thread, "_terminate_all", None)
        if (
            type(thread).__name__ != "_ChildProcessObserver"
            or kill is None
            or getattr(kill, "patient", False)
        ):
            continue

        def patient(kill: Any = kill) -> None:
            time.sleep(grace)
            kill()

        patient.patient = True  # type: ignore[attr-defined]
        thread._terminate_all = patient  # type: ignore[attr-defined]
