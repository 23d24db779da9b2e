"""Stage modules: the blocks ``[start, end)`` of a captured model as one runnable ``nn.Module``.

[Note: stage interface] A stage module is called with the tensors of cut ``start - 1`` (for the first
stage: the model's flat inputs, in ``CapturedModel.inputs`` order) and returns the tensors of cut
``end - 1`` as a tuple (for the last stage: the model's flat outputs, ``CapturedModel.cuts[-1]``), in the
order of ``CapturedModel.cuts``; :func:`stage_inputs` and :func:`stage_outputs` name them. Every tensor
crossing a cut travels, float or not (a bool mask, int ids), even when the stage only passes it on.

A stage owns exactly the parameters and buffers of its blocks, under their original FQNs
(``layers.3.weight``), and shares the parameter objects with the user's module: no copies. A tied
parameter used by blocks of two stages appears in both stage modules; its gradients must be summed over
those stages (:func:`tied_groups` lists them).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import fx, nn

from lightning_autopart.capture.graph import CapturedModel, TensorInfo
from lightning_autopart.capture.modes import branch_mode, mixed_modes, modules_of
from lightning_autopart.capture.portable import MODES_ATTRIBUTE, ModeSwitch
from lightning_autopart.errors import ConfigError
from lightning_autopart.plan import Plan

__all__ = ["build_stage_module", "parameters_in_order", "stage_inputs", "stage_outputs", "tied_groups"]


def stage_inputs(captured: CapturedModel, start: int) -> tuple[TensorInfo, ...]:
    """The tensors a stage starting at block ``start`` is called with, in argument order."""
    return captured.inputs if start == 0 else captured.cuts[start - 1]


def stage_outputs(captured: CapturedModel, end: int) -> tuple[TensorInfo, ...]:
    """The tensors a stage ending before block ``end`` returns, in order (the model outputs for the last)."""
    return captured.cuts[end - 1]


def build_stage_module(captured: CapturedModel, start: int, end: int) -> nn.Module:
    """A module running blocks ``[start, end)``; see [Note: stage interface] in this module's docstring.

    Args:
        captured: The captured model (by either method).
        start: First block of the stage.
        end: One past the last block of the stage.

    Returns:
        For "export": an ``fx.GraphModule`` inlining the block programs; for "modules": a module that
        holds the user's block modules at their FQNs and chains them by the recorded tensor routing.

    Raises:
        ConfigError: The range is empty or outside the model's blocks.
    """
    if not 0 <= start < end <= captured.num_blocks:
        raise ConfigError(
            f"a stage needs blocks start < end within 0..{captured.num_blocks} (got start={start}, end={end})"
        )
    if captured.method == "export":
        return _export_stage(captured, start, end)
    return ModuleStage(captured, start, end)


def tied_groups(plan: Plan, captured: CapturedModel) -> list[tuple[str, tuple[int, ...]]]:
    """Tied parameters held by more than one stage of ``plan``: (canonical FQN, stage indices), sorted.

    The runtime sums the gradients of each such parameter over the ranks that hold those stages.
    """
    stage_of = {k: s.index for s in plan.stages for k in range(s.block_start, s.block_end)}
    groups = []
    for fqn, blocks in sorted(captured.tied.items()):
        stages = tuple(sorted({stage_of[k] for k in blocks}))
        if len(stages) > 1:
            groups.append((fqn, stages))
    return groups


def parameters_in_order(captured: CapturedModel, stages: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The parameters of ``stages``, each once, in the model's registration order (as DDP orders its
    buckets): alike on every replica, where a stage's own order, and its blocks', follow the run order of its
    forward ([Note: rank-independent values] in capture/keys.py)."""
    order = {id(p): i for i, p in enumerate(captured.module.parameters())}
    owned = dict.fromkeys(p for stage in stages for p in stage.parameters())
    return sorted(owned, key=lambda p: order.get(id(p), len(order)))


def _canonical(module: nn.Module) -> dict[int, str]:
    """The first FQN of every parameter and buffer of ``module``, by tensor identity."""
    names: dict[int, str] = {}
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        names.setdefault(id(t), name)
    return names


def _export_stage(captured: CapturedModel, start: int, end: int) -> fx.GraphModule:
    """Inline the programs of blocks ``[start, end)`` into one graph whose attributes are canonical FQNs;
    where blocks have evaluation-mode programs, a second graph of those runs in evaluation mode
    (:class:`_Modes`)."""
    canonical = _canonical(captured.module)
    root: dict[str, Any] = {}
    constants: list[str] = []
    graph = _inline(captured, start, end, canonical, root, constants, evaluation=False)
    stage = fx.GraphModule(root, graph, class_name=f"{type(captured.module).__name__}Stage")
    if any(captured.blocks[k].eval_program is not None for k in range(start, end)):
        known = set(root)
        other = _inline(captured, start, end, canonical, root, constants, evaluation=True)
        for name in root.keys() - known:  # the evaluation graph's own constants and subgraphs
            _attach(stage, name, root[name])
        stage.forward = _Modes(stage, other, modules_of(captured.module, captured.eval_branches))
    for name in dict.fromkeys(constants):  # constants are no state: keep them out of state_dict
        owner, _, field = name.rpartition(".")
        holder = stage.get_submodule(owner)
        value = holder._buffers.pop(field) if field in holder._buffers else holder.__dict__.pop(field)
        holder.register_buffer(field, value, persistent=False)
    return stage


