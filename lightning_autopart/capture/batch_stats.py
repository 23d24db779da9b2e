"""Which normalizations of a captured model reduce over the batch: their results depend on how it is split.

[Note: batch statistics] A batch norm in training normalizes each channel with the mean and variance of the
samples it is given. A pipeline gives it one micro-batch at a time, so a model with one trains on other
numbers than plain Lightning (which normalizes each replica's whole batch), and its running statistics take
one update per micro-batch. The planner cannot hide that, so the plan says so (``batch_statistics`` in its
notes) and the strategy warns, with the fix. Layer, group, instance and RMS norms reduce within a sample and
are unaffected.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from lightning_autopart.capture.graph import CapturedModel

__all__ = ["batch_statistics"]

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
