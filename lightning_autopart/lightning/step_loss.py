"""The user's training loss as a function of the pipelined model's output, for the profiler (see [Note: the
loss] in profile/loss.py): ``training_step`` run with the model's forward replaced, its logs recorded and its
metrics left as they were."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning.hooks import (
    LOG_ARGUMENTS,
    instance_attribute,
    patched_log,
    replaced_forward,
    slice_batch,
    take_rows,
)
from lightning_autopart.lightning.metrics import is_metric
from lightning_autopart.profile.readback import StepReads, ValueReads

__all__ = ["StepLoss", "step_loss"]


class StepLoss:
    """The user's training loss as a function of the pipelined model's output (see [Note: the loss]):
    ``training_step`` on the first ``samples`` samples of ``batch`` (moved to the output's device), with the
    model's forward returning ``output``, ``self.log`` recorded instead of logged and torchmetrics states
    restored afterwards, so profiling it leaves nothing behind. ``reads`` says what the step reads back from
    the device and logs at each step (see [Note: reads back]); it is recorded until one run completes."""

    def __init__(self, module: Any, root_name: str, batch: Any, batch_size: int, hook: str = "training_step") -> None:
        self.module, self.root_name, self.batch, self.batch_size = module, root_name, batch, batch_size
        #: The step it runs: ``training_step``, or an evaluation step traced as the training batch's
        #: (:meth:`evaluation_steps`).
        self.hook = hook
        self.reads = StepReads()
        #: The slice of the batch the last call read, on the output's device (what the profiler's
        #: ``profile_loss`` leaves out of the loss's saved bytes: the batch is priced on its own).
        self.sliced: Any = ()
        self._placed: tuple[torch.device, Any] | None = None
        self._tracing = False
        #: The last value of each number the step logged (a one-element tensor, detached, or a number); what
        #: calls inside :meth:`tracing` log (fake tensors) is forgotten at its end.
        self.logged: dict[str, Any] = {}
        #: The numbers the last call's ``training_step`` returned besides the loss, by key (a dict's other
        #: entries that are numbers or one-element tensors, detached: nothing keeps a graph or a batch's
        #: tensors alive after a profiling run); as :attr:`logged`, forgotten at the end of :meth:`tracing`.
        self.returned: dict[str, Any] = {}

    def place(self, device: torch.device | None) -> None:
        """Hold the batch on ``device`` (None: forget it), so that a call there reads a view of it, as the last
        stage reads the batch it holds: no copy of it is priced as the loss's (a CPU batch for meta outputs)."""
        self._placed = None
        if device is not None:
            self._placed = (device, _to_device(self.batch, device))

    def __call__(self, output: Any, samples: int) -> torch.Tensor:
        module = self.module
        device = next((t.device for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)), None)
        batch = self.batch
        if self._placed is not None and self._placed[0] == device:
            batch, device = self._placed[1], None  # there already: a view, no copy
        part = slice_batch(batch, 0, samples, self.batch_size)
        if device is not None:
            part = _to_device(part, device)
        self.sliced = part
        root = module.get_submodule(self.root_name) if self.root_name else module
        watch = ValueReads(self.reads) if not self.reads.seen else nullcontext()
        kept = nullcontext() if self._tracing else _metrics_kept(module)  # no metric updates while traced
        with replaced_forward(root, output), patched_log(module, self._log), kept, _attributes_kept(module), watch:
            out = getattr(module, self.hook)(part, 0)
        self.reads.seen = True
        value = out.get("loss") if isinstance(out, dict) else out
        self.returned = _numbers(out) if isinstance(out, dict) else {}
        if self.hook != "training_step":
            return value if isinstance(value, torch.Tensor) else torch.zeros(())
        if not isinstance(value, torch.Tensor):
            raise ConfigError(
                "training_step must return the loss (a tensor, or a dict with 'loss') under autopart"
            )
        return value

    def rows(self, indices: list[int]) -> StepLoss:
        """The loss over the batch's samples ``indices``, in that order and repeats allowed (the step checks of
        profile/step_checks.py run it on one sample, on it repeated, on two)."""
        rows = take_rows(self.batch, indices, self.batch_size)
        return StepLoss(self.module, self.root_name, rows, len(indices), self.hook)

    def evaluation_steps(self) -> list[StepLoss]:
        """The module's own ``validation_step`` and ``test_step``, each as a loss over this batch: they run once
        per micro-batch too, so the profiler traces them where they mix samples (``loss_findings`` in
        profile/step_checks.py; a step that cannot run on this batch tells nothing)."""
        hooks = [h for h in ("validation_step", "test_step") if _overrides(self.module, h)]
        return [StepLoss(self.module, self.root_name, self.batch, self.batch_size, hook) for hook in hooks]

    @contextmanager
    def tracing(self) -> Iterator[None]:
        """Calls inside skip the step's torchmetrics updates: the loss is traced on fake tensors
        (``step_flow`` in profile/step_checks.py), which hold no values for a metric to count, and a metric
        changes nothing the loss computes. What they log or return (fake tensors) is forgotten at the end."""
        with ExitStack() as stack:
            for m in self.module.modules():
                if is_metric(m):
                    stack.enter_context(instance_attribute(m, "forward", _no_update))
                    stack.enter_context(instance_attribute(m, "update", _no_update))
            self._tracing, kept = True, (self.logged, self.returned)
            self.logged, self.returned = dict(self.logged), dict(self.returned)
            try:
                yield
            finally:
                self._tracing, (self.logged, self.returned) = False, kept

    def _log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if _is_number(value):
            self.logged[name] = value.detach() if isinstance(value, torch.Tensor) else value
        if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.device.type == "cpu"):
            return  # converting it to a number reads nothing from a device
        options = {**dict(zip(LOG_ARGUMENTS, args, strict=False)), **kwargs}
        self.reads.note_log(bool(options.get("prog_bar", False)), options.get("logger"), options.get("on_step"))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)


