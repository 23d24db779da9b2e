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
Python's and NumPy's global generators are restored afterwards, and so are the generators the dataset, the
loader and its samplers hold (:func:`read_aside`): a dataset that draws augmentations from either leaves
training's draws unchanged. A batch counts its wall time (reads from disk wait, and count) less the time
its thread waited for a core (Linux's ``/proc/thread-self/schedstat``), and the quickest batch counts: other
work on the machine while the plan is made stretches the wall clock, not the batch (tests running beside it
made the examples' image batches take 9x longer), and a first, cold batch is no typical one. An iterable
dataset is read from a fresh iterator of its own, as each epoch reads it; its attributes are put back
afterwards (a dataset that records its position on itself, as Hugging Face's ``IterableDataset`` does, still
reports training's). One whose ``iter()`` gives back the same iterator each time is a single stream: reading
it aside would take training's samples, so it is not timed (None). Nor is a dataset whose first sample fails
to load: the error is training's to report, at the sample training reads. Where the loader has no automatic
batching (``batch_size=None`` and no ``batch_sampler``), each item is a whole batch of the step's samples.
The cost model adds ``fetch_us(samples)`` per step with no workers where the loop reads a device value back
every step (see [Note: reads back] in ``readback.py``; otherwise the fetch overlaps the device's work), or bounds the step
below by ``fetch_us(samples) / workers`` ([Note: loader in the step] in ``partition/cost.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from lightning_autopart.capture.host_random import generator_state, held_generators, set_generator_state
from lightning_autopart.profile.records import ModelProfile

__all__ = ["LoaderCost", "generators_kept", "read_aside", "single_stream", "time_loader", "with_loader"]

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
def generators_kept(*owners: Any) -> Iterator[None]:
    """Restore torch's (CPU), Python's and NumPy's global generators on exit, and the generators that ``owners``
    hold as attributes (a dataset's own ``torch.Generator``, ``random.Random`` or NumPy generator): what runs
    inside draws nothing that training would see."""
    py = random.getstate()
    numpy = sys.modules.get("numpy")
    np_state = numpy.random.get_state() if numpy is not None else None
    own = [(gen, generator_state(gen)) for owner in owners for gen in held_generators(owner)]
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py)
            if numpy is not None:
                numpy.random.set_state(np_state)
            for gen, state in own:
                set_generator_state(gen, state)


@contextmanager
def _attributes_kept(dataset: Any) -> Iterator[None]:
    """Put ``dataset``'s attributes back as they were on exit: an iterable dataset whose ``__iter__`` records its
    position on itself (Hugging Face's ``IterableDataset`` keeps its resumable state so) then still reports
    training's iterator, not the one timed aside."""
    attributes = getattr(dataset, "__dict__", None)
    before = dict(attributes) if isinstance(attributes, dict) else None
    try:
        yield
    finally:
        if before is not None and attributes is not None:
            attributes.clear()
            attributes.update(before)


def _queued_s() -> float:
    """Seconds this thread has waited for a core so far (0 where the kernel does not say)."""
    try:
        with open("/proc/thread-self/schedstat", encoding="ascii") as stats:
            return int(stats.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _close(iterator: Any) -> None:
    """Close a generator timed aside (its files and buffers go now, not at garbage collection)."""
    close = getattr(iterator, "close", None)
    if callable(close):
        close()


def time_loader(loader: Any, samples: int, batches: int = 5) -> LoaderCost | None:
    """Time ``batches`` batches of ``samples`` samples made from ``loader``'s dataset and collate function, as its
    training process (or each worker) makes them ([Note: loader time]); None for anything but a ``DataLoader``,
    for an empty dataset, and for a stream that cannot be read aside."""
    dataset = getattr(loader, "dataset", None)
    collate = getattr(loader, "collate_fn", None)
    if not isinstance(loader, torch.utils.data.DataLoader) or dataset is None or collate is None:
        return None
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return _time_stream(loader, dataset, samples, batches)
    # without automatic batching (no batch sampler), each item the dataset gives is a whole batch of ``samples``
    whole = loader.batch_sampler is None
    try:
        size = len(dataset)
    except TypeError:
        return None
    if size == 0:
        return None
    samples = max(1, min(samples, _MAX_SAMPLES) if whole else min(samples, size, _MAX_SAMPLES))
    getitems = getattr(dataset, "__getitems__", None)
    start = 0

    def make() -> int:
        nonlocal start
        if whole:
            collate(dataset[start % size])
            start += 1
            return samples
        indices = [(start + i) % size for i in range(samples)]
        start += samples
        # as DataLoader's fetcher does: a batched read where the dataset has one
        collate(getitems(indices) if getitems else [dataset[i] for i in indices])
        return samples

    with read_aside(loader):
        times = _per_sample_times(make, batches)
    return _cost(loader, samples, times)


def _time_stream(
    loader: Any, dataset: torch.utils.data.IterableDataset[Any], samples: int, batches: int
) -> LoaderCost | None:
    """Time batches from a fresh iterator of an iterable dataset; None for a single stream (see
    :func:`single_stream`): reading it aside would take training's samples, and for one that fails to open.
    The dataset's attributes and own generators are put back afterwards."""
    whole = loader.batch_sampler is None
    samples = max(1, min(samples, _MAX_SAMPLES))
    collate = loader.collate_fn
    with read_aside(loader):
        try:
            if single_stream(dataset):
                return None
            stream = iter(dataset)
        except Exception:  # a stream that only its workers can open, say: training reports its own errors
            return None

        def make() -> int:
            if whole:
                collate(next(stream))
                return samples
            items = list(itertools.islice(stream, samples))
            if not items:
                raise StopIteration
            collate(items)
            return len(items)

        try:
            times = _per_sample_times(make, batches)
        finally:
            _close(stream)
    return _cost(loader, samples, times)


def _cost(loader: Any, samples: int, times: list[float]) -> LoaderCost | None:
    """The loader's cost from its batches' seconds per sample: the quickest counts ([Note: loader time])."""
    return LoaderCost(min(times) * 1e6, int(loader.num_workers), samples, len(times)) if times else None


def single_stream(dataset: Any) -> str | None:
    """What ``iter(dataset)`` gives back each time where ``dataset`` is an iterable dataset read as a single
    stream ("the dataset itself", "the same iterator"): a read aside would take samples from it. None where each
    ``iter()`` starts a fresh iterator, and for anything but an iterable dataset."""
    if not isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    first, again = iter(dataset), iter(dataset)
    if first is dataset:
        return "the dataset itself"
    if again is first:
        return "the same iterator"
    _close(first)
    _close(again)
    return None


@contextmanager
def read_aside(loader: Any) -> Iterator[None]:
    """Around a read of ``loader`` that training must not notice: the global generators, those the dataset, the
    loader and its samplers hold and (for an iterable dataset) the dataset's attributes are put back on exit."""
    dataset = getattr(loader, "dataset", None)
    streams = isinstance(dataset, torch.utils.data.IterableDataset)
    batches = getattr(loader, "batch_sampler", None)
    # the loader's own generator= and its samplers' draw the shuffle: a read aside must leave them too
    owners = (dataset, loader, getattr(loader, "sampler", None), batches, getattr(batches, "sampler", None))
    kept = getattr(loader, "_iterator", None)
    try:
        with generators_kept(*owners), _attributes_kept(dataset) if streams else nullcontext():
            yield
    finally:
        _drop_new_persistent_iterator(loader, kept)


def _drop_new_persistent_iterator(loader: Any, kept: Any) -> None:
    """Shut down the worker iterator a read left in a ``persistent_workers`` loader that held none before.
    Training would otherwise reuse it: its workers' generators advanced by the read and the global draw of a
    fresh iterator's worker seed skipped, so an epoch's shuffle and augmentations would differ from plain
    Lightning's."""
    made = getattr(loader, "_iterator", None)
    if made is None or made is kept:
        return
    loader._iterator = None
    shutdown = getattr(made, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()


def _per_sample_times(make: Callable[[], int], batches: int) -> list[float]:
    """Seconds per sample of up to ``batches`` calls of ``make`` (which makes a batch and says of how many
    samples), each less the time its thread waited for a core; stops at the end of the data, at the first
    batch that fails to load (its error belongs to training) or at the time budget."""
    times: list[float] = []
    begun = time.perf_counter()
    for _ in range(max(1, batches)):
        t0, q0 = time.perf_counter(), _queued_s()
        try:
            made = make()
        except Exception:  # StopIteration (the end of a stream), or a sample training may never read
            break
        q1 = _queued_s()  # before the clock: a wait between the two reads then counts as the batch's time,
        t1 = time.perf_counter()  # where the other order would take it off a batch that never waited
        times.append(max(0.0, t1 - t0 - (q1 - q0)) / made)
        if len(times) >= 2 and time.perf_counter() - begun > _BUDGET_S:
            break
    return times


def with_loader(profile: ModelProfile, cost: LoaderCost | None) -> ModelProfile:
    """``profile`` with the training loader's cost in ``meta["loader"]``, where the planner prices it."""
    if cost is None:
        return profile
    return dataclasses.replace(profile, meta={**profile.meta, "loader": cost.as_meta()})
