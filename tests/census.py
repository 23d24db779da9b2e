"""Device-independent probes of a training step's leanness: host syncs, live tensor bytes and peak tensor bytes.

- :class:`SyncCounter` counts host syncs: calls of ``aten._local_scalar_dense``, which ``.item()``,
  ``float(t)``, ``int(t)``, ``bool(t)`` (an ``if`` on a tensor) and ``f"{t:.3f}"`` all go through.
- :func:`live_tensor_bytes` is a gc census of the tensor storages alive *now*, without collecting: a reference
  cycle that keeps tensors alive costs real device memory until the collector runs, so it must be seen.
- :class:`PeakTracker` follows the storages ops create (and the ones it is told about) until they die, and
  keeps the peak of their sum: the step's peak tensor bytes, as ``torch.cuda.max_memory_allocated`` would
  see it but on any device.
- :class:`StepProbe` is a Lightning callback running all three over a window of training batches
  (``tests/step_peak.py``'s ``StepPeak`` runs the peak alone, for a prediction to meet).

They see tensors, not allocators: the caching allocator's reserve, kernel workspaces and temporaries a
native kernel allocates and frees inside one op are invisible to all of them.
"""

from __future__ import annotations

import gc
import traceback
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import lightning as L
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten

__all__ = ["PeakTracker", "StepProbe", "SyncCounter", "live_tensor_bytes"]

_LOCAL_SCALAR_DENSE = torch.ops.aten._local_scalar_dense.default
_THIS_FILE = __file__
#: Files of torch's dispatch-mode and dynamo-disable wrappers, left out of stack summaries.
_MACHINERY = (
    "utils/_python_dispatch.py",
    "utils/_contextlib.py",
    "_dynamo/eval_frame.py",
    "torch/_compile.py",
)


class SyncCounter(TorchDispatchMode):
    """Counts host syncs: calls of ``aten._local_scalar_dense`` while the mode is active.

    ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)`` (so ``if t:`` and ``if t > 0:``), ``f"{t:.3f}"`` and
    indexing a Python list with a tensor all call it. ``.tolist()`` and ``.numpy()`` do not: on CPU they read
    the memory directly (not counted), and on a GPU ``.tolist()`` first copies to the host with ``_to_copy``,
    which :attr:`to_host` counts (together with every other device-to-host copy). Dispatch modes are
    thread-local, but autograd carries them into its backward threads, so syncs in backward hooks count.

    Args:
        trace: Keep a short stack summary of each counted call in :attr:`where`.
        depth: Frames kept per summary (innermost last), frames of this module and torch's dispatch
            machinery left out.
    """

    def __init__(self, trace: bool = False, depth: int = 8) -> None:
        super().__init__()
        #: Calls of ``aten._local_scalar_dense`` seen.
        self.count: int = 0
        #: Copies from a non-CPU device to the CPU seen (``_to_copy``/``copy_``); always 0 on a CPU run.
        self.to_host: int = 0
        #: With ``trace=True``, one summary per counted call: "file:line in function" frames joined by " < ",
        #: the innermost first.
        self.where: list[str] = []
        self.trace = trace
        self.depth = depth

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _LOCAL_SCALAR_DENSE:
            self.count += 1
            if self.trace:
                self.where.append(_stack_summary(self.depth))
        elif func._overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_) and _to_host(
            func, args, kwargs
        ):
            self.to_host += 1
        return func(*args, **kwargs)


def _to_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``_to_copy`` or ``copy_`` call copies a tensor from an accelerator to the CPU."""
    if func._overloadpacket is torch.ops.aten.copy_:
        dst, src = args[0], args[1]
        return _on_accelerator(src) and isinstance(dst, torch.Tensor) and dst.device.type == "cpu"
    device = kwargs.get("device")
    return _on_accelerator(args[0]) and device is not None and torch.device(device).type == "cpu"


def _on_accelerator(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")


def _stack_summary(depth: int) -> str:
    """The innermost ``depth`` frames outside this module and torch's dispatch-mode machinery."""
    frames = []
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename
        if name == _THIS_FILE or name.endswith(_MACHINERY):
            continue
        short = "/".join(name.split("/")[-2:])
        frames.append(f"{short}:{frame.lineno} in {frame.name}")
        if len(frames) == depth:
            break
    return " < ".join(frames)


# -------------------------------------------------------------------------------------------------------------
# The census of live storages
# -------------------------------------------------------------------------------------------------------------


def _storage_of(t: torch.Tensor) -> tuple[tuple[str, int], torch.UntypedStorage] | None:
    """``((device, data_ptr), storage)`` of a tensor with real, non-empty memory; None otherwise."""
    if isinstance(t, FakeTensor):  # a meta tensor dressed as another device (export keeps some): no memory
        return None
    try:
        if t.device.type == "meta" or t.is_sparse:
            return None
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.device.type == "meta":
            return None
        return (str(storage.device), int(storage.data_ptr())), storage
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):  # storage-less subclasses
        return None


