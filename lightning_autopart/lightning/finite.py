"""A NaN or infinite training loss found without a host sync per step, and training stopped at it.

[Note: non-finite loss] Plain Lightning trains on through a NaN loss: its gradients make every weight NaN, and
the job burns its remaining hours (and writes NaN checkpoints) unless someone watches the logs. Every rank of a
pipeline already holds the last stage's loss as a device tensor (the log channel replays it, see [Note: log
channel]), so each rank keeps, on the device, the first non-finite batch of the current window: three tiny
kernels per step (``isfinite``, ``where``, ``minimum``) and no read. The host reads it only at steps where
Lightning reads the host anyway or the run ends: every ``log_every_n_steps`` batches (Lightning converts the
logged values for its loggers there), before each validation during fit (an epoch's end, usually) and when
training ends, both outside any step. These steps are the same on every rank, so there the ranks agree with one ``all_reduce``
(MIN) of the encoded first bad batch and one ``.item()``, then all raise, or all go on, together: a rank that raised alone would leave
the others waiting in a collective.

On a non-finite loss every rank raises :class:`~lightning_autopart.errors.NonFiniteLossError` naming the epoch,
batch and global step, the last stage and its rank, and the fix. It raises rather than setting
``trainer.should_stop``: a graceful stop would run ``on_train_end`` and let ``ModelCheckpoint`` save the NaN
weights as ``last.ckpt`` over the last good one. The exception is the one case where training on is right: with
a gradient scaler (``16-mixed``) the NaN gradients make the scaler skip that optimizer step on every rank (see
``agree_on_overflow``), so the weights stay finite; there rank 0 warns instead. Up to ``log_every_n_steps - 1``
steps may run between the bad one and the check; the message says which step was first.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_autopart.errors import NonFiniteLossError

__all__ = ["LossCheck", "check_due"]

#: The code of a window without a non-finite loss: above every real code.
_NONE = 1 << 62


def check_due(trainer: Any) -> bool:
    """Whether the current training batch is one where the host reads the check (see [Note: non-finite loss]):
    a logging step (validation during fit and the run's end are checked by the strategy's
    ``on_validation_start`` and ``on_train_end``, outside any step). The same on every rank (it depends only on the loop's
    counters and settings); False for anything that is not a fitting Trainer."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if loop is None:
        return False
    every = int(getattr(trainer, "log_every_n_steps", 0) or 0)
    logging = every > 0 and (loop._batches_that_stepped + 1) % every == 0
    return bool(logging)  # epoch ends and the run's end: the strategy's on_validation_start and on_train_end


class LossCheck:
    """One rank's watch over the training loss of its pipeline (see [Note: non-finite loss]).

    Args:
        last_stage: Index of the pipeline's last stage (it computes the loss).
        last_rank: Global rank of this pipeline's last stage.
        world_size: Ranks of the job (codes are unique per rank).
        rank: This rank (rank 0 warns).
    """

    def __init__(self, last_stage: int, last_rank: int, world_size: int, rank: int) -> None:
        self.last_stage = last_stage
        self.last_rank = last_rank
        self.world_size = max(1, world_size)
        self.rank = rank
        #: Smallest code of a non-finite loss in the window (on the device); None before its first batch.
        self._first: Tensor | None = None
        #: (epoch, batch_idx, global_step) of each batch of the window, on the host.
        self._window: list[tuple[int, int, int]] = []
        #: ``id`` of the Trainer the window belongs to (not the Trainer: the check lives on the module).
        self._trainer = 0

    def observe(self, loss: Tensor, trainer: Any, batch_idx: int, scaled: bool = False) -> None:
        """Note this batch's ``loss`` (the same value on every rank of the pipeline) with tensor ops only; at a
        step where :func:`check_due`, agree with every rank on the window's first non-finite loss and raise
        (warn, when ``scaled``: a gradient scaler skips such steps) if there was one."""
        if trainer is None:
            return
        step = int(trainer.global_step)
        if id(trainer) != self._trainer or (self._window and step < self._window[-1][2]):
            # another fit (a window left by one that failed before its check belongs to that run)
            self._first, self._window, self._trainer = None, [], id(trainer)
        code = (len(self._window) * self.world_size + self.last_rank) * 2
        self._window.append((int(trainer.current_epoch), int(batch_idx), step))
        bad = torch.where(torch.isfinite(loss.detach()), _NONE, code)
        self._first = bad if self._first is None else torch.minimum(self._first, bad)
        if check_due(trainer):
            self.check(scaled)

    def check(self, scaled: bool = False) -> None:
        """Read the window (one host sync; with several ranks, one all-reduce first) and start a new one."""
        first, window = self._first, self._window
        self._first, self._window = None, []
        if first is None:
            return
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            first = first.clone()
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        code = int(first.item())
        if code >= _NONE:
            return
        index, rank = divmod(code // 2, self.world_size)
        epoch, batch, step = window[index]
        where = (
            f"the training loss was NaN or infinite at epoch {epoch}, batch {batch} (global step {step}), as "
            f"computed by the last stage (stage {self.last_stage}, on rank {rank})"
        )
        if scaled:
            if self.rank == 0:
                warnings.warn(
                    f"{where}; the gradient scaler (16-mixed) skipped the optimizer steps with NaN gradients, so "
                    "the weights stay finite. If it repeats, lower the learning rate or use bf16-mixed",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return
        raise NonFiniteLossError(
            f"{where}; autopart stops here instead of training on NaN weights (checked every log_every_n_steps, "
            f"before validation and at the end of training, without a host sync per step, so steps after it ran too, and checkpoints "
            "saved since hold NaN weights). Fix: lower the learning rate, clip gradients "
            "(Trainer(gradient_clip_val=1.0)), check that batch for NaN or inf inputs and labels, or use "
            "bf16-mixed or 32-true; Trainer(detect_anomaly=True) names the operation that made it (slow)"
        )
