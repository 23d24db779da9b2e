"""Models, data and plans of the recompute (activation checkpointing) tests, shared by the scripts and the tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from lightning_autopart.plan import Plan
from tests.distributed.runtime_cases import MICRO, micro_example
from tests.models import make

__all__ = [
    "BUDGET",
    "NormDrop",
    "Tall",
    "TallLit",
    "checkpointed",
    "make_model",
    "model_example",
    "tall_dataset",
]

#: Device memory for the strategy case: a 2-stage plan of :class:`Tall` at 4 samples fits only with checkpointing
#: (~426 kB with, ~553 kB without, for the measured profile on CPU), and no 1-stage plan fits (~811 kB with).
BUDGET = 490_000


class NormDropBlock(nn.Module):
    """Linear, BatchNorm, ReLU, dropout and Linear around a skip."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.norm = nn.BatchNorm1d(hidden)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.relu(self.norm(self.fc1(x)))))


class NormDrop(nn.Module):
    """Wide blocks with batch norm and dropout: activations dominate, masks and statistics matter."""

    def __init__(self, width: int = 16, hidden: int = 128, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(NormDropBlock(width, hidden) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class TallBlock(nn.Module):
    """A token-wise MLP around a skip: 8 features in and out, 128 inside."""

    def __init__(self, width: int = 8, hidden: int = 128) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Tall(nn.Module):
    """Few parameters, many activations: 8 blocks over 64 tokens of 8 features (each block saves 33x its input)."""

    def __init__(self, depth: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TallBlock() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class TallLit(L.LightningModule):
    """:class:`Tall` trained with SGD on a mean squared error."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Tall()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def tall_dataset(n: int) -> TensorDataset:
    """``n`` deterministic (tokens, target) samples for :class:`Tall`."""
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 64, 8, generator=g), torch.randn(n, 64, 8, generator=g))


def make_model(name: str) -> nn.Module:
    """``normdrop`` (batch norm and dropout) or a zoo model, with deterministic weights."""
    if name == "normdrop":
        torch.manual_seed(0)
        return NormDrop()
    return make(name)


def model_example(name: str) -> torch.Tensor:
    """One micro-batch of inputs (``normdrop`` takes the 16 features of runtime_cases' default data)."""
    return torch.randn(MICRO, 16) if name == "normdrop" else micro_example(name)


def checkpointed(plan: Plan, stages: Iterable[int]) -> Plan:
    """``plan`` with activation checkpointing on exactly ``stages``."""
    chosen = set(stages)
    return dataclasses.replace(
        plan, stages=tuple(dataclasses.replace(s, checkpoint=s.index in chosen) for s in plan.stages)
    )
