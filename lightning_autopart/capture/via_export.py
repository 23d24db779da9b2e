"""Capture by torch.export: one graph of the whole forward, cut at block boundaries into one program each.

[Note: runs] A block is a contiguous run of operations. A module whose operations are interrupted by another
block's (a layer called twice, a shared bias module used by every layer) becomes one block per run; the
parameters it uses then appear in several blocks and are handled as tied weights (one owner, gradients summed
over the stages holding a copy), so a shared module never fuses everything between its uses into one block.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from lightning_autopart.capture.attributes import watch_attributes
from lightning_autopart.capture.backward_hooks import TensorHooks, backward_hooked, record_tensor_hooks
from lightning_autopart.capture.causal import fold_causal_masks
from lightning_autopart.capture.functions import watch_functions
from lightning_autopart.capture.graph import CapturedModel, OutputSpec
from lightning_autopart.capture.host_random import watch_host_random
from lightning_autopart.capture.meta_layouts import meta_layouts
from lightning_autopart.capture.modes import eval_branches, signature
from lightning_autopart.capture.outputs import flat_forward
from lightning_autopart.capture.portable import ModeSwitch, home_device, make_portable
from lightning_autopart.capture.tree import block_modules, param_weight
from lightning_autopart.errors import CaptureError

__all__: list[str] = []

_ATTR_KINDS = {InputKind.PARAMETER: "param", InputKind.BUFFER: "buffer", InputKind.CONSTANT_TENSOR: "const"}


def capture_export(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    max_blocks: int,
    check_eval: bool = False,
) -> CapturedModel:
    """Export ``module`` (non-strict), cut its graph at block boundaries and record each block's inputs; with
    ``check_eval``, export it again in evaluation mode to find Python branches on the mode ([Note: Python
    branches on the mode])."""
    found: list[OutputSpec] = []
    cls = type(module).__name__
    hooked = backward_hooked(module)  # see [Note: backward hooks]
    if hooked:
        raise CaptureError(
            f"module {hooked[0]!r} of {cls} has backward hooks, which an exported graph would leave out; "
            "module hooks run them"
        )
    # See [Note: host random numbers], [Note: Python state in the forward], [Note: custom autograd functions].
    with (
        _quiet(),
        flat_forward(module, found),
        watch_host_random(module, cls),
        watch_attributes(module, cls),
        watch_functions(cls) as functions,
        record_tensor_hooks(module) as hook_owners,
    ):
        ep = torch.export.export(module, args, kwargs, strict=False)
    if hook_owners:
        owners = list(dict.fromkeys(hook_owners))
        raise TensorHooks(
            f"{cls}.forward registers hooks on tensors (Tensor.register_hook, in the forward of "
            f"{', '.join(repr(o) for o in owners[:3])}), which an exported graph would leave out; module "
            "hooks run them",
            owners,
        )
    trained = signature(ep.graph, training=True) if check_eval else []
    attrs, canonical, user_inputs = _lifted(ep, module)
    # Attention given a materialised causal mask runs as is_causal=True, as it does eagerly ([Note: causal masks]).
    fold_causal_masks(ep.graph, {n: v[2] for n, v in attrs.items() if n.op == "placeholder"})
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

    fqns, group, group_blocks = _blocks(module, ops, max_blocks)
    nodes_of = group_members(group, ops, len(group_blocks))
    flat = pytree.tree_leaves((args, _reorder(kwargs, ep.call_spec.in_spec)))
    home = home_device([*flat, *module.parameters(), *module.buffers()])
    interface, programs = _split(nodes_of, attrs, model_outputs, home, ModeSwitch(module))
    split_graph = _top_graph(cls, user_inputs, interface, programs, model_outputs)
    recorder = _Recorder(split_graph)
    with torch.no_grad(), meta_layouts([*flat, *module.parameters()]):  # [Note: channels-last on meta]
        recorder.run(*flat)

    names = _run_names([fqns[b] or cls for b in group_blocks])
    blocks = []
    for k, ((inputs, outputs), nodes) in enumerate(zip(interface, nodes_of, strict=True)):
        used = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a in attrs))
        blocks.append(
            RawBlock(
                name=names[k],
                modules=(fqns[group_blocks[k]],),
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
    grads = _requiring_grad(ep.graph, attrs)
    captured = assemble(
        module, "export", blocks, inputs_info, values, out_names, split_graph, found[-1], grads
    )
    notes = (*captured.notes, *functions.notes())
    branches: list[str] = []
    if check_eval:

        def export_again() -> Any:
            with _quiet(), flat_forward(module, []):
                return torch.export.export(module, args, kwargs, strict=False)

        branches = eval_branches(module, trained, export_again)
    if branches:
        shown = ", ".join(repr(b) for b in branches[:3])
        shown += f" and {len(branches) - 3} more" if len(branches) > 3 else ""
        notes = (
            *notes,
            f"in evaluation mode the forward of {shown} runs other operations (a Python branch on "
            "self.training, such as a drop-path): the captured graph follows training mode, so pipelined "
            "validation, test and predict steps are refused",
        )
    return dataclasses.replace(captured, notes=notes, eval_branches=tuple(branches))


def _run_names(fqns: list[str]) -> list[str]:
    """Block names: a module's first run keeps its FQN, later runs are "fqn#2", "fqn#3" (see [Note: runs])."""
    seen: Counter[str] = Counter()
    names = []
    for fqn in fqns:
        seen[fqn] += 1
        names.append(fqn if seen[fqn] == 1 else f"{fqn}#{seen[fqn]}")
    return names


