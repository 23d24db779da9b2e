"""A sandboxed copy of one block that runs forward and backward, and the cost record the profilers fill."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from lightning_autopart.capture.graph import Block
from lightning_autopart.capture.meta_layouts import meta_layouts
from lightning_autopart.profile.opcount import OpCounter
from lightning_autopart.profile.precision import Precision, lightning_autocast
from lightning_autopart.profile.sandbox import (
    clear_grads,
    copy_program,
    fresh_inputs,
    grad_outputs,
    make_args,
    release_program,
    state_tensors,
)
from lightning_autopart.profile.saved import SavedTensorMeter, storage_key
from lightning_autopart.profile.transient import AllocationMeter

__all__: list[str] = []


@dataclass(frozen=True, slots=True)
class RunMemory:
    """What one counted run of a block (:meth:`Runner.counted_run`) held beyond its saved tensors, in bytes."""

    #: Backward's transient peak beyond the saved tensors ([Note: transient memory]).
    transient: int = 0
    #: Autocast's weight copies that live into the backward, per forward.
    cast: int = 0
    #: What the gradients made by the peak add to it ([Note: gradients made by the peak]).
    fresh_extra: int = 0
    #: The saves of the block's dead part, freed before backward ([Note: a dead part's saves]).
    dropped: int = 0
    #: Whether the block differentiates nothing (runs no backward).
    forward_only: bool = False


@dataclass(frozen=True, slots=True)
class BlockCost:
    """What a profiler learns about one block, before static memory is added."""

    fwd_us: float
    bwd_us: float
    fwd_fixed_us: float
    bwd_fixed_us: float
    activation_bytes: int
    #: Part of ``activation_bytes`` that is the block's own inputs (the previous block may save them too).
    saved_input_bytes: int
    #: Part of ``activation_bytes`` that is the block's own outputs (the next block may save them too).
    saved_output_bytes: int
    fwd_flops: float
    bwd_flops: float
    fwd_kernels: int
    bwd_kernels: int
    #: Backward's transient peak beyond the saved tensors (see [Note: transient memory]).
    transient_bytes: int = 0
    #: Autocast's weight copies the backward keeps, per forward ([Note: weight casts] in partition/cost.py).
    cast_bytes: int = 0
    #: What that peak adds where the backward makes the parameters' gradients ([Note: gradients made by the
    #: peak] in transient.py).
    fresh_extra_bytes: int = 0
    #: What the forward saved for a part of the block whose outputs are all dead, freed before backward, and
    #: whether the block differentiates nothing (runs no backward: its transient is its forward's; [Note: a dead
    #: part's saves]).
    dropped_bytes: int = 0
    forward_only: bool = False
    #: Names of the block's inputs and of its outputs that it saves for backward (see [Note: saved twice]).
    saved_names: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())
    #: Host time of the forward and the backward where the device runs behind the host (CUDA), else 0.
    host_us: tuple[float, float] = (0.0, 0.0)
    #: Custom ops the counter could not see into (their FLOPs are unknown; see ``OpCounter.opaque``).
    opaque_ops: frozenset[str] = frozenset()

    @classmethod
    def of(
        cls,
        counter: OpCounter,
        saved: tuple[int, int, int],
        times_us: tuple[float, float],
        fixed_us: tuple[float, float],
        memory: RunMemory = RunMemory(),
        saved_names: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset()),
        host_us: tuple[float, float] = (0.0, 0.0),
    ) -> BlockCost:
        """A cost from a counted run: FLOPs and kernels, ``saved`` bytes and ``memory`` as ``counted_run`` leaves
        them, and times."""
        fwd, bwd = counter.counts["fwd"], counter.counts["bwd"]
        return cls(
            fwd_us=times_us[0],
            bwd_us=times_us[1],
            fwd_fixed_us=fixed_us[0],
            bwd_fixed_us=fixed_us[1],
            activation_bytes=saved[0],
            saved_input_bytes=saved[1],
            saved_output_bytes=saved[2],
            fwd_flops=fwd.flops,
            bwd_flops=bwd.flops,
            fwd_kernels=fwd.kernels,
            bwd_kernels=bwd.kernels,
            transient_bytes=memory.transient,
            cast_bytes=memory.cast,
            fresh_extra_bytes=memory.fresh_extra,
            dropped_bytes=memory.dropped,
            forward_only=memory.forward_only,
            saved_names=saved_names,
            host_us=host_us,
            opaque_ops=frozenset(counter.opaque),
        )


class Runner:
    """A sandboxed copy of one block with its inputs, able to run forward and backward repeatedly."""

    def __init__(self, block: Block, device: torch.device, precision: Precision) -> None:
        self.device = device
        self._original = block.program
        self.program: nn.Module = copy_program(block.program, device, precision.param)
        # "-mixed": inputs in the dtypes autocast gives them ([Note: cut dtypes under autocast])
        self.args = make_args(block, device, None if precision.mixed else precision.param)
        #: Context of every forward: autocast for a "-mixed" precision, or what the caller sets.
        self.context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        if precision.mixed and precision.compute is not None and device.type != "meta":
            self.context = lightning_autocast(device.type, precision.compute)
        self.grads: list[torch.Tensor] = []
        #: Backward's transient peak and autocast's weight copies, from the last :meth:`counted_run`.
        self.transient_bytes = 0
        self.cast_bytes = 0
        self.fresh_extra_bytes = 0
        #: What the last :meth:`counted_run`'s forward saved for its dead outputs alone, and whether it ran no
        #: backward ([Note: a dead part's saves]).
        self.dropped_bytes = 0
        self.forward_only = False
        #: The bytes alive after each operation of the last :meth:`counted_run` beyond the saves it allocated,
        #: and the inputs a forward-only block saves: ``transient_bytes`` is ``max(0, *moments) + inputs``
        #: ([Note: a peak's moments] in transient.py).
        self.moments: tuple[tuple[int, ...], int] = ((), 0)
        #: Names of the block's inputs and outputs that the last :meth:`counted_run` saved for backward.
        self.saved_names: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())
        self._names = (tuple(t.name for t in block.inputs), tuple(t.name for t in block.outputs))
        self._dead = block.dead_outputs
        self._dead_inputs = block.dead_inputs

    def release(self) -> None:
        """Free the copy, its arguments and gradient seeds now; the runner cannot run again.

        Called when a profiler is done with the runner, also when a block failed, so nothing it made is
        left for the garbage collector (see [Note: no copy outlives the profiler] in sandbox.py).
        """
        release_program(self.program, self._original)
        self.program = nn.Module()
        self.args = ()
        self.grads = []

    def forward(self, inputs: tuple[Any, ...]) -> list[torch.Tensor]:
        with self.context():
            out = self.program(*inputs)
        return self._live(out)

    def _live(self, out: Any) -> list[torch.Tensor]:
        """The outputs backward starts from, without the block's dead outputs (see ``Block.dead_outputs``)."""
        if not self._dead:
            return grad_outputs(out)
        leaves = tree_leaves(out)
        if len(leaves) != len(self._names[1]):
            return grad_outputs(out)
        return grad_outputs([t for n, t in zip(self._names[1], leaves, strict=True) if n not in self._dead])

    def backward(self, outputs: list[torch.Tensor]) -> None:
        if outputs:
            torch.autograd.backward(outputs, grad_tensors=self.grads)

    def counted_run(self, counter: OpCounter) -> tuple[int, int, int]:
        """One forward and backward under ``counter``, metering saved tensors and allocations.

        Also sets :attr:`transient_bytes` (backward's transient peak beyond the saved tensors),
        :attr:`fresh_extra_bytes` (what the gradients made by then add to it, [Note: gradients made by the peak]) and
        :attr:`cast_bytes` (autocast's weight copies that live into the backward, per forward; not in the saved
        bytes returned), see [Note: transient memory], and :attr:`dropped_bytes` (the saves of the block's dead
        part, freed before backward: [Note: a dead part's saves]).

        Returns:
            Bytes saved for backward (weight casts excluded), and the parts of them that are the block's inputs
            and its outputs.
        """
        state = state_tensors(self.program)
        meter = SavedTensorMeter(exclude=state)
        allocations = AllocationMeter(state, moments=True)
        for p in self.program.parameters():  # gradients are state: backward accumulates into them
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                counter.accumulators.add(id(p.grad))  # adds into it: [Note: gradient accumulation]
        inputs = fresh_inputs(self.args)
        layouts = meta_layouts([*tree_leaves(inputs), *self.program.parameters()])
        hooks = allocations.watch(self.program.parameters())
        with layouts, counter, allocations:  # layouts nearest the kernels: [Note: channels-last on meta]
            counter.phase = "fwd"
            with meter.hooks(), self.context():
                raw = self.program(*inputs)
            saved_outputs = _saved(meter, self._names[1], raw)
            outputs = self._live(raw)
            output_bytes = meter.nbytes_of(outputs)
            # a block that differentiates nothing (every output dead, or none) runs no backward: all it saved goes
            # with its graph, held until then, of its inputs those only dead parts use ([Note: a dead part's
            # saves]; the others live on, saved by a live block or not)
            self.forward_only = not outputs
            leaves = tree_leaves(inputs)
            dead_in = (
                [t for n, t in zip(self._names[0], leaves, strict=True) if n in self._dead_inputs]
                if len(leaves) == len(self._names[0])
                else []
            )
            dropped = meter.nbytes - meter.nbytes_of(t for t in leaves if all(t is not d for d in dead_in))
            saved_inputs = meter.nbytes_of(dead_in) if self.forward_only else 0
            meter.forget_freed()  # what the forward dropped itself (a router's scores that only pick the experts)
            kept = meter.nbytes
            raw = None  # dead outputs are freed before backward, as a training step's are
            # and with them what only they needed: their part of the graph and its saves
            meter.forget_freed()
            if not self.forward_only:
                dropped = kept - meter.nbytes
            casts = dict(allocations.casts)  # the copies that live into the backward (it saves them)
            # the saves this block made (not its inputs'), and its outputs a step frees before this backward
            # ([Note: a block's own memory] in transient.py)
            made = allocations.owned(meter.keys())
            allocations.discount(allocations.owned(storage_key(t) for t in outputs) - made)
            counter.phase = None
            self.grads = [torch.ones_like(t) for t in outputs]
            counter.phase = "bwd"
            self.backward(outputs)
            counter.phase = None
        for hook in hooks:
            hook.remove()
        clear_grads(self.program, self.args)
        saved = meter.nbytes
        saved_here = meter.nbytes_of_keys(made)  # what of the saves the meter saw allocated
        self.cast_bytes = sum(casts.values())
        # a block that runs no backward peaks in its forward, with the inputs it saves
        self.transient_bytes = max(0, allocations.peak - saved_here) + saved_inputs
        self.moments = (tuple(n - saved_here for n in allocations.moments or ()), saved_inputs)
        self.fresh_extra_bytes = max(0, allocations.fresh_peak - saved_here - self.transient_bytes)
        self.dropped_bytes = dropped
        casts_saved = meter.nbytes_of_keys(casts)
        self.saved_names = (_saved(meter, self._names[0], inputs), saved_outputs)
        return saved - casts_saved, meter.nbytes_of(tree_leaves(inputs)), output_bytes

    def memory(self) -> RunMemory:
        """What the last :meth:`counted_run` held beyond its saved tensors."""
        return RunMemory(
            self.transient_bytes, self.cast_bytes, self.fresh_extra_bytes, self.dropped_bytes, self.forward_only
        )


def _saved(meter: SavedTensorMeter, names: tuple[str, ...], values: Any) -> frozenset[str]:
    """The ``names`` of the tensors among ``values`` (in their order) that ``meter`` saw saved."""
    tensors = tree_leaves(values)
    if len(tensors) != len(names):
        return frozenset()
    return frozenset(n for n, t in zip(names, tensors, strict=True) if meter.nbytes_of([t]) > 0)
