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
CLIP 55 % away from plain Lightning's losses, silently). A ``training_step`` may do the same with the model's
output (a contrastive loss's ``z @ y.T``: losses 31-51 % lower with 4 micro-batches), and a forward or a step
may compute a statistic of the batch back into its samples (``x - x.mean(0)``, a Barlow Twins loss). Two runs at
different batch sizes tell all of these ([Note: sample flow] in sample_flow.py): :func:`mixed_samples` compares
two captures of the forward node by node, ``step_flow`` (profile/step_checks.py) two traces of the step's loss. Such
a model is planned with one micro-batch per replica (each replica computes on its whole share, as Lightning's
DDP does), and a plan asked for more is refused with the fix. Batch norms are found by their operations above
(they combine the batch inside one), and keep their micro-batches with a warning, as GPipe trains them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.capture.sample_flow import SampleFlow, walk_graph

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
    """Where the forward mixes samples (see [Note: values that mix samples] and [Note: sample flow]): between
    the captures ``a`` and ``b`` of one model at two batch sizes, the values with more than one dimension that
    follows the batch size, and the per-sample values computed from a value over the whole batch, as "block:
    operation (shape at a's batch)", in execution order; nothing where the two captures' programs cannot be
    matched node for node (captured by module hooks, or another structure)."""
    if a.batch_size == b.batch_size:
        return ()
    flow = SampleFlow()
    for x, y in zip(a.blocks, b.blocks, strict=False):

        def where(node: fx.Node, block: str = x.name) -> str:
            return f"{_module_of(node) or block}: {node.target}"

        top = x.program if isinstance(x.program, fx.GraphModule) else None
        for gx, gy in zip(x.program.modules(), y.program.modules(), strict=False):
            if not (isinstance(gx, fx.GraphModule) and isinstance(gy, fx.GraphModule)):
                continue
            inputs = [t.name for t in x.inputs] if gx is top else []
            if walk_graph(flow, gx.graph, gy.graph, where, inputs) and gx is top:
                _name_outputs(flow, gx.graph, [t.name for t in x.outputs])
    return tuple(f"{place}, from a value over the whole batch" if kind == "statistics" else place
                 for place, kind in flow.found.items())  # fmt: skip


def _name_outputs(flow: SampleFlow, graph: fx.Graph, names: list[str]) -> None:
    """Give the values a block returns the kinds of the nodes that make them, under the names later blocks read
    them by."""
    returned = [n for n in graph.nodes if n.op == "output"]
    if not returned:
        return
    values = returned[0].args[0]
    values = values if isinstance(values, (tuple, list)) else (values,)
    for name, node in zip(names, values, strict=False):
        if isinstance(node, fx.Node) and node in flow.kinds:
            flow.kinds[name] = flow.kinds[node]
