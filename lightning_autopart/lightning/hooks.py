"""Helpers that run a user's LightningModule step around a pipeline: forward interception, batch slicing, logs."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_autopart.errors import ConfigError
from lightning_autopart.lightning.metrics import (
    StateSpec,
    check_logged,
    finish_notes,
    is_metric,
    metric_attribute,
    step_value,
    tracked_metrics,
)

__all__ = [
    "LOG_ARGUMENTS",
    "REDUCE",
    "ForwardCall",
    "LogRecord",
    "batch_range",
    "batch_size_of",
    "capture_logs",
    "find_forward",
    "flat_inputs",
    "instance_attribute",
    "merge_logs",
    "patched_log",
    "replaced_forward",
    "sample_range",
    "slice_batch",
    "take_rows",
]


@dataclass
class ForwardCall:
    """The first module call a step makes: which submodule (FQN, "" for the root) and with what."""

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


class _Stop(Exception):
    """Raised by the interception hook to leave the user's step at its first module call."""

    def __init__(self, call: ForwardCall) -> None:
        super().__init__(call.name)
        self.call = call


def find_forward(root: nn.Module, step: Callable[[], Any], only: str | None = None) -> ForwardCall:
    """Run ``step`` until it calls ``root`` or one of its submodules; return that call, stopping the step there.

    With ``only`` (a submodule's FQN, "" for ``root``), the step is stopped at that module's first call alone,
    which costs one hook instead of one per module. ``root.log`` is silenced meanwhile. Raises ConfigError
    when the step calls no module.
    """
    handles = []
    targets = (
        dict(root.named_modules()) if only is None else {only: root.get_submodule(only) if only else root}
    )
    names = {id(m): n for n, m in targets.items()}

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        raise _Stop(ForwardCall(names[id(module)], tuple(args), dict(kwargs)))

    for module in targets.values():
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with _silenced_log(root):
            step()
    except _Stop as stop:
        return stop.call
    finally:
        for h in handles:
            h.remove()
    if only is not None:
        raise ConfigError(
            f"a step of {type(root).__name__} never called {only or 'self'}, the module autopart pipelined; "
            "every training, validation and test step must call it"
        )
    raise ConfigError(
        f"{type(root).__name__}.training_step never calls the model (self(x) or a submodule); autopart "
        "pipelines the first module the step calls, so the step must call one"
    )


def flat_inputs(module: nn.Module, call: ForwardCall) -> tuple[list[Any], tuple[Any, ...]]:
    """The call's inputs flattened as capture flattens them (positional args, then kwargs in the forward's
    order): all leaves, and the tensors alone (the captured model's inputs)."""
    kwargs: list[Any] = []
    if call.kwargs:
        order = list(inspect.signature(module.forward).parameters)
        kwargs = [
            call.kwargs[k] for k in sorted(call.kwargs, key=lambda k: order.index(k) if k in order else 0)
        ]
    leaves, _ = tree_flatten((call.args, kwargs))
    return leaves, tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))


def sample_range(index: torch.Tensor) -> tuple[int, int]:
    """The samples ``lo:hi`` a micro-batch's slice of a ``batch_range`` tensor covers, read from its metadata
    (offset and length), so no value is read and nothing waits for a device."""
    lo = int(index.storage_offset())
    return lo, lo + int(index.shape[0])


def batch_range(size: int) -> torch.Tensor:
    """A stand-in target of ``size`` samples that costs no memory: slicing it says which samples a slice holds
    (see :func:`sample_range`)."""
    return torch.empty(size, device="meta")


def batch_size_of(batch: Any) -> int:
    """The leading size of the batch's first tensor."""
    leaves, _ = tree_flatten(batch)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ConfigError(
        f"the batch ({type(batch).__name__}) holds no tensor with a batch dimension, and autopart splits batches "
        "into micro-batches along the first dimension of their tensors: make the loader yield tensors (e.g. "
        "(x, y) with x of shape (batch, ...))"
    )


