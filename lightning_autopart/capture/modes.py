"""Forwards that take another path in evaluation mode, which the captured (training-mode) graph cannot follow.

[Note: Python branches on the mode] A model is captured in training mode, and the flags that operations take
(dropout's ``train``, batch norm's ``training``) follow each module's mode when the programs run ([Note:
modes] in portable.py). A Python branch on ``self.training`` is different: torch.export records the path the
training mode took. Stochastic depth is the common case (``if not self.training or p == 0: return x`` in the
drop-path of Swin, BEiT and timm's models): a pipelined validation step would still drop paths at random,
and its metrics would be wrong with no error. So an exported model is exported a second time in evaluation
mode, and the two graphs are compared with the mode flags blanked (and batch norm's ``num_batches_tracked``
update, made in training only, left out). The modules whose operations differ are kept on the capture
(``CapturedModel.eval_branches``).

Each block then gets a second program, cut from the evaluation-mode graph at the same blocks
(``Block.eval_program``, capture/mode_programs.py); a stage runs those while the modules are in evaluation
mode (:func:`lightning_autopart.runtime.stages.build_stage_module`), so pipelined validation follows the
model's evaluation path. Where the evaluation graph cannot be cut alike (its blocks exchange other values,
or it does not export), no program is made, and a pipelined evaluation step is refused with the fix
(:func:`lightning_autopart.lightning.steps.PipelinedSteps.check_mode`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn

from lightning_autopart.capture.data_reads import writes_data
from lightning_autopart.capture.portable import MODE_ARGS

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SDPA_DROPOUT = 4  # position of its dropout_p
_CONTIGUOUS = torch.ops.aten.contiguous.default
_CHECK = torch.ops.aten._assert_tensor_metadata.default

__all__ = [
    "branch_mode", "eval_branches", "evaluating", "innermost_module", "mixed_modes", "modules_of", "signature",
]  # fmt: skip

_Signature = list[tuple[str, str, tuple[Any, ...]]]  # (innermost module FQN, op, normalised arguments)


def signature(graph: fx.Graph, training: bool) -> _Signature:
    """The graph's operations in order, each with its module, with what follows the mode at run time made
    equal: mode flags blanked ([Note: modes]), attention's dropout probability blanked where the run-time rule
    (``p`` in training, 0 in evaluation) gives the graph's value, batch norm's batch count and ``contiguous``
    (a copy the layout of a kernel's output decides) left out, and so are operations no output depends on (but
    writes through a ``.data`` read, [Note: .data in the forward]). An operation's inputs are named by the
    module that made them, so a branch changes its own module only (and those that read its output)."""
    made_by: dict[fx.Node, Any] = {}
    found: _Signature = []
    live = _live(graph)
    for node in graph.nodes:
        if node not in live:  # feeds no output (a cache that only evaluation fills, and capture drops)
            continue
        if node.op == "placeholder":
            made_by[node] = node.name
        elif node.op == "call_function":
            if _counts_batches(node) or node.target is _CHECK:  # training's count; export's own checks
                continue
            if node.target is _CONTIGUOUS:  # a copy only where the layout needs one, which kernels decide
                made_by[node] = _norm(node.args[0], made_by)
                continue
            fqn = innermost_module(node)
            made_by[node] = ("%", fqn)
            named = _named(node, made_by)
            position = MODE_ARGS.get(node.target)
            if position is not None and position in named:
                named[position] = "<mode>"
            if node.target is _SDPA:  # as ModeSwitch.dropout reads it: p in training, 0 in evaluation
                p = named.get(_SDPA_DROPOUT, 0.0)
                named[_SDPA_DROPOUT] = "<p>" if training or p == 0.0 else p
            found.append((fqn, str(node.target), tuple(sorted(named.items(), key=str))))
    return found


def _live(graph: fx.Graph) -> set[fx.Node]:
    """The nodes some output depends on (buffer updates are outputs of an exported graph too), or a write through
    a ``.data`` read does ([Note: .data in the forward])."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    live: set[fx.Node] = set()
    stack = [out, *(n for n in graph.nodes if writes_data(n))]
    while stack:
        node = stack.pop()
        if node not in live:
            live.add(node)
            stack.extend(node.all_input_nodes)
    return live


