"""Capture by torch.export: one graph of the whole forward, cut at block boundaries into one program each."""

from __future__ import annotations

import contextlib
import io
import logging
import operator
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from lightning_autopart.capture.assemble import RawBlock, assemble
from lightning_autopart.capture.tree import block_modules, param_weight
from lightning_autopart.errors import CaptureError
from lightning_autopart.graph import CapturedModel

__all__: list[str] = []

_ATTR_KINDS = {InputKind.PARAMETER: "param", InputKind.BUFFER: "buffer", InputKind.CONSTANT_TENSOR: "const"}


def capture_export(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], max_blocks: int
) -> CapturedModel:
    """Export ``module`` (non-strict), cut its graph at block boundaries and record each block's inputs."""
    with _quiet():
        ep = torch.export.export(module, args, kwargs, strict=False)
    cls = type(module).__name__
    attrs, canonical, user_inputs = _lifted(ep, module)
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    for spec in ep.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise CaptureError(
                f"cannot capture {cls}: torch.export gave an unsupported output {spec.kind.name}"
            )
    model_outputs: list[Any] = list(out_node.args[0])
    ops = [n for n in ep.graph.nodes if n.op == "call_function"]
    if not ops:
        raise CaptureError(f"cannot capture {cls}: its forward performs no tensor operations")

    fqns, owner = _owners(module, ops, max_blocks)
    group, members = contiguous_groups(owner)
    nodes_of = group_members(group, ops, len(members))
    interface, programs = _split(nodes_of, attrs, model_outputs)
    split_graph = _top_graph(cls, user_inputs, interface, programs, model_outputs)
    flat = pytree.tree_leaves((args, _reorder(kwargs, ep.call_spec.in_spec)))
    recorder = _Recorder(split_graph)
    with torch.no_grad():
        recorder.run(*flat)

    blocks = []
    for k, ((inputs, outputs), nodes) in enumerate(zip(interface, nodes_of, strict=True)):
        used = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a in attrs))
        blocks.append(
            RawBlock(
                name="+".join(fqns[b] or cls for b in members[k]),
                modules=tuple(fqns[b] for b in members[k]),
                params=tuple(canonical[a] for a in used if attrs[a][0] == "param"),
                buffers=tuple(canonical[a] for a in used if attrs[a][0] == "buffer"),
                program=split_graph.get_submodule(f"submod_{k}"),
                args=recorder.seen[f"submod_{k}"],
                inputs=tuple(a.name for a in inputs),
                outputs=tuple(o.name for o in outputs),
                op_count=sum(1 for n in nodes if _counts(n)),
            )
        )
    values = {o.name: o.meta.get("val") for _, outputs in interface for o in outputs}
    inputs_info = [(p.name, v) for p, v in zip(user_inputs, flat, strict=True)]
    out_names = [o.name for o in model_outputs if isinstance(o, fx.Node)]
    return assemble(module, "export", blocks, inputs_info, values, out_names, split_graph)


def _lifted(
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


def _owners(module: nn.Module, ops: list[fx.Node], max_blocks: int) -> tuple[list[str], list[int | None]]:
    """Choose the block modules; give each operation the block whose module its nn_module_stack names.

    Returns:
        The block FQNs, and each operation's block index (None for glue outside every block).
    """
    paths = [{path for path, _ in n.meta.get("nn_module_stack", {}).values()} for n in ops]
    ops_under = Counter(p for ps in paths for p in ps)
    weight = param_weight(module)
    fqns = block_modules(module, max_blocks, weight if weight("") > 0 else ops_under.__getitem__)
    index = {f: i for i, f in enumerate(fqns)}
    position = {n: i for i, n in enumerate(ops)}
    owner: list[int | None] = []
    for node, ps in zip(ops, paths, strict=True):
        source = node.args[0] if node.target is operator.getitem else None
        if isinstance(source, fx.Node) and source in position:  # a tuple access stays with its tuple
            owner.append(owner[position[source]])
        else:
            owner.append(next((index[p] for p in ps if p in index), None))
    if all(o is None for o in owner):  # every operation is glue: the whole model is one block
        return [""], [0] * len(ops)
    return fqns, owner


def _top_graph(
    cls: str,
    user_inputs: list[fx.Node],
    interface: list[tuple[list[fx.Node], list[fx.Node]]],
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


def contiguous_groups(owner: Sequence[int | None]) -> tuple[list[int], list[list[int]]]:
    """Group blocks so each group's nodes are contiguous; give every node (glue included) its group.

    ``owner[i]`` is the block of node ``i`` in execution order, or None for glue. Blocks whose spans of
    nodes overlap (a module called at two distant places) are merged with everything between. Glue joins
    the group of the next owned node; trailing glue joins the last group.

    Returns:
        The group of each node, and the blocks of each group (groups in execution order).
    """
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for pos, b in enumerate(owner):
        if b is not None:
            first.setdefault(b, pos)
            last[b] = pos
    members: list[list[int]] = []
    group_of: dict[int, int] = {}
    end = -1
    for b in sorted(first, key=first.__getitem__):
        if members and first[b] < end:
            members[-1].append(b)
        else:
            members.append([b])
        end = max(end, last[b])
        group_of[b] = len(members) - 1
    group = [0] * len(owner)
    following = len(members) - 1
    for pos in reversed(range(len(owner))):
        b = owner[pos]
        if b is not None:
            following = group_of[b]
        group[pos] = following
    return group, members


def group_members(group: list[int], ops: list[fx.Node], count: int) -> list[list[fx.Node]]:
    """The nodes of each group, in execution order."""
    out: list[list[fx.Node]] = [[] for _ in range(count)]
    for node, g in zip(ops, group, strict=True):
        out[g].append(node)
    return out


def _split(
    nodes_of: list[list[fx.Node]], attrs: dict[fx.Node, tuple[str, str, Any]], model_outputs: list[Any]
) -> tuple[list[tuple[list[fx.Node], list[fx.Node]]], list[fx.GraphModule]]:
    """One GraphModule per group, returning a tuple; parameters are get_attr of the user's own tensors.

    Returns:
        Each program's input and output nodes (of the exported graph), and the programs.
    """
    of = {n: k for k, nodes in enumerate(nodes_of) for n in nodes}
    final = {o for o in model_outputs if isinstance(o, fx.Node)}
    interface: list[tuple[list[fx.Node], list[fx.Node]]] = []
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
        programs.append(fx.GraphModule(root, graph, class_name=f"Block{k}"))
        interface.append((inputs, outputs))
    return interface, programs


def _counts(node: fx.Node) -> bool:
    """Whether a node is a tensor operation (not a tuple access or an assertion)."""
    return node.target is not operator.getitem and not str(node.target).startswith(
        ("aten._assert", "aten.sym")
    )


def _reorder(kwargs: dict[str, Any], in_spec: pytree.TreeSpec | None) -> dict[str, Any]:
    """``kwargs`` in the order torch.export flattened them (the forward signature's order)."""
    if in_spec is None or in_spec.num_children != 2 or in_spec.child(1).type is not dict:
        return kwargs
    return {key: kwargs[key] for key in in_spec.child(1).context}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence torch.export's dump of the partial graph and its shape warnings when it fails (we report it)."""
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


class _Recorder(fx.Interpreter):
    """Runs the split graph once and keeps the arguments each block program was called with."""

    def __init__(self, graph_module: fx.GraphModule) -> None:
        super().__init__(graph_module)
        self.seen: dict[str, tuple[Any, ...]] = {}

    def call_module(self, target: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        self.seen[str(target)] = tuple(args)
        return super().call_module(target, args, kwargs)
