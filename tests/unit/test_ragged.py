"""Ragged batches in one process: padding, trimming and weighting helpers, the refusal of batch-coupled
models, and one-stage fits and validations on ragged loaders equal to plain Lightning (see
[Note: ragged batches])."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, NamedTuple

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, Subset
from transformers.modeling_outputs import SequenceClassifierOutput

from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning.hooks import LogRecord, merge_logs
from lightning_autopart.lightning.ragged import (
    check_even_batches,
    coupled_modules,
    pad_batch,
    real_rows,
    trim_output,
    zero_loss,
)
from lightning_autopart.lightning.steps import merge_outputs
from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from tests.distributed._ragged_script import RaggedLit, run_case
from tests.distributed.strategy_cases import Lit, dataset


def test_pad_batch_repeats_real_samples_in_order() -> None:
    batch = {
        "x": torch.randn(5, 2),
        "ids": torch.arange(5),
        "mask": torch.tensor([True, False, True, True, False]),
        "scale": torch.tensor(2.0),
        "table": torch.randn(3, 5),  # no batch dimension of 5: left alone
        "n": 3,
    }
    padded = pad_batch(batch, 5, 8)
    order = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    assert torch.equal(padded["x"], batch["x"][order]) and torch.equal(padded["ids"], order)
    assert padded["ids"].dtype == torch.int64 and torch.equal(padded["mask"], batch["mask"][order])
    assert padded["scale"] is batch["scale"] and padded["table"] is batch["table"] and padded["n"] == 3
    assert torch.equal(pad_batch([torch.arange(2)], 2, 7)[0], torch.tensor([0, 1, 0, 1, 0, 1, 0]))


def test_real_rows_of_each_micro_batch() -> None:
    # A batch of 6 real samples padded to 8, in micro-batches of 4, then of 2.
    assert [real_rows(lo, lo + 4, 6) for lo in (0, 4)] == [4, 2]
    assert [real_rows(lo, lo + 2, 6) for lo in (0, 2, 4, 6)] == [2, 2, 2, 0]
    assert [real_rows(lo, lo + 2, 8) for lo in (0, 2, 4, 6)] == [2, 2, 2, 2]


class _Pair(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


def test_trim_output_keeps_the_structure() -> None:
    output = {"logits": torch.randn(4, 3), "pair": _Pair(torch.randn(4, 2), torch.arange(4)), "k": 7}
    cut = trim_output(output, 4, 3)
    assert set(cut) == {"logits", "pair", "k"} and cut["k"] == 7 and isinstance(cut["pair"], _Pair)
    assert torch.equal(cut["logits"], output["logits"][:3]) and torch.equal(
        cut["pair"].second, torch.arange(3)
    )
    hf = SequenceClassifierOutput(logits=torch.randn(4, 5), hidden_states=(torch.randn(4, 2, 8),))
    cut = trim_output(hf, 4, 1)
    assert isinstance(cut, SequenceClassifierOutput) and cut.logits.shape == (1, 5)
    assert cut.hidden_states[0].shape == (1, 2, 8) and cut.loss is None
    assert trim_output(torch.ones(4, 2), 4, 2).shape == (2, 2)


def test_trim_output_refuses_an_output_without_batch_dimension() -> None:
    hf = SequenceClassifierOutput(loss=torch.tensor(0.3), logits=torch.randn(4, 5))
    with pytest.raises(ConfigError, match=r"2 real samples of 4.*output \['loss'\] has no batch dimension"):
        trim_output(hf, 4, 2)
    with pytest.raises(ConfigError, match=r"model's output has no batch .*drop_last=True.*multiple of 4"):
        trim_output(torch.tensor(1.0), 4, 2)


def test_zero_loss_gives_every_output_a_zero_gradient() -> None:
    big = torch.full((4, 3), 6e4, dtype=torch.float16, requires_grad=True)  # its sum overflows float16
    small = torch.randn(4, 2, requires_grad=True)
    labels = torch.arange(4)
    loss = zero_loss({"big": big, "small": (small, labels)})
    assert loss.item() == 0.0
    loss.backward()
    assert big.grad is not None and small.grad is not None
    assert not big.grad.any() and not small.grad.any() and not big.grad.isnan().any()
    assert zero_loss(labels).item() == 0.0


def test_coupled_modules_are_batch_norms_using_batch_statistics() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.LayerNorm(4), nn.GroupNorm(2, 4))
    assert coupled_modules(model) == ["1"]
    assert coupled_modules(model, evaluation=True) == []  # eval mode: running statistics
    assert coupled_modules(model.eval()) == []
    stateless = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=False)).eval()
    assert coupled_modules(stateless) == ["1"] and coupled_modules(stateless, evaluation=True) == ["1"]
    assert coupled_modules(nn.BatchNorm2d(3)) == ["BatchNorm2d"]


def test_merge_logs_weights_micro_batches_by_real_samples() -> None:
    records = [
        LogRecord("loss", torch.tensor(1.0), {"batch_size": 4}),
        LogRecord("n", 1.0, {"batch_size": 8}),
        LogRecord("loss", torch.tensor(4.0), {"batch_size": 2}),
        LogRecord("n", 4.0, {"batch_size": 8}),
    ]
    merged = {r.name: r for r in merge_logs(records, [4, 4, 2, 2])}
    assert float(merged["loss"].value) == pytest.approx(2.0)  # (4 x 1 + 2 x 4) / 6
    assert merged["n"].value == pytest.approx(2.0)
    assert merged["loss"].kwargs == {"batch_size": 6}  # each call's own size: the batch is their sum
    assert merged["n"].kwargs == {"batch_size": 8}  # a constant is kept as given
    equal = {r.name: r for r in merge_logs(records, [4, 4, 4, 4])}
    assert float(equal["loss"].value) == 2.5 and equal["n"].kwargs == {"batch_size": 8}
    assert merge_logs(records)[0].kwargs == {"batch_size": 2}  # without sizes: the last call's options


def test_merge_outputs_weights_scalars_and_concatenates_samples() -> None:
    outputs = [
        {"loss": torch.tensor(1.0), "y": torch.zeros(4, 2)},
        {"loss": torch.tensor(4.0), "y": torch.ones(1, 2)},
    ]
    merged = merge_outputs(outputs, [4, 1])
    assert float(merged["loss"]) == pytest.approx(1.6) and merged["y"].shape == (5, 2)
    assert float(merge_outputs(outputs)["loss"]) == 2.5


def _namespace_trainer(module: nn.Module, train: Any, val: Any = None) -> Any:
    def loop(loader: Any) -> Any:
        source = SimpleNamespace(is_defined=lambda: loader is not None, dataloader=lambda: loader)
        return SimpleNamespace(_data_source=source)

    fit = loop(train)
    fit.epoch_loop = SimpleNamespace(val_loop=loop(val))
    return SimpleNamespace(
        lightning_module=module,
        fit_loop=fit,
        validate_loop=loop(val),
        test_loop=loop(None),
        predict_loop=loop(None),
    )


def test_only_batch_coupled_loops_refuse_ragged_loaders() -> None:
    data = dataset("mlp", 22)
    ragged, even = DataLoader(data, batch_size=8), DataLoader(data, batch_size=8, drop_last=True)
    check_even_batches(_namespace_trainer(RaggedLit(), ragged, ragged), "training_step", 1)  # padded
    bn = RaggedLit(batch_norm=True)
    with pytest.raises(
        ConfigError, match=r"train loader's last batch per replica holds 6 samples, not 8 .*model\.1 "
    ):
        check_even_batches(_namespace_trainer(bn, ragged), "training_step", 1)
    check_even_batches(
        _namespace_trainer(bn, even, ragged), "training_step", 1
    )  # BatchNorm evaluates on stats
    check_even_batches(_namespace_trainer(bn, DataLoader(data, batch_size=11)), "training_step", 2)  # 11 each
    bn.model[1].track_running_stats, bn.model[1].running_mean, bn.model[1].running_var = False, None, None
    with pytest.raises(
        ConfigError, match=r"val loader's last batch .*normalise\(s\) over the batch.*drop_last=True"
    ):
        check_even_batches(_namespace_trainer(bn, even, ragged), "training_step", 1)


def _trainer(strategy: Any, epochs: int = 2) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


@pytest.mark.usefixtures("master_port")
def test_one_stage_ragged_fit_equals_plain_lightning() -> None:
    """Micro-batches of 2: the last batch (6 of 8) leaves one micro-batch without a real sample."""
    strategy = AutoPartitionStrategy(num_stages=1, micro_batches=4, profile="estimate")
    got = run_case({"train": 22, "val": 13}, strategy, 1)
    torch.distributed.destroy_process_group()
    expected = run_case({"train": 22, "val": 13}, "auto", 1)
    assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5)
    for mine, theirs in zip(got["epochs"], expected["epochs"], strict=True):
        assert mine == pytest.approx(theirs, rel=1e-5)
    assert got["validate"] == pytest.approx(expected["validate"], rel=1e-5)
    torch.testing.assert_close(got["predictions"], expected["predictions"], rtol=1e-5, atol=1e-6)
    for name, value in expected["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.usefixtures("master_port")
def test_batch_norm_validates_a_ragged_loader_in_eval_mode() -> None:
    """Evaluation uses BatchNorm's running statistics: padding changes nothing, and no sample is lost."""
    val = DataLoader(Subset(dataset("mlp", 13), range(13)), batch_size=8)

    def validate(strategy: Any) -> dict[str, float]:
        model = RaggedLit(batch_norm=True)
        model.model[1].running_mean.uniform_(-1, 1, generator=torch.Generator().manual_seed(2))
        model.model[1].running_var.uniform_(0.5, 2, generator=torch.Generator().manual_seed(3))
        return {k: float(v) for k, v in _trainer(strategy).validate(model, val, verbose=False)[0].items()}

    got = validate(AutoPartitionStrategy(num_stages=1, micro_batches=2, profile="estimate"))
    torch.distributed.destroy_process_group()
    assert got == pytest.approx(validate("auto"), rel=1e-5)


