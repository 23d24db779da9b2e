"""What the GPU tier's comparisons share: the models, one ``Trainer.fit`` per side, and the checks between sides.

Every helper takes the accelerator as an argument, so the harness (and the check functions of the test modules)
can be tried on a machine without a GPU with ``accelerator="cpu"``; the tier's tests pass ``"gpu"``. A side is
one fresh ``Trainer`` on one device, built after seeding 0 and fed the same loader in order. Both sides run with
``use_distributed_sampler=False``: autopart is a distributed strategy, and Lightning would otherwise swap its
training loader's sampler for a ``DistributedSampler``, which shuffles training data whatever the loader said,
while the default strategy reads it in order.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from examples.data import SyntheticRegression, SyntheticTokens
from examples.gpt import GPT as ExampleGPT
from examples.tutorial import Net
from tests.distributed.strategy_cases import Lit, dataset
from tests.models import ResNet

__all__ = [
    "CASES",
    "QUIET",
    "Case",
    "Classifier",
    "CudaPeak",
    "StepLog",
    "SyncWindow",
    "Trained",
    "assert_same_training",
    "autopart",
    "fit",
    "image_data",
    "ordered_loader",
]

#: Trainer options of every side: nothing but training, no output, the loader's own order (see above).
QUIET: dict[str, Any] = {
    "use_distributed_sampler": False,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
}


def autopart(micro_batches: int = 1) -> Any:
    """A fresh strategy with a 1-stage plan of ``micro_batches`` micro-batches (one GPU holds one rank).

    A strategy object serves one Trainer only: build one per fit.
    """
    from lightning_autopart import AutoPartitionStrategy

    return AutoPartitionStrategy(num_stages=1, micro_batches=micro_batches)


class Classifier(L.LightningModule):
    """``model`` trained with cross-entropy and SGD with momentum; logs ``train_loss``."""

    def __init__(self, model: nn.Module, lr: float = 0.1, momentum: float = 0.9) -> None:
        super().__init__()
        self.model = model
        self.lr = lr
        self.momentum = momentum

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def image_data(n: int, classes: int = 10, size: int = 8) -> TensorDataset:
    """``n`` deterministic (image 3 x size x size, label) pairs."""
    g = torch.Generator().manual_seed(1)
    images = torch.randn(n, 3, size, size, generator=g)
    return TensorDataset(images, torch.randint(0, classes, (n,), generator=g))


def ordered_loader(data: Dataset[Any], batch_size: int) -> DataLoader[Any]:
    """``data`` in order, in full batches."""
    return DataLoader(data, batch_size=batch_size, shuffle=False, drop_last=True)


@dataclass(frozen=True)
class Case:
    """A model to compare: how to build it and its loader, and the micro-batches autopart splits a batch into."""

    module: Callable[[], L.LightningModule]
    loader: Callable[[], DataLoader[Any]]
    micro_batches: int


#: The tier's models, each small enough to train a few steps in seconds.
CASES: dict[str, Case] = {
    # tests/models.py GPT: causal mask and position ids built in forward on x.device, head tied to the embedding.
    "gpt": Case(lambda: Lit("gpt"), lambda: ordered_loader(dataset("gpt", 32), 4), 2),
    # examples/gpt.py: scaled_dot_product_attention with a mask made on x.device, tied head, SGD with momentum.
    "example_gpt": Case(
        lambda: ExampleGPT.from_preset("tiny", lr=0.1, momentum=0.9),
        lambda: ordered_loader(SyntheticTokens(64, 32, 256, seed=0), 8),
        4,
    ),
    # BatchNorm normalises by the micro-batch: one micro-batch keeps autopart's statistics Lightning's.
    "resnet": Case(lambda: Classifier(ResNet()), lambda: ordered_loader(image_data(64), 8), 1),
    # examples/tutorial.py, the RaNNC tutorial model.
    "tutorial": Case(
        lambda: Net(256, 6, lr=0.05, batch_size=32, momentum=0.9),
        lambda: ordered_loader(SyntheticRegression(256, 256, seed=0), 32),
        2,
    ),
}


class StepLog(L.Callback):
    """After every training batch: the logged ``name`` as callbacks see it, and the GradScaler's scale if any."""

    def __init__(self, name: str = "train_loss") -> None:
        self.name = name
        self.losses: list[float] = []
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics[self.name]))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.scales.append(float(scaler.get_scale()))


class DeviceLog(L.Callback):
    """The device types of the model's tensors at the end of training: Lightning moves a GPU model back to the
    CPU in its teardown, so reading them after ``fit`` would say "cpu" on both sides."""

    def __init__(self) -> None:
        self.devices: set[str] = set()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.devices = {t.device.type for t in (*pl_module.parameters(), *pl_module.buffers())}


class _Window(L.Callback):
    """Training batches ``start`` (inclusive) to ``stop`` (exclusive): ``open`` at ``start``'s
    ``on_train_batch_start``, ``close`` at ``stop``'s (or at the end of training), so everything Lightning does
    per step, its metric updates after ``on_train_batch_end`` included, falls inside."""

    def __init__(self, start: int, stop: int) -> None:
        if not 0 <= start < stop:
            raise ValueError(f"need 0 <= start < stop, got start={start}, stop={stop}")
        self.start, self.stop = start, stop
        self.opened = self.closed = False

    def open(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.stop and self.opened and not self.closed:
            self.closed = True
            self.close()
        if batch_idx == self.start:
            self.opened = True
            self.open()

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.opened and not self.closed:
            self.closed = True
            self.close()

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)

    @property
    def steps(self) -> int:
        return self.stop - self.start


