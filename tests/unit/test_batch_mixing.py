"""[Note: values that mix samples]: a forward that scores every sample of the batch against every other (CLIP's
image-text logits) is found from two captures at different batch sizes, planned with one micro-batch per replica
(more would train another model than plain Lightning), and a plan asked for more is refused with the fix, in
estimate and measure mode and under the strategy. Models that keep samples apart are planned as before."""

from __future__ import annotations

import io

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_autopart import AutoPartitionStrategy, Cluster, plan_model
from lightning_autopart.capture import capture
from lightning_autopart.capture.batch_stats import mixed_samples
from lightning_autopart.errors import ConfigError
from lightning_autopart.plan.report import print_plan
from lightning_autopart.profile.curves import resize_batch
from tests.models import make


class TwoTowers(nn.Module):
    """Like CLIP: an image tower and a text tower, every image scored against every text of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 8))
        self.text = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 8))
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        a = F.normalize(self.image(images), dim=-1)
        b = F.normalize(self.text(texts), dim=-1)
        return self.scale.exp() * a @ b.t()  # (batch, batch)


def _inputs(n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 12), torch.randn(n, 6)


def test_two_captures_find_the_value_that_mixes_samples() -> None:
    model, x = TwoTowers(), _inputs()
    found = mixed_samples(capture(model, x), capture(model, resize_batch(x, 4, 8)))
    assert found and all("(4, 4)" in f for f in found), found
    mlp, y = make("mlp"), torch.randn(4, 16)
    assert mixed_samples(capture(mlp, y), capture(mlp, resize_batch(y, 4, 8))) == ()


@pytest.mark.parametrize("mode", ["estimate", "measure"])
def test_it_is_planned_with_one_micro_batch_and_the_plan_says_why(mode: str) -> None:
    model = TwoTowers() if mode == "measure" else TwoTowers().to("meta")
    x = _inputs() if mode == "measure" else tuple(t.to("meta") for t in _inputs())
    cluster = Cluster.from_spec("a100-40gb", 2)
    plan = plan_model(model, x, cluster, 32, profile=mode, num_stages=2)
    assert plan.micro_batches == 1
    note = plan.notes["batch_mixing"]
    assert note.startswith("the forward combines samples of the batch into one value") and "(4, 4)" in note
    out = io.StringIO()
    print_plan(plan, Console(file=out, width=240))
    assert "combines samples" in out.getvalue()
    with pytest.raises(ConfigError, match=r"micro_batches=4, but the forward combines samples .* micro_batches=1"):
        plan_model(model, x, cluster, 32, profile=mode, num_stages=2, micro_batches=4)


def test_a_model_that_keeps_samples_apart_is_micro_batched_as_before() -> None:
    plan = plan_model(make("mlp").to("meta"), torch.randn(4, 16, device="meta"), Cluster.from_spec("a100-40gb", 2),
                      64, num_stages=2, micro_batches=4)  # fmt: skip
    assert plan.micro_batches == 4 and "batch_mixing" not in plan.notes


class _Pairs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(12, generator=g), torch.randn(6, generator=g)


class _Contrastive(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TwoTowers()

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        return self.model(images, texts)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(*batch)
        labels = torch.arange(logits.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.usefixtures("master_port")
def test_the_strategy_refuses_micro_batches_with_the_fix() -> None:
    quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    strategy = AutoPartitionStrategy(num_stages=1, micro_batches=4, profile="estimate")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, **quiet)
    try:
        with pytest.raises(ConfigError, match=r"micro_batches=4, but the forward combines samples"):
            trainer.fit(_Contrastive(), DataLoader(_Pairs(), batch_size=8))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
