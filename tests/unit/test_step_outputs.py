"""[Note: a step's other outputs]: a ``training_step`` that returns a dict hands its other entries to
``on_train_batch_end``. Under the strategy the hooks saw only the loss, silently; now each micro-batch's entries
are merged (per-sample tensors concatenated, a count summed, a mean averaged), a ragged last batch too, and the
hooks see what plain Lightning's see."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F

from lightning_autopart import AutoPartitionStrategy
from tests.one_device import fit_one_device
from tests.unit.test_step_checks import _Summed


class _Returns(_Summed):
    """A regression whose step returns its predictions, its batch's size and its mean error beside the loss."""

    seen: ClassVar[list[dict[str, Any]]] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        x, y = batch
        out = self(x)
        loss = F.mse_loss(out, y)
        self.log("train_loss", loss)
        error = (out - y).abs().mean()
        return {"loss": loss, "preds": out.detach(), "samples": torch.tensor(len(x)), "error": error, "tag": "fit"}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        type(self).seen.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in outputs.items()})


class _RaggedReturns(_Returns):
    samples = 44


def check_step_outputs(module: type[_Returns], accelerator: str) -> None:
    """What ``on_train_batch_end`` sees of ``module``'s step on one device of ``accelerator``, 4 micro-batches:
    what plain Lightning's sees."""
    module.seen = []
    fit_one_device(module, "auto", accelerator, steps=3)
    expected, module.seen = module.seen, []
    strategy = AutoPartitionStrategy(num_stages=1, micro_batches=4, profile="estimate")
    fit_one_device(module, strategy, accelerator, steps=3)
    assert strategy.plan is not None
    assert strategy.plan.notes["output_combines"] == {"samples": "sum"}
    assert len(module.seen) == len(expected) == 3
    for got, want in zip(module.seen, expected, strict=True):
        assert set(got) == set(want)
        assert got.pop("tag") == want.pop("tag") == "fit"
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.usefixtures("master_port")
@pytest.mark.parametrize("module", [_Returns, _RaggedReturns], ids=["even", "ragged"])
def test_on_train_batch_end_sees_the_whole_batchs_outputs(module: type[_Returns]) -> None:
    """Before: [{'loss': ...}] each step, the other keys dropped."""
    check_step_outputs(module, "cpu")