def _live_tensors() -> Iterator[torch.Tensor]:
    """Every tensor with a Python object, and the ``.grad`` of every leaf among them (no collection)."""
    for obj in gc.get_objects():
        # type() rather than isinstance(): isinstance reads __class__, which some lazy or deprecated module
        # attributes (torch.distributed.reduce_op) turn into a warning or an import.
        if not issubclass(type(obj), torch.Tensor):
            continue
        yield obj
        try:
            grad = obj.grad if obj.is_leaf else None  # .grad of a non-leaf warns and is always None
        except (RuntimeError, NotImplementedError, AttributeError):  # exotic tensor subclasses
            continue
        if grad is not None:
            yield grad


def _live_storages() -> dict[tuple[str, int], tuple[torch.UntypedStorage, int]]:
    """The census: distinct live storages by (device, data pointer), each with its bytes."""
    found: dict[tuple[str, int], tuple[torch.UntypedStorage, int]] = {}
    for t in _live_tensors():
        entry = _storage_of(t)
        if entry is None:
            continue
        key, storage = entry
        nbytes = int(storage.nbytes())
        if key not in found or found[key][1] < nbytes:
            found[key] = (storage, nbytes)
    return found


def live_tensor_bytes() -> int:
    """Bytes of the distinct tensor storages alive now, found by a gc census that collects nothing.

    Every tensor object ``gc.get_objects()`` lists counts (parameters, buffers, optimizer state, the
    tensors in any list, dict or object, and tensors kept alive only by a reference cycle the collector has
    not reached yet), plus the ``.grad`` of every leaf tensor among them (a gradient autograd accumulated
    has no Python object until someone reads it). Storages are counted once however many views share
    them (keyed by device and data pointer); meta tensors and empty storages count nothing.

    What it cannot see: tensors that have never had a Python object and are held only by C++, such as the
    tensors autograd saved for backward in a graph that is still alive (a stored loss with its graph; a
    tensor that had a Python object before autograd saved it does count), DDP's reducer buckets, buffers
    inside process-group work objects and kernel workspaces; sparse tensors; nor the allocator's cache.
    """
    return sum(nbytes for _, nbytes in _live_storages().values())


# -------------------------------------------------------------------------------------------------------------
# Peak tracking
# -------------------------------------------------------------------------------------------------------------


class _Release:
    """Weakref callback subtracting a dead storage's bytes from its tracker (held weakly: no cycle)."""

    __slots__ = ("key", "tracker")

    def __init__(self, tracker: PeakTracker, key: int) -> None:
        self.tracker = weakref.ref(tracker)
        self.key = key

    def __call__(self, _: Any) -> None:
        tracker = self.tracker()
        if tracker is not None:
            tracker._release(self.key)


class PeakTracker(TorchDispatchMode):
    """Bytes of the storages created by ops while the mode is active, as they live and die, and their peak.

    Every op's output whose storage is not one of its inputs' storages (a view or an in-place result is
    not new memory) is tracked from then on; a weak reference on its ``untyped_storage()`` object
    subtracts its bytes when the storage dies. torch preserves the storage's Python object for as long as
    the C++ storage lives (checked on torch 2.13: the weak reference fires only when the last tensor on it
    dies, even if the storage is then held only by autograd), so frees inside C++ (saved tensors released
    by backward) are seen. Storages that grow under the mode (``resize_``, ``out=``) are re-measured.
    Autograd's backward dispatches its ops through the same mode, so the gradients and temporaries of a
    ``backward()`` run inside it count.

    ``current`` starts at 0 (only allocations made under the mode count), or at the bytes of a census
    when ``include_live=True``: every storage :func:`live_tensor_bytes` finds on entering the mode is
    tracked too, so frees of older storages lower ``current`` and ``peak`` is the absolute peak of the
    tracked bytes. Frees keep being seen after the mode exits, until the tracker is garbage.

    Args:
        include_live: Seed the tracker with a census of the live storages on entering (see above).
    """

    def __init__(self, include_live: bool = False, labels: bool = False) -> None:
        super().__init__()
        #: Bytes of the tracked storages alive now.
        self.current: int = 0
        #: The most ``current`` has been since creation or the last :meth:`reset_peak`.
        self.peak: int = 0
        self.include_live = include_live
        self._tracked: dict[int, tuple[int, weakref.ref[Any]]] = {}
        #: With ``labels``: what made each live storage ("F"/"B" for forward/backward, the op, shape, dtype),
        #: and the bytes of each label at the last peak (a debugging aid: where a measured peak comes from).
        self.labels: dict[int, str] | None = {} if labels else None
        self.at_peak: dict[str, int] = {}

    def __enter__(self) -> PeakTracker:
        if self.include_live:
            self.track(storage for storage, _ in _live_storages().values())
        super().__enter__()
        return self

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        self.peak = self.current

    def track(self, storages: Iterable[torch.UntypedStorage]) -> None:
        """Track existing storages (not made under the mode), as if they had been created now."""
        for storage in storages:
            self._track(storage)

    def _track(self, storage: torch.UntypedStorage) -> None:
        if storage.device.type == "meta":
            return
        key = int(storage._cdata)
        nbytes = int(storage.nbytes())
        entry = self._tracked.get(key)
        if entry is not None:
            if entry[0] == nbytes:
                return
            self.current += nbytes - entry[0]
            self._tracked[key] = (nbytes, entry[1])
        else:
            self._tracked[key] = (nbytes, weakref.ref(storage, _Release(self, key)))
            self.current += nbytes
        if self.current > self.peak and self.labels is not None:
            self.at_peak = {}
            for k, (n, _) in self._tracked.items():
                label = self.labels.get(k, "before")
                self.at_peak[label] = self.at_peak.get(label, 0) + n
        self.peak = max(self.peak, self.current)

    def _release(self, key: int) -> None:
        entry = self._tracked.pop(key, None)
        if entry is not None:
            self.current -= entry[0]

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = _key(t)
            if key is None or (key in inputs and key not in self._tracked):
                continue  # a view or an in-place result of an input the tracker does not follow
            if self.labels is not None and key not in self._tracked:
                phase = "F" if torch.is_grad_enabled() else "B"
                self.labels[key] = f"{phase} {func} {tuple(t.shape)} {str(t.dtype)[6:]}"
            try:
                self._track(t.untyped_storage())
            except (RuntimeError, NotImplementedError):  # storage-less tensor subclasses
                continue
        return out


