"""[Note: a loss that grows]: a training step whose loss sums over its samples (``reduction="sum"``, a VAE's
terms) would be scaled by 1 / micro_batches in a pipeline, gradients and logged loss alike. Such a loss is found
by running it on one sample and on that sample repeated, planned with one micro-batch per replica (training then
equals plain Lightning's), and more micro-batches are refused with the fix. Means, weighted means and a mean
plus a constant are not found."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_autopart import AutoPartitionStrategy
from lightning_autopart.errors import ConfigError
from lightning_autopart.profile.step_checks import log_combines, loss_growth
from tests.one_device import fit_one_device, run_fit


class _Step:
    """A loss as the strategy's StepLoss offers it: a batch, and the loss over some of its rows."""

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], batch: torch.Tensor) -> None:
        self.fn, self.batch = fn, batch

    def __call__(self, output: torch.Tensor, samples: int) -> torch.Tensor:
        return self.fn(output, self.batch[:samples])

    def rows(self, indices: list[int]) -> _Step:
        return _Step(self.fn, self.batch[torch.tensor(indices)])


#: Token labels with padding (-100), and the outputs' shapes (batch first) for them and for regression targets.
_TOKENS = torch.tensor([[3, 1, -100, -100], [2, 2, 0, -100]])
_DATA = {"tokens": (_TOKENS, (4, 5)), "values": (torch.randn(4, 4), (4,))}


def _token_ce(out: torch.Tensor, y: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100, **kwargs)


@pytest.mark.parametrize(
    ("data", "fn", "growth"),
    [
        ("values", lambda out, y: F.mse_loss(out, y, reduction="sum"), 2.0),
        ("tokens", lambda out, y: _token_ce(out, y, reduction="sum"), 2.0),
        ("values", lambda out, y: F.mse_loss(out, y), None),
        ("tokens", _token_ce, None),  # a mean over the tokens that are not padding
        ("values", lambda out, y: F.mse_loss(out, y, reduction="sum") / len(y), None),
        ("values", lambda out, y: F.mse_loss(out, y) + 3.0, None),
    ],
    ids=["sum", "token sum", "mean", "token mean", "sum over len", "mean plus a constant"],
)
def test_a_loss_is_run_on_a_sample_and_on_it_repeated(data: str, fn: Any, growth: float | None) -> None:
    batch, shape = _DATA[data]
    outputs = {n: torch.empty(n, *shape, device="meta") for n in (1, 2, 4)}
    got = loss_growth(_Step(fn, batch), outputs)
    assert got == (None if growth is None else pytest.approx(growth, rel=1e-5))


def test_it_tells_nothing_without_a_way_to_repeat_a_sample() -> None:
    outputs = {n: torch.empty(n, 4, device="meta") for n in (1, 2)}
    assert loss_growth(lambda out, n: out.sum(), outputs) is None


class _Summed(L.LightningModule):
    """A regression whose loss is summed over the batch, as a VAE's reconstruction term is; ``samples`` in its
    loader (44: a last batch of 12, padded to the plan's 16)."""

    samples = 48

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.example_input_array = torch.zeros(2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y, reduction="sum")
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        g = torch.Generator().manual_seed(0)
        n = self.samples
        return DataLoader(TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)), 16)


class _Ragged(_Summed):
    samples = 44


class _SumPlusConstant(_Summed):
    """A loss that neither averages nor sums its samples: micro-batches cannot give it."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y, reduction="sum") + 10.0
        self.log("train_loss", loss)
        return loss


def check_summed_loss(accelerator: str) -> None:
    """A summed loss under the strategy on one device of ``accelerator`` (the step run there on random outputs),
    4 micro-batches, a ragged last batch too: the same losses, logged values and weights as plain Lightning."""
    for module in (_Summed, _Ragged):
        expected, weights = fit_one_device(module, "auto", accelerator)
        strategy = AutoPartitionStrategy(num_stages=1, micro_batches=4, profile="estimate")
        losses, trained = fit_one_device(module, strategy, accelerator)
        assert strategy.plan is not None and strategy.plan.notes["loss_reduction"] == "sum"
        assert strategy.plan.notes["log_combines"] == {"train_loss": "sum"}
        assert losses == pytest.approx(expected, rel=1e-5)
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(trained, weights, strict=True))


@pytest.mark.usefixtures("master_port")
def test_a_summed_loss_trains_as_plain_lightning() -> None:
    """Before: 4 micro-batches logged 45.2 where plain Lightning logged 180.6 (a quarter), and trained with a
    quarter of the gradient. Now each micro-batch's loss is added, and its logged value summed."""
    check_summed_loss("cpu")