def _inline(
    captured: CapturedModel,
    start: int,
    end: int,
    canonical: dict[int, str],
    root: dict[str, Any],
    constants: list[str],
    evaluation: bool,
) -> fx.Graph:
    """The graph of blocks ``[start, end)`` (their evaluation-mode programs where they have one, with
    ``evaluation``); the objects it reads are added to ``root`` by name, the names of constants to
    ``constants``."""
    graph = fx.Graph()
    env: dict[str, fx.Node] = {t.name: graph.placeholder(t.name) for t in stage_inputs(captured, start)}
    attr_nodes: dict[str, fx.Node] = {}
    for k in range(start, end):
        block = captured.blocks[k]
        program = block.eval_program if evaluation and block.eval_program is not None else block.program
        if not isinstance(program, fx.GraphModule):
            raise ConfigError(f"block {k} ({block.name}) of an 'export' capture has no graph program")
        local: dict[fx.Node, fx.Node] = {}
        names = iter(block.inputs)
        for node in program.graph.nodes:
            if node.op == "placeholder":
                local[node] = env[next(names).name]
            elif node.op == "get_attr":
                obj = operator.attrgetter(str(node.target))(program)
                name = MODES_ATTRIBUTE if isinstance(obj, ModeSwitch) else canonical.get(id(obj))
                if name is None:  # a lifted constant or a higher-order-op subgraph
                    name = next((n for n, o in root.items() if o is obj), f"_constant{len(root)}")
                    if isinstance(obj, torch.Tensor):
                        constants.append(name)
                if name not in attr_nodes:
                    root.setdefault(name, obj)
                    attr_nodes[name] = graph.get_attr(name)
                local[node] = attr_nodes[name]
            elif node.op == "output":
                for info, value in zip(block.outputs, node.args[0], strict=True):
                    env[info.name] = local[value]
            else:
                local[node] = graph.node_copy(node, local.__getitem__)
    graph.output(tuple(env[t.name] for t in stage_outputs(captured, end)))
    return graph


class _Modes:
    """A stage's forward: its training graph, or its evaluation-mode graph while the modules that branch on
    the mode are in evaluation mode (see [Note: Python branches on the mode] in capture/modes.py). The second
    module is made when first needed, over the stage's own tensors, and again if they were replaced."""

    def __init__(self, stage: fx.GraphModule, graph: fx.Graph, modules: list[tuple[str, nn.Module]]) -> None:
        self._stage = weakref.ref(stage)  # the stage holds this forward: no cycle
        self._graph = graph
        self._modules = modules
        self._eval: tuple[tuple[int, ...], fx.GraphModule] | None = None

    def __call__(self, *tensors: Any) -> Any:
        stage = self._stage()
        assert stage is not None
        training = branch_mode(self._modules)
        if training is None:
            raise ConfigError(mixed_modes(self._modules))
        if training:
            return type(stage).forward(stage, *tensors)
        key = tuple(id(t) for t in (*stage.parameters(), *stage.buffers()))
        if self._eval is None or self._eval[0] != key:
            self._eval = key, fx.GraphModule(stage, self._graph, class_name=f"{type(stage).__name__}Eval")
        return self._eval[1](*tensors)


class ModuleStage(nn.Module):
    """Blocks of a "modules" capture, chained by the recorded routing of tensors between them.

    The user's block modules are children at their original FQNs (under plain holder modules); the block
    programs that call them are kept unregistered, so each parameter has one name.
    """

    def __init__(self, captured: CapturedModel, start: int, end: int) -> None:
        super().__init__()
        blocks = captured.blocks[start:end]
        root = captured.module
        modules = dict(root.named_modules())
        owned = list(dict.fromkeys(m for b in blocks for m in b.modules))
        if "" in owned:  # the root is a block: hold its children and its own tensors
            owned = [name for name, _ in root.named_children()]
        order = {name: i for i, name in enumerate(modules)}
        for fqn in sorted(owned, key=order.__getitem__):
            _attach(self, fqn, modules[fqn])
        covered = tuple(f"{m}." for m in owned)
        for fqn in dict.fromkeys(n for b in blocks for n in (*b.params, *b.buffers)):
            if not fqn.startswith(covered):
                _attach(self, fqn, _lookup(root, fqn))
        self._programs = [b.program for b in blocks]  # a list: not registered as submodules
        self._routes = [(tuple(t.name for t in b.inputs), tuple(t.name for t in b.outputs)) for b in blocks]
        self._inputs = tuple(t.name for t in stage_inputs(captured, start))
        self._outputs = tuple(t.name for t in stage_outputs(captured, end))

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Run the blocks on the cut's tensors (see [Note: stage interface]); return the next cut's."""
        if len(tensors) != len(self._inputs):
            raise ConfigError(
                f"stage expects {len(self._inputs)} tensors ({', '.join(self._inputs)}), got {len(tensors)}"
            )
        env = dict(zip(self._inputs, tensors, strict=True))
        for program, (inputs, outputs) in zip(self._programs, self._routes, strict=True):
            env.update(zip(outputs, program(*(env[n] for n in inputs)), strict=True))
        return tuple(env[n] for n in self._outputs)


def _lookup(root: nn.Module, fqn: str) -> Any:
    """The parameter, buffer or module at ``fqn`` in ``root``."""
    owner, _, field = fqn.rpartition(".")
    module = root.get_submodule(owner)
    for table in (module._parameters, module._buffers, module._modules):
        if field in table:
            return table[field]
    return getattr(module, field)


def _attach(stage: nn.Module, fqn: str, obj: Any) -> None:
    """Register ``obj`` (module, parameter or buffer, not copied) at ``fqn`` under plain holder modules."""
    *path, field = fqn.split(".")
    holder = stage
    for part in path:
        child = holder._modules.get(part)
        if child is None:
            child = nn.Module()
            holder.add_module(part, child)
        holder = child
    if isinstance(obj, nn.Module):
        holder.add_module(field, obj)
    elif isinstance(obj, nn.Parameter):
        holder.register_parameter(field, obj)
    else:
        holder.register_buffer(field, obj)
