"""A user-style script logging torchmetrics metrics, with Lightning's usual callbacks, under AutoPartitionStrategy.

Usage: ``python tests/distributed/_metrics_script.py CASES OUT DEVICES`` (Lightning's launcher starts the other
processes) or under ``torchrun``. Rank r writes ``OUT/rank{r}.pt`` = {case index: what :func:`fit_case`
returns}; rank 0's CSVLogger writes ``OUT/csv{i}/version_0/metrics.csv``. The tests import :func:`fit_case` to
run the same case on one process.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset
from torchmetrics import MeanMetric, MeanSquaredError
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from tests.census import StepProbe
from tests.distributed.job import end_job

__all__ = ["LOCAL_BATCH", "MAX_EPOCHS", "MetricLit", "fit_case"]

#: Samples per pipeline per step, training steps and validation steps per epoch, classes, most epochs.
LOCAL_BATCH, TRAIN_STEPS, VAL_STEPS, CLASSES, MAX_EPOCHS = 8, 4, 2, 4, 6


class MetricLit(L.LightningModule):
    """A classifier logging metric objects in its steps, the usual way, plus one metric computed at epoch end, and
    gradient norms and maxima in the gradient hooks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(
            nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, CLASSES)
        )
        self.train_acc = MulticlassAccuracy(
            num_classes=CLASSES, average="macro"
        )  # not a mean of micro-batches
        self.train_mse = MeanSquaredError()
        self.train_mean = MeanMetric()
        self.epoch_mean = MeanMetric()  # updated in the step, computed and reset in on_train_epoch_end
        self.val_acc = MulticlassAccuracy(num_classes=CLASSES)
        self.val_auroc = MulticlassAUROC(num_classes=CLASSES, thresholds=None)  # list ("cat") states
        self.updates = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        losses = F.cross_entropy(logits, y, reduction="none")
        loss = losses.mean()
        self.train_acc(logits, y)
        self.train_mse(logits.softmax(-1), F.one_hot(y, CLASSES).float())
        self.train_mean(losses)
        self.epoch_mean.update(losses)
        self.updates += 1
        self.log("train_loss", loss, prog_bar=True, sync_dist=True, on_step=True, on_epoch=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("train_mse", self.train_mse, on_step=True, on_epoch=True)
        self.log("train_mean", self.train_mean, on_step=False, on_epoch=True)
        return loss

    def on_after_backward(self) -> None:
        grads = [p.grad.abs().max() for p in self.parameters() if p.grad is not None]
        self.log("grad_max", torch.stack(grads).max())  # over one stage's parameters under autopart
        self.log("lr_seen", self.trainer.optimizers[0].param_groups[0]["lr"])  # the same on every stage

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log_dict(grad_norm(self, norm_type=2))  # Lightning's documented idiom

    def on_train_epoch_end(self) -> None:
        self.log("epoch_mean", self.epoch_mean.compute())
        self.epoch_mean.reset()

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.val_auroc(logits.softmax(-1), y)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc, on_epoch=True)
        self.log("val_auroc", self.val_auroc, on_epoch=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.7)}


def dataset(n: int, seed: int) -> TensorDataset:
    """``n`` samples of a noisy linear 4-class problem."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, CLASSES, generator=torch.Generator().manual_seed(7))
    return TensorDataset(x, (x @ w + torch.randn(n, CLASSES, generator=g)).argmax(-1))


class EpochOrder(Sampler[int]):
    """One process's order equal to ``replicas`` ranks under DistributedSampler(shuffle=True, seed=0): the k-th
    batch of ``batch x replicas`` samples holds the k-th batches of every rank."""

    def __init__(self, n: int, replicas: int) -> None:
        self.n, self.replicas, self.epoch = n, replicas, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        shards = [perm[r :: self.replicas] for r in range(self.replicas)]
        for k in range(self.n // (self.replicas * LOCAL_BATCH)):
            for shard in shards:
                yield from shard[k * LOCAL_BATCH : (k + 1) * LOCAL_BATCH]


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


class Recorder(L.Callback):
    """This rank's view: callback metrics after every training batch and every validation."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.validations: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps.append(_numbers(trainer.callback_metrics))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.validations.append(_numbers(trainer.callback_metrics))


def fit_case(case: dict[str, Any], strategy: Any, devices: int, replicas: int, out: Path) -> dict[str, Any]:
    """Fit ``MetricLit`` with the callbacks under test; each batch holds ``LOCAL_BATCH x replicas`` samples in
    all (one loader batch on one process). Returns what every rank saw."""
    model = MetricLit()
    n = LOCAL_BATCH * replicas * TRAIN_STEPS
    batch, sampler = LOCAL_BATCH, None
    if strategy == "auto":  # the reference: one process, the same global batches
        batch, sampler = LOCAL_BATCH * replicas, EpochOrder(n, replicas)
    train = DataLoader(dataset(n, 1), batch_size=batch, sampler=sampler)
    val = DataLoader(dataset(LOCAL_BATCH * replicas * VAL_STEPS, 2), batch_size=batch)
    recorder = Recorder()
    probe = StepProbe(1, 3)  # host syncs of steady steps (the first builds the schedules)
    best = ModelCheckpoint(dirpath=out / "ckpt", monitor="val_acc", mode="max", save_top_k=1)
    stop = EarlyStopping(monitor="val_acc", mode="max", patience=1, min_delta=0.05)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=MAX_EPOCHS,
        logger=CSVLogger(out, name="csv", version=0),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,
        callbacks=[recorder, probe, LearningRateMonitor(logging_interval="step"), best, stop],
    )
    trainer.fit(model, train, val)
    runner = getattr(strategy, "_runner", None)
    return {
        "steps": recorder.steps,
        "validations": recorder.validations,
        "final": _numbers(trainer.callback_metrics),
        "updates": model.updates,
        "host_syncs": probe.syncs,
        "last_stage": runner is None or runner.is_last,
        "replica": 0 if runner is None else runner.placement.replica,
        "global_step": trainer.global_step,
        "epochs": trainer.current_epoch,
        "stopped_epoch": stop.stopped_epoch,
        "best": (Path(best.best_model_path).name, float(best.best_model_score or math.nan)),
    }


def main() -> None:
    torch.set_num_threads(1)
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    devices = int(sys.argv[3])
    results: dict[int, Any] = {}
    rank = -1
    try:
        for i, case in enumerate(cases):
            strategy = AutoPartitionStrategy(num_stages=case["stages"], micro_batches=2, profile="estimate")
            results[i] = fit_case(case, strategy, devices, devices // case["stages"], out / f"case{i}")
            rank = dist.get_rank()
    finally:
        if rank < 0 and dist.is_initialized():
            rank = dist.get_rank()
        torch.save(results, out / f"rank{max(rank, 0)}.pt")
    end_job()


if __name__ == "__main__":
    main()