def _named(node: fx.Node, made_by: dict[fx.Node, Any]) -> dict[Any, Any]:
    """The node's arguments by position in its operator's schema, defaults filled in (so ``f(x, None)`` and
    ``f(x)`` agree), each normalised by :func:`_norm`."""
    named: dict[Any, Any] = {i: _norm(a, made_by) for i, a in enumerate(node.args)}
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        named.update({k: _norm(v, made_by) for k, v in node.kwargs.items()})
        return named
    for i, argument in enumerate(schema.arguments):
        if argument.name in node.kwargs:
            named[i] = _norm(node.kwargs[argument.name], made_by)
        elif i not in named and argument.has_default_value():
            named[i] = _norm(argument.default_value, made_by)
    return named


def _norm(value: Any, made_by: dict[fx.Node, Any]) -> Any:
    if isinstance(value, fx.Node):
        return made_by.get(value, value.op)
    if isinstance(value, (list, tuple)):
        return tuple(_norm(v, made_by) for v in value)
    return repr(value) if not isinstance(value, (int, float, bool, str, type(None))) else value


def _counts_batches(node: fx.Node) -> bool:
    """Batch norm's ``num_batches_tracked += 1``, which only training mode runs."""
    first = node.args[0] if node.args else None
    return (
        "add" in str(node.target)
        and isinstance(first, fx.Node)
        and first.op == "placeholder"
        and "num_batches_tracked" in first.name
    )


@contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """``module`` in evaluation mode (``eval()``, so a user's ``train`` override runs) for the body; every
    submodule's flag put back after."""
    modes = [(m, m.training) for m in module.modules()]
    try:
        module.eval()
        yield
    finally:
        for m, training in modes:
            m.training = training


def eval_branches(module: nn.Module, train: _Signature, export: Callable[[], Any]) -> tuple[list[str], Any]:
    """The modules whose forward runs other operations in evaluation mode than ``train`` (the training-mode
    :func:`signature`), innermost only (a parent differs with its child), and the evaluation-mode export;
    ``export`` exports ``module`` as capture does. No modules when both modes agree; no export if it fails."""
    try:
        with evaluating(module):
            ep = export()
    except Exception as error:  # the evaluation path itself does not export: it is another path
        name = type(module).__name__
        return [f"{name} (its evaluation mode does not export: {type(error).__name__})"], None
    other = signature(ep.graph, training=False)
    if other == train:
        return [], ep
    by_module: dict[str, list[Any]] = {}
    for fqn, *op in train:
        by_module.setdefault(fqn, []).append(("train", op))
    for fqn, *op in other:
        by_module.setdefault(fqn, []).append(("eval", op))
    differ = [fqn for fqn, ops in by_module.items() if _side(ops, "train") != _side(ops, "eval")]
    return _innermost_of(differ) or [type(module).__name__], ep


def _side(ops: list[Any], mode: str) -> list[Any]:
    return [op for m, op in ops if m == mode]


def innermost_module(node: fx.Node) -> str:
    """The FQN of the innermost module whose forward ran ``node`` ("" for the root's own operations)."""
    stack = list(node.meta.get("nn_module_stack", {}).values())
    return str(stack[-1][0]) if stack else ""


def _innermost_of(fqns: list[str]) -> list[str]:
    """``fqns`` without those that hold another of them (a parent differs with its child), sorted."""
    return sorted(f for f in fqns if not any(o != f and (f == "" or o.startswith(f + ".")) for o in fqns))


def modules_of(module: nn.Module, branches: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The modules ``branches`` names in ``module``, by name (``module`` itself where it names none)."""
    names = dict(module.named_modules(remove_duplicate=False))
    return [(f, names[f]) for f in branches if f in names] or [("<root>", module)]


def branch_mode(modules: list[tuple[str, nn.Module]]) -> bool | None:
    """Whether ``modules`` are all in training mode (True), all in evaluation mode (False), or mixed (None):
    a stage holds one program for each mode, not one for each mix."""
    modes = {bool(m.training) for _, m in modules}
    return modes.pop() if len(modes) == 1 else None


def mixed_modes(modules: list[tuple[str, nn.Module]]) -> str:
    """The error for ``modules`` in mixed modes, with the fix."""
    training = [repr(f) for f, m in modules if m.training]
    evaluating = [repr(f) for f, m in modules if not m.training]
    return (
        f"the modules that branch on self.training are in mixed modes (training: {', '.join(training[:3])}; "
        f"evaluating: {', '.join(evaluating[:3])}), and a pipeline stage holds one program per mode, not one "
        "per mix; set their modes alike (model.train() or model.eval(), or override train() to set them)"
    )
