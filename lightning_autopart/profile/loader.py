"""The training loader's cost: how long a batch takes to make on the host, timed on the loader's own dataset.

[Note: loader time]
A step is the batch's fetch as well as its math. With ``num_workers=0`` the training process makes each batch
itself (``dataset[i]`` for every sample, then ``collate_fn``), and where the loop reads a value back once a
step (the progress bar shows ``self.log(..., prog_bar=True)``), the next batch's fetch starts only when the
device is idle, so the device waits for it ([Note: reads back] in ``readback.py``). Issue 9's rows were
measured that way: the tutorial ``Net(5000, 24)`` at batch 512 took 95.6 ms a step on an H100 where its math
takes 50.6 ms, and the examples' loader makes 512 such samples in 45-49 ms on one core; GPT's token batches cost 0.2 ms and its step matched.
With ``W`` workers, batches are made by other processes, ``W`` at a time: a step takes at least one batch's
time over ``W``.

:func:`time_loader` makes batches as the loader would, from the dataset and collate function it holds, at
indices ``0, 1, ...`` (the sampler is not touched, so shuffling draws the same order in training). torch's,
Python's and NumPy's global generators are restored afterwards: a dataset that draws augmentations from them
leaves training's draws unchanged. A batch counts its wall time (reads from disk wait, and count) less the time
its thread waited for a core (Linux's ``/proc/thread-self/schedstat``), and the quickest batch counts: other
work on the machine while the plan is made stretches the wall clock, not the batch (tests running beside it
made the examples' image batches take 9x longer), and a first, cold batch is no typical one. An iterable
dataset cannot be read without consuming it, so it is not timed (None), nor is a dataset whose first sample
fails to load: the error is training's to report, at the sample training reads. The cost model adds
``fetch_us(samples)`` per step with no workers where the loop reads a device value back every step (see
[Note: reads back] in ``readback.py``; otherwise the fetch overlaps the device's work), or bounds the step
below by ``fetch_us(samples) / workers`` ([Note: loader in the step] in ``partition/cost.py``).
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from lightning_autopart.profile.records import ModelProfile

__all__ = ["LoaderCost", "generators_kept", "time_loader", "with_loader"]

#: Samples per timed batch at most, and how long timing may take before it stops at two batches.
_MAX_SAMPLES, _BUDGET_S = 4096, 2.0


@dataclass(frozen=True)
class LoaderCost:
    """Host time to make one batch, per sample (``dataset[i]`` plus its share of ``collate_fn``)."""

    sample_us: float
    #: The loader's worker processes (0: the training process makes each batch).
    workers: int
    #: Samples per timed batch, and batches timed.
    samples: int
    batches: int
    #: Steps between two reads of a device value by the training loop (0: never; 1: every step, the default
    #: where unknown): whether the fetch overlaps the device's work ([Note: reads back] in ``readback.py``).
    readback_every: int = 1

    def fetch_us(self, samples: int) -> float:
        """Time to make a batch of ``samples`` on one process."""
        return self.sample_us * samples

    def as_meta(self) -> dict[str, Any]:
        """The profile's ``meta["loader"]`` entry (plain JSON numbers)."""
        return {
            "sample_us": self.sample_us,
            "workers": self.workers,
            "samples": self.samples,
            "batches": self.batches,
            "readback_every": self.readback_every,
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None) -> LoaderCost | None:
        """The cost a profile's ``meta["loader"]`` records; None where the loader was not timed."""
        if not meta:
            return None
        return cls(
            float(meta["sample_us"]),
            int(meta["workers"]),
            int(meta["samples"]),
            int(meta["batches"]),
            int(meta.get("readback_every", 1)),
        )


@contextmanager
def generators_kept() -> Iterator[None]:
    """Restore torch's (CPU), Python's and NumPy's global generators on exit: what runs inside draws nothing
    that training would see."""
    py = random.getstate()
    numpy = sys.modules.get("numpy")
    np_state = numpy.random.get_state() if numpy is not None else None
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py)
            if numpy is not None:
                numpy.random.set_state(np_state)


def _queued_s() -> float:
    """Seconds this thread has waited for a core so far (0 where the kernel does not say)."""
    try:
        with open("/proc/thread-self/schedstat", encoding="ascii") as stats:
            return int(stats.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def time_loader(loader: Any, samples: int, batches: int = 5) -> LoaderCost | None:
    """Time ``batches`` batches of ``samples`` samples made from ``loader``'s dataset and collate function, as its
    training process (or each worker) makes them ([Note: loader time]); None for a loader that is not a
    map-style ``DataLoader`` with automatic batching, or whose dataset is empty."""
    dataset = getattr(loader, "dataset", None)
    collate = getattr(loader, "collate_fn", None)
    if (
        not isinstance(loader, torch.utils.data.DataLoader)
        or isinstance(dataset, torch.utils.data.IterableDataset)
        or loader.batch_size is None
        or collate is None
    ):
        return None
    try:
        size = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
    if dataset is None or size == 0:
        return None
    samples = max(1, min(samples, size, _MAX_SAMPLES))
    times: list[float] = []
    start = 0
    with generators_kept():
        begun = time.perf_counter()
        for _ in range(max(1, batches)):
            indices = [(start + i) % size for i in range(samples)]
            start += samples
            t0, q0 = time.perf_counter(), _queued_s()
            try:  # as DataLoader's fetcher does: a batched read where the dataset has one
                getitems = getattr(dataset, "__getitems__", None)
                collate(getitems(indices) if getitems else [dataset[i] for i in indices])
            except Exception:  # a sample training may never read, or reads later: its error belongs there
                break
            q1 = _queued_s()  # before the clock: a wait between the two reads then counts as the batch's time,
            t1 = time.perf_counter()  # where the other order would take it off a batch that never waited
            times.append(max(0.0, t1 - t0 - (q1 - q0)))
            if len(times) >= 2 and time.perf_counter() - begun > _BUDGET_S:
                break
    if not times:
        return None
    return LoaderCost(min(times) * 1e6 / samples, int(loader.num_workers), samples, len(times))


def with_loader(profile: ModelProfile, cost: LoaderCost | None) -> ModelProfile:
    """``profile`` with the training loader's cost in ``meta["loader"]``, where the planner prices it."""
    if cost is None:
        return profile
    return dataclasses.replace(profile, meta={**profile.meta, "loader": cost.as_meta()})
