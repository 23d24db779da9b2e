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
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.export.graph_signature import OutputKind
from torch.utils import _pytree as pytree

from lightning_autopart.capture.assemble import RawBlock, assemble
from lightning_autopart.capture.attributes import watch_attributes
from lightning_autopart.capture.backward_hooks import TensorHooks, backward_hooked, record_tensor_hooks
from lightning_autopart.capture.causal import fold_causal_masks
from lightning_autopart.capture.data_reads import as_found, trace_data_reads, untie_data_reads
from lightning_autopart.capture.functions import Unkept, watch_functions
from lightning_autopart.capture.glue import first_line
from lightning_autopart.capture.graph import CapturedModel, OutputSpec
from lightning_autopart.capture.host_random import watch_host_random
from lightning_autopart.capture.keys import value_keys
from lightning_autopart.capture.meta_layouts import meta_layouts
from lightning_autopart.capture.mode_programs import eval_programs
from lightning_autopart.capture.modes import eval_branches, signature
from lightning_autopart.capture.outputs import flat_forward
from lightning_autopart.capture.portable import ModeSwitch, home_device
from lightning_autopart.capture.programs import (
    choose_blocks,
    group_members,
    lift_inputs,
    split_programs,
    top_graph,
)
from lightning_autopart.errors import CaptureError

__all__: list[str] = []

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
    # See [Note: host random numbers], [Note: Python state in the forward], [Note: custom autograd functions],
    # [Note: .data in the forward].
    skip: frozenset[Any] = frozenset()
    while True:
        try:
            with (
                _quiet(),
                flat_forward(module, found),
                watch_host_random(module, cls),
                watch_attributes(module, cls),
                watch_functions(cls, skip) as functions,
                record_tensor_hooks(module) as hook_owners,
                trace_data_reads(),
            ):
                ep = torch.export.export(module, args, kwargs, strict=False)
            break
        except Unkept as unkept:  # exported again, those Functions as their operations
            skip |= frozenset(unkept.reasons)
    if hook_owners:
        owners = list(dict.fromkeys(hook_owners))
        raise TensorHooks(
            f"{cls}.forward registers hooks on tensors (Tensor.register_hook, in the forward of "
            f"{', '.join(repr(o) for o in owners[:3])}), which an exported graph would leave out; module "
            "hooks run them",
            owners,
        )
    reads = untie_data_reads(ep.graph_module)
    trained = signature(ep.graph, training=True) if check_eval else []
    attrs, canonical, user_inputs = lift_inputs(ep, module)
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

    fqns, group, group_blocks = choose_blocks(module, ops, max_blocks)
    nodes_of = group_members(group, ops, len(group_blocks))
    flat = pytree.tree_leaves((args, _reorder(kwargs, ep.call_spec.in_spec)))
    home = home_device([*flat, *module.parameters(), *module.buffers()])
    interface, programs = split_programs(nodes_of, attrs, model_outputs, home, ModeSwitch(module))
    split_graph = top_graph(cls, user_inputs, interface, programs, model_outputs)
    recorder = _Recorder(split_graph)
    with torch.no_grad(), meta_layouts([*flat, *module.parameters()]), as_found(reads, attrs):
        recorder.run(*flat)  # [Note: channels-last on meta]

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
    keys = value_keys(ep.graph, attrs, canonical, user_inputs)  # [Note: rank-independent values]
    captured = assemble(
        module, "export", blocks, inputs_info, values, out_names, split_graph, found[-1], grads, keys
    )
    captured = dataclasses.replace(captured, notes=(*captured.notes, *functions.notes()))
    for note in functions.memory_notes():  # memory the user can win back: said aloud
        warnings.warn(note, stacklevel=3)
    if not check_eval:
        return captured

    def export_again() -> Any:
        with _quiet(), flat_forward(module, []), watch_functions(cls, skip, check=False), trace_data_reads():
            again = torch.export.export(module, args, kwargs, strict=False)
        untie_data_reads(again.graph_module)
        return again

    train = (user_inputs, interface, model_outputs, nodes_of)
    return _follow_eval(captured, trained, export_again, train, home)


def _follow_eval(
    captured: CapturedModel, trained: Any, export: Any, train: Any, home: torch.device | None
) -> CapturedModel:
    """``captured`` with the modules that branch on the mode, and the blocks' evaluation-mode programs where
    they can be cut (see [Note: Python branches on the mode]); a note says which."""
    module = captured.module
    branches, ep = eval_branches(module, trained, export)
    if not branches:
        return captured
    made: list[Any] | str = "its evaluation mode does not export"
    try:
        made = eval_programs(ep, module, train, home) if ep is not None else made
    except Exception as error:  # refused below, with the reason
        made = f"its evaluation-mode graph cannot be cut ({type(error).__name__}: {first_line(error)})"
    if isinstance(made, list):
        blocks = [dataclasses.replace(b, eval_program=p) for b, p in zip(captured.blocks, made, strict=True)]
        captured = dataclasses.replace(captured, blocks=blocks)
        then = "evaluation steps run programs cut from the forward exported in evaluation mode"
    else:
        then = f"{made}, so pipelined validation, test and predict steps are refused"
    shown = ", ".join(repr(b) for b in branches[:3])
    shown += f" and {len(branches) - 3} more" if len(branches) > 3 else ""
    note = f"in evaluation mode the forward of {shown} runs other operations (a Python branch on "
    note += f"self.training, such as a drop-path): {then}"
    return dataclasses.replace(captured, notes=(*captured.notes, note), eval_branches=tuple(branches))


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
