"""AutoPartitionStrategy in one process: registration, settings, bad input with its messages, and the hook helpers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader

from lightning_autopart.errors import ConfigError, PlanMismatchError
from lightning_autopart.lightning.first_batch import PlanSettings, _make_plan, choose_micro_batches
from lightning_autopart.lightning.hooks import (
    LogRecord,
    capture_logs,
    find_forward,
    merge_logs,
    replaced_forward,
    slice_batch,
)
from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from lightning_autopart.runtime.runner import move_in_place
from tests.distributed.strategy_cases import Lit, dataset, fit
from tests.models import make


def _trainer(strategy: AutoPartitionStrategy, max_steps: int = 2) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_registers_autopart_once() -> None:
    registry = _StrategyRegistry()
    AutoPartitionStrategy.register_strategies(registry)
    AutoPartitionStrategy.register_strategies(registry)  # no duplicate error
    assert "autopart" in registry
    assert isinstance(registry.get("autopart"), AutoPartitionStrategy)


def test_is_distributed_and_settings() -> None:
    strategy = AutoPartitionStrategy(num_stages=2, micro_batches=4, schedule="1F1B", device_memory="40GB")
    assert strategy.is_distributed is True
    assert (strategy.num_stages, strategy.micro_batches, strategy.schedule) == (2, 4, "1F1B")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule": "zigzag"}, "unknown schedule 'zigzag'"),
        ({"profile": "guess"}, "unknown profile mode 'guess'"),
        ({"num_stages": 0}, "num_stages must be at least 1"),
        ({"micro_batches": 0}, "micro_batches must be at least 1"),
    ],
)
def test_bad_settings(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AutoPartitionStrategy(**kwargs)


class _Manual(Lit):
    def __init__(self) -> None:
        super().__init__("mlp")
        self.automatic_optimization = False


@pytest.mark.usefixtures("master_port")
def test_manual_optimization_is_refused() -> None:
    loader = DataLoader(dataset("mlp", 8), batch_size=4)
    with pytest.raises(ConfigError, match=r"manual optimization \(automatic_optimization=False\)"):
        _trainer(AutoPartitionStrategy(num_stages=1, profile="estimate")).fit(_Manual(), loader)


@pytest.mark.usefixtures("master_port")
def test_more_stages_than_devices() -> None:
    loader = DataLoader(dataset("mlp", 8), batch_size=4)
    with pytest.raises(ConfigError, match="num_stages=2 is more than the 1 devices"):
        _trainer(AutoPartitionStrategy(num_stages=2, profile="estimate")).fit(Lit("mlp"), loader)


def test_more_stages_than_blocks() -> None:
    model = Lit("mlp")  # 4 blocks
    call = find_forward(model, lambda: model.training_step(list(dataset("mlp", 4).tensors), 0))
    settings = PlanSettings(num_stages=8, profile="estimate")
    with pytest.raises(ConfigError, match="num_stages=8 is more than the 4 blocks"):
        _make_plan(settings, model, call, 4, 8, 1, torch.device("cpu"))
    gated = make("data_dependent")  # hooks capture merges 'gate': the message says why and what to change
    settings = PlanSettings(num_stages=4, profile="measure")
    call = find_forward(gated, lambda: gated(torch.randn(4, 8)))
    with pytest.raises(ConfigError, match=r"more than the 3 blocks .*'gate' is one block: .*into a submodule"):
        _make_plan(settings, gated, call, 4, 4, 1, torch.device("cpu"))


@pytest.mark.usefixtures("master_port")
def test_ragged_batch_is_refused_clearly_only_for_batch_norm_training() -> None:
    from tests.distributed._ragged_script import RaggedLit

    loader = DataLoader(dataset("mlp", 10), batch_size=4)  # the last batch has 2 samples: padded
    trainer = _trainer(AutoPartitionStrategy(num_stages=1, profile="estimate"), max_steps=5)
    trainer.fit(Lit("mlp"), loader)
    assert trainer.global_step == 5  # through the ragged third batch into the next epoch
    torch.distributed.destroy_process_group()
    trainer = _trainer(AutoPartitionStrategy(num_stages=1, profile="estimate"), max_steps=5)
    # BatchNorm trains on the batch's statistics, which padding would change: refused in setup, before any
    # training step, with the numbers and the fix.
    message = r"train loader's last batch per replica holds 2 samples, not 4 .*model\.1 .*drop_last=True"
    with pytest.raises(ConfigError, match=message):
        trainer.fit(RaggedLit(batch_norm=True), loader)
    assert trainer.global_step == 0


def test_micro_batches_that_do_not_divide_the_batch() -> None:
    with pytest.warns(UserWarning, match="micro_batches=3 does not divide the batch of 4 .* using 2"):
        assert choose_micro_batches(3, 4) == 2
    assert choose_micro_batches(None, 4) is None
    assert choose_micro_batches(4, 8) == 4


@pytest.mark.usefixtures("master_port")
def test_undivisible_micro_batches_keep_gradients_right() -> None:
    strategy = AutoPartitionStrategy(num_stages=1, micro_batches=3, profile="estimate")
    with pytest.warns(UserWarning, match="using 2 equal micro-batches"):
        model, losses, _ = fit({"model": "mlp"}, strategy, 1, 1)
    assert strategy.plan is not None and strategy.plan.micro_batches == 2
    torch.distributed.destroy_process_group()
    reference, expected, _ = fit({"model": "mlp"}, "auto", 1, 1)
    assert losses == pytest.approx(expected, rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.usefixtures("master_port")
def test_load_plan_checks_model_and_world(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    strategy = AutoPartitionStrategy(num_stages=1, profile="estimate", save_plan=str(path))
    fit({"model": "mlp"}, strategy, 1, 1)
    torch.distributed.destroy_process_group()
    assert path.exists()
    other = Lit("residual")
    batch = list(dataset("residual", 4).tensors)
    call = find_forward(other, lambda: other.training_step(batch, 0))
    settings = PlanSettings(load_plan=str(path))
    with pytest.raises(PlanMismatchError, match="another model"):
        _make_plan(settings, other, call, 4, 1, 1, torch.device("cpu"))
    same = Lit("mlp")
    call = find_forward(same, lambda: same.training_step(list(dataset("mlp", 4).tensors), 0))
    with pytest.raises(PlanMismatchError, match="world size 1, this job has 2 ranks"):
        _make_plan(settings, same, call, 4, 2, 1, torch.device("cpu"))


class _Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(3, 2)
        self.logged: list[tuple[Any, ...]] = []

    def log(self, *args: Any, **kwargs: Any) -> None:
        self.logged.append(args)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        self.log("before", 1.0)
        return self.model(x, *()) * 2


def test_find_forward_stops_at_the_first_module_call() -> None:
    module = _Wrapper()
    x = torch.randn(4, 3)
    call = find_forward(module, lambda: module.step(x))
    assert call.name == "model" and call.args[0] is x and call.kwargs == {}
    assert module.logged == []  # logs are silenced while looking
    with pytest.raises(ConfigError, match="never calls the model"):
        find_forward(module, lambda: None)
    # Knowing the pipelined module, one hook on it is enough; a step that skips it is refused by name.
    assert find_forward(module, lambda: module.step(x), only="model").args[0] is x
    assert not module.model._forward_pre_hooks
    with pytest.raises(ConfigError, match="never called model, the module autopart pipelined"):
        find_forward(module, lambda: module.log("no model", 0.0), only="model")


def test_replaced_forward_and_captured_logs() -> None:
    module = _Wrapper()
    out = torch.ones(4, 2)
    records: list[LogRecord] = []
    with replaced_forward(module.model, out), capture_logs(module, records):
        assert torch.equal(module.step(torch.randn(4, 3)), 2 * out)
    assert [r.name for r in records] == ["before"] and module.logged == []
    assert "forward" not in module.model.__dict__ and "log" not in module.__dict__
    module.log("after", 2.0)
    assert module.logged == [("after", 2.0)]


def test_capture_logs_maps_positional_options_and_refuses_objects() -> None:
    module = _Wrapper()
    records: list[LogRecord] = []
    with capture_logs(module, records):
        module.log("a", torch.tensor(1.0), True, sync_dist=True)
        with pytest.raises(ConfigError, match="log tensors or numbers"):
            module.log("b", object())
    assert records[0].kwargs == {"prog_bar": True, "sync_dist": True}


def test_merge_logs_averages_micro_batches() -> None:
    records = [
        LogRecord("loss", torch.tensor(1.0), {"prog_bar": True}),
        LogRecord("acc", 0.5, {}),
        LogRecord("loss", torch.tensor(3.0), {"prog_bar": True}),
        LogRecord("acc", 1.0, {}),
    ]
    merged = {r.name: r for r in merge_logs(records)}
    assert float(merged["loss"].value) == 2.0 and merged["loss"].kwargs == {"prog_bar": True}
    assert merged["acc"].value == 0.75


def test_slice_batch_cuts_only_batch_sized_tensors() -> None:
    batch: dict[str, Any] = {
        "x": torch.arange(8).view(4, 2),
        "y": torch.arange(4),
        "scale": torch.tensor(2.0),
        "n": 3,
    }
    part = slice_batch(batch, 1, 3, 4)
    assert torch.equal(part["x"], batch["x"][1:3]) and torch.equal(part["y"], torch.tensor([1, 2]))
    assert part["scale"] is batch["scale"] and part["n"] == 3


def test_trainer_accepts_the_registered_name() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    AutoPartitionStrategy.register_strategies(StrategyRegistry)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="autopart", logger=False)
    assert isinstance(trainer.strategy, AutoPartitionStrategy)
    assert trainer.strategy.launcher is not None  # Lightning's script launcher starts the other processes


def test_spawning_from_an_interactive_session_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lightning_autopart.lightning.strategy._IS_INTERACTIVE", True)
    with pytest.raises(ConfigError, match="cannot start processes from an interactive session"):
        L.Trainer(accelerator="cpu", devices=2, strategy=AutoPartitionStrategy(), logger=False)


def test_torchrun_processes_are_not_relaunched(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("GROUP_RANK", "0")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=AutoPartitionStrategy(), logger=False)
    assert trainer.strategy.launcher is None


class _LossParameter(Lit):
    """A learnable scale used in training_step, outside the forward that autopart pipelines."""

    def __init__(self) -> None:
        super().__init__("mlp")
        self.scale = nn.Parameter(torch.ones(()))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.scale * super().training_step(batch, batch_idx)


@pytest.mark.usefixtures("master_port")
def test_parameters_outside_the_forward_are_refused() -> None:
    loader = DataLoader(dataset("mlp", 8), batch_size=4)
    with pytest.raises(
        ConfigError, match="parameters scale are optimized but not used by the pipelined model"
    ):
        _trainer(AutoPartitionStrategy(num_stages=1, profile="estimate")).fit(_LossParameter(), loader)


@pytest.mark.usefixtures("master_port")
def test_default_settings_plan_from_the_first_batch() -> None:
    strategy = AutoPartitionStrategy()  # measured profile, the planner picks stages and micro-batches
    model, losses, _ = fit({"model": "residual"}, strategy, 1, 1)
    assert strategy.plan is not None and strategy.plan.num_stages == 1 and strategy.plan.batch_size == 4
    torch.distributed.destroy_process_group()
    reference, expected, _ = fit({"model": "residual"}, "auto", 1, 1)
    assert losses == pytest.approx(expected, rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)


def test_optimizer_spec_sizes_the_state_the_user_configured() -> None:
    from lightning_autopart.lightning.first_batch import optimizer_spec

    p = [torch.nn.Parameter(torch.zeros(64))]
    assert optimizer_spec([torch.optim.SGD(p, lr=0.1)], gpu=True) == "sgd:state=0,transient=0"
    assert optimizer_spec([torch.optim.SGD(p, lr=0.1, momentum=0.9)], gpu=True) == "sgd_momentum:state=1,transient=0"
    assert optimizer_spec([torch.optim.AdamW(p)], gpu=True) == "adamw:decay,state=2,transient=1"
    assert optimizer_spec([torch.optim.AdamW(p, fused=True)], gpu=True) == "adamw:fused,decay,state=2,transient=0"
    assert optimizer_spec([torch.optim.SGD(p, lr=0.1), torch.optim.Adam(p)], gpu=True) == "adam:state=2,transient=1"
    assert optimizer_spec([torch.optim.LBFGS(p)], gpu=True) == "adam:loop"  # no stand-in: priced as Adam
    assert optimizer_spec([], gpu=True) == "sgd"


def test_move_in_place_to_the_same_device_changes_nothing() -> None:
    model = nn.BatchNorm1d(3)
    before = [(id(t), t.data_ptr()) for t in (*model.parameters(), *model.buffers())]
    move_in_place(model, torch.device("cpu"))
    assert [(id(t), t.data_ptr()) for t in (*model.parameters(), *model.buffers())] == before


def test_a_split_model_refuses_another_world_or_device() -> None:
    """A module split by an earlier fit runs only on its world size and device; otherwise the fix is named."""
    from types import SimpleNamespace

    from lightning_autopart.lightning.split import Partition

    part = Partition(None, SimpleNamespace(device=torch.device("cpu")), set(), set(), None, 2)  # type: ignore[arg-type]
    part.check_job(2, torch.device("cpu"))
    message = (
        r"split for 2 ranks on cpu by an earlier run; this Trainer has 4 ranks on cpu: load it from a check"
    )
    with pytest.raises(ConfigError, match=message):
        part.check_job(4, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"this Trainer has 2 ranks on meta"):
        part.check_job(2, torch.device("meta"))
