"""What every example shares: its optimizer choice and loaders over a synthetic dataset it generates."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Subset

__all__ = ["SyntheticDataModule"]


class SyntheticDataModule(L.LightningModule):
    """A LightningModule whose data is ``_dataset()``: ``num_samples`` training samples, then held-out ones.

    Subclasses save ``lr``, ``momentum``, ``optimizer`` ("sgd" or "adam"), ``batch_size`` and ``num_samples`` as
    hyperparameters and implement ``_dataset``.
    """

    def _dataset(self) -> Dataset[Any]:
        """Training samples followed by four batches of held-out validation samples."""
        raise NotImplementedError

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams["optimizer"] == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=self.hparams["momentum"])

    def train_dataloader(self) -> DataLoader[Any]:
        train = Subset(self._dataset(), range(self.hparams["num_samples"]))
        return DataLoader(train, batch_size=self.hparams["batch_size"], shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader[Any]:
        data = self._dataset()
        val = Subset(data, range(self.hparams["num_samples"], len(data)))  # type: ignore[arg-type]
        return DataLoader(val, batch_size=self.hparams["batch_size"])
