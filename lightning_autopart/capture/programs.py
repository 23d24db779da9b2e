"""Cutting an exported graph into block programs: its lifted inputs sorted, operations grouped into runs of
one block each ([Note: runs] in via_export.py), and one GraphModule per run with its interface."""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind

from lightning_autopart.capture.portable import ModeSwitch, make_portable
from lightning_autopart.capture.tree import block_modules, param_weight
from lightning_autopart.errors import CaptureError

__all__ = [
    "choose_blocks", "group_members", "group_ops", "lift_inputs", "runs", "split_programs", "top_graph",
]  # fmt: skip

_ATTR_KINDS = {InputKind.PARAMETER: "param", InputKind.BUFFER: "buffer", InputKind.CONSTANT_TENSOR: "const"}

#: One program's interface: its input nodes and output nodes, of the exported graph.
Interface = tuple[list[fx.Node], list[fx.Node]]


def lift_inputs(
    ep: torch.export.ExportedProgram, module: nn.Module
) -> tuple[dict[fx.Node, tuple[str, str, Any]], dict[fx.Node, str], list[fx.Node]]:
    """Sort the exported graph's inputs into lifted tensors and user inputs.

    Returns:
        For each parameter, buffer or constant node: (kind, get_attr target, the user's own object); for each
        parameter or buffer node, its canonical FQN (a tied parameter's first name); the user input nodes.
    """
    fqn_of = {id(t): n for n, t in (*module.named_parameters(), *module.named_buffers())}
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    attrs: dict[fx.Node, tuple[str, str, Any]] = {}
    canonical: dict[fx.Node, str] = {}
    user_inputs: list[fx.Node] = []
    for spec in ep.graph_signature.input_specs:
        node = placeholders[spec.arg.name]
        if spec.kind == InputKind.USER_INPUT:
            user_inputs.append(node)
            continue
        if spec.kind not in _ATTR_KINDS or spec.target is None:
            raise CaptureError(
                f"cannot capture {type(module).__name__}: torch.export gave an unsupported input {spec.kind.name}"
            )
        kind = _ATTR_KINDS[spec.kind]
        if kind == "param":
            obj: Any = module.get_parameter(spec.target)
        elif kind == "buffer":
            obj = module.get_buffer(spec.target)
        else:
            obj = ep.constants[spec.target]
        attrs[node] = (kind, spec.target, obj)
        canonical[node] = fqn_of.get(id(obj), spec.target)
    for node in ep.graph.nodes:
        if node.op == "get_attr":  # subgraphs of higher-order ops (torch.cond, ...)
            attrs[node] = ("const", str(node.target), ep.graph_module.get_submodule(str(node.target)))
    return attrs, canonical, user_inputs


def choose_blocks(
    module: nn.Module, ops: list[fx.Node], max_blocks: int
) -> tuple[list[str], list[int], list[int]]:
    """Choose the block modules and group the operations into runs of one block each (see [Note: runs]).

    Every operation goes to the block whose module its ``nn_module_stack`` names; glue outside every block
    stays with the module whose forward runs it (see :func:`_owners`).

    Returns:
        The block FQNs, each operation's group, and each group's block.
    """
    paths = [{path for path, _ in n.meta.get("nn_module_stack", {}).values()} for n in ops]
    weight = param_weight(module)
    ops_under = Counter(p for ps in paths for p in ps)
    fqns = block_modules(module, max_blocks, weight if weight("") > 0 else ops_under.__getitem__)
    group, group_blocks = group_ops(fqns, ops)
    return (fqns, group, group_blocks) if group_blocks is not None else ([""], group, [0])


def group_ops(fqns: list[str], ops: list[fx.Node]) -> tuple[list[int], list[int] | None]:
    """Each operation's group and each group's block, for the blocks ``fqns`` (see :func:`runs`); the blocks
    are None when every operation is glue (the whole model is then one block)."""
    paths = [{path for path, _ in n.meta.get("nn_module_stack", {}).values()} for n in ops]
    owner = _owners(fqns, ops, paths)
    if all(o is None for o in owner):
        return [0] * len(ops), None
    return runs(owner)


def runs(owner: Sequence[int | None]) -> tuple[list[int], list[int]]:
    """Group operations into maximal contiguous runs of one block; glue (None) joins the run that follows it.

    Returns:
        Each operation's group, and each group's block (groups in execution order). Trailing glue joins the
        last group; if every operation is glue there is one group, of block 0.
    """
    filled: list[int | None] = list(owner)
    following: int | None = None
    for pos in reversed(range(len(filled))):
        if filled[pos] is None:
            filled[pos] = following
        following = filled[pos]
    last = next((b for b in reversed(owner) if b is not None), 0)
    group: list[int] = []
    blocks: list[int] = []
    for b in filled:
        b = last if b is None else b
        if not blocks or blocks[-1] != b:
            blocks.append(b)
        group.append(len(blocks) - 1)
    return group, blocks or [0]