def slice_batch(batch: Any, lo: int, hi: int, size: int) -> Any:
    """Samples ``lo:hi`` of every tensor of ``batch`` whose leading size is ``size`` (others unchanged)."""
    return take_rows(batch, slice(lo, hi), size)


def take_rows(batch: Any, rows: slice | list[int], size: int) -> Any:
    """The samples ``rows`` (a slice: views; indices: copies, in that order, repeats allowed) of every tensor of
    ``batch`` whose leading size is ``size``, the batch's; other leaves unchanged."""

    def cut(x: Any) -> Any:
        if not (isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == size):
            return x
        return x[rows] if isinstance(rows, slice) else x[torch.tensor(rows, device=x.device)]

    return tree_map(cut, batch)


@contextmanager
def replaced_forward(module: nn.Module, output: Any) -> Iterator[None]:
    """Make ``module(...)`` return ``output`` (the pipeline's result) for the duration."""
    with instance_attribute(module, "forward", lambda *args, **kwargs: output):
        yield


@dataclass
class LogRecord:
    """One ``self.log`` call: name, value (a number, or a detached tensor where it was computed) and options.

    ``metric`` is the FQN of a logged torchmetrics Metric (``value``: the metric while the step runs, then its
    step value or None), or, with ``states`` set, of a metric the step updated: a note, not logged (see
    [Note: metrics]).
    """

    name: str
    value: Any
    kwargs: dict[str, Any]
    metric: str | None = None
    states: tuple[StateSpec, ...] | None = None


@contextmanager
def capture_logs(module: nn.Module, records: list[LogRecord]) -> Iterator[None]:
    """Record ``module.log(...)`` calls into ``records`` instead of logging them, and note the updates of the
    module's torchmetrics metrics there (see [Note: metrics])."""
    names = LOG_ARGUMENTS

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.update(zip(names, args, strict=False))
        fqn = None
        if isinstance(value, torch.Tensor):
            value = value.detach()  # stays on its device: reading it would wait for the device
            if value.untyped_storage().nbytes() > value.nbytes:
                value = value.clone()  # a view (a loss can be one) would keep its whole buffer alive
        elif is_metric(value):
            fqn = metric_attribute(module, value, kwargs.get("metric_attribute"))
            check_logged(value, fqn)
        elif not isinstance(value, (int, float)):
            raise ConfigError(
                f"self.log({name!r}, <{type(value).__name__}>): autopart replays logged values on every stage, "
                "so log tensors or numbers (or torchmetrics Metric objects)"
            )
        records.append(LogRecord(name, value, kwargs, fqn))

    def note(fqn: str, metric: Any) -> None:
        records.append(LogRecord(fqn, metric, {}, fqn, ()))

    with patched_log(module, log), tracked_metrics(module, note):
        yield


