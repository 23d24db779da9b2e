"""Fit a LightningModule on one device for a few steps, for comparisons of a strategy with plain Lightning."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import torch

__all__ = ["fit_one_device", "run_fit"]


def run_fit(
    model: L.LightningModule,
    strategy: object,
    accelerator: str = "cpu",
    callbacks: Sequence[L.Callback] = (),
    **options: Any,
) -> L.Trainer:
    """Fit ``model`` on one device of ``accelerator`` with ``strategy``, in its loader's own order (one replica:
    a distributed sampler would shuffle it), quietly, with more Trainer ``options``; the process group goes after."""
    quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    trainer = L.Trainer(accelerator=accelerator, devices=1, strategy=strategy, callbacks=list(callbacks),
                        use_distributed_sampler=False, enable_model_summary=False, **quiet, **options)  # fmt: skip
    try:
        trainer.fit(model)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return trainer


def fit_one_device(
    make: Callable[[], L.LightningModule], strategy: object, accelerator: str = "cpu", steps: int = 3
) -> tuple[list[float], list[torch.Tensor]]:
    """Seed 0, ``make()`` the module and fit it ``steps`` steps (:func:`run_fit`); its logged ``train_loss`` per
    step and its parameters (on the CPU)."""
    torch.manual_seed(0)
    model = make()
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
            losses.append(float(trainer.callback_metrics["train_loss"]))

    run_fit(model, strategy, accelerator, [Record()], max_steps=steps)
    return losses, [p.detach().cpu() for p in model.parameters()]