class _Stream(IterableDataset[list[torch.Tensor]]):
    """10 samples with no length: no loader check can see the ragged last batch before it comes."""

    def __iter__(self) -> Any:
        data = dataset("mlp", 10)
        return iter([list(data[i]) for i in range(10)])


@pytest.mark.usefixtures("master_port")
def test_a_ragged_batch_reaching_batch_norm_training_is_refused() -> None:
    trainer = _trainer(AutoPartitionStrategy(num_stages=1, micro_batches=2, profile="estimate"), epochs=1)
    with pytest.raises(
        ConfigError, match=r"a batch of 2 samples reached the pipeline, planned for 4 .*model\.1 "
    ):
        trainer.fit(RaggedLit(batch_norm=True), DataLoader(_Stream(), batch_size=4))
    assert trainer.global_step == 2


def _fit_losses(strategy: Any, n: int) -> list[float]:
    """Lit("loss") (its loss computed inside the model) for one epoch of ``n`` samples in batches of 4."""
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, *args: Any) -> None:
            losses.append(float(outputs["loss"]))

    data = dataset("loss", n)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=0) if strategy == "auto" else None
    trainer = _trainer(strategy, epochs=1)
    trainer.callbacks.append(Record())
    trainer.fit(Lit("loss"), DataLoader(data, batch_size=4, sampler=sampler))
    return losses


@pytest.mark.usefixtures("master_port")
def test_a_loss_computed_inside_the_model_needs_whole_micro_batches() -> None:
    """10 samples: the last batch of 2 fills one micro-batch of 2 exactly (the other is all padding): equal to
    plain Lightning. 9 samples: a micro-batch of 1 real sample and 1 padded one is refused in setup, with the
    fix."""
    got = _fit_losses(AutoPartitionStrategy(num_stages=1, micro_batches=2, profile="estimate"), 10)
    torch.distributed.destroy_process_group()
    assert got == pytest.approx(_fit_losses("auto", 10), rel=1e-5) and len(got) == 3
    message = r"holds 1 samples, not 4 .*outputs cross_entropy_loss have no batch dimension.*compute the loss"
    with pytest.raises(ConfigError, match=message):
        _fit_losses(AutoPartitionStrategy(num_stages=1, micro_batches=2, profile="estimate"), 9)
