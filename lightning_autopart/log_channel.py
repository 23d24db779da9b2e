"""Carries the last stage's loss and logged values to the other stages of its pipeline, as one small tensor.

[Note: log channel] Only the last stage runs the user's loss and ``self.log`` calls, but every rank must log
the same values (the progress bar and loggers live on rank 0, ``sync_dist`` is a collective of all ranks).
The values of a step are packed into a float64 tensor and broadcast from the last stage over a gloo group of
the pipeline's ranks. Their layout (names, options, shapes, dtypes) rarely changes, so every member keeps
the last layout per step kind: the sender broadcasts ``[same layout?, loss, values...]`` *asynchronously*
and goes on with its optimizer step (it waits for that message only before the next one), while receivers
find the message already there when their own schedule ends. When the layout changes (the first step, a
new ``self.log`` name), the flag says so and a pickled broadcast of the records follows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_autopart.lightning_hooks import LogRecord
from lightning_autopart.plan import Plan
from lightning_autopart.topology import pipeline_ranks

__all__ = ["LogChannel", "open_log_channel"]


@dataclass(frozen=True)
class _Slot:
    """Where one record's value sits in the packed tensor, and how to rebuild it."""

    name: str
    kind: str  # "tensor", "int" or "float"
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    kwargs: tuple[tuple[str, Any], ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _slots(records: list[LogRecord]) -> list[_Slot]:
    out = []
    for r in records:
        kwargs = tuple(sorted(r.kwargs.items()))
        if isinstance(r.value, torch.Tensor):
            out.append(_Slot(r.name, "tensor", r.value.dtype, tuple(r.value.shape), kwargs))
        else:
            out.append(_Slot(r.name, "int" if isinstance(r.value, int) else "float", None, (), kwargs))
    return out


class LogChannel:
    """One pipeline's channel from its last stage (``src``) to its other ranks; every member calls ``share``."""

    def __init__(self, group: dist.ProcessGroup | None, src: int, rank: int) -> None:
        self.group = group
        self.src = src
        self.is_src = rank == src
        self._layouts: dict[str, list[_Slot]] = {}
        self._inflight: tuple[Any, torch.Tensor] | None = None
        self._posted: tuple[str, Any, torch.Tensor] | None = None

    def expect(self, kind: str) -> None:
        """On a receiver, post the receive of the next ``kind`` step's message now, before the step's schedule
        runs, so its latency hides behind the schedule; ``share`` then only waits. Senders ignore it."""
        if self.group is None or self.is_src or self._posted is not None:
            return
        message = torch.empty(2 + sum(s.numel for s in self._layouts.get(kind, [])), dtype=torch.float64)
        self._posted = (kind, dist.broadcast(message, self.src, group=self.group, async_op=True), message)

    def share(self, kind: str, loss: float | None, records: list[LogRecord]) -> tuple[float, list[LogRecord]]:
        """The sender's ``(loss, records)`` on every member (``kind`` names the step, e.g. "training_step")."""
        if self.group is None:
            return (math.nan if loss is None else loss), records
        if self.is_src:
            layout = self._layouts.get(kind, [])
            width = 2 + sum(s.numel for s in layout)
            return self._send(kind, layout, width, loss, records)
        self.expect(kind)
        assert self._posted is not None and self._posted[0] == kind, (
            "expect() was called for another step kind"
        )
        _, work, message = self._posted
        self._posted = None
        work.wait()
        if message[0].item() == 1.0:
            return float(message[1]), _unpack(self._layouts.get(kind, []), message[2:])
        box: list[Any] = [None]
        dist.broadcast_object_list(box, self.src, group=self.group)
        self._layouts[kind] = _slots(box[0])
        return float(message[1]), list(box[0])

    def _send(
        self, kind: str, layout: list[_Slot], width: int, loss: float | None, records: list[LogRecord]
    ) -> tuple[float, list[LogRecord]]:
        self.wait()
        value = math.nan if loss is None else float(loss)
        slots = _slots(records)
        same = slots == layout
        message = torch.zeros(width, dtype=torch.float64)
        message[0], message[1] = float(same), value
        if same and width > 2:
            message[2:] = torch.cat(
                [torch.as_tensor(r.value, dtype=torch.float64).reshape(-1) for r in records]
            )
        work = dist.broadcast(message, self.src, group=self.group, async_op=True)
        if same:
            self._inflight = (work, message)
        else:
            dist.broadcast_object_list([records], self.src, group=self.group)
            self._layouts[kind] = slots
            work.wait()
        return value, records

    def wait(self) -> None:
        """Wait until the last asynchronous message has left (before the next one, and at teardown)."""
        if self._inflight is not None:
            self._inflight[0].wait()
            self._inflight = None


def _unpack(layout: list[_Slot], values: torch.Tensor) -> list[LogRecord]:
    out = []
    offset = 0
    for slot in layout:
        chunk = values[offset : offset + slot.numel]
        offset += slot.numel
        value: Any
        if slot.kind == "tensor":
            assert slot.dtype is not None
            value = chunk.reshape(slot.shape).to(slot.dtype)
        else:
            value = int(chunk[0]) if slot.kind == "int" else float(chunk[0])
        out.append(LogRecord(slot.name, value, dict(slot.kwargs)))
    return out


def open_log_channel(plan: Plan, rank: int) -> LogChannel:
    """This rank's channel; creates one gloo group per multi-stage pipeline, so every rank must call it together."""
    mine: dist.ProcessGroup | None = None
    src = rank
    for replica in range(plan.replicas):
        ranks = sorted(pipeline_ranks(plan, replica))
        if len(ranks) < 2:
            continue
        group = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            mine, src = group, plan.stages[-1].ranks[replica]
    return LogChannel(mine, src, rank)
