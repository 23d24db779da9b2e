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
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

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
