"""The loss a training step computes from the model's output, profiled like a block: it runs on the last stage.

[Note: the loss] ``training_step`` turns the model's output into a loss: a cross entropy over a GPT's logits
reads 8 x 1024 x 50257 floats, saves its log-softmax for backward and allocates a gradient as large as the
logits. That work runs on the last stage, once per micro-batch, so the profiler prices it like a block and
adds it to the model's last block: its forward and backward time, the bytes it saves and its transient peak.
The caller gives the loss as a function of the model's output (the strategy: the user's ``training_step`` with
the model's forward replaced by that output, on the matching slice of the batch). That slice is a view of the
batch on the output's device, placed there before the meters run (``place``) and held through the timed
runs: the last stage reads the batch it holds, and a copy of it (a CPU batch for estimate mode's meta outputs)
is not the loss's memory or time. The profile drops the placed batch when it returns or raises. A loss that
cannot run on a profiling copy (user code that reads values on meta tensors, say) is left unpriced, and the
profile says why.

[Note: a loss that grows] The pipeline computes the loss of each micro-batch and divides it by the micro-batch
count, as Lightning's gradient accumulation divides each batch's: the total is the batch's loss where the loss
is a mean over samples. A sum (``F.mse_loss(..., reduction="sum")``, a VAE's summed reconstruction and KL terms)
would come out scaled by 1 / micro_batches, gradients and logged loss alike (a step of 4 micro-batches logged
45.2 where plain Lightning logged 180.6, and trained otherwise). :func:`loss_growth` runs the step on one sample
and on that sample repeated twice (random outputs, the batch's first sample): a mean gives the same loss, a sum
twice it. A loss that does not give the same is planned with one micro-batch per replica, as samples that mix
are, and more micro-batches are refused with the fix (``partition/build.py``). A loss computed inside the
model's forward (a Hugging Face model given labels) is not run here.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from lightning_autopart.capture.sample_flow import RecordOps, Trace, trace_flow
from lightning_autopart.profile.autocast_meta import MetaAutocast
from lightning_autopart.profile.opcount import OpCounter, Roofline
from lightning_autopart.profile.precision import lightning_autocast
from lightning_autopart.profile.records import ModelProfile
from lightning_autopart.profile.saved import SavedTensorMeter
from lightning_autopart.profile.transient import AllocationMeter

__all__ = [
    "LossCost",
    "LossFn",
    "batch_bytes",
    "loss_context",
    "loss_findings",
    "loss_growth",
    "loss_mixing",
    "profile_loss",
]

#: ``loss(output, samples)``: the training loss of ``samples`` samples given the model's output for them.
LossFn = Callable[[Any, int], torch.Tensor]


@dataclass(frozen=True, slots=True)
class LossCost:
    """The loss at one batch size: forward and backward time, bytes saved for backward, transient peak, and the
    bytes of the model's output it saves (the rest of the output is freed: [Note: the last stage's outputs] in
    runtime/outputs.py)."""

    fwd_us: float
    bwd_us: float
    saved_bytes: int
    transient_bytes: int
    output_saved_bytes: int = 0


def _leaf_outputs(output: Any) -> Any:
    """A detached copy of every floating tensor of ``output`` that needs a gradient (the loss's inputs)."""
    def leaf(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.detach().requires_grad_(True)
        return t

    return tree_map(leaf, output)


def profile_loss(
    loss: LossFn,
    output: Any,
    samples: int,
    *,
    roofline: Roofline | None = None,
    warmup: int = 1,
    repeats: int = 3,
    context: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> LossCost:
    """Time (or, with ``roofline`` on meta tensors, price) the loss of ``samples`` samples from ``output``, its
    forward under ``context`` (a "-mixed" step's autocast: :func:`loss_context`).

    Raises whatever the user's loss code raises; :func:`lightning_autopart.planner.profile_model` catches it.
    """
    device = next((t.device for t in tree_leaves(output) if isinstance(t, torch.Tensor)), torch.device("cpu"))

    def run(counter: OpCounter | None = None, forward_done: Callable[[], None] = _nothing) -> tuple[float, float, Any]:
        leaves = _leaf_outputs(output)
        grads = [t for t in tree_leaves(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if counter is not None:
            counter.phase = "fwd"
        t0 = _now(device)
        with context():
            value = loss(leaves, samples)
        t1 = _now(device)
        forward_done()
        if counter is not None:
            counter.phase = "bwd"
        if value.requires_grad:
            torch.autograd.backward(value, inputs=grads)
        t2 = _now(device)
        if counter is not None:
            counter.phase = None
        return t1 - t0, t2 - t1, value

    state = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
    place = getattr(loss, "place", None)
    try:
        if callable(place):  # the batch on the output's device before the meters: the stage holds it there
            place(device)
        meter = SavedTensorMeter()
        allocations = AllocationMeter()
        counter = OpCounter(roofline)
        made: set[int] = set()  # the saves the loss allocated ([Note: a block's own memory] in transient.py)
        with counter, allocations, meter.hooks():
            run(counter, lambda: made.update(allocations.owned(meter.keys())))
        # The batch's slice the loss read (its targets) is the batch every rank holds anyway ([Note:
        # pipeline buffers] in partition/cost.py): what the loss saves of it is not the loss's own memory.
        # What it saves of the model's output is told apart: the last block may save the same tensor
        # (curves.add_loss).
        of_output = meter.nbytes_of(state)
        saved = meter.nbytes - of_output - meter.nbytes_of(tree_leaves(getattr(loss, "sliced", ())))
        _drop_slice(loss)
        transient = max(0, allocations.peak - meter.nbytes_of_keys(made))
        if roofline is not None:  # an estimate: the counter's roofline prices every op
            fwd_us, bwd_us = counter.counts["fwd"].time_us, counter.counts["bwd"].time_us
            return LossCost(fwd_us, bwd_us, saved, transient, of_output)
        fwd, bwd = [], []
        for i in range(warmup + repeats):  # the batch stays placed: no run copies it to the device
            f, b, _ = run()
            if i >= warmup:
                fwd.append(f * 1e6)
                bwd.append(b * 1e6)
        return LossCost(statistics.median(fwd), statistics.median(bwd), saved, transient, of_output)
    finally:  # no profile leaves a device copy of the batch behind, returning or raising
        _drop_slice(loss)
        if callable(place):
            place(None)


def loss_context(prof: ModelProfile, estimate: bool) -> Callable[[], AbstractContextManager[Any]]:
    """The autocast a "-mixed" step runs its loss under, as ``prof``'s blocks ran: on meta, the estimate's
    (:class:`MetaAutocast`, of the device priced); on a device, torch's with Lightning's settings (no cast
    cache). Nothing for other precisions."""
    kernels = prof.meta.get("autocast")
    if kernels is None:
        return nullcontext
    dtype = getattr(torch, prof.meta["compute_dtype"])
    if estimate:
        return lambda: MetaAutocast(dtype, kernels)
    return lightning_autocast(kernels, dtype)


def _nothing() -> None:
    """No hook between a run's forward and its backward."""


def _drop_slice(loss: object) -> None:
    """Forget the batch slice a step loss keeps from its last call (not the batch it placed on the device)."""
    if hasattr(loss, "sliced"):
        loss.sliced = ()


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def batch_bytes(loss: object, dtype: torch.dtype | None = None) -> float | None:
    """Bytes per sample of the batch ``loss`` computes from (its ``batch`` of ``batch_size`` samples, as the
    strategy's and the CLI's step losses carry it), floating tensors in ``dtype`` where a "-true" precision
    converts them; every rank of a pipeline holds its replica's whole batch on the device through the step
    ([Note: pipeline buffers] in partition/cost.py). None where the loss carries no batch."""
    batch, size = getattr(loss, "batch", None), getattr(loss, "batch_size", None)
    if batch is None or not isinstance(size, int) or size < 1:
        return None
    total = 0
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor):
            itemsize = dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size()
            total += t.numel() * itemsize
    return total / size


def loss_findings(loss: LossFn, outputs: dict[int, Any], limit: int) -> dict[str, Any]:
    """What the training loss does that micro-batches would change, as profile notes: "batch_mixing" (where it,
    or an evaluation step the loss offers as ``evaluation_steps()``, mixes samples: :func:`loss_mixing`) or
    "loss_growth" (:func:`loss_growth`); empty for a mean over samples that mixes none."""
    mixed = list(loss_mixing(loss, outputs, limit))
    for step in getattr(loss, "evaluation_steps", list)():  # they run per micro-batch as well
        mixed += loss_mixing(step, outputs, limit)
    if mixed:
        return {"batch_mixing": mixed}
    growth = loss_growth(loss, outputs)
    return {} if growth is None else {"loss_growth": growth}


def loss_mixing(loss: LossFn, outputs: dict[int, Any], limit: int) -> tuple[str, ...]:
    """Where the training loss mixes samples (a contrastive loss's ``(batch, batch)`` scores, a normalization
    over the batch; see [Note: sample flow] in capture/sample_flow.py), as "training_step: operation (shape)":
    ``loss`` traced at the two smallest sizes of ``outputs`` (the model's output by batch size) up to ``limit``,
    on fake tensors (no memory) on the batch's device, inside ``loss.tracing()`` where the loss has one (the
    strategy's: torchmetrics updates skipped). Nothing where it cannot tell: fewer than two sizes, or a loss that
    needs values (``.item()``) or does not trace alike at both."""
    sizes = sorted(n for n in outputs if n <= limit)
    sizes = [n for n in sizes if n > 1][:2] if len([n for n in sizes if n > 1]) > 1 else sizes[:2]
    if len(sizes) < 2:
        return ()
    batch = [t for t in tree_leaves(getattr(loss, "batch", None)) if isinstance(t, torch.Tensor)]
    device = batch[0].device if batch else torch.device("cpu")
    traces = []
    tracing = getattr(loss, "tracing", nullcontext)  # the strategy's step skips its metrics' updates there
    try:
        for n in sizes:
            trace = Trace()
            with tracing(), FakeTensorMode(allow_non_fake_inputs=True):
                fake = tree_map(lambda t: _fake_like(t, device), outputs[n])
                with RecordOps(trace):
                    loss(fake, n)
            traces.append(trace)
    except Exception:  # user code that needs values: nothing can be told
        return ()
    finally:
        _drop_slice(loss)
    return trace_flow(traces[0], traces[1], getattr(loss, "hook", "training_step")) or ()


def _fake_like(t: Any, device: torch.device) -> Any:
    """An empty tensor of ``t``'s shape and dtype on ``device`` (inside a fake mode: no memory), needing a
    gradient where it is floating, as the model's output does; other leaves as they are."""
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=device).requires_grad_(t.is_floating_point())


#: How far from 1 the growth of a loss that averages its samples may be (rounding, in bfloat16 too).
_MEAN_TOLERANCE = 0.02


def loss_growth(loss: LossFn, outputs: dict[int, Any]) -> float | None:
    """How the training loss grows with its samples where it is not a mean over them (see [Note: a loss that
    grows]): its value on one sample repeated twice over its value on that sample once (2 for a sum; a mean
    gives 1, and None). Computed with ``loss.repeated(copies)`` (the loss over the batch's first sample
    repeated) on random outputs for that sample, their shapes from the two smallest sizes of ``outputs``: on the
    CPU (no device memory while the model may fill it), else on the batch's device where they are small. None
    where it cannot tell: a loss without ``repeated``, fewer than two sizes, an output with two dimensions that
    follow the batch, a loss of zero, or one that fails."""
    repeated = getattr(loss, "repeated", None)
    sizes = sorted(outputs)[:2]
    if not callable(repeated) or len(sizes) < 2:
        return None
    shapes = _one_sample(outputs[sizes[0]], outputs[sizes[1]], *sizes)
    if shapes is None:
        return None
    batch = [t for t in tree_leaves(getattr(loss, "batch", None)) if isinstance(t, torch.Tensor)]
    devices = [torch.device("cpu")]
    if batch and batch[0].device.type != "cpu" and 2 * _nbytes(outputs[sizes[0]]) // sizes[0] <= _DEVICE_BYTES:
        devices.append(batch[0].device)  # a step that makes its tensors on self.device runs there
    for device in devices:
        values = _repeated_values(repeated, *shapes, device)
        if values is not None:
            break
    if values is None or not all(map(math.isfinite, values)) or abs(values[0]) < 1e-12:
        return None
    growth = values[1] / values[0]
    return None if abs(growth - 1) <= _MEAN_TOLERANCE else growth


#: Largest random outputs (for two samples) :func:`loss_growth` puts on a device.
_DEVICE_BYTES = 1 << 28


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def _one_sample(x_tree: Any, y_tree: Any, a: int, b: int) -> tuple[list[Any], Any, list[int | None]] | None:
    """The leaves of the model's output for one sample (as shape and dtype), its structure, and each leaf's
    dimension that follows the batch (None: none), from the outputs at ``a`` and ``b`` samples; None where a
    leaf has two such dimensions, or one not proportional to the batch."""
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
        one.append((tuple(per[0] if d in follow else n for d, n in enumerate(x.shape)), x.dtype))
        dims.append(follow[0] if follow else None)
    return one, spec, dims


def _repeated_values(
    repeated: Callable[[int], LossFn], one: list[Any], spec: Any, dims: list[int | None], device: torch.device
) -> list[float] | None:
    """The loss on random outputs ``one`` for one sample on ``device``, then on them repeated twice (the same
    random draws in the loss at both); None where the loss fails there."""
    once, twice = [], []
    for leaf, dim in zip(one, dims, strict=True):
        if not isinstance(leaf, tuple):
            once.append(leaf)
            twice.append(leaf)
            continue
        shape, dtype = leaf
        if dtype.is_floating_point:
            t = torch.randn(shape, device=device).to(dtype)
        else:
            t = torch.zeros(shape, dtype=dtype, device=device)
        once.append(t)
        twice.append(t if dim is None else torch.cat([t, t], dim))
    values = []
    try:
        for copies, out in ((1, once), (2, twice)):
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
                torch.manual_seed(0)
                values.append(float(repeated(copies)(tree_unflatten(out, spec), copies)))
    except Exception:  # user code that cannot run here
        return None
    return values
