"""The blocks' evaluation-mode programs: the forward exported in evaluation mode, cut at the training graph's
blocks, for a model whose forward branches on the mode ([Note: Python branches on the mode] in modes.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from lightning_autopart.capture.causal import fold_causal_masks
from lightning_autopart.capture.modes import innermost_module
from lightning_autopart.capture.portable import ModeSwitch
from lightning_autopart.capture.programs import Interface, group_members, lift_inputs, split_programs

__all__ = ["eval_programs"]


def eval_programs(
    ep: Any,
    module: nn.Module,
    train: tuple[list[fx.Node], list[Interface], list[Any], list[list[fx.Node]]],
    home: torch.device | None,
) -> list[fx.GraphModule] | str:
    """Each block's evaluation-mode program, cut from ``ep`` (the forward exported in evaluation mode) at the
    training graph's blocks; ``train`` is that graph's (user inputs, block interfaces, model outputs,
    operations of each block). Or why they cannot stand in for the training programs: the blocks fall
    otherwise, or exchange other values. Every block gets one, though most run as in training: which blocks a
    branch changed is not known (a branch moves glue into a neighbour's block), and together they are the
    evaluation graph.

    An operation goes to the block of the training operation it repeats: the same module's n-th (glue joins
    the block before it where training has no such operation), so glue stays where training put it although
    a branch removed the block it joined by proximity. A block left with no operation (a drop-path block,
    which returns its input in evaluation) passes its inputs on as its outputs (:func:`_pass_through`)."""
    attrs, _, user_inputs = lift_inputs(ep, module)
    fold_causal_masks(ep.graph, {n: v[2] for n, v in attrs.items() if n.op == "placeholder"})
    ops = [n for n in ep.graph.nodes if n.op == "call_function"]
    trained = [n for nodes in train[3] for n in nodes]
    placed = dict(zip(_occurrences(trained), _groups(train[3]), strict=True))
    group: list[int] = []
    for key in _occurrences(ops):
        group.append(placed.get(key, group[-1] if group else 0))
    if group != sorted(group):
        return "its operations fall into other blocks"
    counterpart = _counterparts(trained, ops)
    counterpart.update(zip(train[0], user_inputs, strict=False))
    for k in sorted(set(range(len(train[3]))) - set(group), reverse=True):
        if not _pass_through(ep.graph, ops, group, k, train[1][k], counterpart):
            return "its operations fall into other blocks"
    nodes_of = group_members(group, ops, len(train[3]))
    outputs = list(next(n for n in reversed(ep.graph.nodes) if n.op == "output").args[0])
    interface, programs = split_programs(nodes_of, attrs, outputs, home, ModeSwitch(module, traced=False))
    wanted = _wiring(*train[:3])
    _reorder_inputs(_refs(user_inputs, interface), interface, programs, wanted[0])
    if _wiring(user_inputs, interface, outputs) != wanted:
        return "its blocks exchange other values than in training"
    return list(programs)


def _occurrences(ops: list[fx.Node]) -> list[tuple[str, int]]:
    """Each operation as (its innermost module, how many of that module's operations came before it)."""
    seen: dict[str, int] = {}
    keys = []
    for node in ops:
        fqn = innermost_module(node)
        keys.append((fqn, seen.get(fqn, 0)))
        seen[fqn] = seen.get(fqn, 0) + 1
    return keys


def _groups(nodes_of: list[list[fx.Node]]) -> list[int]:
    return [k for k, nodes in enumerate(nodes_of) for _ in nodes]


def _refs(user_inputs: list[fx.Node], interface: list[Interface]) -> dict[fx.Node, Any]:
    """Each value by where it comes from: a model input (("input", i)), or output j of block k ((k, j))."""
    ref: dict[fx.Node, Any] = {n: ("input", i) for i, n in enumerate(user_inputs)}
    for k, (_, made) in enumerate(interface):
        ref.update({o: (k, j) for j, o in enumerate(made)})
    return ref


def _wiring(user_inputs: list[fx.Node], interface: list[Interface], outputs: list[Any]) -> Any:
    """Where each block's inputs come from, what each returns (shape and dtype) and where the model's outputs
    come from: equal for two cuts that interchange."""
    ref = _refs(user_inputs, interface)
    blocks = [([ref.get(a) for a in inputs], [_value(o) for o in made]) for inputs, made in interface]
    return blocks, [ref.get(o) if isinstance(o, fx.Node) else repr(o) for o in outputs]


def _reorder_inputs(
    ref: dict[fx.Node, Any], interface: list[Interface], programs: list[fx.GraphModule], wanted: list[Any]
) -> None:
    """Give each program the inputs of the training block in its order, where it reads the same ones in
    another (``x + f(x)`` written ``f(x) + x`` by a branch), in place."""
    for (inputs, _), program, (order, _) in zip(interface, programs, wanted, strict=True):
        got = [ref.get(a) for a in inputs]
        if got == order or sorted(map(repr, got)) != sorted(map(repr, order)):
            continue
        position = {r: i for i, r in enumerate(got)}
        inputs[:] = [inputs[position[r]] for r in order]
        placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
        anchor = next(n for n in program.graph.nodes if n.op != "placeholder")
        for r in order:  # each put just before the first operation, after those put before it
            anchor.prepend(placeholders[position[r]])
        program.recompile()


def _value(node: fx.Node) -> Any:
    value = node.meta.get("val")
    return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__


def _counterparts(trained: list[fx.Node], ops: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """The evaluation graph's operation for each training operation it repeats (see :func:`_occurrences`)."""
    mine = dict(zip(_occurrences(ops), ops, strict=True))
    return {n: mine[key] for n, key in zip(trained, _occurrences(trained), strict=True) if key in mine}


def _pass_through(
    graph: fx.Graph,
    ops: list[fx.Node],
    group: list[int],
    k: int,
    trained: Interface,
    counterpart: dict[fx.Node, fx.Node],
) -> bool:
    """Give block ``k``, which has no operation in evaluation mode, its training interface: an ``alias`` of
    each input (in the evaluation graph) as the output in its place, read by the later blocks and the model's
    outputs instead of the input; ``ops`` and ``group`` take the new operations, in place. False where the
    training block does not map as many inputs to outputs of the same shapes and dtypes."""
    inputs, outputs = trained
    if len(inputs) != len(outputs):
        return False
    if any(_value(a) != _value(o) for a, o in zip(inputs, outputs, strict=True)):
        return False
    if any(a not in counterpart for a in inputs):
        return False
    found = [counterpart[a] for a in inputs]
    later = next((i for i, g in enumerate(group) if g > k), len(ops))
    anchor = ops[later] if later < len(ops) else next(n for n in reversed(graph.nodes) if n.op == "output")
    users = set(ops[later:])
    made = []
    for e, o in zip(found, outputs, strict=True):
        with graph.inserting_before(anchor):
            alias = graph.call_function(torch.ops.aten.alias.default, (e,))
        alias.meta = {**e.meta, "nn_module_stack": o.meta.get("nn_module_stack", {})}
        e.replace_all_uses_with(alias, delete_user_cb=lambda user: user in users or user.op == "output")
        made.append(alias)
    ops[later:later] = made
    group[later:later] = [k] * len(made)
    return True
