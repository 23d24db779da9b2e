"""torchmetrics ``Metric`` objects under pipelining: exact step values over micro-batches, and stand-ins on the
stages that never update them.

[Note: metrics] Only the last stage runs the user's step, so only its metrics are ever updated. torchmetrics
synchronises metric states over the default process group in ``compute()``, and every other rank holds its own
copy of each metric at its default state, which adds nothing to a sum, a max, a min or a concatenation. So when
every rank logs the metric object under the same name (the last stage's ``self.log`` calls are replayed with
each rank's own metric), Lightning's epoch-end ``compute()``, run by every rank at once, gives the value of one
process. Per step:

- on the last stage, each metric's ``forward`` also updates a *twin* (a copy, never synchronised, reset every
  step) whose ``compute()`` is the step value over the whole batch, which one process's ``forward`` gives (the
  metric's own forward sees one micro-batch); each ``update`` is noted, with the dtype and trailing shape of
  every list ("cat") state;
- the other stages receive the step value (set as their metric's forward cache) and the notes (see
  [Note: log channel]): a noted metric counts an update (``compute()`` would warn otherwise) and gets an empty
  tensor of the right dtype and rank in each empty list state, so torchmetrics' all-gather sees matching shapes.

Refused with a ConfigError: ``dist_sync_on_step=True`` (a collective inside the schedule, on one stage alone),
``sync_on_compute=False`` on a logged metric (the other stages would log their default state), and state
reductions other than sum, max, min and cat (default states would change them).
"""

from __future__ import annotations

import copy
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_autopart.errors import ConfigError

if TYPE_CHECKING:
    from lightning_autopart.lightning.hooks import LogRecord

__all__ = [
    "StateSpec",
    "check_logged",
    "finish_notes",
    "is_metric",
    "metric_attribute",
    "resolve_metrics",
    "step_value",
    "tracked_metrics",
]

#: A list state of a metric after an update: its name, dtype and the shape of an element past dim 0.
StateSpec = tuple[str, torch.dtype, tuple[int, ...]]

#: Per LightningModule, its metrics as (FQN, metric), found at its first step (again if a logged one is new).
_FOUND: weakref.WeakKeyDictionary[nn.Module, list[tuple[str, Any]]] = weakref.WeakKeyDictionary()
#: Per metric (by id, with a weak reference to tell a reused id), its twin.
_TWINS: dict[int, tuple[weakref.ref[Any], Any]] = {}


def is_metric(value: Any) -> bool:
    """Whether ``value`` is a torchmetrics ``Metric`` (without importing torchmetrics: none exists unless it is)."""
    metric_type = getattr(sys.modules.get("torchmetrics"), "Metric", None)
    return metric_type is not None and isinstance(value, metric_type)


def _metrics(module: nn.Module, again: bool = False) -> list[tuple[str, Any]]:
    found = _FOUND.get(module)
    if found is None or again:
        found = [(n, m) for n, m in module.named_modules() if is_metric(m)]
        _FOUND[module] = found
    return found


def metric_attribute(module: nn.Module, metric: Any, given: str | None) -> str:
    """The FQN of ``metric`` in ``module`` (``given``, Lightning's ``metric_attribute``, if set)."""
    if given:
        return given
    for again in (False, True):
        for name, m in _metrics(module, again):
            if m is metric:
                return name
    raise ConfigError(
        f"a logged {type(metric).__name__} is not an attribute of {type(module).__name__}: autopart finds each "
        "stage's copy of a metric by name, so make it a module attribute or pass self.log(..., metric_attribute=)"
    )


def _reduction_problem(metric: Any) -> str | None:
    """Why the metric's states would not survive default states on the other ranks, or None."""
    from torchmetrics.utilities.data import dim_zero_cat, dim_zero_max, dim_zero_min, dim_zero_sum

    for attr, fx in metric._reductions.items():
        default = metric._defaults[attr]
        if fx in (dim_zero_sum, dim_zero_max, dim_zero_min):
            continue
        if fx is dim_zero_cat and (isinstance(default, list) or default.numel() == 0):
            continue
        how = getattr(fx, "__name__", repr(fx)).replace("dim_zero_", "")
        return f"state {attr!r} is reduced across processes by {how}"
    return None


def _refuse(metric: Any, fqn: str, why: str) -> ConfigError:
    return ConfigError(
        f"metric {fqn!r} ({type(metric).__name__}): {why}. Under autopart only the last pipeline stage updates "
        "metrics and every stage computes them together, so metrics must keep sync_on_compute=True, "
        "dist_sync_on_step=False and sum/max/min/cat state reductions; otherwise create the metric with "
        "sync_on_compute=False and log metric.compute() from the step (a tensor, replayed on every stage)"
    )


def check_logged(metric: Any, fqn: str) -> None:
    """Refuse a metric whose logged object would compute a different value on the other stages."""
    if not metric.sync_on_compute:
        raise _refuse(
            metric, fqn, "sync_on_compute=False leaves the other stages' default states unsynchronised"
        )
    problem = _reduction_problem(metric)
    if problem:
        raise _refuse(metric, fqn, problem)