def _key(t: torch.Tensor) -> int | None:
    """Identity of the storage behind ``t`` (the C++ StorageImpl); None for meta or storage-less tensors."""
    try:
        if t.device.type == "meta":
            return None
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


# -------------------------------------------------------------------------------------------------------------
# The Lightning callback
# -------------------------------------------------------------------------------------------------------------


class StepProbe(L.Callback):
    """Host syncs, live tensor bytes and peak tensor bytes of the training batches ``start <= i < stop``.

    ``i`` counts training batches from the start of ``fit`` (0-based, across epochs; in the first epoch it
    is ``batch_idx``). For each batch in the window, at ``on_train_batch_start``:

    - ``live`` gets :func:`live_tensor_bytes` (the batch itself is alive and counted);
    - a :class:`SyncCounter` and a :class:`PeakTracker` seeded with that census (``include_live``) start;

    and at ``on_train_batch_end`` both stop:

    - ``syncs`` gets the host syncs counted between the two hooks (training step, backward, optimizer step
      and whatever callbacks earlier in the list run in those hooks; the logger connector's work after
      ``on_train_batch_end`` is not in it);
    - ``peaks`` gets the **absolute** peak: the most bytes the census' storages plus every storage created
      during the step held at once, so it compares with ``torch.cuda.max_memory_allocated`` after
      ``reset_peak_memory_stats`` at the step start, and a strategy that keeps more alive between steps
      shows it in both ``live`` and ``peaks``. ``peaks[k] - live[k]`` is the step's rise above its start.

    Args:
        start: First probed batch.
        stop: One past the last probed batch.
        trace: Let the sync counters keep stack summaries; ``where`` gets one list per probed batch.
    """

    def __init__(self, start: int, stop: int, trace: bool = False) -> None:
        super().__init__()
        self.start = start
        self.stop = stop
        self.trace = trace
        #: Host syncs per probed batch.
        self.syncs: list[int] = []
        #: Live tensor bytes at the start of each probed batch.
        self.live: list[int] = []
        #: Absolute peak tensor bytes of each probed batch.
        self.peaks: list[int] = []
        #: With ``trace=True``: the stack summaries of each probed batch's syncs.
        self.where: list[list[str]] = []
        self._index = -1
        self._active: tuple[SyncCounter, PeakTracker] | None = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._index += 1
        if not self.start <= self._index < self.stop:
            return
        storages = _live_storages()
        self.live.append(sum(nbytes for _, nbytes in storages.values()))
        counter = SyncCounter(trace=self.trace)
        tracker = PeakTracker()
        tracker.track(storage for storage, _ in storages.values())
        del storages
        counter.__enter__()
        tracker.__enter__()
        self._active = (counter, tracker)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._stop()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._stop()  # a step that raised never reached on_train_batch_end: leave no mode behind

    def _stop(self) -> None:
        if self._active is None:
            return
        counter, tracker = self._active
        self._active = None
        # A mode's __exit__ pops whatever mode is on top of the stack: make sure it is ours.
        for mode in (tracker, counter):
            top = _get_current_dispatch_mode()
            if top is not mode:
                raise RuntimeError(
                    f"StepProbe found {type(top).__name__} on top of the dispatch mode stack where it left its "
                    f"{type(mode).__name__}: a mode entered during the step was not exited (or one of the probe's "
                    "was exited by someone else); results would be wrong"
                )
            mode.__exit__(None, None, None)
        self.syncs.append(counter.count)
        self.peaks.append(tracker.peak)
        if self.trace:
            self.where.append(counter.where)
