"""A LightningModule's training, validation and test steps run through this rank's share of the pipeline.

The first stage runs the user's step only up to its first model call, to take the model's inputs; the last
stage runs the whole step once per micro-batch, with the model's forward returning the pipeline's output, so
the user's loss code, ``self.log`` calls and metrics run unchanged there. The last stage's loss and logs then
reach every rank of the pipeline (see [Note: log channel]) and are logged there again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning_hooks import (
    LogRecord,
    batch_size_of,
    capture_logs,
    find_forward,
    flat_inputs,
    merge_logs,
    replaced_forward,
    slice_batch,
)
from lightning_autopart.log_channel import LogChannel
from lightning_autopart.runtime import PipelineRunner

__all__ = ["PipelinedSteps"]


class PipelinedSteps:
    """Runs ``module``'s steps over ``runner``, the submodule ``root_name`` ("" for the module) being pipelined.

    ``module`` is a LightningModule (any object with the step methods and ``log``); nothing here imports
    Lightning.
    """

    def __init__(
        self, module: Any, root_name: str, runner: PipelineRunner, channel: LogChannel, device: torch.device
    ) -> None:
        self.module = module
        self.root_name = root_name
        self.runner = runner
        self.channel = channel
        self.device = device

    def root(self) -> nn.Module:
        """The pipelined module."""
        root: nn.Module = self.module.get_submodule(self.root_name) if self.root_name else self.module
        return root

    def train(self, batch: Any, batch_idx: int, accumulate: int, sync: bool) -> Tensor:
        """One training step; gradients add to ``.grad`` (all-reduced if ``sync``); returns the batch's loss."""
        size = self.check_batch(batch)
        self.channel.expect("training_step")
        # Logs by micro-batch start: pipelining may run the loss twice on its first step (shape inference).
        by_micro: dict[int, list[LogRecord]] = {}
        module = self.module

        def loss_fn(output: Any, index: Tensor) -> Tensor:
            lo, hi = int(index[0]), int(index[-1]) + 1
            by_micro[lo] = []
            with replaced_forward(self.root(), output), capture_logs(module, by_micro[lo]):
                out = module.training_step(slice_batch(batch, lo, hi, size), batch_idx)
            loss = out.get("loss") if isinstance(out, Mapping) else out
            if not isinstance(loss, Tensor):
                raise ConfigError(
                    "training_step must return the loss (a tensor, or a dict with 'loss') under autopart"
                )
            return loss / accumulate

        self._loss_fn = loss_fn
        inputs = self.inputs(lambda: module.training_step(batch, batch_idx))
        target = torch.arange(size, device=self.device) if self.runner.is_last else None
        loss = self.runner.step(inputs, target, sync=sync)
        records = merge_logs([r for lo in sorted(by_micro) for r in by_micro[lo]])
        value = self.replay("training_step", None if loss is None else float(loss) * accumulate, records)
        return torch.tensor(value, device=self.device)

    def call_loss(self, output: Any, target: Tensor) -> Tensor:
        """The runner's loss function: the user's step on one micro-batch (``target`` holds its sample indices)."""
        return self._loss_fn(output, target)

    def evaluate(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        """Forward-only pipeline; the user's ``hook`` runs on the last stage, its logs are replayed on all."""
        step = getattr(self.module, hook)
        self.check_batch(args[0] if args else kwargs["batch"])
        self.channel.expect(hook)
        inputs = self.inputs(lambda: step(*args, **kwargs))
        output = self.runner.eval_step(inputs)
        records: list[LogRecord] = []
        out = None
        if self.runner.is_last:
            with replaced_forward(self.root(), output), capture_logs(self.module, records):
                out = step(*args, **kwargs)
        self.replay(hook, None, merge_logs(records))
        return out

    def check_batch(self, batch: Any) -> int:
        """The batch's size, which must be the plan's per-replica batch (pipelined shapes are fixed)."""
        size = batch_size_of(batch)
        plan = self.runner.plan
        if size != self.runner.local_batch_size:
            raise ConfigError(
                f"a batch of {size} samples reached the pipeline, but the plan needs {self.runner.local_batch_size} "
                f"per replica (global batch {plan.batch_size} over {plan.replicas} replicas): pipelined "
                "shapes are fixed, so use drop_last=True and the same batch size in every loader"
            )
        return size

    def inputs(self, step: Callable[[], Any]) -> tuple[Any, ...] | None:
        """On the first stage, the inputs the user's step gives the model (the step is stopped there)."""
        if not self.runner.is_first:
            return None
        call = find_forward(self.module, step, only=self.root_name)
        return flat_inputs(self.root(), call)

    def replay(self, kind: str, loss: float | None, records: list[LogRecord]) -> float:
        """Send the last stage's loss and logs along the pipeline; log them again on every rank."""
        value, logs = self.channel.share(kind, loss, records)
        for record in logs:
            v = record.value.to(self.device) if isinstance(record.value, Tensor) else record.value
            self.module.log(record.name, v, **record.kwargs)
        return value
