"""Captured programs that run anywhere and in either mode: devices and train/eval flags are read at run time
(and fill values that stand for a dtype's extreme, under autocast: [Note: dtype extremes] in extremes.py).

[Note: portable programs] torch.export records the device of every tensor the forward creates
(``torch.arange(t, device=x.device)``, a causal mask from ``torch.ones(..., device=x.device)``,
``torch.randn``-style noise, ``.to(x.device)``) as a constant: the device the model was captured on. A stage
captured on the CPU (or on ``meta``, for planning) and run on a GPU would then mix devices. So every device
constant equal to the capture device is replaced by the device of a tensor the program receives (its first
tensor input, else its first parameter or buffer on the capture device), read when the program runs. A device
that differs from the capture device (an explicit ``.cpu()`` in a GPU model) stays as written. A constant that
the forward made without a device (a Hugging Face sliding-window cache's ``torch.tensor(...)``) lives on the
CPU whatever the capture device, so a model captured on ``meta`` must not read its device from one: Mistral's
rotary embedding then moved its ``meta`` frequencies to the CPU and estimate mode could not capture it. Such a
constant also stays where it is when the profiler copies the program to another device (:func:`stays_put`):
BEiT captured on ``meta`` builds its relative-position index on the CPU, filling it with constants that a copy
moved to ``meta`` had no values for.
torch.export's own checks of a tensor's dtype and device (``_assert_tensor_metadata``, emitted before
``.to(...)``) are removed: the device moves, and under autocast a value's dtype is not the traced one.

[Note: views on any layout] ``x.contiguous()`` copies only a tensor that is not contiguous, so torch.export
records it only where the traced tensor was not: where the capture device's kernel happened to lay out its
output so that the copy was not needed, the graph has no copy, and a ``view`` after it holds on that layout
alone. Hugging Face's sdpa path ends ``attn_output.transpose(1, 2).contiguous()`` and the layer views the
result as ``(batch, length, -1)``: the CPU's flash kernel returns (batch, length, heads, size) in memory, so
the transpose is contiguous and no copy is recorded; a GPU's math path (grouped key/value heads in float32,
or with a mask) and meta's return (batch, heads, length, size), where that ``view`` raised "view size is not
compatible" (AFMoE captured on the CPU, in estimate mode, and so on such a GPU). So every ``view`` of a
captured program is a ``reshape``: the same view (the same aten ``view`` at dispatch) wherever a view
exists, and the copy ``contiguous()`` makes eagerly where the run-time layout allows none.

[Note: modes] torch.export also records ``self.training`` as a constant: ``dropout(x, p, train=True)``,
``batch_norm(..., training=True, ...)`` and BatchNorm's ``num_batches_tracked += 1``. Models are captured in
training mode (so a dropout's probability is the training one), and each such flag becomes a read of the
``training`` attribute of the user's module that made the call, when the program runs. Lightning's
``model.train()``/``model.eval()`` and a user's own per-module choice (a frozen BatchNorm) then switch the
pipelined programs as they switch the model. A flag other than the mode of the export is the forward's own
constant, not ``self.training``, and stays (``F.batch_norm(x, mean, var, training=False)`` in a training
forward: frozen statistics). Attention's dropout is the one probability written with the
mode: Hugging Face and ``nn.MultiheadAttention`` pass ``dropout_p=p if self.training else 0.0`` to
``scaled_dot_product_attention``, so a nonzero ``dropout_p`` becomes ``p`` in training and 0 in evaluation,
read the same way. (A forward that keeps attention dropout in evaluation is told apart by the
evaluation-mode export, [Note: Python branches on the mode] in modes.py.)
"""

from __future__ import annotations

import builtins
import operator
import warnings
from typing import Any

import torch
from torch import fx, nn

from lightning_autopart.capture.extremes import follow_extremes

__all__ = [
    "MODES_ATTRIBUTE",
    "MODE_ARGS",
    "ModeSwitch",
    "attention_dropout",
    "home_device",
    "make_portable",
    "stays_put",
]

_aten = torch.ops.aten

#: Operations whose argument at this position is ``self.training`` (see [Note: modes]).
MODE_ARGS: dict[Any, int] = {
    _aten.dropout.default: 2,
    _aten.feature_dropout.default: 2,
    _aten.alpha_dropout.default: 2,
    _aten.feature_alpha_dropout.default: 2,
    _aten.dropout_.default: 2,  # nn.Dropout(inplace=True)
    _aten.feature_dropout_.default: 2,
    _aten.alpha_dropout_.default: 2,
    _aten.feature_alpha_dropout_.default: 2,
    _aten.native_dropout.default: 2,
    _aten.batch_norm.default: 5,
}

