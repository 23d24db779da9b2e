"""The peak tensor bytes of a training step, for a memory prediction to meet: :class:`StepPeak`, seeded with the
model's, the optimizer's and the batch's tensors only (and a pipeline's receive buffers: :func:`stage_buffers`),
then following every storage the step creates with ``tests/census.py``'s :class:`PeakTracker`."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import lightning as L
import torch
from torch.utils._pytree import tree_flatten

from tests.census import PeakTracker

__all__ = ["LABELS", "StepPeak", "stage_buffers"]


class StepPeak(L.Callback):
    """The peak tensor bytes of training batches ``start <= i < stop``: the model's and the optimizer's tensors and
    the batch at the step's start, plus every storage the step creates, as they live and die.

    Unlike :class:`StepProbe`, whose census counts every tensor of the process, it counts nothing another test
    or object left alive: a peak to compare with a prediction for this model alone (``batch_idx`` counts the
    first epoch's batches)."""

    def __init__(
        self, start: int, stop: int, extra: Callable[[L.Trainer], Iterable[torch.Tensor]] | None = None
    ) -> None:
        super().__init__()
        self.start, self.stop = start, stop
        #: The absolute peak of each probed batch.
        self.peaks: list[int] = []
        #: Tensors made before the step that it holds too (a pipeline's receive buffers: :func:`stage_buffers`).
        self.extra = extra
        self._tracker: PeakTracker | None = None

    def on_train_batch_start(self, trainer: L.Trainer, lm: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self.start <= batch_idx < self.stop:
            return
        state = [*lm.parameters(), *lm.buffers(), *(p.grad for p in lm.parameters() if p.grad is not None)]
        state += [t for o in trainer.optimizers for s in o.state.values() for t in s.values() if torch.is_tensor(t)]
        state += [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
        state += list(self.extra(trainer)) if self.extra is not None else []
        self._tracker = PeakTracker(labels=bool(os.environ.get(LABELS)))
        self._tracker.track({t.untyped_storage()._cdata: t.untyped_storage() for t in state}.values())
        self._tracker.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, lm: L.LightningModule, out: Any, batch: Any, i: int) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self.peaks.append(self._tracker.peak)
            if self._tracker.labels is not None:
                _write_labels(self._tracker, i, trainer.global_rank)
            self._tracker = None


#: Set to a folder, StepPeak writes what each probed batch held at its peak there, by what made it
#: (``peaks-{rank}.txt``): a debugging aid for a prediction that misses, at no cost otherwise.
LABELS = "AUTOPART_PEAK_LABELS"


def _write_labels(tracker: PeakTracker, batch: int, rank: int) -> None:
    """Append ``tracker``'s peak, and the bytes of each label at it (largest first), to the labels' folder."""
    path = os.path.join(os.environ[LABELS], f"peaks-{rank}.txt")
    rows = sorted(tracker.at_peak.items(), key=lambda kv: -kv[1])
    with open(path, "a") as f:
        f.write(f"batch {batch} peak {tracker.peak}\n")
        f.writelines(f"  {n:12d}  {label}\n" for label, n in rows)


def stage_buffers(schedules: Iterable[Any]) -> list[torch.Tensor]:
    """The receive buffers torch.distributed.pipelining made for the stages of ``schedules``: one per micro-batch
    and received value (activations into a stage after the first, gradients into a stage before the last),
    made at a schedule's first step and kept."""
    found: list[torch.Tensor] = []
    for schedule in schedules:
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        for stage in stages:
            for table in (stage.args_recv_info, getattr(stage, "grad_recv_info", {})):
                for infos in table.values():
                    found += [i.buffer for i in infos if isinstance(getattr(i, "buffer", None), torch.Tensor)]
    return found
