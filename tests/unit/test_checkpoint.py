"""Checkpoints by name in one process: freeing other stages, optimizer state across splits, atomic writes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_autopart.errors import CheckpointError, ConfigError
from lightning_autopart.lightning.ragged import check_even_batches
from lightning_autopart.runtime.checkpoint import (
    free_elsewhere,
    held_state,
    load_optimizer_by_name,
    optimizer_by_name,
    replace_atomically,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    return model


def _trained(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.1}])
    for _ in range(2):
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
    return optimizer


def test_free_elsewhere_keeps_shapes_and_ties_but_no_memory() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].weight = model[0].weight
    drop = {id(model[0].weight), id(model[0].bias)}
    free_elsewhere(model, drop)
    assert model[0].weight.device.type == "meta" and model[0].weight.shape == (3, 3)
    assert model[1].weight is model[0].weight  # a tie stays one parameter
    assert model[1].bias.device.type == "cpu"
    assert sum(p.numel() for p in model.parameters()) == 9 + 3 + 3  # a model summary counts the whole model
    assert set(held_state(model.state_dict())) == {"1.bias"}


def test_optimizer_state_moves_by_name_between_splits() -> None:
    model = _model()
    whole = _trained(model)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [[names[id(p)] for p in g["params"]] for g in whole.param_groups]
    saved = optimizer_by_name(whole, names, groups)
    assert set(saved["state"]) == {n for g in groups for n in g}
    # Another split: this rank holds only the last layer; its optimizer's groups hold what it holds.
    other = torch.optim.Adam([{"params": []}, {"params": model[2].parameters(), "lr": 0.5}])
    load_optimizer_by_name(other, saved, names, groups)
    assert other.param_groups[1]["lr"] == 0.1  # the checkpoint's hyperparameters
    for p in model[2].parameters():
        torch.testing.assert_close(other.state[p]["exp_avg"], whole.state[p]["exp_avg"])
    # A plain optimizer over the whole model reads the named file by position, as Optimizer.load_state_dict does.
    plain = torch.optim.Adam([{"params": model[0].parameters()}, {"params": model[2].parameters()}])
    plain.load_state_dict(saved)
    for p in (*model[0].parameters(), *model[2].parameters()):
        torch.testing.assert_close(plain.state[p]["exp_avg_sq"], whole.state[p]["exp_avg_sq"])
    # A plain (by-position) checkpoint loads into a split too.
    split = torch.optim.Adam([{"params": model[0].parameters()}, {"params": []}])
    load_optimizer_by_name(split, whole.state_dict(), names, groups)
    torch.testing.assert_close(split.state[model[0].weight]["exp_avg"], whole.state[model[0].weight]["exp_avg"])


def test_optimizer_state_of_another_model_is_refused() -> None:
    model = _model()
    whole = _trained(model)
    names = {id(p): n for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError, match=r"group 0 .* 2 parameters, this model's has 1"):
        load_optimizer_by_name(whole, whole.state_dict(), names, [["0.weight"], ["2.weight", "2.bias"]])


def test_a_failing_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    replace_atomically(path, lambda partial: partial.write_text("one"))
    assert path.read_text() == "one"

    def fail(partial: Path) -> None:
        partial.write_text("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        replace_atomically(path, fail)
    assert path.read_text() == "one"
    replace_atomically(path, lambda partial: partial.mkdir() or (partial / "x").write_text("two"))
    assert (path / "x").read_text() == "two" and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def _trainer(train: Any, val: Any = None, module: nn.Module | None = None) -> Any:
    def loop(loader: Any) -> Any:
        source = SimpleNamespace(is_defined=lambda: loader is not None, dataloader=lambda: loader)
        return SimpleNamespace(_data_source=source)

    fit = loop(train)
    fit.epoch_loop = SimpleNamespace(val_loop=loop(val))
    module = module if module is not None else nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    return SimpleNamespace(
        lightning_module=module,
        fit_loop=fit,
        validate_loop=loop(val),
        test_loop=loop(None),
        predict_loop=loop(None),
    )


def test_ragged_last_batches_are_refused_before_training_with_batch_norm() -> None:
    """A smaller last batch is padded (see [Note: ragged batches]): BatchNorm's statistics would see it."""
    data = TensorDataset(torch.zeros(20, 2))
    check_even_batches(_trainer(DataLoader(data, batch_size=5)), "training_step", 2)  # 10 per replica
    check_even_batches(_trainer(DataLoader(data, batch_size=4, drop_last=True)), "training_step", 1)
    with pytest.raises(ConfigError, match="train loader's last batch per replica holds 2 samples, not 4"):
        check_even_batches(_trainer(DataLoader(data, batch_size=4)), "training_step", 2)
    check_even_batches(_trainer(DataLoader(data, batch_size=4), module=nn.Linear(2, 2)), "training_step", 2)
    val = [DataLoader(data, batch_size=5), DataLoader(data, batch_size=3)]
    check_even_batches(_trainer(DataLoader(data, batch_size=5), val), "training_step", 1)  # eval: running
    stateless = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, track_running_stats=False))
    with pytest.raises(ConfigError, match=r"val loader.*drop_last=True"):
        check_even_batches(_trainer(DataLoader(data, batch_size=5), val, stateless), "training_step", 1)
