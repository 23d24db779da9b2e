"""Bad inputs to the strategy, each answered with the problem and the fix (issue 11, item 4), through a real
Trainer in one process: empty loaders in every loop, a depth the devices cannot hold, an estimate of a forward
that reads values on the host, nothing to train, and a NaN loss found without a host sync per step."""

from __future__ import annotations

import warnings
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_autopart.capture import capture
from lightning_autopart.errors import ConfigError, NonFiniteLossError, ProfileError
from lightning_autopart.lightning.finite import LossCheck
from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from lightning_autopart.profile import profile
from lightning_autopart.profile.hints import failure_hint
from tests.census import SyncCounter
from tests.distributed.strategy_cases import Lit, dataset


def _trainer(strategy: Any = None, max_steps: int = 2, **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "strategy": strategy or AutoPartitionStrategy(num_stages=1, profile="estimate"),
        "max_steps": max_steps,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(**{**options, **kwargs})


class _Every(Lit):
    """The zoo MLP with a test and a predict step (Lit has training and validation steps)."""

    def __init__(self) -> None:
        super().__init__("mlp")

    def test_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])


def _loader(samples: int, batch_size: int = 4, drop_last: bool = False) -> DataLoader[Any]:
    return DataLoader(dataset("mlp", samples), batch_size=batch_size, drop_last=drop_last)


