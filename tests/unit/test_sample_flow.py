"""[Note: sample flow]: where a forward or a training step mixes the samples of its batch, told from two runs at
different batch sizes. A statistic over the batch computed back into samples (``x - x.mean(0)``, across blocks
too) and a contrastive loss in ``training_step`` (``z @ y.T``) are found, and the strategy then trains as plain
Lightning does; per-sample models, losses that only average, and counts that route samples (a flag that some
value is infinite, tokens per expert) are not found."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils.data import DataLoader, TensorDataset

from lightning_autopart import AutoPartitionStrategy
from lightning_autopart.capture import capture
from lightning_autopart.capture.batch_stats import mixed_samples
from lightning_autopart.capture.sample_flow import RecordOps, SampleFlow, Trace, trace_flow
from lightning_autopart.errors import ConfigError
from lightning_autopart.profile.curves import resize_batch
from lightning_autopart.profile.step_checks import step_flow
from tests.one_device import fit_one_device


class Centered(nn.Module):
    """A layer that subtracts the batch's mean (a normalization over the batch, written by hand)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True)


class Mean(nn.Module):
    """Returns its input and the batch's mean of it: the statistic crosses into the next block."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x.mean(0)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, mean = pair
        return self.linear(x) * mean


class Guarded(nn.Module):
    """A clamp guarded by a flag over the whole batch (T5's infinite-value guard): a count, not a statistic."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        bound = torch.where(torch.isinf(y).any(), 1e3, 1e4)
        return torch.clamp(y, -bound, bound)


class Grouped(nn.Module):
    """Rows grouped by expert as transformers' grouped-product fallback groups them (Mixtral and 18 other
    mixtures): the groups' offsets are a histogram of the expert indices converted to float, a count."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.ones(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = self.gate(x).argmax(-1).sort()
        offsets = torch.histc(order.values.float(), bins=4, min=0, max=3).cumsum(0).to(torch.int64)
        group = torch.bucketize(torch.arange(x.shape[0], device=x.device), offsets, right=True).clamp(max=3)
        return x[order.indices] * self.scale[group]


def _found(model: nn.Module) -> tuple[str, ...]:
    x = torch.randn(4, 8, device="meta")
    model = model.to("meta")
    return mixed_samples(capture(model, x), capture(model, resize_batch(x, 4, 8)))


def test_a_statistic_of_the_batch_computed_back_into_samples_is_found() -> None:
    found = _found(nn.Sequential(nn.Linear(8, 8), Centered(), nn.Linear(8, 8)))
    assert found and all(f.endswith("from a value over the whole batch") for f in found), found
    assert any("(4, 8)" in f for f in found), found


def test_a_statistic_is_followed_from_one_block_into_the_next() -> None:
    found = _found(nn.Sequential(nn.Linear(8, 8), Mean(), Scaled()))
    assert any("mul" in f for f in found), found


@pytest.mark.parametrize(
    "model",
    [
        nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8)),
        nn.Sequential(Guarded(), nn.Linear(8, 8)),
        nn.Sequential(nn.Linear(8, 8), Grouped(), nn.Linear(8, 8)),
    ],
    ids=["per-sample", "guarded by a count", "grouped by a count"],
)
def test_models_that_keep_samples_apart_are_not_found(model: nn.Module) -> None:
    assert _found(model) == ()


def _trace(fn: object, *tensors: torch.Tensor) -> Trace:
    trace = Trace()
    with RecordOps(trace):
        fn(*tensors)  # type: ignore[operator]
    return trace


@pytest.mark.parametrize(
    ("loss", "kind"),
    [
        (lambda z, y: F.cross_entropy(z @ y.T, torch.arange(len(z))), "mm (2, 2)"),  # contrastive (InfoNCE)
        (lambda z, y: ((z - z.mean(0)) / z.std(0)).T @ y, "sub (2, 4)"),  # Barlow Twins' normalization
        (lambda z, y: F.mse_loss(z, y), None),
        (lambda z, y: ((z - y).square().sum(1) * (y[:, 0] > 0)).sum() / (y[:, 0] > 0).sum().clamp(min=1), None),
        (lambda z, y: F.cross_entropy(z, y.argmax(1)) + 0.1 * z.mean(0).square().sum(), None),  # an aux term
    ],
    ids=["contrastive", "normalized over the batch", "mse", "masked mean", "auxiliary statistic"],
)
def test_a_loss_is_traced_at_two_sizes(loss: object, kind: str | None) -> None:
    a = _trace(loss, torch.randn(2, 4), torch.randn(2, 4))
    b = _trace(loss, torch.randn(3, 4), torch.randn(3, 4))
    found = trace_flow(a, b, "step")
    assert found is not None
    if kind is None:
        assert found.mixed == ()
    else:
        assert found.mixed and any(f.startswith(f"step: {kind}") for f in found.mixed), found


def test_traces_of_another_structure_tell_nothing() -> None:
    a = _trace(lambda x: x.sum(), torch.randn(2, 4))
    b = _trace(lambda x: x.exp().sum(), torch.randn(3, 4))
    assert trace_flow(a, b, "step") is None


def test_the_flow_names_a_pairwise_value_and_a_statistic_once_each() -> None:
    flow = SampleFlow()
    x, y = torch.empty(2, 4), torch.empty(3, 4)
    flow.step("in", [], [("x", x, y)])
    flow.step("mean", ["x"], [("m", torch.empty(4), torch.empty(4))])
    flow.step("sub", ["x", "m"], [("c", x, y)])
    flow.step("mm", ["c"], [("p", torch.empty(2, 2), torch.empty(3, 3))])
    assert flow.found == {"sub (2, 4)": "statistics", "mm (2, 2)": "pairs"}


def test_a_size_the_data_decides_follows_the_samples() -> None:
    """JetMoE splits its tokens by expert into parts whose sizes are symbols of the capture: values computed from
    those parts are per-sample, not statistics of the batch (its experts' outputs were found mixing samples)."""
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        routed = [torch.empty(env.create_unbacked_symint(), 4) for _ in range(2)]
    flow = SampleFlow()
    flow.step("in", [], [("x", torch.empty(2, 4), torch.empty(3, 4))])
    flow.step("split", ["x"], [("part", routed[0], routed[1])])
    flow.step("linear", ["part"], [("y", routed[0], routed[1])])
    flow.step("index_add", ["x", "y"], [("z", torch.empty(2, 4), torch.empty(3, 4))])
    assert flow.kinds["y"] == "per-sample" and flow.found == {}


class _Contrastive(L.LightningModule):
    """A CLIP-style objective in ``training_step``: the model embeds, the step scores every pair of the batch;
    a torchmetrics accuracy beside it (its update needs values, which the tracing skips)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.example_input_array = torch.zeros(2, 8)
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        z = F.normalize(self(x), dim=-1)
        logits = 10 * z @ F.normalize(y, dim=-1).T
        labels = torch.arange(len(x), device=logits.device)
        loss = F.cross_entropy(logits, labels)
        self.accuracy(logits.argmax(1), labels)
        self.log("train_loss", loss)
        self.log("train_accuracy", self.accuracy)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 8, generator=g))
        return DataLoader(data, batch_size=16)


def check_contrastive_step(accelerator: str) -> None:
    """A contrastive ``training_step`` under the strategy on one device of ``accelerator`` trains as plain
    Lightning does (its loss traced on fake tensors on that device), and 4 micro-batches are refused."""
    expected = fit_one_device(_Contrastive, "auto", accelerator)[0]
    got = fit_one_device(_Contrastive, AutoPartitionStrategy(num_stages=1, profile="estimate"), accelerator)[0]
    assert got == pytest.approx(expected, rel=1e-5)
    four = AutoPartitionStrategy(num_stages=1, micro_batches=4, profile="estimate")
    with pytest.raises(ConfigError, match=r"micro_batches=4, but training_step combines samples .*mm \(\d+, \d+\)"):
        fit_one_device(_Contrastive, four, accelerator)


@pytest.mark.usefixtures("master_port")
def test_a_contrastive_training_step_trains_as_plain_lightning() -> None:
    """Before: 4 micro-batches of 4 scored each sample against its micro-batch's 3 others, losses 31-51 % lower
    than plain Lightning's, silently. Now the plan keeps one micro-batch, and micro_batches=4 is refused."""
    check_contrastive_step("cpu")


def test_a_loss_that_needs_values_tells_nothing() -> None:
    def loss(output: torch.Tensor, samples: int) -> torch.Tensor:
        return output.sum() * float(output.sum().item() > 0)

    outputs = {n: torch.empty(n, 4, device="meta") for n in (1, 2, 4)}
    assert step_flow(loss, outputs, 4).mixed == ()


class _RetrievalValidated(_Contrastive):
    """A per-sample training loss, and a validation metric that ranks each sample among the batch's others."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        scores = F.normalize(self(x), dim=-1) @ F.normalize(y, dim=-1).T
        hits = scores.argmax(1) == torch.arange(len(x), device=scores.device)
        self.log("val_recall", hits.float().mean())

    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return self.train_dataloader()


@pytest.mark.usefixtures("master_port")
def test_a_validation_step_that_ranks_samples_keeps_one_micro_batch() -> None:
    """validation_step runs once per micro-batch as well: a recall among each micro-batch's 4 samples logged 0.31
    where plain Lightning, ranking 16, logged 0.06."""
    strategy = AutoPartitionStrategy(num_stages=1, profile="estimate")
    fit_one_device(_RetrievalValidated, strategy)
    assert strategy.plan is not None and strategy.plan.micro_batches == 1
    assert strategy.plan.notes["batch_mixing"].startswith("validation_step combines samples of the batch")
    four = AutoPartitionStrategy(num_stages=1, micro_batches=4, profile="estimate")
    with pytest.raises(ConfigError, match=r"micro_batches=4, but validation_step combines samples"):
        fit_one_device(_RetrievalValidated, four)
