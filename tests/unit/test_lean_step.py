"""A steady 1-stage autopart step is as lean as plain Lightning's, measured device-independently on the CPU.

Host syncs are calls of ``aten._local_scalar_dense`` (``.item()``, ``float(t)``, ``if t:``): on a GPU each one
makes the host wait for the device. Live tensor bytes are a gc census taken without collecting (what a reference
cycle keeps costs device memory until the collector runs), and the peak follows every storage a step creates
(see tests/census.py). The strategy plans with ``profile="measure"``, so a profiler copy left alive shows too.
"""

from __future__ import annotations

import gc
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_autopart import AutoPartitionStrategy
from tests.census import StepProbe

#: Probed training batches (planning, the first schedule and the allocator's warm-up come before).
START, STOP, STEPS = 3, 6, 7
#: Live and peak tensor bytes of autopart over plain Lightning's, at most.
RATIO = 1.03


class _MLP(L.LightningModule):
    """8 x (Linear(512, 512) + ReLU) trained with Adam and an MSE loss, logged every step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(512, 512), nn.ReLU())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _probe(strategy: Any) -> dict[str, list[int]]:
    gc.collect()  # an earlier fit's garbage must not count; what this fit leaves uncollected must
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(128 * STEPS, 512, generator=g), torch.randn(128 * STEPS, 512, generator=g))
    probe = StepProbe(START, STOP)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    trainer.fit(_MLP(), DataLoader(data, batch_size=128))
    assert len(probe.syncs) == STOP - START
    # Numbers only: Lightning gives callbacks the module's bound log method, so the probe would keep the model alive.
    return {"syncs": probe.syncs, "live": probe.live, "peaks": probe.peaks}


@pytest.fixture(scope="module")
def plain() -> dict[str, list[int]]:
    return _probe("auto")


@pytest.mark.usefixtures("master_port")
@pytest.mark.parametrize("micro_batches", [1, 4])
def test_one_stage_step_is_as_lean_as_plain_lightning(plain: dict[str, list[int]], micro_batches: int) -> None:
    ours = _probe(AutoPartitionStrategy(num_stages=1, micro_batches=micro_batches))
    syncs, reference = ours["syncs"], plain["syncs"]
    assert max(syncs) <= min(reference), f"host syncs per step: {syncs} against {reference}"
    live, base = max(ours["live"]), max(plain["live"])
    assert live <= RATIO * base, f"live tensor bytes at a step's start: {live:,} against {base:,}"
    peak, top = max(ours["peaks"]), max(plain["peaks"])
    assert peak <= RATIO * top, f"a step's peak tensor bytes: {peak:,} against {top:,}"
