"""After a few optimizer steps, rank 0 says how long a training step took against the plan's prediction.

[Note: step readout] The plan table prints a predicted step time, and users size clusters on it; a prediction
that training then misses by 1.5x would otherwise go unnoticed. So rank 0 marks the end of every optimizer step
from step ``START`` on (``perf_counter`` on a host device; a CUDA event on the device's current stream, which
costs no host sync) and, once ``COUNT`` steps are marked, reports the median step beside the prediction: one
line, and a warning with the likely cause beyond ``WARN_RATIO``x either way. The median keeps a validation run
or a checkpoint save inside the window from counting. On CUDA the report waits until the last event has
completed (``query()``, at later step ends), or for it at the end of training. Every pipeline rank runs the same
steps in lockstep, so rank 0's steps are the job's. With gradient accumulation the prediction of one optimizer
step is ``A`` batches of pipeline work plus one all-reduce and one optimizer step.
"""

from __future__ import annotations

import statistics
import time
from itertools import pairwise
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_autopart.plan import Plan

__all__ = ["COUNT", "START", "WARN_RATIO", "StepReadout", "predicted_step_ms", "watch_steps"]

#: Optimizer steps left out (warm-up), then steps timed, and the ratio beyond which the readout warns.
START, COUNT, WARN_RATIO = 5, 10, 1.5


def predicted_step_ms(plan: Plan, accumulate: int) -> float:
    """The plan's predicted optimizer step (ms) with ``accumulate`` batches per step (see [Note: step readout])."""
    p = plan.prediction
    once = p.allreduce_us + p.optimizer_us
    return (accumulate * (p.step_us - once) + once) / 1e3


class StepReadout(Callback):
    """Times rank 0's optimizer steps ``START + 1`` to ``START + COUNT`` of a fit (counted from the fit's start,
    also when it resumes from a checkpoint) and reports their median against ``predicted_ms``."""

    def __init__(self, predicted_ms: float, device: torch.device, cause: str) -> None:
        self.predicted_ms = predicted_ms
        self.device = device
        self.cause = cause
        #: The median measured step (ms) and its ratio to the prediction, once reported.
        self.step_ms: float | None = None
        self.ratio: float | None = None
        self._marks: list[Any] = []
        self._last_step = 0
        self._stepped = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step, self._stepped = trainer.global_step, 0  # a resumed fit counts its own steps

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or self.step_ms is not None or step == self._last_step:
            return  # another rank, reported, or inside an accumulation window
        self._last_step = step
        self._stepped += 1
        if self._stepped >= START and len(self._marks) <= COUNT:
            self._marks.append(self._mark())
        self._report(wait=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self.step_ms is None:
            self._report(wait=True)  # training is over: waiting for the last event costs nothing

    def _mark(self) -> Any:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _report(self, wait: bool) -> None:
        """Report the median of the marked steps once all ``COUNT`` are marked (and, on CUDA, done)."""
        if len(self._marks) <= COUNT:
            return
        if self.device.type == "cuda":
            last = self._marks[-1]
            if not wait and not last.query():
                return
            last.synchronize()
            steps = [a.elapsed_time(b) for a, b in pairwise(self._marks)]
        else:
            steps = [(b - a) * 1e3 for a, b in pairwise(self._marks)]
        self.step_ms = statistics.median(steps)
        self.ratio = self.step_ms / self.predicted_ms if self.predicted_ms > 0 else float("inf")
        line = (
            f"autopart: a training step took {self.step_ms:,.1f} ms (median of steps {START + 1}-{START + COUNT}); "
            f"the plan predicted {self.predicted_ms:,.1f} ms ({self.ratio:.2f}x)"
        )
        if 1 / WARN_RATIO <= self.ratio <= WARN_RATIO:
            rank_zero_info(line)
        else:
            rank_zero_warn(f"{line}. {self.cause}")


def _cause(plan: Plan, device: torch.device) -> str:
    """The likeliest reason a step misses ``plan``'s prediction on ``device``, with what to do."""
    if plan.profile_mode == "estimate":
        return (
            f"The plan was estimated for the device spec {plan.cluster.device!r}: profile='measure' times this "
            "device's blocks instead"
        )
    if device.type != "cuda":
        return (
            "On CPUs the plan leaves out Lightning's own loop (hooks, data, logging: milliseconds a step, most of "
            "a small model's step), and the machine's speed can move between profiling and training (cores "
            "shared with other work); plan again when it is quiet, or reuse a plan with load_plan"
        )
    return "The device or its host may have been busy while profiling; plan again, or reuse a plan with load_plan"


def watch_steps(trainer: pl.Trainer, plan: Plan, device: torch.device) -> StepReadout:
    """Add a :class:`StepReadout` of ``plan`` on ``device`` to ``trainer``'s callbacks (see [Note: step
    readout]); returns it."""
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning at init
    for callback in callbacks:
        if isinstance(callback, StepReadout):
            callbacks.remove(callback)  # a later fit of the same Trainer times its own steps
            break
    readout = StepReadout(
        predicted_step_ms(plan, trainer.accumulate_grad_batches), device, _cause(plan, device)
    )
    callbacks.append(readout)
    return readout
