"""Values logged in the gradient hooks, gathered from every stage of the pipeline and logged as the whole model's.

[Note: gradient hooks] ``on_after_backward`` and ``on_before_optimizer_step`` (of the LightningModule and its
callbacks) run on every rank, but a rank holds only its own stages' parameters: the others are empty, their
``.grad`` None. Plain Lightning's idiom, ``self.log_dict(grad_norm(self, norm_type=2))``, would log on rank 0
the first stage's parameters alone and a "total" norm of the first stage only. So the strategy records what
these hooks log on each rank (:func:`gathered_logs`), gathers the records of every stage of the pipeline and
logs, on every rank, one value per name:

- a name logged by one stage (a parameter's norm): that stage's value, so rank 0's logger sees every parameter;
- a name logged by several stages with one value (a learning rate, a tied parameter's norm): that value;
- Lightning's ``grad_{p}_norm_total`` with per-parameter norms beside it: the p-norm of all of them, as one
  process computes it over the whole model;
- a name whose value differs between stages (a norm or maximum over ``self.parameters()``: each stage's covers
  that stage alone): it is logged per stage, as ``name/stage_<i>``, and rank 0 warns once with the values and
  the fix, never one stage's part under the model's name.

Layouts (names, options, shapes) are exchanged pickled once, as in the log channel ([Note: log channel]); then
each step gathers the host numbers over gloo and the tensors as one device tensor (on a CPU device, both in the
one gloo message), so nothing is read back.
Whether several stages' tensors agree is read once, when a name first appears; afterwards a disagreement
makes the logged value NaN on the device (never a wrong number), and the host reads that flag only at logging
steps (``check_due``), where the name then goes per stage. A pipeline of one stage, or hooks that no module
or callback overrides, costs nothing.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning.finite import check_due
from lightning_autopart.lightning.hooks import LogRecord, capture_logs
from lightning_autopart.lightning.log_channel import (
    NUMBER_KINDS,
    LogChannel,
    Slot,
    layout_of,
    layout_widths,
    packed,
    placed,
    portable,
    remember,
    unpack_layout,
)
from lightning_autopart.runtime.topology import Placement, pipeline_ranks

__all__ = ["GradientLogs", "gathered_logs", "merge_stage_logs"]

#: Lightning's ``grad_norm`` total: ``grad_{norm_type}_norm_total``.
_TOTAL = re.compile(r"grad_(.+)_norm_total")


class GradientLogs:
    """One rank's share of the gathering over its pipeline (see [Note: gradient hooks]).

    Args:
        group: The pipeline's gloo group (its members in stage order), or None for a pipeline of one rank.
        device_group: The same ranks on the device's backend, for the tensors (None on a CPU device).
        position: This rank's position in ``group``.
        labels: Each position's stages, as they appear in per-stage names ("0", or "0_2" with interleaving).
        device: Where logged tensors live.
        rank: This global rank (rank 0 warns).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device_group: dist.ProcessGroup | None,
        position: int,
        labels: list[str],
        device: torch.device,
        rank: int,
    ) -> None:
        self.group, self.device_group, self.position = group, device_group, position
        self.labels, self.device, self.rank = labels, device, rank
        self._active: dict[str, bool] = {}
        #: Per hook, per position: the layouts seen so far (the same on every member).
        self._layouts: dict[str, list[list[list[Slot]]]] = {}
        #: Per hook: the widths of a message that fits every layout seen (numbers, tensor elements).
        self._widths: dict[str, tuple[int, int]] = {}
        #: (hook, name) of names several stages log: True where their values agreed when first seen.
        self._agreed: dict[tuple[str, str], bool] = {}
        #: (hook, name) of agreeing tensor names: a device flag set when they stop agreeing.
        self._flags: dict[tuple[str, str], torch.Tensor] = {}

    @classmethod
    def of(cls, channel: LogChannel, placement: Placement, plan: Any) -> GradientLogs:
        """This rank's gathering, over the groups of its log channel."""
        ranks = pipeline_ranks(plan, placement.replica)
        along = [s.ranks[placement.replica] for s in plan.stages]
        labels = ["_".join(str(s) for s, r in enumerate(along) if r == member) for member in ranks]
        return cls(channel.group, channel.device_group, ranks.index(placement.rank), labels, channel.device,
                   placement.rank)  # fmt: skip

    def active(self, hook: str, overridden: bool) -> bool:
        """Whether ``hook``'s logs are gathered: a pipeline of several ranks where any member overrides it
        (agreed once, so that a rank-local callback cannot leave the others waiting)."""
        if self.group is None:
            return False
        if hook not in self._active:
            flag = torch.tensor([int(overridden)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            self._active[hook] = bool(flag.numpy()[0])  # host memory: no device sync
        return self._active[hook]

    def gather(self, hook: str, records: list[LogRecord]) -> list[list[LogRecord]]:
        """Every member's ``records`` of this call of ``hook``, by position (every member calls it)."""
        assert self.group is not None
        members = len(self.labels)
        # a metric travels as its name alone (refused in merge)
        bare = [replace(r, value=None) if r.metric is not None else r for r in records]
        layout = layout_of(bare)
        known = self._layouts.setdefault(hook, [[] for _ in range(members)])
        index = known[self.position].index(layout) if layout in known[self.position] else -1
        numbers_width, tensors_width = self._widths.get(hook, (0, 0))
        on_host = self.device_group is None  # a CPU device: the tensors travel in the gloo message too
        host = torch.zeros(1 + numbers_width + (tensors_width if on_host else 0), dtype=torch.float64)
        host[0] = index
        tensors = [r.value for r, s in zip(records, layout, strict=True) if s.kind == "tensor"]
        if index >= 0:
            numbers = [float(r.value) for r, s in zip(records, layout, strict=True) if s.kind in NUMBER_KINDS]
            host[1 : 1 + len(numbers)] = torch.tensor(numbers, dtype=torch.float64)
            if on_host and tensors:
                flat = packed(tensors, host.device)
                host[1 + numbers_width : 1 + numbers_width + flat.numel()] = flat
        hosts = [torch.empty_like(host) for _ in range(members)]
        dist.all_gather(hosts, host, group=self.group)
        indices = [int(h.numpy()[0]) for h in hosts]  # host memory, read without a dispatch
        if min(indices) < 0:  # a layout not seen before: the records travel pickled, once
            boxes: list[Any] = [None] * members
            dist.all_gather_object(boxes, [replace(r, value=portable(r.value)) for r in bare], group=self.group)
            for position, got in enumerate(boxes):
                if indices[position] < 0:
                    remember(known[position], layout_of(got))
            self._widths[hook] = layout_widths([one for layouts in known for one in layouts])
            return [[replace(r, value=placed(r.value, self.device)) for r in got] for got in boxes]
        if on_host:
            parts = [h[1 + numbers_width :] for h in hosts]
        else:  # on the device's backend, asynchronous on its stream: nothing waits for the device here
            mine = torch.zeros(tensors_width, dtype=torch.float64, device=self.device)
            if tensors:
                flat = packed(tensors, self.device)
                mine[: flat.numel()] = flat
            parts = [torch.empty_like(mine) for _ in range(members)]
            if tensors_width:
                dist.all_gather(parts, mine, group=self.device_group)
        return [
            unpack_layout(known[p][indices[p]], hosts[p][1 : 1 + numbers_width].numpy(), parts[p].to(self.device))
            for p in range(members)
        ]

    def merge(self, hook: str, gathered: list[list[LogRecord]], check: bool = False) -> list[LogRecord]:
        """One record per name over the members' records (see [Note: gradient hooks]); with ``check`` (a logging
        step), first read whether names that agreed still do."""
        if check:
            self._check(hook)
        return merge_stage_logs(hook, gathered, self.labels, self._agreed, self._flags, self.rank == 0)

    def _check(self, hook: str) -> None:
        watched = [key for key in self._flags if key[0] == hook]
        if not watched:
            return
        flags = torch.stack([self._flags[key] for key in watched]).tolist()  # one read, at a logging step
        for key, differs in zip(watched, flags, strict=True):
            if differs:
                del self._flags[key]
                self._agreed[key] = False
                if self.rank == 0:
                    _warn_per_stage(key, "they agreed at first, then differed; logged as NaN meanwhile")


def merge_stage_logs(
    hook: str,
    gathered: list[list[LogRecord]],
    labels: list[str],
    agreed: dict[tuple[str, str], bool],
    flags: dict[tuple[str, str], torch.Tensor],
    warn: bool = False,
) -> list[LogRecord]:
    """One record per name from each position's ``gathered`` records (see [Note: gradient hooks]). ``agreed``
    and ``flags`` persist between calls: whether a name several stages log agreed when first seen, and the
    device flags of agreeing tensor names. ``warn``: warn of names logged per stage (rank 0)."""
    held: dict[str, list[tuple[int, LogRecord]]] = {}
    for position, records in enumerate(gathered):
        for r in records:
            if r.metric is not None or r.states is not None:
                raise ConfigError(
                    f"{hook} logged or updated the torchmetrics Metric {r.metric!r}; autopart gathers what the "
                    "gradient hooks log from every stage as values, so log metric.compute() or a tensor there"
                )
            held.setdefault(r.name, []).append((position, r))
    out = []
    for name, pairs in held.items():
        total = _grad_norm_total(name, held) if len(pairs) > 1 else None
        if len(pairs) == 1 or total is not None:
            out.append(pairs[0][1] if total is None else replace(pairs[0][1], value=total))
            continue
        key = (hook, name)
        values = [r.value for _, r in pairs]
        numbers = all(isinstance(v, (int, float)) for v in values)
        if key not in agreed or (agreed[key] and numbers and len(set(values)) > 1):  # numbers: checked each call
            agreed[key] = _agree(values)
            if not agreed[key] and warn:
                _warn_per_stage(key, ", ".join(f"stage {labels[p]}: {_shown(r.value)}" for p, r in pairs))
        if agreed[key]:
            out.append(replace(pairs[0][1], value=values[0] if numbers else _agreeing(key, values, flags)))
        else:
            out.extend(replace(r, name=f"{name}/stage_{labels[p]}") for p, r in pairs)
    return out


def _agree(values: list[Any]) -> bool:
    """Whether every value equals the first (read on the host: once per name)."""
    first = torch.as_tensor(values[0]).cpu()
    return all(
        (t := torch.as_tensor(v).cpu()).shape == first.shape and bool(torch.equal(t, first)) for v in values[1:]
    )


def _agreeing(key: tuple[str, str], values: list[Any], flags: dict[tuple[str, str], torch.Tensor]) -> Any:
    """The first of tensors that agreed so far, NaN where they no longer do; the disagreement is noted in
    ``flags[key]`` on the device, read at the next check."""
    first = torch.as_tensor(values[0])
    others = [torch.as_tensor(v, device=first.device) for v in values[1:]]
    if any(o.shape != first.shape for o in others):
        differs = torch.ones((), dtype=torch.bool, device=first.device)
    else:
        differs = torch.stack([(o != first).any() for o in others]).any()
    flags[key] = differs if key not in flags else flags[key] | differs
    if not first.is_floating_point():
        return first
    return torch.where(differs, torch.full_like(first, math.nan), first)


def _grad_norm_total(name: str, held: dict[str, list[tuple[int, LogRecord]]]) -> torch.Tensor | None:
    """Lightning's ``grad_norm`` total over every stage's per-parameter norms, where ``name`` is one."""
    match = _TOTAL.fullmatch(name)
    if match is None:
        return None
    try:
        norm_type = float(match.group(1))
    except ValueError:
        return None
    prefix = f"grad_{match.group(1)}_norm"
    parts = [pairs[0][1].value for other, pairs in held.items() if other != name and other.startswith(prefix)]
    if not parts or any(not isinstance(v, torch.Tensor) or v.numel() != 1 for v in parts):
        return None
    total = torch.linalg.vector_norm(packed(parts, parts[0].device), ord=norm_type)
    return total.to(parts[0].dtype)


def _warn_per_stage(key: tuple[str, str], values: str) -> None:
    hook, name = key
    warnings.warn(
        f"{name!r}, logged in {hook}, has a different value on each stage of the pipeline ({values}): a stage "
        "holds only its own layers' parameters and gradients, so a value computed over self.parameters() there "
        f"covers that stage alone. autopart logs it per stage, as '{name}/stage_<i>', not one stage's part as "
        "the model's. To log the whole model's value, log per-parameter values (they are gathered from every "
        "stage) or use lightning.pytorch.utilities.grad_norm (its total is recomputed over every stage); "
        "Trainer(gradient_clip_val=...) already clips by the norm over every stage",
        RuntimeWarning,
        stacklevel=3,
    )


def _shown(value: Any) -> str:
    t = torch.as_tensor(value)
    return f"{t.item():.6g}" if t.numel() == 1 else f"a tensor of shape {tuple(t.shape)}"


@contextmanager
def gathered_logs(logs: GradientLogs | None, module: Any, hook: str, overridden: bool = True) -> Iterator[None]:
    """Run ``hook`` (of ``module``, a LightningModule, and its Trainer's callbacks) inside, recording what it
    logs; then log, on every rank, the values gathered from every stage (see [Note: gradient hooks]).
    ``overridden``: whether this rank's module or a callback overrides ``hook`` (else nothing can be logged)."""
    trainer = getattr(module, "_trainer", None)
    if logs is None or trainer is None or not logs.active(hook, overridden):
        yield
        return
    records: list[LogRecord] = []
    with capture_logs(module, records):
        yield
    merged = logs.merge(hook, logs.gather(hook, records), check_due(trainer))
    before = module._current_fx_name
    module._current_fx_name = hook  # where Lightning files the values, as when the hook logged them
    try:
        for r in merged:
            module.log(r.name, r.value, **r.kwargs)
    finally:
        module._current_fx_name = before
