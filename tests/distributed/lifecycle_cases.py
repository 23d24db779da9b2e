"""What a Lightning user does around ``fit``: loops after it, checkpoints, resumes under other plans.

Shared by the launched script (``_lifecycle_script.py``) and the one-process reference in the test. A job is a
list of actions run in order in one process group; checkpoints are named, under the job's output folder.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Sampler

from tests.distributed.strategy_cases import LOCAL_BATCH, dataset
from tests.models import make

__all__ = ["EPOCH", "TOTAL_STEPS", "DistributedOrder", "LifecycleLit", "run_action"]

#: Optimizer steps of an uninterrupted run (two epochs); a resumed run restarts at the first epoch's end.
TOTAL_STEPS, EPOCH = 6, 3


class LifecycleLit(L.LightningModule):
    """The zoo MLP with Adam and a step scheduler (state that a wrong resume would lose), every loop's step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = make("mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.mse_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", F.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)}


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


class DistributedOrder(Sampler[int]):
    """The samples Lightning's ``DistributedSampler(shuffle=True, seed=0)`` gives ``replicas[epoch]`` replicas,
    as one process's batches of ``batch`` samples (each the union of the replicas' batches)."""

    def __init__(self, n: int, replicas: list[int], batch: int) -> None:
        self.n, self.replicas, self.batch, self.epoch = n, replicas, batch, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        count = self.replicas[min(self.epoch, len(self.replicas) - 1)]
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        shards, per = [perm[r::count] for r in range(count)], self.batch // count
        return iter([i for k in range(self.n // self.batch) for s in shards for i in s[k * per : (k + 1) * per]])


def _loader(n: int, replicas: int, order: list[int] | None = None) -> DataLoader[Any]:
    """Batches of ``2 x LOCAL_BATCH`` samples in all: one loader batch per replica (Lightning shards and shuffles
    training data), or for the reference (``order``: the replicas of each epoch's run) the same global batches."""
    data = dataset("mlp", n)
    if order is None:
        return DataLoader(data, batch_size=2 * LOCAL_BATCH // max(replicas, 1))
    return DataLoader(data, batch_size=2 * LOCAL_BATCH, sampler=DistributedOrder(n, order, 2 * LOCAL_BATCH))


def run_action(action: dict[str, Any], out: Path, strategy: Any, devices: int) -> dict[str, Any]:
    """Run one action ("fit", "validate", "test" or "predict") on a fresh model and Trainer, or on the job's
    previous ones (``"same": True``); returns what it logged or predicted.

    Every data loader holds two pipelines' worth of samples per batch in all (``LOCAL_BATCH`` x 2), so every
    plan (1 to 4 ranks, 1 or 2 replicas) and the one-process reference see the same global batches.
    """
    global _previous
    replicas = 0 if strategy == "auto" else action.get("replicas", 1)
    if action.get("same"):
        model, trainer = _previous
    else:
        model = LifecycleLit()
        losses = _Losses()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=strategy,
            max_epochs=action.get("steps", TOTAL_STEPS) // EPOCH,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[losses],
        )
    ckpt = str(out / action["ckpt"]) if action.get("ckpt") else None
    n, evaluated = 2 * LOCAL_BATCH * EPOCH, _loader(4 * LOCAL_BATCH, replicas)
    result: dict[str, Any] = {}
    if action["do"] == "fit":
        train = _loader(n, replicas, action.get("order", [1]) if strategy == "auto" else None)
        trainer.fit(model, train, evaluated, ckpt_path=ckpt)
        result["losses"] = trainer.callbacks[0].losses  # type: ignore[attr-defined]
    elif action["do"] in ("validate", "test"):
        run = trainer.validate if action["do"] == "validate" else trainer.test
        (result["metrics"],) = run(model, evaluated, ckpt_path=ckpt)
    elif action["do"] == "predict":
        predictions = trainer.predict(model, evaluated, ckpt_path=ckpt)
        result["predictions"] = torch.cat([p.cpu() for p in predictions or []])
    if action.get("save"):
        trainer.save_checkpoint(out / action["save"])
    _previous = (model, trainer)
    return result


_previous: Any = None
