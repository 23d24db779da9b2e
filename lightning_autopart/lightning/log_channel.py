"""Carries the last stage's loss and logged values to the other stages of its pipeline, without a host sync.

[Note: log channel] Only the last stage runs the user's loss and ``self.log`` calls, but every rank must log
the same values (the progress bar and loggers live on rank 0, ``sync_dist`` is a collective of all ranks).
Logged tensors stay on the device: they are packed into one device tensor (``[loss, values...]``, float64)
broadcast from the last stage over a group of the pipeline's ranks on the device's backend, while Python
numbers and the layout flag travel in a small CPU message over gloo, read on the host without touching a
device. On a CPU device both parts are one gloo message. Every member keeps the layouts (names, options,
shapes, dtypes) seen so far per step kind, and messages are as wide as the widest of them, so the sender
broadcasts *asynchronously* and goes on with its optimizer step (it waits for that message only before the
next one), and receivers post their receive before their own schedule runs and find the message there when it
ends. The message names its layout by index; a layout never seen (the first step, a new ``self.log`` name) is
flagged and a pickled broadcast of the records (tensors copied to the CPU) follows, once. A step kind that
keeps making new layouts (names that change every step) starts its list over past ``MAX_LAYOUTS``. A logged
torchmetrics Metric travels as its step value and its FQN (in the layout), and the notes of updated metrics
travel in the layout alone; each member then logs its own copy of the metric (see [Note: metrics]). The host
part also carries the sender's ``trainer.should_stop``: a step that sets it (on the last stage, after the model
call) stops every stage of the pipeline after that step, as it stops the one process of plain Lightning.
A record whose value is neither a tensor nor a number (an entry ``training_step`` returns beside its loss: a
string, a list) travels pickled in the layout: free while it stays the same, a new layout where it changes.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from lightning_autopart.lightning.hooks import LogRecord
from lightning_autopart.lightning.metrics import StateSpec, resolve_metrics
from lightning_autopart.plan import Plan
from lightning_autopart.runtime.topology import new_group, pipeline_ranks

__all__ = [
    "MAX_LAYOUTS",
    "NUMBER_KINDS",
    "LogChannel",
    "Slot",
    "layout_of",
    "layout_widths",
    "open_log_channel",
    "packed",
    "placed",
    "portable",
    "remember",
    "unpack_layout",
]

#: Layouts kept per step kind before the list starts over.
MAX_LAYOUTS = 16


@dataclass(frozen=True)
class Slot:
    """Where one record's value sits in the packed messages, and how to rebuild it."""

    name: str
    kind: str  # "tensor" (device part), "int" or "float" (host part), "none", "note" or "object" (in the layout)
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    kwargs: tuple[tuple[str, Any], ...]
    metric: str | None = None
    states: tuple[StateSpec, ...] | None = None
    blob: bytes | None = None  # an "object" record's value, pickled (tensors on the CPU)

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)


def layout_of(records: list[LogRecord]) -> list[Slot]:
    """The layout of ``records``: where each value travels (device part, host part or the layout itself)."""
    out = []
    for r in records:
        kwargs = tuple(sorted(r.kwargs.items()))
        dtype: torch.dtype | None = None
        shape: tuple[int, ...] = ()
        blob = None
        if r.states is not None:
            kind = "note"
        elif isinstance(r.value, torch.Tensor):
            kind, dtype, shape = "tensor", r.value.dtype, tuple(r.value.shape)
        elif r.value is None:
            kind = "none"  # a metric without a step value
        elif isinstance(r.value, (int, float)):
            kind = "int" if isinstance(r.value, int) else "float"
        else:
            kind, blob = "object", pickle.dumps(portable(r.value))
        out.append(Slot(r.name, kind, dtype, shape, kwargs, r.metric, r.states, blob))
    return out


#: Slot kinds sent in the host part.
NUMBER_KINDS = ("int", "float")


#: Entries of the host part before the numbers: the layout index and the sender's ``should_stop``.
_HEADER = 2


def layout_widths(layouts: list[list[Slot]]) -> tuple[int, int]:
    """The numbers and the tensor elements a message must hold to fit every one of ``layouts``."""
    numbers = max((sum(1 for s in layout if s.kind in NUMBER_KINDS) for layout in layouts), default=0)
    elements = max((sum(s.numel for s in layout if s.kind == "tensor") for layout in layouts), default=0)
    return numbers, elements


def remember(known: list[list[Slot]], layout: list[Slot]) -> None:
    """Add a new ``layout`` to ``known`` (on every member alike, so indices and widths agree), starting the list
    over past ``MAX_LAYOUTS``."""
    if len(known) >= MAX_LAYOUTS:
        known.clear()
    known.append(layout)


def _widths(layouts: list[list[Slot]]) -> tuple[int, int]:
    """Sizes of the host part (header, numbers) and of the device part (loss, tensors) of a message that fits
    every one of ``layouts``."""
    numbers, elements = layout_widths(layouts)
    return _HEADER + numbers, 1 + elements