def _numbers(out: dict[str, Any]) -> dict[str, Any]:
    """The entries of a step's returned dict beside its loss that are numbers, tensors detached."""
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items()
            if k != "loss" and _is_number(v)}  # fmt: skip


def _overrides(module: Any, hook: str) -> bool:
    """Whether ``module``'s class (not Lightning's) defines ``hook``; Lightning is not imported here (the CLI
    imports this module, and the core runs without Lightning)."""
    owner = next((c for c in type(module).__mro__ if hook in c.__dict__), None)
    return owner is not None and not owner.__module__.startswith(("lightning.", "pytorch_lightning."))


def _no_update(*args: Any, **kwargs: Any) -> None:
    """A metric's ``forward`` and ``update`` while the loss is traced (:meth:`StepLoss.tracing`)."""


def _to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with every tensor moved to ``device`` (other leaves as they are)."""
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def step_loss(module: Any, root_name: str, batch: Any, batch_size: int) -> StepLoss:
    """The training loss of ``module``'s ``training_step`` on ``batch`` as a function of the output of its
    submodule ``root_name`` (:class:`StepLoss`)."""
    return StepLoss(module, root_name, batch, batch_size)


@contextmanager
def _metrics_kept(module: nn.Module) -> Iterator[None]:
    """Restore every torchmetrics ``Metric`` of ``module`` on exit: its states and its other attributes, which a
    ``forward`` that raised halfway (on the planner's meta tensors) leaves changed (``_to_sync=False`` would stop
    this rank's ``compute()`` from joining the others')."""
    metrics: list[Any] = [m for m in module.modules() if is_metric(m)]
    saved = []
    for m in metrics:
        table = dict(m.__dict__)
        for k in (*m._defaults, "_computed", "_forward_cache", "_cache"):
            if k in table:
                table[k] = copy.deepcopy(table[k])
        saved.append(table)
    try:
        yield
    finally:
        for m, table in zip(metrics, saved, strict=True):
            m.__dict__.clear()
            m.__dict__.update(table)


@contextmanager
def _attributes_kept(module: nn.Module) -> Iterator[None]:
    """Restore, on exit, the public attributes of ``module`` and its submodules as the step found them: one it
    set or added, and the contents of a list, dict or set it filled in place (the step outputs Lightning's docs
    collect for ``on_train_epoch_end``), so that the planner's runs of the step on stand-ins leave nothing there
    (a meta or fake tensor among the real ones would fail the epoch's end)."""
    saved = []
    for m in module.modules():
        table = m.__dict__
        public = {k: v for k, v in table.items() if not k.startswith("_")}
        contents = {k: _contents(v) for k, v in public.items()}
        saved.append((table, public, contents))
    try:
        yield
    finally:
        for table, public, contents in saved:
            for k in [k for k in table if not k.startswith("_") and k not in public]:
                del table[k]
            for k, v in public.items():
                table[k] = v
                _refill(v, contents[k])


def _contents(value: Any) -> Any:
    """A shallow copy of a list, dict or set's contents; None for another value."""
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, set):
        return set(value)
    return None


def _refill(value: Any, contents: Any) -> None:
    """Put ``contents`` (:func:`_contents`) back into the container ``value``, in place."""
    if contents is None:
        return
    if isinstance(value, list):
        value[:] = contents
    elif isinstance(value, (dict, set)):
        value.clear()
        value.update(contents)
