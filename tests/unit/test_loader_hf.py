"""A Hugging Face ``datasets`` stream as users write one (``to_iterable_dataset``, a shuffle buffer, torch
format) through the strategy: its fetch is timed, and training reads the same batches as plain Lightning."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from lightning_autopart.profile.loader import time_loader

datasets = pytest.importorskip("datasets")


def _stream() -> object:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 6, generator=g)
    table = datasets.Dataset.from_dict({"x": x.tolist(), "y": x.sum(1, keepdim=True).tolist()})
    stream = table.to_iterable_dataset(num_shards=4).shuffle(seed=3, buffer_size=16)
    return stream.with_format("torch")


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        self.data = _stream()
        self.seen: list[torch.Tensor] = []
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
        loss = F.mse_loss(self(batch["x"]), batch["y"])
        self.losses.append(loss.item())
        return loss

    def on_train_batch_start(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.seen.append(batch["x"].clone())  # the batches the loop reads (the strategy also runs steps to plan)

    def train_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        return DataLoader(self.data, batch_size=4)  # type: ignore[arg-type]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_stream_is_timed_and_its_state_is_left_as_found() -> None:
    stream = _stream()
    before = stream.state_dict()  # type: ignore[attr-defined]
    cost = time_loader(DataLoader(stream, batch_size=4), samples=4, batches=3)  # type: ignore[arg-type]
    assert cost is not None and cost.batches == 3 and cost.sample_us > 0
    assert stream.state_dict() == before  # type: ignore[attr-defined]


def _fit(strategy: object) -> Regression:
    torch.manual_seed(7)
    model = Regression()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=6, logger=False,  # type: ignore[arg-type]
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model)
    return model


@pytest.mark.usefixtures("master_port")
def test_the_strategy_reads_the_same_batches_as_plain_lightning() -> None:
    strategy = AutoPartitionStrategy(num_stages=1, micro_batches=1, profile="estimate")
    got = _fit(strategy)
    assert strategy.plan is not None and "ms/sample, 0 workers" in strategy.plan.notes["loader"]
    torch.distributed.destroy_process_group()
    plain = _fit("auto")
    assert len(got.seen) == len(plain.seen) == 6
    assert all(torch.equal(a, b) for a, b in zip(got.seen, plain.seen, strict=True))
    assert got.losses == pytest.approx(plain.losses, rel=1e-5)