def merge_logs(
    records: list[LogRecord], samples: list[int] | None = None, combine: dict[str, str] | None = None
) -> list[LogRecord]:
    """One record per name: the mean of its micro-batch values, last call's options; a logged metric's value
    is its step value, and each updated metric is noted once, after them.

    ``samples[j]`` is how many samples the micro-batch that made ``records[j]`` held: values of micro-batches
    of different sizes (a ragged batch, see [Note: ragged batches]) are weighted by them, and a ``batch_size``
    the step gave as its micro-batch's size becomes the batch's (their sum), as one process logs it. None:
    equal micro-batches. ``combine[name]``: "sum", "max" or "min" for a value that is one over the samples, not
    a mean ([Note: logged values over micro-batches] in profile/step_checks.py). Tensors are combined on their device;
    nothing is read back to the host.
    """
    merged: dict[str, list[tuple[LogRecord, int]]] = {}
    notes = []
    for j, r in enumerate(records):
        if r.states is not None:
            notes.append(r)
        else:
            merged.setdefault(r.name, []).append((r, samples[j] if samples is not None else 1))
    out = []
    for name, pairs in merged.items():
        recs, counts = [r for r, _ in pairs], [c for _, c in pairs]
        kwargs = _whole_batch_size(recs, counts) if samples is not None else recs[-1].kwargs
        last = recs[-1].value
        if recs[-1].metric is not None:
            out.append(replace(recs[-1], value=step_value(last) if is_metric(last) else last))
            continue
        if len(recs) == 1:
            out.append(recs[0] if kwargs is recs[0].kwargs else replace(recs[0], kwargs=kwargs))
            continue
        how = (combine or {}).get(name, "mean")
        total = sum(counts)
        weights = None if len(set(counts)) == 1 or how != "mean" else [c / total for c in counts]
        value: Any
        if isinstance(last, torch.Tensor):
            values = torch.stack([torch.as_tensor(r.value, dtype=torch.float64, device=last.device) for r in recs])
            if how != "mean":
                value = REDUCE[how](values).to(last.dtype)
            elif weights is None:
                value = values.mean(0).to(last.dtype)
            else:  # Python weights: no host-to-device copy
                weighted = [v * w for v, w in zip(values, weights, strict=True)]
                value = torch.stack(weighted).sum(0).to(last.dtype)
        else:
            numbers = [float(r.value) for r in recs]
            if how != "mean":
                value = float(REDUCE[how](torch.tensor(numbers, dtype=torch.float64)))
            elif weights is None:
                value = sum(numbers) / len(numbers)
            else:
                value = sum(v * w for v, w in zip(numbers, weights, strict=True))
        out.append(LogRecord(name, value, kwargs))
    return out + finish_notes(notes)


#: How micro-batches' values of a value that is not a mean combine (stacked on dimension 0), by ``combine`` name:
#: logged values here, a step's other outputs in steps.py.
REDUCE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": lambda t: t.sum(0),
    "max": lambda t: t.amax(0),
    "min": lambda t: t.amin(0),
}


def _whole_batch_size(records: list[LogRecord], samples: list[int]) -> dict[str, Any]:
    """The last record's options, with ``batch_size`` the sum of the micro-batches' when every call gave its
    own micro-batch's size (``batch_size=len(x)``); any other ``batch_size`` (a constant) is kept as given."""
    kwargs = records[-1].kwargs
    given = [r.kwargs.get("batch_size") for r in records]
    own = all(type(g) is int and g == s for g, s in zip(given, samples, strict=True))
    if not own or kwargs["batch_size"] == sum(samples):
        return kwargs
    return {**kwargs, "batch_size": sum(samples)}


def _log_signature(self: Any, name: str, value: Any, prog_bar: bool = False, logger: Any = None,
                   on_step: Any = None, on_epoch: Any = None, reduce_fx: Any = "mean",
                   enable_graph: bool = False, sync_dist: bool = False, sync_dist_group: Any = None,
                   add_dataloader_idx: bool = True, batch_size: Any = None, metric_attribute: Any = None,
                   rank_zero_only: bool = False) -> None:  # fmt: skip
    """Positional order of ``LightningModule.log``'s arguments."""


#: Names of ``LightningModule.log``'s arguments after ``name`` and ``value``, in positional order.
LOG_ARGUMENTS = list(inspect.signature(_log_signature).parameters)[3:]


@contextmanager
def _silenced_log(module: nn.Module) -> Iterator[None]:
    with patched_log(module, lambda *args, **kwargs: None):
        yield


@contextmanager
def patched_log(module: nn.Module, log: Callable[..., None]) -> Iterator[None]:
    with instance_attribute(module, "log", log):
        yield


@contextmanager
def instance_attribute(module: nn.Module, name: str, value: Any) -> Iterator[None]:
    """Shadow the method ``name`` of ``module`` by an instance attribute for the duration."""
    table = module.__dict__
    missing = object()
    saved = table.get(name, missing)
    table[name] = value
    try:
        yield
    finally:
        if saved is missing:
            del table[name]
        else:
            table[name] = saved