def _trainer(module: Any) -> Any:
    """The Trainer of a LightningModule ``module`` (None for anything else, or before it has one)."""
    return getattr(module, "_trainer", None)


class LogChannel:
    """One pipeline's channel from its last stage (``src``) to its other ranks; every member calls ``share``.

    Args:
        group: The gloo group of the pipeline's ranks (None: a 1-stage pipeline, nothing to send).
        src: Global rank of the last stage.
        rank: This rank.
        device: Where logged tensors live.
        device_group: A group of the same ranks on the device's backend, for the device part (None on CPU:
            the device part travels in the gloo message).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        src: int,
        rank: int,
        device: torch.device | None = None,
        device_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group
        self.src = src
        self.is_src = rank == src
        self.device = device or torch.device("cpu")
        self.device_group = device_group
        self._layouts: dict[str, list[list[Slot]]] = {}
        self._inflight: tuple[list[Any], tuple[torch.Tensor, ...]] = ([], ())
        self._posted: tuple[str, list[Any], torch.Tensor, torch.Tensor] | None = None

    def _buffers(self, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Zeroed buffers for a ``kind`` message: (what gloo sends, its host part, the device part)."""
        host, values = _widths(self._layouts.get(kind, []))
        if self.device_group is None:  # a CPU device: one gloo message holds both parts
            whole = torch.zeros(host + values, dtype=torch.float64)
            return whole, whole[:host], whole[host:]
        flags = torch.zeros(host, dtype=torch.float64)
        return flags, flags, torch.zeros(values, dtype=torch.float64, device=self.device)

    def _broadcast(self, whole: torch.Tensor, values: torch.Tensor) -> list[Any]:
        works = [dist.broadcast(whole, self.src, group=self.group, async_op=True)]
        if self.device_group is not None:
            works.append(dist.broadcast(values, self.src, group=self.device_group, async_op=True))
        return works

    def expect(self, kind: str) -> None:
        """On a receiver, post the receive of the next ``kind`` step's message now, before the step's schedule
        runs, so its latency hides behind the schedule; ``share`` then only waits. Senders ignore it."""
        if self.group is None or self.is_src or self._posted is not None:
            return
        whole, host, values = self._buffers(kind)
        self._posted = (kind, self._broadcast(whole, values), host, values)

    def share(
        self, kind: str, loss: torch.Tensor | None, records: list[LogRecord], module: Any = None
    ) -> tuple[torch.Tensor, list[LogRecord]]:
        """The sender's ``(loss, records)`` on every member (``kind`` names the step, e.g. "training_step").

        With ``module`` (the LightningModule), a logged metric's record comes back holding the member's own copy
        of the metric, and notes of updated metrics are applied to the copies (see [Note: metrics]); without
        it, notes are dropped.
        """
        trainer = _trainer(module)
        value, logs, stop = self._share(kind, loss, records, bool(getattr(trainer, "should_stop", False)))
        if stop and trainer is not None:
            trainer.should_stop = True
        if module is None:
            return value, logs if all(r.states is None for r in logs) else [r for r in logs if r.states is None]
        return value, resolve_metrics(module, logs, updated_here=self.is_src)

    def _share(
        self, kind: str, loss: torch.Tensor | None, records: list[LogRecord], stop: bool = False
    ) -> tuple[torch.Tensor, list[LogRecord], bool]:
        """The sender's loss, records and ``should_stop`` (``stop``, read on the sender only)."""
        if self.group is None:
            return (torch.tensor(math.nan, device=self.device) if loss is None else loss), records, stop
        if self.is_src:
            return (*self._send(kind, loss, records, stop), stop)
        self.expect(kind)
        assert self._posted is not None and self._posted[0] == kind, (
            "expect() was called for another step kind"
        )
        _, works, host, values = self._posted
        self._posted = None
        for work in works:
            work.wait()
        numbers = host.numpy()  # host memory: read without a device sync
        stop = bool(numbers[1] > 0)
        if numbers[0] >= 0:
            return values[0], unpack_layout(self._layouts[kind][int(numbers[0])], numbers[_HEADER:], values[1:]), stop
        box: list[Any] = [None]
        dist.broadcast_object_list(box, self.src, group=self.group)
        received: list[LogRecord] = box[0]
        self._learn(kind, layout_of(received))
        for r in received:
            r.value = placed(r.value, self.device)
        return values[0], received, stop

    def _send(
        self, kind: str, loss: torch.Tensor | None, records: list[LogRecord], stop: bool = False
    ) -> tuple[torch.Tensor, list[LogRecord]]:
        self.wait()
        slots = layout_of(records)
        known = self._layouts.get(kind, [])
        same = slots in known
        whole, host, values = self._buffers(kind)
        host[0] = float(known.index(slots)) if same else -1.0
        host[1] = float(stop)
        value = torch.tensor(math.nan, device=self.device) if loss is None else loss.detach()
        values[0] = value
        if same:
            numbers = [float(r.value) for r, s in zip(records, slots, strict=True) if s.kind in NUMBER_KINDS]
            if numbers:
                host[_HEADER : _HEADER + len(numbers)] = torch.tensor(numbers, dtype=torch.float64)
            tensors = [r.value for r, s in zip(records, slots, strict=True) if s.kind == "tensor"]
            if tensors:
                flat = packed(tensors, values.device)
                values[1 : 1 + flat.numel()] = flat
        works = self._broadcast(whole, values)
        if same:
            self._inflight = (works, (whole, values))  # the buffers stay alive until sent
        else:
            sent = [replace(r, value=portable(r.value)) for r in records]
            dist.broadcast_object_list([sent], self.src, group=self.group)
            self._learn(kind, slots)
            for work in works:
                work.wait()
        return value, records

    def _learn(self, kind: str, layout: list[Slot]) -> None:
        """Remember a new layout of ``kind``."""
        remember(self._layouts.setdefault(kind, []), layout)

    def wait(self) -> None:
        """Wait until the last asynchronous message has left (before the next one, and at teardown)."""
        for work in self._inflight[0]:
            work.wait()
        self._inflight = ([], ())

    @property
    def idle(self) -> bool:
        """Whether no receive is posted and no message is in flight."""
        return self._posted is None and not self._inflight[0]

    def abandon(self) -> None:
        """Forget the posted receive and the message in flight without waiting: after a failure their peer may
        never answer (gloo cannot cancel them; see [Note: failing ranks] in ``faults.py``)."""
        self._posted = None
        self._inflight = ([], ())