def _twin(metric: Any) -> Any:
    """The metric's step twin: a copy that is never synchronised (made once, from the unpatched metric)."""
    entry = _TWINS.get(id(metric))
    if entry is not None and entry[0]() is metric:
        return entry[1]
    twin = copy.deepcopy(metric)  # copies rewrap their class's update; patched forwards are dropped here
    for m in twin.modules():
        if is_metric(m):
            m.__dict__.pop("forward", None)
    twin.reset()
    twin.sync_on_compute = twin.dist_sync_on_step = twin._to_sync = False
    if getattr(twin, "validate_args", None) is True:  # the metric itself checks the same inputs (host syncs)
        twin.validate_args = False
    key = id(metric)
    _TWINS[key] = (weakref.ref(metric), twin)
    weakref.finalize(metric, _TWINS.pop, key, None)
    return twin


@contextmanager
def tracked_metrics(module: nn.Module, note: Callable[[str, Any], None]) -> Iterator[None]:
    """While one micro-batch's step runs on the last stage: every metric's ``forward`` also updates its twin, and
    ``note(fqn, metric)`` is called at its first update."""
    saved: list[tuple[Any, dict[str, Any]]] = []
    noted: set[int] = set()

    def note_once(fqn: str, metric: Any) -> None:
        if id(metric) not in noted:
            noted.add(id(metric))
            if metric.sync_on_compute and (problem := _reduction_problem(metric)):
                raise _refuse(metric, fqn, problem)
            note(fqn, metric)

    for fqn, metric in _metrics(module):
        table = metric.__dict__
        saved.append((metric, {k: table[k] for k in ("forward", "update") if k in table}))
        table["forward"] = _forward(metric, fqn, metric.forward, note_once)
        table["update"] = _update(metric, fqn, metric.update, note_once)
    try:
        yield
    finally:
        for metric, attributes in saved:
            for k in ("forward", "update"):
                metric.__dict__.pop(k, None)
            metric.__dict__.update(attributes)


def _forward(
    metric: Any, fqn: str, forward: Callable[..., Any], note: Callable[[str, Any], None]
) -> Callable[..., Any]:
    def patched(*args: Any, **kwargs: Any) -> Any:
        if metric.dist_sync_on_step:
            raise _refuse(
                metric, fqn, "dist_sync_on_step=True synchronises inside the last stage's step alone"
            )
        note(fqn, metric)  # also where the twin is reset at the step's end
        twin = _twin(metric)
        out = forward(*args, **kwargs)
        with torch.no_grad():
            twin.update(*args, **kwargs)
        return out

    return patched


def _update(
    metric: Any, fqn: str, update: Callable[..., Any], note: Callable[[str, Any], None]
) -> Callable[..., Any]:
    def patched(*args: Any, **kwargs: Any) -> Any:
        note(fqn, metric)
        return update(*args, **kwargs)

    return patched


def step_value(metric: Any) -> torch.Tensor | None:
    """The metric's value over this step's micro-batches (its twin's), else its forward cache; None when not a
    tensor."""
    entry = _TWINS.get(id(metric))
    twin = entry[1] if entry is not None and entry[0]() is metric else None
    value = twin.compute() if twin is not None and twin._update_count > 0 else metric._forward_cache
    return value.detach() if isinstance(value, torch.Tensor) else None


def finish_notes(notes: list[LogRecord]) -> list[LogRecord]:
    """One note per noted metric, holding the specs of its list states instead of the metric; resets the twins
    (after ``step_value``)."""
    out: dict[str, LogRecord] = {}
    for r in notes:
        metric = r.value
        if r.name in out or metric is None:
            continue
        specs: list[StateSpec] = []
        for attr, default in metric._defaults.items():
            state = getattr(metric, attr)
            if isinstance(default, list) and state:
                last = state[-1]
                specs.append((attr, last.dtype, tuple(last.shape[1:])))
        out[r.name] = replace(r, value=None, states=tuple(specs))
        entry = _TWINS.get(id(metric))
        if entry is not None and entry[0]() is metric:
            entry[1].reset()
    return list(out.values())


def resolve_metrics(module: Any, records: list[LogRecord], updated_here: bool) -> list[LogRecord]:
    """The records to log on this rank: a metric's record with this rank's metric object as value (its step value
    set as the forward cache); notes dropped, after being applied where the metrics were not ``updated_here``."""
    out = []
    for r in records:
        if r.metric is None:
            out.append(r)
            continue
        metric = module.get_submodule(r.metric)
        if r.states is None:
            metric._forward_cache = r.value
            out.append(replace(r, value=metric))
        elif not updated_here:
            _mirror(metric, r.states)
    return out


def _mirror(metric: Any, states: tuple[StateSpec, ...]) -> None:
    """Count an update made on the last stage, and give empty list states the shape and dtype of its."""
    metric._update_count += 1
    metric._computed = None
    device = torch.device("cpu") if metric.compute_on_cpu else metric.device
    for attr, dtype, trailing in states:
        if not getattr(metric, attr):
            setattr(metric, attr, [torch.empty((0, *trailing), dtype=dtype, device=device)])
