"""Activation checkpointing of the stages a plan marks ``checkpoint``: keep the stage's inputs, recompute its forward.

The cost model (``partition/cost.py``) prices a checkpointed stage as keeping only its input per in-flight
micro-batch and recomputing one micro-batch's forward at a time in backward. :class:`Recompute` makes the runtime
do exactly that: a stage module wrapped in it runs its forward under non-reentrant
``torch.utils.checkpoint.checkpoint``, which saves the forward's inputs and nothing the forward itself would save
for backward; backward re-runs the forward, one micro-batch at a time, to get those tensors back. Without
gradients (evaluation, ``torch.no_grad()``, the runtime's metadata forward) the stage runs plainly: no inputs are
kept and nothing is recomputed. The wrapper sits inside ``WireStage`` (the values it gets are decoded cut values,
views of the received carriers, so keeping them costs nothing more) and outside the stage module, whose
parameters (tied ones too) stay the user's own objects.

[Note: exact recompute] A recomputed forward must compute what the forward computed, and leave no trace:

- Random numbers (dropout): ``checkpoint(preserve_rng_state=True)`` saves the CPU generator's state and that of
  the inputs' accelerator devices before the forward, and replays it for the recompute inside ``fork_rng``, so
  the recompute draws the same masks and the generators continue as if there were no recompute.
- Autocast: ``checkpoint`` re-enters the forward's autocast state.
- Mutated buffers (BatchNorm's running statistics and ``num_batches_tracked``, a user's ``self.buf.add_(...)``):
  they must be updated once per micro-batch, and the recompute must read the values the forward read, although
  other micro-batches' forwards may have updated them since (GPipe runs every forward first). So ``context_fn``
  gives the forward a context that snapshots, per micro-batch, the buffers the stage's forward writes, and the
  recompute a context that swaps a copy of that snapshot into the stage's buffer registrations
  (``module._buffers``, which the captured programs and the user's modules read at each call) and swaps the real
  buffers back afterwards. The recompute thus reads exactly the forward's values and its writes land in the
  throw-away copy: the real buffers are updated once, by the forward. Swapping registrations moves no data; the
  only copies are the snapshot (a few bytes per BatchNorm channel per in-flight micro-batch) and its copy at
  recompute (so a second backward over a retained graph recomputes exactly too). Skipping the writes alone
  would not do: the recompute of a buffer-reading forward would read later micro-batches' values.

  Which buffers the forward writes: running statistics are found in the stage (the norm modules of a "modules"
  capture, the arguments of the batch-norm operations of an "export" graph), since batch norm updates them
  without bumping their version counters; every other in-place write (``copy_``, ``add_``, ``mul_``...) bumps
  the buffer's version counter, so the first forward snapshots every buffer and keeps those whose version
  changed, and later forwards snapshot only the written ones. A buffer first written by a later forward (a mode
  switched meanwhile) has no snapshot: its recompute reads its current value and writes a throw-away copy.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Recompute", "log_recompute", "running_statistics"]

_log = logging.getLogger(__name__)


class Recompute(nn.Module):
    """A stage module whose forward keeps only its inputs and is recomputed in backward (see the module docstring).

    Args:
        stage: The stage module (it stays a registered child: its parameters are visible through this module).
    """

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage
        self._writes = _BufferWrites(stage)

    def forward(self, *values: Any) -> Any:
        """The stage's forward, checkpointed when autograd records it (see [Note: exact recompute])."""
        if not torch.is_grad_enabled():
            return self.stage(*values)
        return checkpoint(
            self.stage,
            *values,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=self._writes.contexts,
        )


#: Operations whose arguments 3 and 4 are running statistics they update in place without bumping the tensors'
#: version counters (their schemas do not mark them written), so only the graph tells that they are written.
_RUNNING_STATS_OPS = tuple(
    getattr(torch.ops.aten, name).default
    for name in (
        "batch_norm",
        "native_batch_norm",
        "_native_batch_norm_legit",
        "_batch_norm_with_update",
        "cudnn_batch_norm",
        "miopen_batch_norm",
        "instance_norm",
    )
    if hasattr(torch.ops.aten, name)
)


def running_statistics(stage: nn.Module) -> list[torch.Tensor]:
    """The running statistics a stage's forward may update in place: those of the batch/instance-norm modules
    it holds (a "modules" capture) and those its graphs pass to batch-norm operations (an "export" capture)."""
    found: dict[int, torch.Tensor] = {}
    for module in stage.modules():
        if isinstance(module, nn.modules.batchnorm._NormBase):
            stats = (module.running_mean, module.running_var)
        elif isinstance(module, fx.GraphModule):
            stats = tuple(
                _attribute(module, arg)
                for node in module.graph.nodes
                if node.op == "call_function" and node.target in _RUNNING_STATS_OPS
                for arg in node.args[3:5]
            )
        else:
            continue
        found.update((id(t), t) for t in stats if isinstance(t, torch.Tensor))
    return list(found.values())


