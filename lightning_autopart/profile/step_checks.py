"""What a training step does that micro-batches would change, found before planning.

The pipeline runs ``training_step`` (and the evaluation steps) once per micro-batch, divides each micro-batch's
loss by their count and merges what each logged. That is plain Lightning's step where the step treats its
samples apart and averages them. This module checks the user's step against that, on stand-ins for the model's
output: where it mixes samples ([Note: sample flow] in capture/sample_flow.py), where its loss or a value it logs
transforms a statistic of the batch ([Note: statistics transformed] there), where its loss is not a mean
(below), and how each value it logs combines over samples ([Note: logged values over micro-batches]).

[Note: a loss that grows] The pipeline computes the loss of each micro-batch and divides it by the micro-batch
count, as Lightning's gradient accumulation divides each batch's: the total is the batch's loss where the loss
is a mean over samples. A sum (``F.mse_loss(..., reduction="sum")``, a VAE's summed reconstruction and KL terms)
came out scaled by 1 / micro_batches, gradients and logged loss alike (a step of 4 micro-batches logged 45.2
where plain Lightning logged 180.6, and trained otherwise). :func:`loss_growth` runs the step on one sample and
on that sample repeated twice (random outputs, the batch's first sample): a mean gives the same loss, a sum
twice it. A sum is planned as "loss_reduction": "sum", and each micro-batch's loss is then added, not averaged
(``PipelinedSteps.train``), its logged value summed ([Note: logged values over micro-batches]): the batch's
sum, as plain Lightning's step computes it (with replicas, their mean, as DDP averages them). A loss that grows
otherwise (a sum plus a constant) is planned with one micro-batch per replica, as samples that mix are, and
more micro-batches are refused with the fix (``partition/build.py``). A loss computed inside the model's
forward (a Hugging Face model given labels) is not run here.

[Note: logged values over micro-batches] The values a step logs are merged over its micro-batches: a mean of
means is the batch's mean, but a sum (tokens seen), a maximum or a minimum (the largest logit) is not. The step
is run on two samples apart and together (random outputs); a value that comes out as their sum, their maximum
or their minimum, and not their mean, is merged so (``log_combines`` in the profile, ``combine`` in
``merge_logs``). A value that is none of these (a mean weighted by tokens) is averaged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from lightning_autopart.capture.sample_flow import RecordOps, Trace, TracedFlow, trace_flow
from lightning_autopart.profile.loss import LossFn, _drop_slice

__all__ = ["log_combines", "loss_findings", "loss_growth", "step_flow"]

#: The name :func:`step_flow` gives the value a step returns, among those it logs ("logged: name"); and the
#: names the runs give the numbers a step returns beside its loss, among those it logs ("returned: key").
RETURNED, LOGGED, OTHER = "returned", "logged: ", "returned: "


def loss_findings(loss: LossFn, outputs: dict[int, Any], limit: int) -> dict[str, Any]:
    """What the training step does that micro-batches would change, as profile notes: "batch_mixing" (where it,
    or an evaluation step the loss offers as ``evaluation_steps()``, mixes samples: :func:`step_flow`),
    "loss_transformed" (where its loss transforms a statistic of the batch: [Note: statistics transformed] in
    capture/sample_flow.py), "loss_reduction" ("sum": a loss that sums its samples), "loss_growth" (a loss that
    neither averages nor sums them: :func:`loss_growth`), "log_combines" (:func:`log_combines`),
    "log_transformed" (logged values that transform a statistic, by name: where) and "output_combines" (how
    the numbers ``training_step`` returns beside its loss combine, as logged values do); empty for a step that
    averages its samples apart and logs and returns means."""
    found: dict[str, Any] = {}
    evaluation: list[LossFn] = getattr(loss, "evaluation_steps", list)()  # they run per micro-batch as well
    flows = [step_flow(step, outputs, limit) for step in (loss, *evaluation)]
    if mixed := [place for flow in flows for place in flow.mixed]:
        return {"batch_mixing": mixed}
    runs = _sample_runs(loss, outputs)
    if RETURNED in flows[0].transformed:  # not a mean of its micro-batches' losses, whatever it grows by
        found["loss_transformed"] = flows[0].transformed[RETURNED]
    elif (growth := _growth(runs)) is not None and abs(growth - 2) <= _TOLERANCE:
        found["loss_reduction"] = "sum"  # each micro-batch's loss is added, not averaged
    elif growth is not None:
        found["loss_growth"] = growth
    combines: dict[str, str] = {}
    for step in evaluation:
        combines.update(_combines(_sample_runs(step, outputs)))
    combines.update(_combines(runs))  # the training step's, where a name is logged by several steps
    if others := {k[len(OTHER) :]: v for k, v in combines.items() if k.startswith(OTHER)}:
        found["output_combines"] = others  # numbers training_step returns beside its loss
    if combines := {k: v for k, v in combines.items() if not k.startswith(OTHER)}:
        found["log_combines"] = dict(sorted(combines.items()))
    logs = {k[len(LOGGED) :]: v for flow in flows for k, v in flow.transformed.items() if k.startswith(LOGGED)}
    if logs := {k: v for k, v in logs.items() if k not in combines}:  # a maximum or a sum is merged as one
        found["log_transformed"] = dict(sorted(logs.items()))
    return found


def step_flow(loss: LossFn, outputs: dict[int, Any], limit: int) -> TracedFlow:
    """Where the training loss mixes samples (a contrastive loss's ``(batch, batch)`` scores, a normalization
    over the batch; see [Note: sample flow] in capture/sample_flow.py), as "training_step: operation (shape)",
    and whether the value it returns (:data:`RETURNED`) or logs (:data:`LOGGED`) transforms a statistic of the
    batch: ``loss`` traced at the two smallest sizes of ``outputs`` (the model's output by batch size) up to
    ``limit``, on fake tensors (no memory) on the batch's device, inside ``loss.tracing()`` where the loss has
    one (the strategy's: torchmetrics updates skipped). Nothing where it cannot tell: fewer than two sizes, or a
    loss that needs values (``.item()``) or does not trace alike at both."""
    usable = sorted(n for n in outputs if n <= limit)
    above_one = [n for n in usable if n > 1]
    sizes = above_one[:2] if len(above_one) > 1 else usable[:2]
    if len(sizes) < 2:
        return TracedFlow()
    device = _batch_device(loss)
    traces = []
    tracing = getattr(loss, "tracing", nullcontext)  # the strategy's step skips its metrics' updates there
    try:
        for n in sizes:
            trace = Trace()
            with tracing(), FakeTensorMode(allow_non_fake_inputs=True):
                fake = tree_map(lambda t: _fake_like(t, device), outputs[n])
                with RecordOps(trace):
                    value = loss(fake, n)
                logged = getattr(loss, "logged", {})  # read inside: the strategy's loss forgets them after
                trace.named = {LOGGED + k: v for k, v in logged.items() if isinstance(v, torch.Tensor)}
            if isinstance(value, torch.Tensor):
                trace.named[RETURNED] = value
            traces.append(trace)
    except Exception:  # user code that needs values: nothing can be told
        return TracedFlow()
    finally:
        _drop_slice(loss)
    return trace_flow(traces[0], traces[1], getattr(loss, "hook", "training_step")) or TracedFlow()


def _fake_like(t: Any, device: torch.device) -> Any:
    """An empty tensor of ``t``'s shape and dtype on ``device`` (inside a fake mode: no memory), needing a
    gradient where it is floating, as the model's output does; other leaves as they are."""
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=device).requires_grad_(t.is_floating_point())


#: How far from 1 the growth of a loss that averages its samples may be (rounding, in bfloat16 too); also how
#: near a logged value must come to a sum, maximum or minimum of two samples' to be merged so.
_TOLERANCE = 0.02

#: Largest random outputs (for two samples) the runs below put on a device.
_DEVICE_BYTES = 1 << 28

#: The batch rows each run takes: the first sample, it repeated, the second, the first two together.
_ROWS: tuple[tuple[int, ...], ...] = ((0,), (0, 0), (1,), (0, 1))

#: A run's result: the loss, and each number the step logged (by name).
Run = tuple[float, dict[str, float]]


def loss_growth(loss: LossFn, outputs: dict[int, Any]) -> float | None:
    """How the training loss grows with its samples where it is not a mean over them (see [Note: a loss that
    grows]): its value on one sample repeated twice over its value on that sample once (2 for a sum; a mean
    gives 1, and None). None also where it cannot tell (see :func:`_sample_runs`, or a loss of zero)."""
    return _growth(_sample_runs(loss, outputs))


def log_combines(loss: LossFn, outputs: dict[int, Any]) -> dict[str, str]:
    """How each number the step logs combines over samples where it is not a mean ([Note: logged values over
    micro-batches]): "sum", "max" or "min", by name."""
    return _combines(_sample_runs(loss, outputs))


def _growth(runs: dict[tuple[int, ...], Run] | None) -> float | None:
    if runs is None or (0,) not in runs or (0, 0) not in runs:
        return None
    once, twice = runs[(0,)][0], runs[(0, 0)][0]
    if not (math.isfinite(once) and math.isfinite(twice)) or abs(once) < 1e-12:
        return None
    growth = twice / once
    return None if abs(growth - 1) <= _TOLERANCE else growth


def _combines(runs: dict[tuple[int, ...], Run] | None) -> dict[str, str]:
    if runs is None or (0, 1) not in runs:
        return {}
    logs = [runs[r][1] for r in ((0,), (1,), (0, 1))]
    found = {}
    for name in set(logs[0]) & set(logs[1]) & set(logs[2]):
        a, b, both = (log[name] for log in logs)
        candidates = {"mean": (a + b) / 2, "sum": a + b, "max": max(a, b), "min": min(a, b)}
        near = [how for how, v in candidates.items() if abs(both - v) <= _TOLERANCE * max(abs(both), abs(v), 1e-6)]
        if near and near[0] != "mean":  # the mean first: two equal values are a mean, a maximum and a minimum
            found[name] = near[0]
    return dict(sorted(found.items()))


def _sample_runs(loss: LossFn, outputs: dict[int, Any]) -> dict[tuple[int, ...], Run] | None:
    """The step run on each of :data:`_ROWS` (``loss.rows(indices)``: the loss over those rows of its batch;
    the second sample's only where the batch has two), on random outputs for each sample (their shapes from
    the two smallest sizes of ``outputs``): on the CPU (no device memory while the model may fill it), else
    on the batch's device where the outputs are small. None where it cannot tell: a loss without ``rows``,
    fewer than two sizes, an output with two dimensions that follow the batch, or a step that fails."""
    rows = getattr(loss, "rows", None)
    sizes = sorted(outputs)[:2]
    if not callable(rows) or len(sizes) < 2:
        return None
    shapes = _one_sample(outputs[sizes[0]], outputs[sizes[1]], *sizes)
    if shapes is None:
        return None
    wanted: list[tuple[int, ...]] = [r for r in _ROWS if max(r) < getattr(loss, "batch_size", 1)]
    devices = [torch.device("cpu")]
    home = _batch_device(loss)
    if home.type != "cpu" and 2 * _nbytes(outputs[sizes[0]]) // sizes[0] <= _DEVICE_BYTES:
        devices.append(home)  # a step that makes its tensors on self.device runs there
    for device in devices:
        runs = _run(rows, wanted, *shapes, device)
        if runs is not None:
            return runs
    return None


def _batch_device(loss: LossFn) -> torch.device:
    """The device of the batch ``loss`` carries (the strategy's step loss holds one), else the CPU."""
    batch = [t for t in tree_leaves(getattr(loss, "batch", None)) if isinstance(t, torch.Tensor)]
    return batch[0].device if batch else torch.device("cpu")


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def _one_sample(x_tree: Any, y_tree: Any, a: int, b: int) -> tuple[list[Any], Any, list[int | None]] | None:
    """The leaves of the model's output for one sample (as shape and dtype), its structure, and each leaf's
    dimension that follows the batch (None: none), from the outputs at ``a`` and ``b`` samples; None where a
    leaf has two such dimensions, or one not proportional to the batch, or where a floating leaf has none (a
    loss the forward computes over the whole batch: what it is for some samples cannot be made up)."""
    leaves, spec = tree_flatten(x_tree)
    one: list[Any] = []
    dims: list[int | None] = []
    for x, y in zip(leaves, tree_leaves(y_tree), strict=True):
        if not isinstance(x, torch.Tensor):
            one.append(x)
            dims.append(None)
            continue
        if not isinstance(y, torch.Tensor) or x.dim() != y.dim():
            return None
        follow = [d for d in range(x.dim()) if x.shape[d] != y.shape[d]]
        per = [(y.shape[d] - x.shape[d]) // (b - a) for d in follow]
        if len(follow) > 1 or any(x.shape[d] != n * a for d, n in zip(follow, per, strict=True)):
            return None  # mixed samples, or a size not proportional to the batch: nothing to repeat
        if not follow and x.is_floating_point():
            return None  # a value of the whole batch (a loss the forward computes): no sample's own
        one.append((tuple(per[0] if d in follow else n for d, n in enumerate(x.shape)), x.dtype))
        dims.append(follow[0] if follow else None)
    return one, spec, dims


def _run(
    rows: Callable[[list[int]], LossFn],
    wanted: list[tuple[int, ...]],
    one: list[Any],
    spec: Any,
    dims: list[int | None],
    device: torch.device,
) -> dict[tuple[int, ...], Run] | None:
    """The step on each rows of ``wanted``, its outputs the random ones of those samples (``one``: shapes and
    dtypes for one sample, drawn once per sample) on ``device``, the same random draws in the step at each;
    None where the step fails there."""
    samples: dict[int, list[Any]] = {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(1)  # the same stand-ins at every plan, and no draw taken from the user's generator
        for index in sorted({i for r in wanted for i in r}):
            samples[index] = [_random(leaf, device) for leaf in one]
    runs = {}
    try:
        for indices in wanted:
            leaves = []
            for k, dim in enumerate(dims):
                parts = [samples[i][k] for i in indices]
                leaves.append(parts[0] if dim is None else torch.cat(parts, dim))
            step = rows(list(indices))
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
                torch.manual_seed(0)
                value = float(step(tree_unflatten(leaves, spec), len(indices)))
            logged = {k: float(v) for k, v in getattr(step, "logged", {}).items()}
            returned = getattr(step, "returned", {}).items()
            logged |= {OTHER + k: float(v) for k, v in returned if isinstance(v, (int, float)) or _scalar(v)}
            runs[indices] = (value, logged)
    except Exception:  # user code that cannot run here
        return None
    return runs


def _scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_meta


def _random(leaf: Any, device: torch.device) -> Any:
    """A random tensor of ``leaf``'s shape and dtype (integers: zeros) on ``device``; another leaf as it is."""
    if not isinstance(leaf, tuple):
        return leaf
    shape, dtype = leaf
    if dtype.is_floating_point:
        return torch.randn(shape, device=device).to(dtype)
    return torch.zeros(shape, dtype=dtype, device=device)