def portable(value: Any) -> Any:
    """``value`` with its tensors on the CPU, to be pickled: the receivers may have other device indices."""
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, value)


def placed(value: Any, device: torch.device) -> Any:
    """A received ``value`` with its tensors on this rank's ``device``."""
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def unpack_layout(layout: list[Slot], numbers: Any, values: torch.Tensor) -> list[LogRecord]:
    """The records a message of ``layout`` carries: its host part's ``numbers`` and device part's ``values``."""
    out = []
    host = device = 0
    views = _typed_views(layout, values)
    for slot in layout:
        value: Any = None
        if slot.kind == "tensor":
            assert slot.dtype is not None
            whole, scalars = views[slot.dtype]
            value = scalars[device] if slot.shape == () else whole[device : device + slot.numel].reshape(slot.shape)
            device += slot.numel
        elif slot.kind in NUMBER_KINDS:
            number = float(numbers[host])
            value = int(number) if slot.kind == "int" else number
            host += 1
        elif slot.kind == "object" and slot.blob is not None:
            value = placed(pickle.loads(slot.blob), values.device)  # sent by this job's last stage
        out.append(LogRecord(slot.name, value, dict(slot.kwargs), slot.metric, slot.states))
    return out


def packed(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``tensors`` flattened into one float64 tensor on ``device``: a kernel or two for the usual logged values
    (scalars of one dtype), not several per tensor; tensors elsewhere move, mixed dtypes convert one by one."""
    moved = [t if t.device == device else t.to(device) for t in tensors]
    if any(t.dtype != moved[0].dtype for t in moved):
        moved = [t.to(torch.float64) for t in moved]  # no promotion through float32: exact for int64 counts
    flat = torch.stack(moved) if all(t.dim() == 0 for t in moved) else torch.cat([t.reshape(-1) for t in moved])
    return flat.to(torch.float64)


def _typed_views(layout: list[Slot], values: torch.Tensor) -> dict[torch.dtype, tuple[torch.Tensor, Any]]:
    """Per dtype of ``layout``'s tensors: the device part converted once, and its elements as 0-d views (for the
    scalars, the usual logged value), so unpacking costs a few kernels, not several per record."""
    used = sum(s.numel for s in layout if s.kind == "tensor")
    out: dict[torch.dtype, tuple[torch.Tensor, Any]] = {}
    for s in layout:
        if s.kind == "tensor" and s.dtype is not None and s.dtype not in out:
            whole = values[:used].to(s.dtype)
            scalar = any(t.kind == "tensor" and t.dtype == s.dtype and t.shape == () for t in layout)
            out[s.dtype] = (whole, whole.unbind(0) if scalar else ())
    return out


def open_log_channel(plan: Plan, rank: int, device: torch.device | None = None) -> LogChannel:
    """This rank's channel; creates the groups of every multi-stage pipeline (a gloo group, and one on the device's
    backend for a non-CPU device), so every rank must call it together."""
    device = device or torch.device("cpu")
    mine: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None)
    src = rank
    for replica in range(plan.replicas):
        ranks = sorted(pipeline_ranks(plan, replica))
        if len(ranks) < 2:
            continue
        host = new_group(ranks, backend="gloo")
        values = new_group(ranks) if device.type != "cpu" else None
        if rank in ranks:
            mine, src = (host, values), plan.stages[-1].ranks[replica]
    return LogChannel(mine[0], src, rank, device, mine[1])
