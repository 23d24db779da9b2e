"""Ragged batches (``drop_last=False``) in training, validation and prediction, as a user script runs them.

Usage: ``python tests/distributed/_ragged_script.py CASES OUT DEVICES`` (Lightning's launcher starts the other
processes) or under ``torchrun``; rank r writes ``OUT/rank{r}.pt`` = {case index: what :func:`run_case`
returns}. A case with ``"plain": True`` runs Lightning's own ``"ddp"`` strategy, the others autopart; the
tests import :func:`run_case` to run a case in one plain process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchmetrics import MeanSquaredError

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from tests.distributed.job import end_job
from tests.distributed.strategy_cases import dataset
from tests.models import make

__all__ = ["BATCH", "EPOCHS", "RaggedLit", "run_case"]

#: The loaders' batch size and the epochs of every fit.
BATCH, EPOCHS = 8, 2


class RaggedLit(L.LightningModule):
    """The zoo MLP (or, with ``batch_norm``, one with a BatchNorm layer) logging step and epoch means, one
    with ``batch_size`` given as the step's own batch size, and a torchmetrics metric in validation."""

    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = (
            nn.Sequential(
                nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 16)
            )
            if batch_norm
            else make("mlp")
        )
        self.val_mse = MeanSquaredError()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        loss = F.mse_loss(out, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log("train_mae", F.l1_loss(out, y), on_epoch=True, batch_size=len(x), sync_dist=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        out = self(x)
        self.log("val_loss", F.mse_loss(out, y), sync_dist=True)
        self.val_mse(out, y)
        self.log("val_mse", self.val_mse)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)  # plain SGD: a wrong gradient scale shows at once


class _Record(L.Callback):
    """Each step's loss and logged step value, and the epoch metrics of every epoch."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.logged: list[float] = []
        self.epochs: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        self.logged.append(float(trainer.callback_metrics["train_loss_step"]))

    def on_train_epoch_start(self, trainer: L.Trainer, module: Any) -> None:
        if trainer.current_epoch > 0:  # the previous epoch's means are aggregated after its end hooks
            self.epochs.append(_numbers(trainer.callback_metrics))


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def run_case(case: dict[str, Any], strategy: Any, devices: int) -> dict[str, Any]:
    """Fit ``case`` (``train``/``val`` samples, ``batch_norm``) for ``EPOCHS`` epochs with validation, then
    validate and predict on the validation loader; returns what it logged, predicted and trained.

    For one plain process (``strategy="auto"``) the training loader gets the ``DistributedSampler`` Lightning
    gives one replica under a distributed strategy (shuffled by seed 0 and the epoch), so the batches agree.
    """
    data = dataset("mlp", case["train"] + case["val"])
    train = Subset(data, range(case["train"]))
    val = Subset(data, range(case["train"], case["train"] + case["val"]))
    sampler = DistributedSampler(train, num_replicas=1, rank=0, seed=0) if strategy == "auto" else None
    model = RaggedLit(case.get("batch_norm", False))
    record = _Record()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[record],
    )
    try:
        trainer.fit(
            model, DataLoader(train, batch_size=BATCH, sampler=sampler), DataLoader(val, batch_size=BATCH)
        )
    except ConfigError as error:
        return {"error": str(error), "steps": trainer.global_step}
    result: dict[str, Any] = {"losses": record.losses, "logged": record.logged}
    result["epochs"] = [*record.epochs, _numbers(trainer.callback_metrics)]
    result["validate"] = _numbers(
        trainer.validate(model, DataLoader(val, batch_size=BATCH), verbose=False)[0]
    )
    predictions = trainer.predict(model, DataLoader(val, batch_size=BATCH))
    result["predictions"] = torch.cat([p.cpu() for p in predictions or []])
    result["params"] = {n: p.detach().clone() for n, p in model.named_parameters() if p.device.type != "meta"}
    runner = getattr(trainer.strategy, "_runner", None)
    result["replica"] = runner.placement.replica if runner is not None else trainer.global_rank
    return result


def main() -> None:
    torch.set_num_threads(1)
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    devices = int(sys.argv[3])
    results: dict[int, Any] = {}
    for i, case in enumerate(cases):
        strategy: Any = "ddp"
        if not case.get("plain"):
            strategy = AutoPartitionStrategy(
                num_stages=case["stages"],
                micro_batches=case["micro_batches"],
                schedule=case.get("schedule", "auto"),
                profile="estimate",
            )
        results[i] = run_case(case, strategy, devices)
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save(results, out / f"rank{rank}.pt")
    end_job()


if __name__ == "__main__":
    main()