def _owners(fqns: list[str], ops: list[fx.Node], paths: list[set[str]]) -> list[int | None]:
    """Each operation's block index; a tuple access stays with its tuple.

    Glue (an operation outside every block) stays inside the module whose forward runs it: it joins the next
    block within that module, else the previous one (a residual add after the last child); glue of the root
    (None here) joins the block that follows it.
    """
    index = {f: i for i, f in enumerate(fqns)}
    position = {n: i for i, n in enumerate(ops)}
    owner: list[int | None] = []
    for node, ps in zip(ops, paths, strict=True):
        source = node.args[0] if node.target is operator.getitem else None
        if isinstance(source, fx.Node) and source in position:
            owner.append(owner[position[source]])
        else:
            owner.append(next((index[p] for p in ps if p in index), None))
    after: list[int | None] = [None] * len(ops)
    for pos in reversed(range(len(ops) - 1)):
        after[pos] = owner[pos + 1] if owner[pos + 1] is not None else after[pos + 1]
    before: int | None = None
    for pos, node in enumerate(ops):
        if owner[pos] is not None:
            before = owner[pos]
            continue
        stack = list(node.meta.get("nn_module_stack", {}).values())
        inner = stack[-1][0] if stack else ""
        if not inner:
            continue
        inside = [b for b in (after[pos], before) if b is not None and fqns[b].startswith(inner + ".")]
        owner[pos] = inside[0] if inside else None
    return owner


def top_graph(
    cls: str,
    user_inputs: list[fx.Node],
    interface: list[Interface],
    programs: list[fx.GraphModule],
    model_outputs: list[Any],
) -> fx.GraphModule:
    """The graph that calls ``submod_<k>`` for each block and returns the model's flat outputs as a tuple."""
    top = fx.Graph()
    env: dict[fx.Node, fx.Node] = {p: top.placeholder(p.name) for p in user_inputs}
    for k, (inputs, outputs) in enumerate(interface):
        call = top.call_module(f"submod_{k}", tuple(env[a] for a in inputs))
        for j, node in enumerate(outputs):
            env[node] = top.call_function(operator.getitem, (call, j))
    top.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in model_outputs))
    holder = nn.Module()
    for k, program in enumerate(programs):
        holder.add_module(f"submod_{k}", program)
    return fx.GraphModule(holder, top, class_name=f"{cls}Split")


def group_members(group: list[int], ops: list[fx.Node], count: int) -> list[list[fx.Node]]:
    """The nodes of each group, in execution order."""
    out: list[list[fx.Node]] = [[] for _ in range(count)]
    for node, g in zip(ops, group, strict=True):
        out[g].append(node)
    return out


def split_programs(
    nodes_of: list[list[fx.Node]],
    attrs: dict[fx.Node, tuple[str, str, Any]],
    model_outputs: list[Any],
    home: torch.device | None,
    switch: ModeSwitch,
) -> tuple[list[Interface], list[fx.GraphModule]]:
    """One GraphModule per group, returning a tuple; parameters are get_attr of the user's own tensors, and
    tensors created inside follow the device of the program's inputs (see [Note: portable programs]) and
    training flags the mode of the user's modules (see [Note: modes]).

    Returns:
        Each program's input and output nodes (of the exported graph), and the programs.
    """
    of = {n: k for k, nodes in enumerate(nodes_of) for n in nodes}
    final = {o for o in model_outputs if isinstance(o, fx.Node)}
    interface: list[Interface] = []
    programs: list[fx.GraphModule] = []
    for k, nodes in enumerate(nodes_of):
        inputs = list(
            dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in attrs and of.get(a) != k)
        )
        used = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a in attrs))
        outputs = [
            n for n in nodes if n in final or any(u.op == "call_function" and of[u] > k for u in n.users)
        ]
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for a in inputs:
            env[a] = graph.placeholder(a.name)
            env[a].meta = dict(a.meta)
        for a in used:
            env[a] = graph.get_attr(attrs[a][1])
        for n in nodes:
            env[n] = graph.node_copy(n, env.__getitem__)
        graph.output(tuple(env[o] for o in outputs))
        root = {attrs[a][1]: attrs[a][2] for a in used}
        program = fx.GraphModule(root, graph, class_name=f"Block{k}")
        make_portable(program, home, switch)
        programs.append(program)
        interface.append((inputs, outputs))
    return interface, programs