def _attribute(module: fx.GraphModule, arg: Any) -> Any:
    """The tensor a ``get_attr`` node argument reads, else None."""
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        return operator.attrgetter(str(arg.target))(module)
    return None


class _BufferWrites:
    """Which buffers a stage's forward writes, and the contexts that keep a recompute off them.

    Buffers are known by identity: the runtime keeps every tensor object (``move_in_place``, ``materialize``'s
    ``swap_tensors``, checkpoints loaded with ``copy_``); registrations are read at each call all the same.
    """

    def __init__(self, stage: nn.Module) -> None:
        #: Every buffer registration of the stage: (the owner's ``_buffers`` table, name); read at each call.
        self._slots = [(m._buffers, name) for m in stage.modules() for name in m._buffers]
        #: Ids of the buffers a forward writes: running statistics, and what version counters showed.
        self.written: set[int] = {id(t) for t in running_statistics(stage)}
        #: Whether a forward has run (until then every buffer is snapshot, to learn the written ones).
        self.learned = False

    def contexts(self) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        """``checkpoint``'s ``context_fn``: a (forward, recompute) pair sharing one micro-batch's snapshot."""
        micro_batch = _MicroBatch(self)
        return _ForwardContext(micro_batch), _RecomputeContext(micro_batch)

    def buffers(self) -> list[torch.Tensor]:
        """The stage's buffers now, each once."""
        found: dict[int, torch.Tensor] = {}
        for table, name in self._slots:
            buffer = table.get(name)
            if buffer is not None:
                found.setdefault(id(buffer), buffer)
        return list(found.values())


class _MicroBatch:
    """One checkpointed forward's record: buffer versions before it, snapshots of what it writes."""

    def __init__(self, writes: _BufferWrites) -> None:
        self.writes = writes
        self.versions: list[tuple[torch.Tensor, int]] = []
        self.snapshots: dict[int, torch.Tensor] = {}

    def before_forward(self) -> None:
        writes = self.writes
        # An inference tensor (made under inference_mode) has no version counter, and no grad-mode op writes it.
        self.versions = [(b, b._version) for b in writes.buffers() if not b.is_inference()]
        self.snapshots = {
            id(b): b.detach().clone()
            for b, _ in self.versions
            if not writes.learned or id(b) in writes.written
        }

    def after_forward(self) -> None:
        writes = self.writes
        writes.written |= {id(b) for b, version in self.versions if b._version != version}
        writes.learned = True
        self.versions = []
        self.snapshots = {k: v for k, v in self.snapshots.items() if k in writes.written}

    def swap_in(self) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
        """Point every registration of a written buffer at a copy of its snapshot; return what to restore."""
        copies: dict[int, torch.Tensor] = {}
        swapped = []
        for table, name in self.writes._slots:
            buffer = table.get(name)
            if buffer is None or id(buffer) not in self.writes.written:
                continue
            if id(buffer) not in copies:
                before = self.snapshots.get(id(buffer), buffer)  # no snapshot: read the current value
                copies[id(buffer)] = before.detach().clone()
            table[name] = copies[id(buffer)]
            swapped.append((table, name, buffer))
        return swapped


class _ForwardContext(AbstractContextManager[None]):
    def __init__(self, micro_batch: _MicroBatch) -> None:
        self._micro_batch = micro_batch

    def __enter__(self) -> None:
        self._micro_batch.before_forward()

    def __exit__(self, *exc: object) -> None:
        self._micro_batch.after_forward()


class _RecomputeContext(AbstractContextManager[None]):
    def __init__(self, micro_batch: _MicroBatch) -> None:
        self._micro_batch = micro_batch
        self._swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []

    def __enter__(self) -> None:
        self._swapped = self._micro_batch.swap_in()

    def __exit__(self, *exc: object) -> None:
        for table, name, buffer in self._swapped:
            table[name] = buffer
        self._swapped = []


def log_recompute(checkpointed: Sequence[int], num_stages: int, rank: int) -> None:
    """Log, on rank 0, which stages of the plan recompute their activations in backward."""
    if rank == 0 and checkpointed:
        _log.info(
            "activation checkpointing on %d of %d stages (%s): each keeps only its inputs per micro-batch and "
            "recomputes its forward in backward",
            len(checkpointed),
            num_stages,
            ", ".join(map(str, checkpointed)),
        )