@pytest.mark.usefixtures("master_port")
@pytest.mark.parametrize(
    ("run", "loader", "message"),
    [
        ("fit", _loader(0), r"^the train dataloader yields no batch \(its dataset is empty\), and autopart plans the "
         r"pipeline from the first batch of the train loop: give it data$"),
        ("validate", _loader(0), r"^the val dataloader yields no batch \(its dataset is empty\)"),
        ("test", _loader(0), r"^the test dataloader yields no batch \(its dataset is empty\)"),
        ("predict", _loader(0), r"^the predict dataloader yields no batch \(its dataset is empty\)"),
        (
            "fit",
            _loader(3, batch_size=4, drop_last=True),
            r"^the train dataloader yields no batch \(it draws 3 sample\(s\) on this rank, fewer than batch_size=4, "
            r"and drop_last=True drops that one short batch\), .*: use batch_size=3 or less, drop_last=False, or "
            r"more data$",
        ),
    ],
)  # fmt: skip
def test_an_empty_loader_is_refused_with_the_fix(run: str, loader: DataLoader[Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        getattr(_trainer(), run)(_Every(), loader)


def test_stages_that_do_not_divide_the_devices_are_refused_before_the_rendezvous(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As torchrun starts rank 0 of 3: the other ranks never come, so refusing after the rendezvous would hang.
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "0"}
    for key, value in {**env, "TORCHELASTIC_RUN_ID": "test", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    strategy = AutoPartitionStrategy(num_stages=2, timeout=timedelta(seconds=5))
    trainer = _trainer(strategy, devices=3)
    with pytest.raises(ConfigError) as info:
        trainer.fit(Lit("mlp"), _loader(8))
    assert str(info.value) == (
        "num_stages=2 does not divide the 3 devices: every stage runs on the same number of replicas, so 1 "
        "device(s) would hold no stage; use a multiple of 2 devices (2 or 4), or num_stages=1 or 3"
    )
    assert "load_plan" not in str(info.value)


class _Scale(nn.Module):
    """Divides by the batch's largest magnitude, read on the host: fine on real tensors, impossible on meta."""

    def forward(self, x: Tensor) -> Tensor:
        return x / x.abs().max().item()


class _ItemLit(Lit):
    def __init__(self) -> None:
        super().__init__("mlp")
        self.model = nn.Sequential(nn.Linear(16, 16), _Scale(), nn.Linear(16, 16))


@pytest.mark.usefixtures("master_port")
def test_an_estimate_of_a_forward_reading_values_names_the_module_the_line_and_the_fix() -> None:
    with pytest.raises(ProfileError) as info:
        _trainer(AutoPartitionStrategy(num_stages=1, profile="estimate")).fit(_ItemLit(), _loader(8))
    message = str(info.value)
    assert message.startswith(
        "profiling block 1 ('model.1') in estimate mode failed: RuntimeError: Tensor.item() cannot be called on "
        "meta tensors; the estimate runs each block on meta tensors, which hold no values, and module 'model.1' "
        "(_Scale) reads a tensor's value on the host"
    )
    assert "test_bad_inputs.py:" in message and "in forward: `return x / x.abs().max().item()`" in message
    assert "profile by measurement instead (AutoPartitionStrategy(profile='measure')" in message
    torch.distributed.destroy_process_group()
    trainer = _trainer(AutoPartitionStrategy(num_stages=1, profile="measure"))
    trainer.fit(_ItemLit(), _loader(8))  # what the message advises trains
    assert trainer.global_step == 2


@pytest.mark.parametrize("method", ["export", "modules"])
def test_the_hint_finds_the_line_in_either_capture(method: str) -> None:
    model = nn.Sequential(nn.Linear(8, 8), _Scale(), nn.Linear(8, 8))
    captured = capture(model, (torch.randn(4, 8),), method=method)
    with pytest.raises(ProfileError, match=r"in forward: `return x / x\.abs\(\)\.max\(\)\.item\(\)`: profile by"):
        profile(captured, "estimate", spec="a100-40gb")


def test_other_profiling_failures_get_a_fix() -> None:
    block = SimpleNamespace(name="layers.3", program=nn.Identity())
    hint = failure_hint(block, "measure", RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert "profile by estimate instead (AutoPartitionStrategy(profile='estimate')" in hint
    hint = failure_hint(block, "measure", ValueError("shapes do not match"))
    assert "check that the model trains on this batch without autopart" in hint


class _NoParameters(Lit):
    def __init__(self) -> None:
        super().__init__("mlp")
        self.model = nn.Sequential(nn.ReLU(), nn.Tanh())

    def configure_optimizers(self) -> Any:
        return None  # plain Lightning then "trains" with a warning and exits 0


class _Frozen(Lit):
    def __init__(self) -> None:
        super().__init__("mlp")
        self.model.requires_grad_(False)


@pytest.mark.usefixtures("master_port")
@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            _NoParameters,
            r"^nothing to train: the pipelined model _NoParameters, the module training_step calls first, has no "
            r"parameters; make training_step call the module that holds the layers to train .*, or run "
            r"trainer\.validate, test or predict instead of fit$",
        ),
        (
            _Frozen,
            r"^nothing to train: the pipelined model _Frozen, .* has 8 parameter tensor\(s\), all frozen "
            r"\(requires_grad=False\); unfreeze the ones to train \(requires_grad_\(True\)\), or run",
        ),
    ],
)
def test_a_model_with_nothing_to_train_is_refused(model: type[Lit], message: str) -> None:
    trainer = _trainer()
    with pytest.raises(ConfigError, match=message):
        trainer.fit(model(), _loader(8))
    assert trainer.global_step == 0


@pytest.mark.usefixtures("master_port")
def test_a_frozen_model_still_evaluates() -> None:
    _trainer().validate(_Frozen(), _loader(8))


class _NaNAt(Lit):
    """The zoo MLP whose loss is NaN from batch ``at`` on."""

    def __init__(self, at: int) -> None:
        super().__init__("mlp")
        self.at = at

    def _loss(self, batch: list[Tensor]) -> Tensor:
        loss = F.mse_loss(self(batch[0]), batch[1])
        return loss * float("nan") if self.trainer.global_step >= self.at else loss


@pytest.mark.usefixtures("master_port")
@pytest.mark.parametrize(("every", "checked"), [(50, 10), (4, 3)])
def test_a_nan_loss_stops_training_naming_the_first_step(every: int, checked: int) -> None:
    trainer = _trainer(max_steps=10, log_every_n_steps=every)
    with pytest.raises(NonFiniteLossError) as info:
        trainer.fit(_NaNAt(2), _loader(40))
    assert str(info.value).startswith(
        "the training loss was NaN or infinite at epoch 0, batch 2 (global step 2), as computed by the last stage "
        "(stage 0, on rank 0); autopart stops here instead of training on NaN weights"
    )
    assert "Fix: lower the learning rate, clip gradients (Trainer(gradient_clip_val=1.0))" in str(info.value)
    # read at the next logging step (every log_every_n_steps), else before validation or when training ends
    assert trainer.global_step == checked


@pytest.mark.usefixtures("master_port")
def test_a_nan_loss_under_a_gradient_scaler_warns_and_trains_on() -> None:
    scaler = torch.amp.GradScaler("cpu")  # Trainer(precision="16-mixed") on a CPU would be bf16-mixed
    trainer = _trainer(max_steps=4, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    with pytest.warns(RuntimeWarning, match=r"batch 2 \(global step 2\).*the gradient scaler \(16-mixed\) skipped"):
        trainer.fit(_NaNAt(2), _loader(16))
    assert trainer.global_step == 4


def test_the_loss_check_reads_the_host_only_at_logging_steps() -> None:
    check = LossCheck(last_stage=1, last_rank=1, world_size=2, rank=0)
    loop = SimpleNamespace(_batches_that_stepped=0, batch_progress=SimpleNamespace(is_last_batch=False))
    trainer = SimpleNamespace(
        fit_loop=SimpleNamespace(epoch_loop=loop), log_every_n_steps=3, max_steps=-1, global_step=0, current_epoch=0
    )
    syncs = []
    for step in range(7):
        trainer.global_step = loop._batches_that_stepped = step
        loop.batch_progress.is_last_batch = step == 4
        loss = torch.tensor(float("inf") if step == 5 else 1.0)
        with SyncCounter() as counter:
            try:
                check.observe(loss, trainer, step)
            except NonFiniteLossError as error:
                assert "batch 5 (global step 5)" in str(error) and "(stage 1, on rank 1)" in str(error)
                syncs.append(-counter.count)
                continue
        syncs.append(counter.count)
    # a read at logging steps 2 and 5 (every 3rd batch), none elsewhere (an epoch's end is read outside any step,
    # by the strategy's on_validation_start and on_train_end)
    assert syncs == [0, 0, 1, 0, 0, -1, 0]


def test_rank_zero_alone_warns_under_a_scaler() -> None:
    for rank, expected in ((0, 1), (1, 0)):
        check = LossCheck(last_stage=0, last_rank=rank, world_size=1, rank=rank)
        check.observe(torch.tensor(float("nan")), None, 0)  # no trainer (not fitting): nothing noted
        check._first = torch.tensor(0)
        check._window = [(0, 0, 0)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check.check(scaled=True)
        assert len(caught) == expected


def test_a_window_left_by_a_failed_fit_is_not_reported_by_the_next() -> None:
    check = LossCheck(last_stage=0, last_rank=0, world_size=1, rank=0)

    def trainer(step: int, last: bool) -> SimpleNamespace:
        loop = SimpleNamespace(_batches_that_stepped=step, batch_progress=SimpleNamespace(is_last_batch=last))
        return SimpleNamespace(
            fit_loop=SimpleNamespace(epoch_loop=loop), log_every_n_steps=50, max_steps=-1, global_step=step,
            current_epoch=0,
        )

    check.observe(torch.tensor(float("nan")), trainer(7, False), 7)  # that fit failed before its check
    check.observe(torch.tensor(1.0), trainer(0, True), 0)  # a new fit (another Trainer): finite, no error
    first = trainer(3, False)
    check.observe(torch.tensor(float("nan")), first, 3)
    first.global_step = first.fit_loop.epoch_loop._batches_that_stepped = 1  # the same Trainer fits again
    first.fit_loop.epoch_loop.batch_progress.is_last_batch = True
    check.observe(torch.tensor(1.0), first, 1)


def test_a_batch_of_another_length_is_refused_with_the_fix() -> None:
    """Text padded to each batch's longest sample changes the sequence length between steps; the stages run
    the captured shapes, so the step is refused before they run, with both shapes and the fix."""
    g = torch.Generator().manual_seed(0)
    batches = [[torch.randint(0, 50, (4, t), generator=g) for _ in range(2)] for t in (8, 8, 6)]
    match = r"input 0 of .* has shape \(4, 6\), but the pipeline was captured with \(batch, 8\).*max_length"
    with pytest.raises(ConfigError, match=match):
        _trainer(max_steps=3).fit(Lit("gpt"), DataLoader(batches, batch_size=None))


def test_a_step_passing_other_tensors_than_captured_is_refused() -> None:
    from lightning_autopart.lightning.input_checks import check_input_shapes

    with pytest.raises(ConfigError, match=r"passes 1 tensor\(s\) to GPT, which was captured with 2; .*mask"):
        check_input_shapes([torch.zeros(4, 8)], [(2, 8), (2, 8)], "GPT")
    check_input_shapes([torch.zeros(4, 8), torch.zeros(4, 8, 3)], [(2, 8), (2, 8, 3)], "GPT")  # batch may differ
