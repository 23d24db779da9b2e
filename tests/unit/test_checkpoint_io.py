"""Resuming through a checkpoint IO whose ``load_checkpoint`` takes no ``weights_only``: Lightning 2.5's own
(``TorchCheckpointIO``), or a user's plugin written for it. Lightning 2.6 passes the flag only when it is set, and
so does the strategy: a resume from a full checkpoint (one file) must not fail on the older signature, and must
continue the run it left."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_autopart import AutoPartitionStrategy


class _OlderIO(TorchCheckpointIO):
    """Lightning 2.5's signature, no ``**kwargs``: a ``weights_only`` keyword is a TypeError."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[str] = []

    def load_checkpoint(self, path: Any, map_location: Any = None) -> dict[str, Any]:  # type: ignore[override]
        self.loaded.append(str(path))
        return super().load_checkpoint(path)


class _Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _fit(epochs: int, root: Path, io: TorchCheckpointIO | None = None, ckpt: Path | None = None) -> _Regression:
    """Train ``epochs`` epochs of 8 steps, resuming from ``ckpt``; the last epoch's checkpoint is ``root/last.ckpt``."""
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    model = _Regression()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=AutoPartitionStrategy(num_stages=1, micro_batches=2, checkpoint="full"),
        plugins=[io] if io is not None else None,
        max_epochs=epochs,
        default_root_dir=root,
        callbacks=[ModelCheckpoint(dirpath=root, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=8), ckpt_path=ckpt)
    assert trainer.global_step == 8 * epochs
    return model


@pytest.mark.usefixtures("master_port")
def test_a_resume_through_an_io_without_weights_only_continues_the_run(tmp_path: Path) -> None:
    straight = _fit(2, tmp_path / "straight")
    _fit(1, tmp_path / "first")
    io = _OlderIO()
    resumed = _fit(2, tmp_path / "resumed", io, tmp_path / "first" / "last.ckpt")
    assert io.loaded == [str(tmp_path / "first" / "last.ckpt")]
    for (name, p), q in zip(resumed.named_parameters(), straight.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"{name} after the resume")
