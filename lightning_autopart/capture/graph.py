"""A captured model: an ordered sequence of runnable blocks and the tensors that cross each cut between them.

Produced by :func:`lightning_autopart.capture.capture`, consumed by the profilers (which run each block's
``program`` on its recorded ``args``) and by the stage builder (which chains the programs of a stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__: list[str] = ["Block", "CapturedModel", "OutputSpec", "TensorInfo"]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor that flows between blocks (or into or out of the model)."""

    #: Name of the value (graph node name, or "input0", "block3.out1" for module capture).
    name: str
    #: Shape in the captured forward.
    shape: tuple[int, ...]
    #: dtype name ("float32", "int64", "bool", ...).
    dtype: str
    #: Bytes of the tensor.
    nbytes: int
    #: Index of the producing block; -1 for a model input.
    producer: int
    #: Indices of the consuming blocks, ascending; len(blocks) means "a model output".
    consumers: tuple[int, ...]
    #: Whether the value depends on a trainable parameter (it needs a gradient where it crosses a cut).
    requires_grad: bool = False
    #: What computes the value, alike on every rank (see [Note: rank-independent values] in capture/keys.py);
    #: empty where the name serves (module capture names values by block and position).
    key: str = field(default="", compare=False)


@dataclass(frozen=True)
class OutputSpec:
    """How to rebuild a forward's output from the tensors the pipeline carries.

    ``slots[j]`` is the position, among the carried tensors, of output leaf ``j``; None for a constant leaf,
    whose value is ``constants[j]``.
    """

    spec: pytree.TreeSpec
    slots: tuple[int | None, ...]
    constants: tuple[Any, ...]
    #: Paths and types of the leaves that were dropped (rebuilt as None), e.g. ".past_key_values (DynamicCache)".
    dropped: tuple[str, ...] = field(default=())

    @classmethod
    def single(cls) -> OutputSpec:
        """The spec of a forward that returns one tensor."""
        return cls(pytree.tree_flatten(torch.empty(0))[1], (0,), (None,))

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The forward's output with ``tensors`` (the carried outputs, in order) in their places."""
        leaves = [c if s is None else tensors[s] for s, c in zip(self.slots, self.constants, strict=True)]
        return pytree.tree_unflatten(leaves, self.spec)

    def with_slots(self, slots: Sequence[int | None]) -> OutputSpec:
        """The same structure with the tensor leaves at other positions (after deduplication)."""
        return OutputSpec(self.spec, tuple(slots), self.constants, self.dropped)


@dataclass(slots=True)
class Block:
    """One candidate pipeline unit: the cut points of the model lie only between blocks."""

    #: Position in execution order.
    index: int
    #: Display name, usually the FQN of the module the block covers ("layers.3").
    name: str
    #: FQNs of the modules the block owns.
    modules: tuple[str, ...]
    #: FQNs of every parameter the block uses (a tied parameter appears in every block that uses it).
    params: tuple[str, ...]
    #: FQNs of every buffer the block uses.
    buffers: tuple[str, ...]
    #: Runs the block: ``program(*args)`` returns a tuple of tensors, the values ``outputs`` names.
    program: nn.Module
    #: The block's inputs as seen in the captured forward (real or meta tensors, in ``inputs`` order).
    args: tuple[Any, ...]
    #: The values the block reads, in ``program`` argument order.
    inputs: tuple[TensorInfo, ...]
    #: The values the block produces that later blocks or the model's output use, in return order.
    outputs: tuple[TensorInfo, ...]
    #: Number of tensor operations in the block (kernel launches, for the fixed-cost model).
    op_count: int
    #: Names of ``outputs`` that nothing downstream differentiates: model outputs the training loss does not
    #: read (a Hugging Face model's logits beside the loss it computes, a pooled output beside the hidden states
    #: the loss reads), and values only blocks with no live output use (a block with no output at all has none).
    #: Profilers give them no gradient and free them before backward, as training does; a block all of whose
    #: outputs are dead gives its parameters no gradient, so the optimizer keeps no state for them (set by the
    #: planner, see
    #: :func:`lightning_autopart.planner.profile_model`).
    dead_outputs: frozenset[str] = frozenset()
    #: Names of ``inputs`` that are dead outputs of the blocks that make them: values only dead parts use, so
    #: what the block saves of them goes with its graph before backward (see [Note: a dead part's saves] in
    #: partition/cost.py; set by the planner with ``dead_outputs``).
    dead_inputs: frozenset[str] = frozenset()
    #: The block's program in evaluation mode, where the model's forward branches on the mode in Python
    #: (same inputs and outputs; see [Note: Python branches on the mode] in capture/modes.py); None where
    #: one program serves.
    eval_program: nn.Module | None = None


@dataclass
class CapturedModel:
    """The model as a sequence of blocks; ``cuts[k]`` lists the tensors crossing the cut after block ``k``."""

    #: The captured module itself (never modified).
    module: nn.Module
    #: "export" (torch.export graph split at module boundaries) or "modules" (module hooks on one forward).
    method: str
    #: Blocks in execution order.
    blocks: list[Block]
    #: ``cuts[k]``: every tensor produced by blocks <= k (or a model input) and used by blocks > k or as a
    #: model output; ``cuts[-1]`` is the model's outputs.
    cuts: list[tuple[TensorInfo, ...]]
    #: The model's tensor inputs (the flat leaves of its arguments that are tensors, in order).
    inputs: tuple[TensorInfo, ...]
    #: Samples in the example batch (size of dim 0 of the first input).
    batch_size: int
    #: Shape of every parameter by FQN.
    param_shapes: dict[str, tuple[int, ...]]
    #: Parameter FQNs used by more than one block, with the blocks that use them.
    tied: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: For "export": the top-level graph that calls ``submod_<k>`` for block k; None for "modules".
    split_graph: torch.fx.GraphModule | None = None
    #: The other leaves of its arguments, baked into the programs, as (position among all leaves, value).
    constant_inputs: tuple[tuple[int, Any], ...] = ()
    #: What capture had to give up, each with the user's fix (a fallback to module hooks, modules made one block).
    notes: tuple[str, ...] = ()
    #: How the forward's output is rebuilt from ``cuts[-1]`` (see [Note: output structure] in capture/outputs.py).
    output: OutputSpec = field(default_factory=lambda: OutputSpec.single())
    #: Modules whose forward runs other operations in evaluation mode (see [Note: Python branches on the mode]
    #: in capture/modes.py); empty when both modes agree. Their blocks' ``eval_program`` follow that mode,
    #: where it could be cut alike (:attr:`evaluates`).
    eval_branches: tuple[str, ...] = ()

    @property
    def evaluates(self) -> bool:
        """Whether the blocks follow the model's evaluation mode too: no branch on it, or programs for it."""
        return not self.eval_branches or all(b.eval_program is not None for b in self.blocks)

    @property
    def num_blocks(self) -> int:
        """Number of blocks."""
        return len(self.blocks)
