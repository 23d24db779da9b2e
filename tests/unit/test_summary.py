"""Lightning's model summary of a split model (lightning/summary.py): the whole model's parameters and FLOPs on a
rank whose other stages' tensors are meta tensors, as one process summarises it. Lightning counts FLOPs from 2.6
on; before, its summary shows the layers' sizes only, and so does autopart's."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary as SummaryCallback
from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import Tensor, nn

from examples.tutorial import Net
from lightning_autopart.lightning.summary import WholeModelSummary, summarize_whole_model
from lightning_autopart.runtime.checkpoint import free_elsewhere

#: Whether this Lightning's summary counts FLOPs (2.6 and later).
COUNTS_FLOPS = hasattr(ModelSummary, "total_flops")


def _split(model: nn.Module, keep: int) -> None:
    """``model`` as rank 0 holds it after a split: the layers from ``keep`` on live on the meta device."""
    layers = model.layers  # type: ignore[union-attr]
    free_elsewhere(model, {id(t) for layer in layers[keep:] for t in (*layer.parameters(), *layer.buffers())})


def test_a_split_model_is_summarised_as_one_process_summarises_it() -> None:
    whole = Net(hidden=16, layers=4)
    expected = ModelSummary(whole, max_depth=2)
    split = Net(hidden=16, layers=4)
    _split(split, 2)
    example, split.example_input_array = split.example_input_array, None  # the strategy hides it
    summary = WholeModelSummary(split, 2, example)
    assert summary.total_parameters == expected.total_parameters == 4 * (16 * 16 + 16)
    if COUNTS_FLOPS:
        assert summary.total_flops == expected.total_flops == 2 * 2 * 4 * 16 * 16
        assert summary.flop_counts == expected.flop_counts
    assert summary.in_sizes == expected.in_sizes and summary.out_sizes == expected.out_sizes
    assert summary.in_sizes[1] == [2, 16] and summary.out_sizes[-1] == [2, 16]
    assert dict(summary._get_summary_data()) == dict(expected._get_summary_data())
    assert split.example_input_array is None and split.training  # the module is left as it was
    assert split.layers[3].weight.device.type == "meta" and split.layers[0].weight.device.type == "cpu"


class _ReadsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x) * float(x.sum().item() > 0)  # needs a real value: no meta run


class _Lit(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _ReadsAValue()

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


def test_a_forward_that_needs_values_counts_no_flops_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []  # Lightning's logger may not propagate to pytest's handler: record the call itself
    monkeypatch.setattr("lightning_autopart.lightning.summary.rank_zero_info", lambda m, *a, **k: said.append(m))
    module = _Lit()
    summary = WholeModelSummary(module, 1, torch.randn(2, 4))
    assert summary.total_parameters == 20 and summary.in_sizes == ["?"]
    assert not COUNTS_FLOPS or summary.total_flops == 0
    message = "the model summary counts no FLOPs and no layer sizes: _Lit's forward does not run on meta tensors"
    assert any(message in m for m in said), said
    assert module.training and module.model.training


def test_the_trainers_summary_callbacks_use_it() -> None:
    plain, rich = SummaryCallback(max_depth=2), RichModelSummary(max_depth=2)
    trainer = L.Trainer(callbacks=[plain, rich], logger=False, enable_progress_bar=False)
    model = Net(hidden=8, layers=2)
    summarize_whole_model(trainer, torch.randn(2, 8))
    for callback in (plain, rich):
        summary = callback._summary(trainer, model)
        assert isinstance(summary, WholeModelSummary) and summary.in_sizes[1] == [2, 8]
        assert not COUNTS_FLOPS or summary.total_flops == 2 * 2 * 2 * 8 * 8
    other = SummaryCallback(max_depth=2)._summary(trainer, model)  # another Trainer's callback: as before
    assert other.in_sizes[1] == [2, 8] and (not COUNTS_FLOPS or other.total_flops == 2 * 2 * 2 * 8 * 8)
