"""What a block allocates beyond what it saves for backward: backward's transient peak, and autocast's weight copies.

[Note: transient memory] A stage's memory is its state, the activations of the micro-batches in flight, and on top
of that, while one micro-batch runs backward, the gradients and temporaries it allocates (the gradient of a
GPT's logits is as large as the logits). :class:`AllocationMeter` follows every storage the block's operations
create (a weak reference on each storage's Python object, which torch keeps for as long as the storage lives,
meta storages too) and keeps the peak of their sum; the transient is that peak minus the bytes saved for
backward that the block allocated ([Note: a block's own memory]). Parameter gradients are state, counted
elsewhere: the runner gives every parameter a gradient before the run, so backward accumulates into it. Under
autocast, ``_to_copy`` of a parameter makes the low-precision copy of a weight. A copy the backward saves lives
from its forward to the backward, but not through the optimizer step, so those bytes are reported apart
(``cast_bytes``; [Note: weight casts] in partition/cost.py); a copy it does not save (a first layer's, whose
input needs no gradient) dies with its operation, a transient.

[Note: a block's own memory] The peak is of what the block allocates, so the saves it is measured against are
those it allocated too (:meth:`AllocationMeter.owned`): an input it saves was made before it (its activation
bytes count it, the peak does not). And a step frees a block's output that the block does not save before the
block's backward: the next block frees it after its forward (or saves it, as its own activation), a stage's
output is held for its send ([Note: pipeline buffers] in partition/cost.py), the model's output is dropped once
the loss is computed. The profile holds the outputs through the backward, so from the forward's end they are
not counted (:meth:`AllocationMeter.discount`). The two errors cancelled where a block saves an input as large
as its output (a transformer layer), and did not elsewhere: an LM head's transient carried its logits and
missed its saved hidden state (a Llama's last rank 1.08 of its measured peak), an MLP's down-projection missed
its saved 4x-wide input and carried its output (0.98).

[Note: gradients made by the peak] Where a backward makes the step's gradients instead of adding into them (one
replica, gradients dropped at the step's start: [Note: fresh gradients] in partition/fresh.py), those of the
block's parameters it has made by its peak are there too: a GPT-2 layer's backward peaks in its GELU, after
its output projection's weight gradient is made. :meth:`AllocationMeter.watch` counts each parameter's gradient
once its accumulation is done, and ``fresh_peak`` is the peak of the storages plus the gradients made by then
(the storage a gradient accumulated from dies at once where the gradients exist already; it becomes the
gradient where they do not). A GPT-2's GPipe last stage read 0.933 of its measured peak without them.

[Note: a peak's moments] An estimate prices a block at every micro-batch size from two captures, at ``a`` and
``b`` samples (:func:`~lightning_autopart.profile.estimate.estimate_curve`). What is alive after each operation
is affine in the batch, but the peak is the largest of those amounts, so it is convex in the batch, piecewise:
the line through the peaks at ``a`` and ``b`` passes under it outside ``[a, b]``, and the planner reads it below
``a`` (the first batch is captured, the micro-batches are smaller). Swin V2's position bias is an MLP over a
table of coordinates: its backward makes four 100 KB temporaries whatever the batch, after the layer's saves of
the batch's tokens are freed, so its excess over the saves falls as the batch grows and is the layer's peak at
small batches only; another moment's, rising with the batch, is the peak at 8 and 16 samples. The line through
those gave the layer 35.6 KB of transient at 2 samples, where it holds 299 KB: its ranks read 1.309 and 1.112
of their predictions. So the meter records every operation's moment (``moments``), the two runs' moments pair
one to one (the same program runs the same operations), and the transient at ``n`` samples is the largest of
their lines, exact at every size where the moments are affine (where the runs do not pair, the line of their
peaks stays). Swin V2's ranks read 1.000 and 0.995 since (``bench/pipeline_sweep.py --spec cpu``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_autopart.profile.saved import storage_key

__all__: list[str] = []

_TO_COPY = torch.ops.aten._to_copy.default


class _Release:
    """Weak-reference callback subtracting a dead storage's bytes (holds its meter weakly: no cycle)."""

    __slots__ = ("key", "meter")

    def __init__(self, meter: AllocationMeter, key: int) -> None:
        self.meter = weakref.ref(meter)
        self.key = key

    def __call__(self, _: Any) -> None:
        meter = self.meter()
        if meter is not None:
            meter.release(self.key)


class AllocationMeter(TorchDispatchMode):
    """The bytes of the storages operations create while active, as they live and die, and their peak.

    Args:
        state: The block's parameters, buffers and constants: a copy of one of them (``_to_copy``) is a weight
            cast, whose storage is recorded in :attr:`casts`.
        moments: Record :attr:`moments`, the bytes alive after each operation ([Note: a peak's moments]).
    """

    def __init__(self, state: Iterable[torch.Tensor] = (), moments: bool = False) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        #: The bytes alive after each operation, in order (with ``moments``; their largest is :attr:`peak`).
        self.moments: list[int] | None = [] if moments else None
        #: Bytes of the watched parameters' gradients accumulated so far, and the peak with them counted.
        self.made = 0
        self.fresh_peak = 0
        #: Storage keys of the weight casts alive now and their bytes.
        self.casts: dict[int, int] = {}
        self._state = {storage_key(t) for t in state}
        self._tracked: dict[int, tuple[int, weakref.ref[Any]]] = {}

    def watch(self, params: Iterable[torch.Tensor]) -> list[Any]:
        """Count each of ``params``' gradients in :attr:`made` once its first accumulation is done ([Note:
        gradients made by the peak]); returns the hooks' handles, to remove after the backward."""
        seen: set[int] = set()

        def made(p: torch.Tensor) -> None:
            if id(p) not in seen and p.grad is not None:
                seen.add(id(p))
                self.made += p.grad.untyped_storage().nbytes()

        return [p.register_post_accumulate_grad_hook(made) for p in params if p.requires_grad]

    def owned(self, keys: Iterable[int]) -> set[int]:
        """Those of ``keys`` whose storages this meter saw made and still alive (not a block's inputs)."""
        return {key for key in keys if key in self._tracked}

    def discount(self, keys: Iterable[int]) -> None:
        """Stop counting the live storages of ``keys`` from now on: values alive here that a training step
        frees before this point ([Note: a block's own memory])."""
        for key in set(keys):
            entry = self._tracked.get(key)
            if entry is not None and entry[0]:
                self.current -= entry[0]
                self._tracked[key] = (0, entry[1])

    def release(self, key: int) -> None:
        """A tracked storage died."""
        entry = self._tracked.pop(key, None)
        if entry is not None:
            self.current -= entry[0]
            self.casts.pop(key, None)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        cast = func is _TO_COPY and bool(inputs & self._state)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = storage_key(t)
            if key in inputs or key in self._tracked:
                continue  # a view or an in-place result: no new memory
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # storage-less tensor subclasses
                continue
            nbytes = int(storage.nbytes())
            self._tracked[key] = (nbytes, weakref.ref(storage, _Release(self, key)))
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            self.fresh_peak = max(self.fresh_peak, self.current + self.made)
            if cast:
                self.casts[key] = nbytes
        if self.moments is not None:
            self.moments.append(self.current)
        return out
