"""Which normalizations of a captured model reduce over the batch: their results depend on how it is split.

[Note: batch statistics] A batch norm in training normalizes each channel with the mean and variance of the
samples it is given. A pipeline gives it one micro-batch at a time, so a model with one trains on other
numbers than plain Lightning (which normalizes each replica's whole batch), and its running statistics take
one update per micro-batch. The planner cannot hide that, so the plan says so (``batch_statistics`` in its
notes) and the strategy warns, with the fix. Layer, group, instance and RMS norms reduce within a sample and
are unaffected.

[Note: values that mix samples] A forward may combine the samples of its batch into one value: CLIP's and
SigLIP's image-text logits are ``(batch, batch)``, each image scored against every text of the batch. Given one
micro-batch at a time, such a model scores each image against its micro-batch's texts only: another model, and
the loss of plain Lightning's step is not the mean of the micro-batches' (a pipeline of 4 micro-batches trained
CLIP 55 % away from plain Lightning's losses, silently). Two captures at different batch sizes tell it: a value
with more than one dimension that follows the batch size (:func:`mixed_samples`; one such dimension is the batch
itself, or the batch merged with another dimension). Such a model is planned with one micro-batch per replica
(each replica computes on its whole share, as Lightning's DDP does), and a plan asked for more is refused with the
fix. A value that mixes samples with its shape unchanged (``x - x.mean(0)``) is not seen this way; batch norms
are the common case of it, found by their operations above.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from lightning_autopart.capture.graph import CapturedModel

__all__ = ["batch_statistics", "mixed_samples"]

#: aten operations that normalize over the batch, by overload packet name.
_BATCH_NORMS = frozenset(
    {
        "batch_norm",
        "native_batch_norm",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional",
        "_batch_norm_with_update",
        "_batch_norm_with_update_functional",
        "cudnn_batch_norm",
        "miopen_batch_norm",
    }
)


def batch_statistics(captured: CapturedModel) -> tuple[str, ...]:
    """The modules (or, for a functional call, the blocks) whose training forward normalizes with the
    statistics of the batch, in execution order."""
    found: dict[str, None] = {}
    for block in captured.blocks:
        for module in block.program.modules():
            if isinstance(module, fx.GraphModule):
                for node in module.graph.nodes:
                    if _normalizes_over_batch(node):
                        found[_module_of(node) or block.name] = None
        for name, module in _named(block):
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
                found[name] = None
    return tuple(found)


def _normalizes_over_batch(node: fx.Node) -> bool:
    """Whether ``node`` calls a batch norm whose ``training`` flag is not the constant False."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target.namespace != "aten" or target._overloadpacket.__name__ not in _BATCH_NORMS:
        return False
    names = [a.name for a in target._schema.arguments]
    bound = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
    return bound.get("training", True) is not False


def _module_of(node: fx.Node) -> str | None:
    """The FQN of the innermost module that ran ``node``, where the capture recorded it."""
    stack: dict[str, Any] = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return str(path).removeprefix("L['self'].") or None


def _named(block: Any) -> list[tuple[str, nn.Module]]:
    """The block's own modules by FQN, for a capture by module hooks (its program calls them)."""
    if isinstance(block.program, fx.GraphModule):
        return []
    return [(block.name if not name else f"{block.name}.{name}", m) for name, m in block.program.named_modules()]


def mixed_samples(a: CapturedModel, b: CapturedModel) -> tuple[str, ...]:
    """Where the forward combines samples into one value (see [Note: values that mix samples]): between the
    captures ``a`` and ``b`` of one model at two batch sizes, the values with more than one dimension that follows
    the batch size, as "block: operation (shape at a's batch)", in execution order; empty when the two captures'
    programs cannot be matched node for node (captured by module hooks, or another structure)."""
    found: dict[str, None] = {}
    if a.batch_size == b.batch_size:
        return ()
    for x, y in zip(a.blocks, b.blocks, strict=False):
        graphs = zip(x.program.modules(), y.program.modules(), strict=False)
        for gx, gy in graphs:
            if not (isinstance(gx, fx.GraphModule) and isinstance(gy, fx.GraphModule)):
                continue
            nodes = (list(gx.graph.nodes), list(gy.graph.nodes))
            if len(nodes[0]) != len(nodes[1]):
                continue
            for p, q in zip(*nodes, strict=True):
                if _follows_twice(p.meta.get("val"), q.meta.get("val")):
                    found[f"{_module_of(p) or x.name}: {p.target} {tuple(p.meta['val'].shape)}"] = None
    return tuple(found)


def _follows_twice(a: Any, b: Any) -> bool:
    """Whether tensors ``a`` and ``b`` (one value at two batch sizes) differ in more than one dimension."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim()):
        return False
    return sum(m != n for m, n in zip(a.shape, b.shape, strict=True)) > 1