@pytest.mark.usefixtures("master_port")
def test_a_loss_neither_mean_nor_sum_keeps_one_micro_batch() -> None:
    strategy = AutoPartitionStrategy(num_stages=1, profile="estimate")
    fit_one_device(_SumPlusConstant, strategy)
    assert strategy.plan is not None and strategy.plan.micro_batches == 1
    fix = r"micro_batches=4, but training_step's loss on one sample repeated twice is .*reduction='sum'"
    with pytest.raises(ConfigError, match=fix):
        fit_one_device(_SumPlusConstant, AutoPartitionStrategy(num_stages=1, micro_batches=4, profile="estimate"))


class _Counted(_Summed):
    """A mean loss, and values logged as the batch's sum, maximum and minimum beside it; a validation step that
    logs a sum too."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        loss = F.mse_loss(out, y)
        self.log("train_loss", loss)
        self.log("positive_targets", (y > 0).sum().float())
        self.log("largest_output", out.max())
        self.log("smallest_output", out.min())
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))
        self.log("val_positive_targets", (y > 0).sum().float())

    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return self.train_dataloader()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _logged(strategy: object) -> dict[str, float]:
    torch.manual_seed(0)
    trainer = run_fit(_Counted(), strategy, max_steps=3)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


@pytest.mark.usefixtures("master_port")
def test_logged_values_combine_over_micro_batches_as_over_samples() -> None:
    """[Note: logged values over micro-batches]: a sum, a maximum and a minimum logged by the step were merged
    as means of their micro-batches' values (a quarter of the sum with 4 micro-batches)."""
    loss = _Step(lambda out, y: F.mse_loss(out, y), torch.randn(4, 4))
    outputs = {n: torch.empty(n, 4, device="meta") for n in (1, 2, 4)}
    assert log_combines(loss, outputs) == {}  # logs nothing
    strategy = AutoPartitionStrategy(num_stages=1, micro_batches=4, profile="estimate")
    got, expected = _logged(strategy), _logged("auto")
    assert strategy.plan is not None and strategy.plan.micro_batches == 4
    assert strategy.plan.notes["log_combines"] == {
        "largest_output": "max", "positive_targets": "sum", "smallest_output": "min", "val_positive_targets": "sum",
    }  # fmt: skip
    assert {"val_loss", "val_positive_targets"} <= set(got)
    assert got == pytest.approx(expected, rel=1e-5)


class _Collecting(_Summed):
    """Collects its steps' losses in lists, as Lightning's docs show, and reduces them at the epoch's end."""

    def __init__(self) -> None:
        super().__init__()
        self.training_step_outputs: list[torch.Tensor] = []
        self.validation_step_outputs: list[torch.Tensor] = []
        self.epoch_means: dict[str, float] = {}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.training_step_outputs.append(loss.detach())
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.validation_step_outputs.append(F.mse_loss(self(x), y))

    def on_train_epoch_end(self) -> None:
        self.epoch_means["train"] = float(torch.stack(self.training_step_outputs).mean())
        self.epoch_means["train_steps"] = len(self.training_step_outputs)
        self.training_step_outputs.clear()

    def on_validation_epoch_end(self) -> None:
        self.epoch_means["val"] = float(torch.stack(self.validation_step_outputs).mean())
        self.validation_step_outputs.clear()

    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return self.train_dataloader()


@pytest.mark.usefixtures("master_port")
def test_the_planners_runs_of_the_steps_leave_nothing_in_the_module() -> None:
    """Before: the list held 6 meta tensors from planning before the real losses, and the epoch's torch.stack
    failed; the planner's checks added fake and random ones, to the validation list too."""
    means = {}
    for strategy in ("auto", AutoPartitionStrategy(num_stages=1, micro_batches=2, profile="estimate")):
        torch.manual_seed(0)
        model = _Collecting()
        run_fit(model, strategy, max_epochs=1, num_sanity_val_steps=0)
        means[strategy if isinstance(strategy, str) else "autopart"] = model.epoch_means
    plain, pipelined = means["auto"], means["autopart"]
    assert pipelined["train_steps"] == 2 * plain["train_steps"] == 6  # one entry per micro-batch
    assert pipelined["train"] == pytest.approx(plain["train"], rel=1e-5)
    assert pipelined["val"] == pytest.approx(plain["val"], rel=1e-5)


class _LossInForward(_Summed):
    """The forward computes the loss over its whole batch (as a Hugging Face model given labels does)."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = (torch.zeros(2, 8), torch.zeros(2, 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(*batch)
        self.log("train_loss", loss)
        return loss


@pytest.mark.usefixtures("master_port")
def test_a_loss_the_forward_computes_is_not_made_up_per_sample() -> None:
    """Its value for some samples cannot be drawn at random per sample: the logged loss was taken for a maximum
    (two samples' random losses and the first one's again) and merged so."""
    expected, _ = fit_one_device(_LossInForward, "auto")
    strategy = AutoPartitionStrategy(num_stages=1, micro_batches=4, profile="estimate")
    losses, _ = fit_one_device(_LossInForward, strategy)
    assert strategy.plan is not None and "log_combines" not in strategy.plan.notes
    assert losses == pytest.approx(expected, rel=1e-5)