#: Name of the program attribute holding the :class:`ModeSwitch`.
MODES_ATTRIBUTE = "_autopart_modes"
#: Name of the program attribute holding the device it was captured on.
HOME_ATTRIBUTE = "_autopart_home"


class ModeSwitch:
    """The user's modules, read for their ``training`` flag when a program runs (see [Note: modes]).

    Copies of a program (the profiler's) share it: deep-copying returns the same switch, never the model.
    """

    def __init__(self, root: nn.Module, traced: bool = True) -> None:
        self._root = root
        #: The mode the programs were exported in: a flag equal to it is ``self.training``.
        self.traced = traced

    def __deepcopy__(self, memo: dict[int, Any]) -> ModeSwitch:
        return self

    def training(self, fqn: str) -> bool:
        """Whether the module ``fqn`` of the captured model is in training mode."""
        module = self._root.get_submodule(fqn) if fqn else self._root
        return bool(module.training)

    def dropout(self, fqn: str, p: float) -> float:
        """Attention's dropout probability ``p`` in training, 0 in evaluation (see [Note: modes])."""
        return p if self.training(fqn) else 0.0


def make_portable(program: fx.GraphModule, home: torch.device | None, switch: ModeSwitch) -> None:
    """Make a captured program follow its inputs' device and its modules' modes (see [Note: portable programs],
    [Note: modes]) and its views hold on any layout ([Note: views on any layout]), with the subgraphs of its
    higher-order operations (``torch.no_grad()`` regions), in place."""
    for sub in _subgraphs(program):
        make_portable(sub, home, switch)
    for node in list(program.graph.nodes):
        if node.op == "call_function" and node.target is _aten._assert_tensor_metadata.default:
            program.graph.erase_node(node)
    _follow_device(program, home)
    _views_on_any_layout(program.graph)
    follow_extremes(program.graph)
    setattr(program, HOME_ATTRIBUTE, home)
    setattr(program, MODES_ATTRIBUTE, switch)  # before the graph reads it (fx checks get_attr targets)
    if not _follow_mode(program.graph, switch):
        delattr(program, MODES_ATTRIBUTE)
    program.recompile()


def _views_on_any_layout(graph: fx.Graph) -> int:
    """Make every ``view`` of ``graph`` a ``reshape`` (see [Note: views on any layout]); returns how many."""
    views = [n for n in graph.nodes if n.op == "call_function" and n.target is _aten.view.default]
    for node in views:
        node.target = _aten.reshape.default
    return len(views)


def _follow_mode(graph: fx.Graph, switch: ModeSwitch) -> int:
    """Replace every training-mode constant in ``graph`` by a run-time read of its module's flag.

    Returns:
        How many operations now follow a module's mode.
    """
    holder: fx.Node | None = None
    rewritten = 0
    for node in list(graph.nodes):
        position = _mode_position(node)
        dropout = attention_dropout(node)
        if position is None and not dropout:
            continue
        stack = list(node.meta.get("nn_module_stack", {}).values())
        fqn = stack[-1][0] if stack else ""
        written = node.args[position] if position is not None else None
        if isinstance(written, bool) and written is not switch.traced:
            continue  # the forward wrote the flag itself: F.batch_norm(..., training=False) in training stays
        if holder is None:
            first_op = next(n for n in graph.nodes if n.op not in ("placeholder", "get_attr"))
            with graph.inserting_before(first_op), warnings.catch_warnings():
                # fx warns of a get_attr target that is no module, parameter or buffer: the switch is none.
                warnings.filterwarnings("ignore", "Attempted to insert a get_attr Node")
                holder = graph.get_attr(MODES_ATTRIBUTE)
        if position is None:  # attention's dropout probability
            with graph.inserting_before(node):
                p = graph.call_method("dropout", (holder, fqn, dropout))
            if len(node.args) > _SDPA_DROPOUT:
                node.args = (*node.args[:_SDPA_DROPOUT], p, *node.args[_SDPA_DROPOUT + 1 :])
            else:
                node.kwargs = {**node.kwargs, "dropout_p": p}
            rewritten += 1
            continue
        with graph.inserting_before(node):
            flag = graph.call_method("training", (holder, fqn))
        args = list(node.args)
        args[position] = flag
        node.args = tuple(args)
        rewritten += 1
    return rewritten


_SDPA_DROPOUT = 4  # position of scaled_dot_product_attention's dropout_p


def attention_dropout(node: fx.Node) -> float:
    """The constant dropout probability ``node`` gives ``scaled_dot_product_attention`` (0 for other nodes,
    and for one read at run time)."""
    if node.op != "call_function" or node.target is not _aten.scaled_dot_product_attention.default:
        return 0.0
    p = node.args[_SDPA_DROPOUT] if len(node.args) > _SDPA_DROPOUT else node.kwargs.get("dropout_p", 0.0)
    return float(p) if isinstance(p, (int, float)) and not isinstance(p, bool) else 0.0


