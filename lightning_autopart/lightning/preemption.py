"""Pre-emption: a signal (SIGTERM, or SLURM's ``--signal=USR1@90``) stops every rank at one step boundary, the
job's checkpoint is written there, and every process exits with ``128 + the signal's number``.

[Note: pre-emption] A scheduler ends a job with a signal: SIGTERM to every process (a launcher such as torchrun
forwards its own to its workers, so a worker may get two), once per rank (``srun``), or a warning signal some
time before the end (SLURM's ``--signal=USR1@90``). Plain Lightning's SIGTERM handler runs a ``dist.broadcast``
on the default group *inside the signal handler*. Python runs a handler on the main thread between bytecodes, so
a rank blocked in a collective (the last stage, waiting in the pipeline's receive for the first stage's
activations) runs it only when that collective returns, while the first stage, signalled in Python code, runs it
at once and waits in the handler's broadcast for the last stage: each waits for the other until the collective
timeout (every signal that landed inside a step, measured; between steps the ranks got out, with exit code 0 or
a peer's "connection closed"). Lightning's launcher and torchrun also forward their own SIGTERM to the ranks, so
a rank runs the handler once or twice, and the loops' per-rank ``received_sigterm`` check lets one stage leave
the loop while its peer waits for it. SLURM's requeue handler writes a checkpoint, a collective, in the handler.

Here the handler only records the signal's number (:meth:`Preemption._on_signal`): no collective, no I/O, no
lock. At each optimizer-step boundary (the end of a batch that stepped, in a callback that runs after every
other callback, so after ``ModelCheckpoint``) every rank posts an asynchronous max-all-reduce of its recorded
number on a gloo group of all ranks and reads the one it posted at the previous boundary, which completed while
the step ran: a healthy step waits for nothing and touches no device. The log channel's ``should_stop`` cannot
carry it: it flows from a pipeline's last stage to its other stages only, not from the first stage or from other
replicas. Every rank reads the same value at the same boundary, so when it is nonzero they all save through
``trainer.save_checkpoint`` (atomic; sharded or one file, per ``checkpoint=``) at the path rank 0 chose, rank 0
requeues a SLURM job when Lightning's auto-requeue is on and the signal is its requeue signal, and every rank
raises :class:`Preempted`, a ``SystemExit`` with code ``128 + signum`` (143 for SIGTERM, 138 for SIGUSR1),
through Lightning's interrupt handling (``on_exception`` callbacks, teardown). A signal takes effect one or two
optimizer steps after it arrives; one that arrives during the last step ends nothing (the run is complete).

[Note: Lightning's per-batch SIGTERM broadcast] Lightning 2.6's training loop, in a job of several processes,
broadcasts rank 0's ``received_sigterm`` flag before every batch, as a tensor on the strategy's device, and
reads it (``.item()``). Where this handler takes SIGTERM, Lightning's handler never runs, so the flag is always
0: the broadcast only costs a collective per batch (0.8 ms of rank 0's 36 ms step in a 2-rank CPU pipeline,
``bench/trace_steps.py``) and, on a GPU, a wait for every kernel queued before it, which keeps the host from
preparing the next batch while the device computes ([Note: reads back] in ``profile/readback.py``). So while
this handler holds SIGTERM the loop's broadcast is left out (:meth:`Preemption.setup`); with
``preempt_signals`` that leave SIGTERM to Lightning it stays.

The checkpoint is the one Lightning's ``ModelCheckpoint(every_n_train_steps=...)`` would write at that step, so
resuming follows Lightning's rules for it: model, optimizer, schedulers, loops and callbacks continue exactly; the
data continue exactly when the training loader is resumable (``state_dict``/``load_state_dict``), while a plain
``DataLoader`` starts the interrupted epoch's batches over (Lightning warns); a validation due at that very step
is not run again.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_autopart.errors import ConfigError
from lightning_autopart.runtime.topology import new_group

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "DEFAULT_CHECKPOINT",
    "Preempted",
    "Preemption",
    "SignalNames",
    "exit_code",
    "requeue_command",
    "signal_numbers",
]

#: The pre-emption checkpoint's name under ``Trainer(default_root_dir=...)`` when no path is given.
DEFAULT_CHECKPOINT = "preempted.ckpt"

#: What ``preempt_signals`` takes: signal names ("SIGTERM", "USR1") or numbers, one or several; None: none.
SignalNames = Sequence[str | int] | str | int | None


def exit_code(signum: int) -> int:
    """The exit code of a pre-empted process: ``128 + signum``, as a shell reports a process a signal ended."""
    return 128 + signum


class Preempted(SIGTERMException):
    """Raised on every rank once the pre-emption checkpoint is written: the process exits with
    :func:`exit_code` (a ``SystemExit``; Lightning's ``SIGTERMException``, so ``on_exception`` callbacks see it)."""

    def __init__(self, signum: int, checkpoint: str) -> None:
        super().__init__(exit_code(signum))
        #: The signal that stopped the job, and where its checkpoint is.
        self.signum = signum
        self.checkpoint = checkpoint


def signal_numbers(signals: SignalNames) -> tuple[int, ...]:
    """The signal numbers named by ``signals`` ("SIGTERM", "TERM", "usr1", 15...); None or empty: none."""
    if signals is None:
        return ()
    if isinstance(signals, (str, int)):
        signals = (signals,)
    numbers: list[int] = []
    for value in signals:
        if isinstance(value, int):
            number = int(value)
        else:
            name = value.strip().upper()
            name = name if name.startswith("SIG") else f"SIG{name}"
            number = getattr(signal, name, -1) if name.isidentifier() and not name.startswith("SIG_") else -1
        if number not in {int(s) for s in signal.valid_signals()}:
            raise ConfigError(
                f"preempt_signals names an unknown signal {value!r}; use a name such as 'SIGTERM' or 'SIGUSR1' "
                "(or its number), or preempt_signals=() to leave signals to Lightning"
            )
        if number in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(
                f"preempt_signals cannot include {signal.Signals(number).name}: no process can catch it; use "
                "the signal the scheduler sends first (SIGTERM, or SLURM's --signal=USR1@90)"
            )
        if number not in numbers:
            numbers.append(number)
    return tuple(numbers)


def requeue_command(env: dict[str, str] | None = None) -> list[str]:
    """``scontrol requeue JOB`` for this SLURM job (an array task's job id is ``ARRAYJOB_TASK``), as Lightning's
    auto-requeue runs it."""
    env = dict(os.environ) if env is None else env
    array_job = env.get("SLURM_ARRAY_JOB_ID")
    job = (
        f"{array_job}_{env['SLURM_ARRAY_TASK_ID']}" if array_job is not None else env.get("SLURM_JOB_ID", "")
    )
    if not re.fullmatch(r"[0-9_-]+", job):
        raise ConfigError(
            f"cannot requeue this SLURM job: its id {job!r} (SLURM_JOB_ID) is not a job number; run under "
            "sbatch, or pass SLURMEnvironment(auto_requeue=False) in Trainer(plugins=...)"
        )
    return ["scontrol", "requeue", job]


class Preemption:
    """One strategy's pre-emption handling (see [Note: pre-emption]).

    Args:
        signals: The signals that pre-empt (names or numbers); empty: Lightning's own handling stays.
        checkpoint: Where the checkpoint goes; None: ``<default_root_dir>/preempted.ckpt``, or on SLURM with
            Lightning's auto-requeue, the ``hpc_ckpt_N.ckpt`` that the requeued job's ``fit`` loads by itself.
    """

    def __init__(self, signals: SignalNames, checkpoint: str | None = None) -> None:
        self.signals = signal_numbers(signals)
        self.checkpoint = checkpoint
        #: The first pre-empting signal this process received (0: none); written by the handler alone.
        self.received = 0
        self._active: tuple[int, ...] = ()
        self._replaced: dict[int, Any] = {}
        self._group: Any = None
        self._work: Any = None
        self._buffer = torch.zeros(1, dtype=torch.int64)
        self._environment: Any = None

    @property
    def enabled(self) -> bool:
        return bool(self.signals)

    @property
    def takes_sigterm(self) -> bool:
        """Whether this handler, not Lightning's, receives SIGTERM during a fit."""
        return signal.SIGTERM in self.signals

    def setup(self, trainer: pl.Trainer, environment: Any) -> None:
        """Prepare ``trainer``'s fit; every rank calls it together (it may create a process group)."""
        if not self.enabled:
            return
        self._environment = environment
        requeue = self._requeue_signal()
        self._active = self.signals + ((requeue,) if requeue and requeue not in self.signals else ())
        self.received, self._work, self._replaced = 0, None, {}
        if (
            self._group is None
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
        ):
            self._group = new_group(backend="gloo")  # the job's timeout: [Note: a subgroup's timeout]
        if self.takes_sigterm:  # [Note: Lightning's per-batch SIGTERM broadcast]
            _quiet_sigterm_broadcast(trainer)
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning at init
        if not any(isinstance(c, _Boundary) and c.owner is self for c in callbacks):
            callbacks.append(_Boundary(self))  # last: after ModelCheckpoint and the user's callbacks
        # Lightning installs its SIGTERM (and SLURM requeue) handlers after the strategy's setup: ours go on top,
        # the moment it has (the callback's on_train_start installs them too, should that method ever change).
        connector = getattr(trainer, "_signal_connector", None)
        register = getattr(connector, "register_signal_handlers", None)
        if register is not None and not getattr(register, "autopart_preemption", False):

            def register_then_ours() -> None:
                register()
                self.install()

            register_then_ours.autopart_preemption = True  # type: ignore[attr-defined]
            connector.register_signal_handlers = register_then_ours  # type: ignore[union-attr]

    def _requeue_signal(self) -> int:
        env = self._environment
        if isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal is not None:
            return int(env.requeue_signal)
        return 0

    def install(self) -> None:
        """Put this handler on every pre-empting signal (the main thread only, as Python requires)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self._active:
            current = signal.getsignal(signum)
            if current == self._on_signal:
                continue
            self._replaced.setdefault(signum, current)
            signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        """Give back the signals still on this handler. Lightning's teardown (which runs first, after a fit that
        ended or failed) already put back the handlers from before the fit: those stay."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._replaced.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._replaced = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: records the signal, nothing more (no collective, no I/O, no lock)."""
        if not self.received:
            self.received = signum

    def _exchange(self, local: int) -> int:
        """The largest signal number any rank had recorded at the previous boundary (0: none); posts this one's."""
        if self._group is None:
            return local  # one process: nothing to agree on
        agreed = 0
        if self._work is not None:
            self._work.wait()  # posted a whole step ago: complete
            agreed, self._work = int(self._buffer.item()), None  # a CPU tensor: no device sync
        if not agreed:
            self._buffer.fill_(local)
            self._work = dist.all_reduce(self._buffer, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return agreed

    def at_boundary(self, trainer: pl.Trainer) -> None:
        """After a batch: at an optimizer-step boundary, stop every rank if any rank had been signalled."""
        if trainer.fit_loop._should_accumulate():
            return  # inside an accumulation window: the gradients so far are in no checkpoint
        agreed = self._exchange(self.received)
        if agreed:
            self._stop(trainer, agreed)

    def finish(self) -> None:
        """At the end of a completed fit: collect the last exchange (every rank posted it) and say if a signal
        came too late to stop anything."""
        agreed = self.received
        if self._work is not None:
            self._work.wait()
            agreed, self._work = int(self._buffer.item()) or agreed, None
        if agreed:
            rank_zero_warn(
                f"autopart: {signal.Signals(agreed).name} arrived during the last training step; training is "
                "complete, so no pre-emption checkpoint was written"
            )

    def _path(self, trainer: pl.Trainer) -> str:
        """The checkpoint's path, chosen on rank 0 (Lightning's next ``hpc_ckpt_N`` depends on what is there)."""
        if self.checkpoint is not None:
            path = str(self.checkpoint)
        elif self._requeue_signal():
            path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        else:
            path = os.path.join(str(trainer.default_root_dir), DEFAULT_CHECKPOINT)
        return str(trainer.strategy.broadcast(path, 0))

    def _stop(self, trainer: pl.Trainer, signum: int) -> None:
        """Every rank, at the same boundary: save, requeue (rank 0, SLURM), raise :class:`Preempted`."""
        name = signal.Signals(signum).name
        path = self._path(trainer)
        rank_zero_info(
            f"autopart: {name} received; saving a checkpoint at step {trainer.global_step} to {path}"
        )
        trainer.save_checkpoint(path)
        after = f"Resume with trainer.fit(model, ..., ckpt_path={path!r})"
        if signum == self._requeue_signal() and trainer.is_global_zero:
            after = _requeue()
        rank_zero_info(
            f"autopart: pre-empted by {name}: checkpoint {path} written; every rank exits with code "
            f"{exit_code(signum)}. {after}"
        )
        raise Preempted(signum, path)


def _quiet_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Leave out the training loop's per-batch broadcast of a SIGTERM flag that this handler keeps at 0, for
    this fit (an attribute of the loop object; see [Note: Lightning's per-batch SIGTERM broadcast])."""
    loop = trainer.fit_loop.epoch_loop
    if hasattr(type(loop), "_broadcast_sigterm_tensor"):
        loop._broadcast_sigterm_tensor = _sigterm_kept_by_autopart  # type: ignore[method-assign]


def _sigterm_kept_by_autopart() -> None:
    """Stands in for Lightning's per-batch SIGTERM broadcast: autopart's handler holds SIGTERM."""


def _requeue() -> str:
    """Requeue this SLURM job as Lightning's auto-requeue does; says what happened (a failure does not stop the
    exit: the checkpoint is written)."""
    try:
        command = requeue_command()
        result = subprocess.call(command)
    except (ConfigError, OSError) as error:
        rank_zero_warn(f"autopart: the job was not requeued: {error}")
        return "The job was NOT requeued; resume it with fit(ckpt_path=None) under SLURM"
    if result != 0:
        rank_zero_warn(f"autopart: `{' '.join(command)}` failed with code {result}; the job was not requeued")
        return "The job was NOT requeued; resume it with fit(ckpt_path=None) under SLURM"
    return f"`{' '.join(command)}` done: the requeued job's fit(ckpt_path=None) resumes from it"


class _Boundary(Callback):
    """The step boundary of [Note: pre-emption], as the last callback of the fit."""

    def __init__(self, owner: Preemption) -> None:
        self.owner = owner

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.owner.install()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self.owner.at_boundary(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.owner.finish()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.owner.uninstall()
        vars(trainer.fit_loop.epoch_loop).pop("_broadcast_sigterm_tensor", None)  # Lightning's own again
