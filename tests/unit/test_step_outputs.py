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
from lightning_autopart.lightning.steps import merge_outputs
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


def test_merge_outputs_combines_the_keys_found_so_elementwise() -> None:
    """A key the planner found summed (or a maximum) combines elementwise over micro-batches, nested or not, a
    number staying a number; the others are concatenated or averaged as before."""
    outputs = [
        {"counts": torch.tensor([1.0, 2.0]), "best": 3, "nested": {"n": torch.tensor(2)}, "preds": torch.zeros(2, 1)},
        {"counts": torch.tensor([4.0, 0.0]), "best": 5, "nested": {"n": torch.tensor(3)}, "preds": torch.ones(2, 1)},
    ]
    merged = merge_outputs(outputs, None, {"counts": "sum", "best": "max", "nested": "sum"})
    assert merged["counts"].tolist() == [5.0, 2.0]
    assert merged["best"] == 5 and isinstance(merged["best"], int)
    assert int(merged["nested"]["n"]) == 5
    assert merged["preds"].shape == (4, 1)
