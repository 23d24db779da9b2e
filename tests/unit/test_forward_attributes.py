"""Python attributes a forward changes are not frozen into the captured graph ([Note: Python state in the
forward] in lightning_autopart/capture/attributes.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_autopart.capture import capture
from lightning_autopart.capture.attributes import AttributeWatch
from lightning_autopart.errors import CaptureError


class WarmUp(nn.Module):
    """Doubles its output once it has been called twice: a warm-up switched by a Python call counter."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.layer(x)
        return y * 2 if self.calls > 2 else y


class History(nn.Module):
    """Appends each batch size to a list it keeps (a container changed in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.sizes.append(x.shape[0])
        return self.layer(x)


def test_a_counter_in_a_forward_is_not_exported_and_its_module_runs_it_at_every_call() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), WarmUp(), nn.Linear(4, 2))
    captured = capture(model, torch.randn(3, 4))
    assert captured.method == "modules"  # torch.export would have frozen the branch taken at capture
    assert any("1.calls (0 -> 1)" in note and "freeze" in note for note in captured.notes), captured.notes
    assert model[1].calls == 0  # capture leaves the Python state as it found it
    block = next(b for b in captured.blocks if b.modules == ("1",))  # the module is a block: eager every call
    x = torch.randn(2, 4)
    first, second, third = (block.program(x)[0] for _ in range(3))
    torch.testing.assert_close(first, second)
    torch.testing.assert_close(third, 2 * first)  # the warm-up ends as it does eagerly


def test_a_container_changed_in_place_is_seen() -> None:
    captured = capture(nn.Sequential(History(), nn.Linear(4, 2)), torch.randn(3, 4))
    assert captured.method == "modules"
    assert any("0.sizes ([] -> [3])" in note for note in captured.notes), captured.notes


def test_a_state_change_between_submodules_makes_the_parent_one_block() -> None:
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.steps = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.a(x)
            self.steps += 1
            return self.b(x) if self.steps % 2 else x

    model = nn.Sequential(nn.Linear(4, 4), Gate(), nn.Linear(4, 2))
    captured = capture(model, torch.randn(3, 4))
    assert ("1",) in [b.modules for b in captured.blocks]
    note = next(n for n in captured.notes if n.startswith("'1' is one block"))
    assert "Gate.forward changes the Python attribute 1.steps (0 -> 1) outside any submodule" in note
    assert model[1].steps == 0


def test_a_state_change_in_the_root_is_refused_with_the_fix() -> None:
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.warm = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.a(x)
            if self.warm:
                self.warm = False
                x = x * 0.5
            return self.b(x)

    model = Root()
    with pytest.raises(CaptureError, match=r"changes the Python attribute warm \(True -> False\).*buffer"):
        capture(model, torch.randn(3, 4))
    assert model.warm is True


def test_set_up_done_once_and_unchanged_state_are_exported() -> None:
    class InstallsOnce(nn.Module):
        """Marks a one-time set-up with a new attribute, as transformers marks the hooks it installs."""

        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)
            self.scale = 0.5  # read, never written

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not getattr(self, "_installed", False):
                self._installed = True
            return self.layer(x) * self.scale

    assert capture(nn.Sequential(InstallsOnce(), nn.Linear(4, 2)), torch.randn(3, 4)).method == "export"


def test_a_watch_compares_plain_values_only() -> None:
    module = nn.Linear(2, 2)
    module.tag, module.shape, module.cache = "a", (1, 2), {"t": torch.ones(1)}
    watch = AttributeWatch(module)
    assert {name for _, name in watch.names} == {"training", "in_features", "out_features", "tag", "shape"}
    module.tag, module.shape, module.cache = "b", (1, 3), {"t": torch.zeros(1)}  # the cache holds a tensor
    module.in_features = torch.tensor(2)  # no longer plain: torch.export refuses tensor attributes itself
    module.added = 1
    assert watch.changes() == ["tag ('a' -> 'b')", "shape ((1, 2) -> (1, 3))"]
    watch.rebase()
    assert watch.changes() == []
    module.shape = (1, 2)
    assert watch.changes() == ["shape ((1, 3) -> (1, 2))"]


class Counters:
    """A plain object a model keeps its running state in (a trainer-like ``state`` holder)."""

    def __init__(self) -> None:
        self.step = 0
        self.name = "warm-up"


class Config:
    """A config object every layer holds and reads, as a Hugging Face model's layers hold ``config``."""

    def __init__(self) -> None:
        self.hidden = 4
        self.scale = 0.5
        self.problem: str | None = None


def test_state_kept_in_a_plain_object_is_watched_and_a_shared_config_is_not_a_false_alarm() -> None:
    class Stepper(nn.Module):
        def __init__(self, config: Config) -> None:
            super().__init__()
            self.layer, self.config, self.state = nn.Linear(4, 4), config, Counters()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.state.step += 1
            return self.layer(x) * (self.config.scale if self.state.step > 2 else 1.0)

    class Reader(nn.Module):
        def __init__(self, config: Config) -> None:
            super().__init__()
            self.layer, self.config = nn.Linear(4, 4), config

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x) * self.config.scale

    class ChoosesOnce(Reader):
        """Sets a config field from None at its first call, as a Hugging Face classifier sets
        ``config.problem_type``: a set-up done once, not state."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.config.problem is None:
                self.config.problem = "regression"
            return super().forward(x)

    config = Config()
    assert capture(nn.Sequential(Reader(config), ChoosesOnce(config)), torch.randn(3, 4)).method == "export"
    model = nn.Sequential(Reader(config), Stepper(config), Reader(config))
    watch = AttributeWatch(model)
    assert sum(name.startswith("config.") for _, name in watch.names) == 3  # the shared config once
    captured = capture(model, torch.randn(3, 4))
    assert captured.method == "modules"
    assert any("1.state.step (0 -> 1)" in note for note in captured.notes), captured.notes
    assert model[1].state.step == 0  # put back, though torch.export restores modules' attributes only
    block = next(b for b in captured.blocks if b.modules == ("1",))
    x = torch.randn(2, 4)
    first, second, third = (block.program(x)[0] for _ in range(3))
    torch.testing.assert_close(first, second)
    torch.testing.assert_close(third, 0.5 * first)  # the warm-up ends as it does eagerly


def test_a_mode_set_in_the_forward_is_kept_and_one_set_in_train_is_exported() -> None:
    """A frozen batch norm: ``self.bn.eval()`` in the forward would be lost (the stages read modes when they
    run), so that module stays one block; the same freeze written in ``train()`` exports."""

    class EvalInForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn, self.layer = nn.BatchNorm1d(4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.bn.eval()
            return self.layer(self.bn(x))

    class EvalInTrain(EvalInForward):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(self.bn(x))

        def train(self, mode: bool = True) -> EvalInTrain:
            super().train(mode)
            self.bn.eval()
            return self

    for frozen in (EvalInForward(), EvalInTrain()):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), frozen, nn.Linear(4, 2)).train()
        model[1].bn.running_mean.fill_(3.0)  # train-mode statistics would differ from the running ones
        captured = capture(model, torch.randn(3, 4))
        if isinstance(frozen, EvalInTrain):
            assert captured.method == "export"
        else:
            assert ("1",) in [b.modules for b in captured.blocks]
            assert any("1.bn.training (True -> False)" in n and "train()" in n for n in captured.notes)
        model.train()
        x = torch.randn(5, 4)
        y = x
        for block in captured.blocks:
            y = block.program(y)[0]
        torch.testing.assert_close(y, model(x))
