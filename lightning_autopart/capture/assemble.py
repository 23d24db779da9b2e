"""Assembly of a CapturedModel from raw blocks: tensor records, cuts, tied parameters and batch size."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_autopart.capture.graph import Block, CapturedModel, OutputSpec, TensorInfo

__all__: list[str] = []


@dataclass(slots=True)
class RawBlock:
    """A block before assembly: values are named, not yet described by :class:`TensorInfo`."""

    name: str
    modules: tuple[str, ...]
    params: tuple[str, ...]
    buffers: tuple[str, ...]
    program: nn.Module
    args: tuple[Any, ...]
    #: Names of the values the block reads, in program argument order.
    inputs: tuple[str, ...]
    #: Names of the values the program returns.
    outputs: tuple[str, ...]
    op_count: int


def describe(
    name: str, value: Any, producer: int, consumers: Sequence[int], requires_grad: bool = False, key: str = ""
) -> TensorInfo:
    """A :class:`TensorInfo` for a tensor (real, meta or fake); a non-tensor gets shape () and 0 bytes."""
    if isinstance(value, torch.Tensor):
        shape = tuple(int(s) for s in value.shape)
        nbytes = value.numel() * value.element_size()
        dtype = str(value.dtype).removeprefix("torch.")
    else:
        shape, nbytes, dtype = (), 0, type(value).__name__
    floating = isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())
    return TensorInfo(
        name, shape, dtype, nbytes, producer, tuple(sorted(set(consumers))), requires_grad and floating, key
    )


def assemble(
    module: nn.Module,
    method: str,
    raw: list[RawBlock],
    inputs: list[tuple[str, Any]],
    values: dict[str, Any],
    outputs: list[str],
    split_graph: torch.fx.GraphModule | None = None,
    output: OutputSpec | None = None,
    grads: set[str] | None = None,
    keys: dict[str, str] | None = None,
) -> CapturedModel:
    """Build the :class:`CapturedModel`.

    Args:
        module: The captured module.
        method: "export" or "modules".
        raw: The blocks in execution order.
        inputs: The model's flat inputs as (name, example value), in order; the tensors become the captured
            model's inputs, the other values (baked into the programs) its ``constant_inputs``.
        values: Example value (for shape and dtype) of every block output named in ``raw``.
        outputs: Names of the model's tensor outputs, in order (one per tensor leaf of ``output``).
        split_graph: The top-level graph calling ``submod_<k>`` ("export" only).
        output: How the forward's output is rebuilt from its tensor leaves (default: one tensor).
        grads: Names of the values that need a gradient (default: a block's floating outputs when the block
            uses a trainable parameter or receives a value that needs one).
        keys: Structural key of each value (export): the cuts list the model's inputs, then each block's
            outputs in key order, alike on every rank (see [Note: rank-independent values] in
            capture/keys.py); default: execution order.
    """
    n = len(raw)
    producer = {name: -1 for name, _ in inputs}
    examples = dict(inputs) | values
    for k, block in enumerate(raw):
        producer.update((name, k) for name in block.outputs)
    consumers: dict[str, list[int]] = {name: [] for name in producer}
    for k, block in enumerate(raw):
        for name in block.inputs:
            consumers[name].append(k)
    for name in outputs:
        consumers[name].append(n)
    if grads is None:
        grads = _block_grads(module, raw)
    keys = keys or {}
    info = {
        name: describe(name, examples[name], producer[name], consumers[name], name in grads, keys.get(name, ""))
        for name in producer
    }
    order = list(info.values())  # model inputs, then block outputs in execution order
    if keys:  # each block's outputs by key: a rank's run order within a block is its own
        order.sort(key=lambda t: (t.producer, t.key if t.producer >= 0 else ""))
    cuts = [
        tuple(t for t in order if t.producer <= k and t.consumers and t.consumers[-1] > k)
        for k in range(n - 1)
    ]
    final = list(dict.fromkeys(outputs))
    cuts.append(tuple(info[name] for name in final))
    spec = output or OutputSpec.single()
    spec = spec.with_slots([None if s is None else final.index(outputs[s]) for s in spec.slots])

    blocks = [
        Block(
            index=k,
            name=b.name,
            modules=b.modules,
            params=b.params,
            buffers=b.buffers,
            program=b.program,
            args=b.args,
            inputs=tuple(info[name] for name in b.inputs),
            outputs=tuple(info[name] for name in b.outputs),
            op_count=b.op_count,
        )
        for k, b in enumerate(raw)
    ]
    users: dict[str, list[int]] = {}
    for k, b in enumerate(raw):
        for name in b.params:
            users.setdefault(name, []).append(k)
    first = next((t for t in info.values() if t.producer < 0 and t.shape), None)
    return CapturedModel(
        module=module,
        method=method,
        blocks=blocks,
        cuts=cuts,
        inputs=tuple(info[name] for name, value in inputs if isinstance(value, torch.Tensor)),
        constant_inputs=tuple((i, v) for i, (_, v) in enumerate(inputs) if not isinstance(v, torch.Tensor)),
        batch_size=first.shape[0] if first is not None else 1,
        param_shapes={name: tuple(p.shape) for name, p in module.named_parameters()},
        tied={name: tuple(ks) for name, ks in users.items() if len(ks) > 1},
        split_graph=split_graph,
        output=spec,
    )


def _block_grads(module: nn.Module, raw: list[RawBlock]) -> set[str]:
    """Values needing a gradient, block by block: all outputs of a block that uses a trainable parameter or
    receives such a value (floating ones only count; see :func:`describe`)."""
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    grads: set[str] = set()
    for block in raw:
        if trainable.intersection(block.params) or grads.intersection(block.inputs):
            grads.update(block.outputs)
    return grads