def _requiring_grad(graph: fx.Graph, attrs: dict[fx.Node, tuple[str, str, Any]]) -> set[str]:
    """Names of the floating values that depend on a trainable parameter: they need a gradient when they cross a
    cut (a conservative superset: a ``.detach()`` in between is not seen)."""
    grads: set[str] = set()
    for node in graph.nodes:
        if node in attrs:
            kind, _, obj = attrs[node]
            if kind == "param" and getattr(obj, "requires_grad", False):
                grads.add(node.name)
        elif node.op == "call_function" and any(a.name in grads for a in node.all_input_nodes):
            val = node.meta.get("val")
            floating = isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex())
            if floating or node.target is operator.getitem or isinstance(val, (tuple, list)):
                grads.add(node.name)
    return grads


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


def _blocks(module: nn.Module, ops: list[fx.Node], max_blocks: int) -> tuple[list[str], list[int], list[int]]:
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
    owner = _owners(fqns, ops, paths)
    if all(o is None for o in owner):  # every operation is glue: the whole model is one block
        return [""], [0] * len(ops), [0]
    group, group_blocks = runs(owner)
    return fqns, group, group_blocks


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


def group_members(group: list[int], ops: list[fx.Node], count: int) -> list[list[fx.Node]]:
    """The nodes of each group, in execution order."""
    out: list[list[fx.Node]] = [[] for _ in range(count)]
    for node, g in zip(ops, group, strict=True):
        out[g].append(node)
    return out


def _split(
    nodes_of: list[list[fx.Node]],
    attrs: dict[fx.Node, tuple[str, str, Any]],
    model_outputs: list[Any],
    home: torch.device | None,
    switch: ModeSwitch,
) -> tuple[list[tuple[list[fx.Node], list[fx.Node]]], list[fx.GraphModule]]:
    """One GraphModule per group, returning a tuple; parameters are get_attr of the user's own tensors, and
    tensors created inside follow the device of the program's inputs (see [Note: portable programs]) and
    training flags the mode of the user's modules (see [Note: modes]).

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
        program = fx.GraphModule(root, graph, class_name=f"Block{k}")
        make_portable(program, home, switch)
        programs.append(program)
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
