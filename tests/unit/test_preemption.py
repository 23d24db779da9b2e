"""Pre-emption on one process (see [Note: pre-emption]): options, the handler, the stop and its checkpoint.

The multi-process cases (every rank agreeing, launchers, SLURM's requeue) are in
``tests/distributed/test_preemption.py``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning.preemption import (
    Preempted,
    Preemption,
    _requeue,
    requeue_command,
    signal_numbers,
)
from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from tests.distributed import _preempt_script as script

#: A signal nothing else in a test run handles (pytest and Lightning leave it alone).
SIGNAL = signal.SIGUSR2


def test_signals_by_name_or_number_once_each() -> None:
    assert signal_numbers(("SIGTERM", "usr1", 15, "TERM")) == (signal.SIGTERM, signal.SIGUSR1)
    assert signal_numbers("SIGUSR1") == (signal.SIGUSR1,)
    assert signal_numbers(None) == signal_numbers(()) == ()


@pytest.mark.parametrize(
    ("signals", "match"),
    [
        (("SIGNOPE",), r"unknown signal 'SIGNOPE'.*'SIGTERM'"),
        ((999,), r"unknown signal 999"),
        (("SIG_DFL",), r"unknown signal 'SIG_DFL'"),
        (("KILL",), r"cannot include SIGKILL: no process can catch it"),
        (("SIGSTOP",), r"cannot include SIGSTOP"),
    ],
)
def test_bad_signals_are_refused_when_the_strategy_is_made(signals: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        AutoPartitionStrategy(preempt_signals=signals)


def test_requeue_command_names_the_job_or_the_array_task() -> None:
    assert requeue_command({"SLURM_JOB_ID": "123"}) == ["scontrol", "requeue", "123"]
    array = {"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3", "SLURM_JOB_ID": "9"}
    assert requeue_command(array) == ["scontrol", "requeue", "7_3"]
    with pytest.raises(ConfigError, match=r"id '' \(SLURM_JOB_ID\) is not a job number"):
        requeue_command({})


def test_a_requeue_that_cannot_run_warns_and_the_exit_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.warns(UserWarning, match=r"not requeued: cannot requeue this SLURM job: its id ''"):
        assert _requeue().startswith("The job was NOT requeued")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol
    with pytest.warns(UserWarning, match=r"not requeued: .*scontrol"):
        assert _requeue().startswith("The job was NOT requeued")


def test_the_handler_only_records_the_first_signal() -> None:
    preemption = Preemption(("SIGTERM", "SIGUSR1"))
    preemption._on_signal(signal.SIGUSR1, None)
    preemption._on_signal(signal.SIGTERM, None)
    assert preemption.received == signal.SIGUSR1
    assert preemption._exchange(preemption.received) == signal.SIGUSR1  # one process: nothing to agree on


class _SignalAt(L.Callback):
    """Sends ``SIGNAL`` to this process after optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), SIGNAL)


def _strategy(**options: Any) -> AutoPartitionStrategy:
    return AutoPartitionStrategy(num_stages=1, micro_batches=2, profile="estimate", **options)


@pytest.mark.usefixtures("master_port")
def test_a_signal_stops_at_that_step_with_a_checkpoint_and_code_128_plus_signum(tmp_path: Path) -> None:
    before = signal.getsignal(SIGNAL)
    strategy = _strategy(preempt_signals=(SIGNAL,))
    with pytest.raises(Preempted) as stopped:
        script.train(tmp_path, "cut", strategy, 1, pace=0.0, callbacks=(_SignalAt(2),))
    assert stopped.value.code == 128 + SIGNAL
    assert stopped.value.checkpoint == str(tmp_path / "preempted.ckpt")
    assert torch.load(tmp_path / "preempted.ckpt" / "meta.pt", weights_only=False)["global_step"] == 2
    assert signal.getsignal(SIGNAL) == before  # the process's own handler is back


@pytest.mark.usefixtures("master_port")
def test_a_chosen_path_and_a_full_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "stop.ckpt"
    strategy = _strategy(preempt_signals=(SIGNAL,), preempt_checkpoint=str(path), checkpoint="full")
    with pytest.raises(Preempted):
        script.train(tmp_path, "cut", strategy, 1, pace=0.0, callbacks=(_SignalAt(1),))
    assert torch.load(path, weights_only=False)["global_step"] == 1


@pytest.mark.usefixtures("master_port")
def test_a_signal_during_the_last_step_ends_nothing(tmp_path: Path) -> None:
    last = script.EPOCHS * script.STEPS_PER_EPOCH
    strategy = _strategy(preempt_signals=(SIGNAL,))
    strategy._preemption._exchange = lambda local: 0  # type: ignore[method-assign]  # as if it came too late
    with pytest.warns(
        UserWarning, match=r"SIGUSR2 arrived during the last training step; training is complete"
    ):
        trainer = script.train(tmp_path, "all", strategy, 1, pace=0.0, callbacks=(_SignalAt(last),))
    assert trainer.global_step == last
    assert not (tmp_path / "preempted.ckpt").exists()


@pytest.mark.usefixtures("master_port")
def test_no_preempt_signals_leaves_lightnings_handling(tmp_path: Path) -> None:
    trainer = script.train(tmp_path, "all", _strategy(preempt_signals=()), 1, pace=0.0)
    assert not any(type(c).__name__ == "_Boundary" for c in trainer.callbacks)


@pytest.mark.usefixtures("master_port")
def test_after_a_fit_the_signals_have_their_handlers_from_before(tmp_path: Path) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, SIGNAL)}
    script.train(tmp_path, "all", _strategy(preempt_signals=("SIGTERM", SIGNAL)), 1, pace=0.0)
    assert {s: signal.getsignal(s) for s in before} == before


class _Broadcast(L.Callback):
    """Records what the training loop calls for its per-batch SIGTERM broadcast during the fit."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seen = trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor


@pytest.mark.usefixtures("master_port")
@pytest.mark.parametrize("signals", [("SIGTERM",), (SIGNAL,)], ids=["autopart-takes-sigterm", "lightning-keeps-it"])
def test_lightnings_per_batch_sigterm_broadcast_is_left_out_while_autopart_holds_sigterm(
    tmp_path: Path, signals: tuple[Any, ...]
) -> None:
    if not hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor"):
        pytest.skip("this Lightning's loop broadcasts nothing per batch")
    watch = _Broadcast()
    trainer = script.train(tmp_path, "all", _strategy(preempt_signals=signals), 1, pace=0.0, callbacks=(watch,))
    left_out = signals == ("SIGTERM",)
    assert (getattr(watch.seen, "__name__", "") == "_sigterm_kept_by_autopart") == left_out
    assert "_broadcast_sigterm_tensor" not in vars(trainer.fit_loop.epoch_loop)  # Lightning's own after the fit
