"""[Note: batch statistics]: the normalizations that reduce over the batch are found in the captured programs,
and a plan that splits the batch into micro-batches says what that changes, with the fix (the report, the
plan file, and the strategy's warning on rank 0)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

from lightning_autopart import Cluster, plan_model
from lightning_autopart.capture import capture
from lightning_autopart.capture.batch_stats import batch_statistics
from lightning_autopart.plan.report import print_plan
from tests.models import make


class _Norms(nn.Module):
    """Every kind of normalization: over the batch (a module, and a functional call in training) and within
    a sample (layer, group, instance norms, and a functional batch norm in evaluation)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.ln = nn.LayerNorm(4)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inorm(self.gn(self.bn(self.conv(x))))
        x = F.batch_norm(x, self.mean, self.var, training=False)  # running statistics only
        x = self.ln(x.mean(dim=(2, 3)))
        if self.training:
            x = F.batch_norm(x, None, None, training=True)  # over the batch, no module of its own
        return self.head(x)


def test_found_in_the_captured_programs() -> None:
    got = batch_statistics(capture(_Norms(), torch.randn(4, 3, 8, 8)))
    assert got[0] == "bn" and len(got) == 2  # the module by name, the functional call by its block
    assert not {"gn", "inorm", "ln"} & set(got)


def test_a_model_without_them_has_none() -> None:
    assert batch_statistics(capture(make("mlp"), torch.randn(4, 16))) == ()
    assert batch_statistics(capture(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), torch.randn(2, 4))) == ()


def test_a_hugging_face_resnet_from_meta() -> None:
    pytest.importorskip("transformers")
    from tests.hf_architectures import build, inputs

    got = batch_statistics(capture(build("resnet"), inputs("resnet")))
    assert len(got) == 16 and got[0] == "resnet.embedder.embedder.normalization"


def _plan(micro_batches: int, schedule: str = "1F1B") -> object:
    return plan_model(
        make("resnet"), torch.randn(2, 3, 16, 16), Cluster.from_spec("a100-40gb", 2), 16, num_stages=2,
        micro_batches=micro_batches, schedules=[schedule],
    )  # fmt: skip


def test_a_micro_batched_plan_says_what_changes_and_the_fix() -> None:
    plan = _plan(4)
    note = plan.notes["batch_statistics"]  # type: ignore[attr-defined]
    assert note.startswith("6 batch norms (stem.1, stage1.bn1, stage1.bn2 and 3 more) normalize")
    assert "each micro-batch of 4 samples on its own, not the replica's 16" in note
    assert "4 times a step" in note and "micro_batches=1" in note and "GroupNorm" in note
    out = io.StringIO()
    print_plan(plan, Console(file=out, width=200))  # type: ignore[arg-type]
    assert "Batch norm" in out.getvalue() and "6 batch norms" in out.getvalue()
    assert "batch_statistics" not in _plan(1, "GPipe").notes  # type: ignore[attr-defined]


@pytest.mark.usefixtures("master_port")
def test_the_strategy_warns_with_the_fix() -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_autopart import AutoPartitionStrategy
    from tests.distributed._ragged_script import RaggedLit
    from tests.distributed.strategy_cases import dataset

    strategy = AutoPartitionStrategy(num_stages=1, micro_batches=2, profile="estimate")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    message = r"autopart: 1 batch norm \(model\.1\) normalizes each micro-batch of 2 samples .* micro_batches=1"
    with pytest.warns(UserWarning, match=message):
        trainer.fit(RaggedLit(batch_norm=True), DataLoader(dataset("mlp", 8), batch_size=4))
    torch.distributed.destroy_process_group()
