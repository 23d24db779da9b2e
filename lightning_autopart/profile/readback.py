"""How often a training loop makes its host wait for the device: what decides whether the next batch's fetch
overlaps the device's work.

[Note: reads back] On a GPU the host queues a step's kernels and runs ahead, unless something reads a device
value (``.item()``, ``bool(t)``, ``float(t)``, ``.tolist()``, a copy to the CPU): then it waits for every kernel
queued so far. Where that happens once a step, the next batch is made on the host while the device idles, and
a loader without workers adds its time to the step; where nothing reads back, the host makes the next batch
while the device still computes this one, and the step takes the longer of the two, device or host (fetch plus
launches). In a Lightning fit the reads come from:

- the step's own code: a value read in ``training_step`` (seen by :class:`ValueReads` while the loss is
  profiled);
- the progress bar, which converts the values logged with ``prog_bar=True`` to numbers every ``refresh_rate``
  steps (a device tensor's conversion reads it; a Python number or a CPU tensor reads nothing);
- the loggers, which convert every logged value every ``log_every_n_steps`` steps;
- a gradient scaler (``16-mixed``), which reads whether the gradients overflowed at every optimizer step;
- in a job of several processes, Lightning's own training loop (2.6): before each batch it broadcasts rank 0's
  SIGTERM flag, a tensor on the strategy's device, and reads it (``.item()``) on every rank. On a GPU the
  broadcast waits for the kernels queued before it, so every step of every rank reads back, whatever the step
  logs (:func:`lightning_syncs_each_step` in the adapter asks the installed Lightning). The strategy leaves
  that broadcast out while its own pre-emption handler holds SIGTERM, the default ([Note: Lightning's
  per-batch SIGTERM broadcast] in ``lightning/preemption.py``), so this counts only with ``preempt_signals``
  that leave SIGTERM to Lightning.

:func:`readback_every` combines them into the steps between two reads (0: never; 1: every step). A step
whose reads are unknown (its loss was not run, or callbacks read values) counts as reading back every step,
the pricing before this note and what the examples' own steps do. A host that does the math itself (a CPU)
waits for nothing: there the fetch always adds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_autopart.errors import ConfigError
from lightning_autopart.profile.loader import LoaderCost

__all__ = ["LoopFacts", "StepReads", "ValueReads", "readback_every", "reads_of", "with_readback"]

#: Tensor methods that hand a device value to the host (and so wait for the device).
_READS = frozenset(
    ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__", "__complex__")
)


@dataclass
class StepReads:
    """What one training step's code was seen doing that reads device values back, directly or through
    Lightning's logging (see [Note: reads back])."""

    #: Names of the tensor methods the step called that read a value ("item", "__bool__", ...).
    values: list[str] = field(default_factory=list)
    #: The step logged a value at each step for the progress bar (``prog_bar=True``) / for the loggers.
    progress_bar: bool = False
    logger: bool = False
    #: The step's code ran (while the loss was profiled): without that, nothing above is known.
    seen: bool = False

    def note_log(self, prog_bar: bool, logger: bool | None, on_step: bool | None) -> None:
        """Record one ``self.log`` call in ``training_step`` (Lightning's defaults there: on each step, logged)."""
        if on_step is False:
            return  # an epoch-level value is read at the epoch's end, outside the steps
        self.progress_bar |= bool(prog_bar)
        self.logger |= logger is not False


@dataclass(frozen=True)
class LoopFacts:
    """What the training loop around the step reads, every how many steps (0: never)."""

    #: The progress bar's refresh rate (0: no progress bar).
    progress_every: int = 1
    #: Trainer(log_every_n_steps), where a logger is attached (0: no logger).
    log_every: int = 50
    #: A gradient scaler reads an overflow flag at every optimizer step.
    scaler: bool = False
    #: The loop itself reads a value that the ranks exchange at every step (Lightning 2.6's training loop
    #: broadcasts rank 0's SIGTERM flag on the device and reads it, in a job of several processes).
    synced: bool = False

    def __post_init__(self) -> None:
        if self.progress_every < 0 or self.log_every < 0:
            raise ConfigError(
                f"the progress bar's refresh rate ({self.progress_every}) and the steps between logs "
                f"({self.log_every}) count steps; give 0 or more (0: no progress bar, no logger)"
            )


class ValueReads(TorchFunctionMode):
    """Records, into ``reads.values``, each tensor method that reads a value from a tensor not on the CPU (on
    meta tensors such calls then fail, as they would have without the mode)."""

    def __init__(self, reads: StepReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        device = args[0].device.type if args and isinstance(args[0], torch.Tensor) else "cpu"
        if device != "cpu" and (name in _READS or (name in ("cpu", "to") and _to_cpu(name, args, kwargs))):
            self.reads.values.append(name)
        return func(*args, **kwargs)


def _to_cpu(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``tensor.cpu()`` or ``tensor.to(...)`` copies to the host."""
    if name == "cpu":
        return True
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(target, (str, torch.device)):
        return torch.device(target).type == "cpu"
    return False


def readback_every(reads: StepReads | None, loop: LoopFacts | None) -> int:
    """Steps between two reads of a device value by the training loop (0: never), as [Note: reads back] sets
    out; 1 where the step's reads are unknown."""
    if reads is None or not reads.seen or reads.values:
        return 1
    loop = loop or LoopFacts()
    if loop.scaler or loop.synced:
        return 1
    periods = []
    if reads.progress_bar and loop.progress_every > 0:
        periods.append(loop.progress_every)
    if reads.logger and loop.log_every > 0:
        periods.append(loop.log_every)
    return min(periods, default=0)


def reads_of(loss: object) -> StepReads | None:
    """What a loss function recorded of its step's reads: its ``reads`` attribute (the Lightning adapter's
    ``StepLoss`` keeps one), None for a loss that keeps none."""
    reads = getattr(loss, "reads", None)
    return reads if isinstance(reads, StepReads) else None


def with_readback(cost: LoaderCost | None, loss: object, loop: LoopFacts | None) -> LoaderCost | None:
    """``cost`` with how often the loop reads back, from what ``loss`` recorded once it ran and ``loop``."""
    if cost is None:
        return None
    return dataclasses.replace(cost, readback_every=readback_every(reads_of(loss), loop))