class CudaPeak(_Window):
    """Peak CUDA memory over the window's steps: ``torch.cuda.max_memory_allocated`` after a reset at its start.

    ``base`` is what was allocated when the window opened (the steady state between two steps, the batch on the
    device included), ``peak`` the most allocated at any moment inside it; both in bytes.
    """

    def __init__(self, start: int, stop: int) -> None:
        super().__init__(start, stop)
        self.base = self.peak = 0

    def open(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()

    def close(self) -> None:
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated()


class SyncWindow(_Window):
    """Host syncs over the window's steps: ``counter()`` (a TorchDispatchMode with ``count``, and optionally
    ``to_host``, such as ``tests.census.SyncCounter``) is active for the whole window."""

    def __init__(self, counter: Callable[[], Any], start: int, stop: int) -> None:
        super().__init__(start, stop)
        self._make = counter
        self._mode: Any = None
        self.count = self.to_host = 0

    def open(self) -> None:
        self._mode = self._make()
        self._mode.__enter__()

    def close(self) -> None:
        self._mode.__exit__(None, None, None)
        self.count = int(self._mode.count)
        self.to_host = int(getattr(self._mode, "to_host", 0))
        self._mode = None


@dataclass
class Trained:
    """What one side's fit left: final parameters and buffers (CPU copies), the initial parameters, the logged
    losses and GradScaler scales per step, the device types the model's tensors ended on, and the CUDA memory
    allocated before the fit (0 without CUDA)."""

    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    initial: dict[str, Tensor]
    losses: list[float]
    scales: list[float]
    devices: set[str]
    allocated_before: int


def _cpu_copies(named: Any) -> dict[str, Tensor]:
    return {n: t.detach().to("cpu", copy=True) for n, t in named}


def fit(
    case: Case,
    strategy: Any,
    *,
    accelerator: str = "gpu",
    max_steps: int = 4,
    precision: str = "32-true",
    plugins: list[Any] | None = None,
    callbacks: Sequence[L.Callback] = (),
    log_steps: bool = True,
) -> Trained:
    """Train ``case``'s module, built after seeding 0, on one device for ``max_steps``; everything freed after.

    ``precision`` is ignored when ``plugins`` holds a precision plugin. ``log_steps=False`` leaves out the
    :class:`StepLog` callback (and its host syncs).
    """
    cuda = torch.cuda.is_available()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    before = torch.cuda.memory_allocated() if cuda else 0
    torch.manual_seed(0)
    module = case.module()
    initial = _cpu_copies(module.named_parameters())
    log, where = StepLog(), DeviceLog()
    options: dict[str, Any] = {"plugins": plugins} if plugins is not None else {"precision": precision}
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=strategy,
        max_steps=max_steps,
        callbacks=[where, *([log] if log_steps else []), *callbacks],
        **options,
        **QUIET,
    )
    trainer.fit(module, case.loader())
    result = Trained(
        params=_cpu_copies(module.named_parameters()),
        buffers=_cpu_copies(module.named_buffers()),
        initial=initial,
        losses=log.losses,
        scales=log.scales,
        devices=where.devices,
        allocated_before=before,
    )
    del trainer, module
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def assert_same_training(
    pipelined: Trained,
    plain: Trained,
    rtol: float,
    atol: float,
    update_tol: float = 0.02,
) -> None:
    """Equal training: the same logged losses, parameters, buffers, GradScaler scales, and parameter updates.

    Losses, parameters and floating buffers are compared with ``rtol``/``atol``, integer buffers exactly. The
    updates (final - initial) are compared against ``update_tol`` times the largest entry of plain Lightning's
    update of each tensor, so a wrong gradient scale fails even where updates are small next to the weights.
    """
    assert plain.losses and len(pipelined.losses) == len(plain.losses), (pipelined.losses, plain.losses)
    torch.testing.assert_close(
        torch.tensor(pipelined.losses), torch.tensor(plain.losses), rtol=rtol, atol=atol, msg=_named("losses")
    )
    assert pipelined.scales == plain.scales, (
        f"GradScaler scale per step: {pipelined.scales} != {plain.scales}"
    )
    assert pipelined.params.keys() == plain.params.keys()
    moved = False
    for name, ref in plain.params.items():
        got = pipelined.params[name]
        torch.testing.assert_close(pipelined.initial[name], plain.initial[name], rtol=0, atol=0)
        assert got.dtype == ref.dtype, f"{name}: {got.dtype} != {ref.dtype}"
        torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, msg=_named(name))
        step_ref = (ref - plain.initial[name]).double()
        step_got = (got - pipelined.initial[name]).double()
        size = float(step_ref.abs().max()) if step_ref.numel() else 0.0
        moved = moved or size > 0
        tol = max(update_tol * size, 0.01 * atol)
        torch.testing.assert_close(step_got, step_ref, rtol=0.0, atol=tol, msg=_named(f"update of {name}"))
    assert moved, "plain Lightning's training changed no parameter: the comparison would prove nothing"
    assert pipelined.buffers.keys() == plain.buffers.keys()
    for name, ref in plain.buffers.items():
        got = pipelined.buffers[name]
        if ref.is_floating_point():
            torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, msg=_named(name))
        else:
            assert torch.equal(got, ref), f"{name}: {got} != {ref}"


def _named(name: str) -> Callable[[str], str]:
    return lambda message: f"{name}: {message}"