def _mode_position(node: fx.Node) -> int | None:
    """Where ``node`` takes ``self.training``: dropout and batch-norm flags (batch norm only when it tracks running
    statistics: without them it always normalises by the batch), BatchNorm's ``num_batches_tracked += 1``."""
    if node.op != "call_function":
        return None
    if node.target is _aten.add_.Tensor and len(node.args) == 2:
        buffer = node.args[0]
        if isinstance(buffer, fx.Node) and buffer.op == "get_attr":
            return 1 if str(buffer.target).endswith("num_batches_tracked") else None
        return None
    position = MODE_ARGS.get(node.target)
    if position is None or len(node.args) <= position or not isinstance(node.args[position], bool):
        return None
    if node.target is _aten.batch_norm.default and node.args[3] is None:
        return None
    return position


def stays_put(program: nn.Module, constant: torch.Tensor) -> bool:
    """Whether a tensor constant of ``program`` keeps its device when a copy of the program moves: it lives
    on another device than the program was captured on (a constant made without a device, on the CPU, in a
    capture on ``meta``), as a device constant other than the capture device stays as written."""
    home = getattr(program, HOME_ATTRIBUTE, None)
    return isinstance(home, torch.device) and not _same(constant.device, home)


def home_device(values: list[Any]) -> torch.device | None:
    """The device of the first tensor among ``values`` (the capture's inputs, then its parameters)."""
    return next((v.device for v in values if isinstance(v, torch.Tensor)), None)


def _attribute(program: fx.GraphModule, node: fx.Node) -> Any:
    """What a ``get_attr`` node reads, None for other nodes."""
    if node.op != "get_attr":
        return None
    try:
        return operator.attrgetter(str(node.target))(program)
    except AttributeError:
        return None


def _is_tensor_node(program: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "placeholder":  # a subgraph's placeholders may carry no example value: tensors
        return isinstance(node.meta.get("val", torch.empty(0)), torch.Tensor)
    return isinstance(_attribute(program, node), torch.Tensor)


def _on_device(program: fx.GraphModule, node: fx.Node, home: torch.device) -> bool:
    """Whether a tensor node lives on ``home`` (a placeholder without an example value is assumed to)."""
    value = node.meta.get("val") if node.op == "placeholder" else _attribute(program, node)
    return not isinstance(value, torch.Tensor) or _same(value.device, home)


def _subgraphs(program: fx.GraphModule) -> list[fx.GraphModule]:
    """The graphs of higher-order operations a program calls (``torch.no_grad()`` regions, ``torch.cond``)."""
    found = [_attribute(program, node) for node in program.graph.nodes]
    return [sub for sub in found if isinstance(sub, fx.GraphModule)]


def _follow_device(program: fx.GraphModule, home: torch.device | None) -> int:
    """Replace every ``home`` device constant in ``program``'s graph by the run-time device of an anchor tensor.

    Args:
        program: A block program (its graph is changed in place).
        home: The device the model was captured on; None changes nothing.

    Returns:
        How many arguments were rewritten (0 when no node names ``home`` or the program has no tensor).
    """
    if home is None:
        return 0
    graph = program.graph
    uses = [n for n in graph.nodes if n.op == "call_function" and _names_device(n, home)]
    tensors = [n for n in graph.nodes if _is_tensor_node(program, n)]
    anchor = next((n for n in tensors if _on_device(program, n, home)), tensors[0] if tensors else None)
    if not uses or anchor is None:
        return 0
    first_op = next(n for n in graph.nodes if n.op not in ("placeholder", "get_attr"))
    with graph.inserting_before(first_op):
        device = graph.call_function(builtins.getattr, (anchor, "device"))
    rewritten = 0
    for node in uses:

        def swap(value: Any) -> Any:
            nonlocal rewritten
            if isinstance(value, torch.device) and _same(value, home):
                rewritten += 1
                return device
            return value

        node.args = fx.node.map_aggregate(node.args, swap)
        node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
    return rewritten


def _same(device: torch.device, home: torch.device) -> bool:
    """``device`` is ``home`` (an index-less "cuda" matches any CUDA index of the same type)."""
    return device.type == home.type and (device.index is None or home.index is None or device.index == home.index)


def _names_device(node: fx.Node, home: torch.device) -> bool:
    found = False

    def look(value: Any) -> Any:
        nonlocal found
        found = found or (isinstance(value, torch.device) and _same(value, home))
        return value

    fx.node.map_aggregate((node.args, node.kwargs), look)
    return found
