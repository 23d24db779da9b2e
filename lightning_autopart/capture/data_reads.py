"""``tensor.data`` read in a forward, which torch.export cannot trace.

[Note: .data in the forward] A forward may read a tensor's ``.data``: a weight constrained in place before it
is used (Gemma 3n's AltUp clamps ``self.prediction_coefs.weight.data`` in training), a statistic read around
autograd. ``.data`` is no operation: the dispatcher never sees it, so non-strict torch.export gets back a fake
tensor its tracer does not follow, takes it for a constant and fails ("We found a fake tensor in the exported
program constant's list", naming a ``lifted_tensor_N``), with or without autopart. So, while a forward is
exported (:func:`trace_data_reads`), ``.data`` of a tensor the tracer follows is read as ``detach()``, an
operation of the graph, whose node is marked; after the export, :func:`untie_data_reads` makes each marked node
a call of :func:`tensor_data`, which reads ``.data`` when the stages run. What the forward does with it (an
in-place clamp) is in the graph, and writes the parameter as it does eagerly. ``detach()`` itself would not do
at run time: it shares the tensor's version counter, so a weight clamped through it would fail the backward of
every micro-batch whose forward saved it before (a pipeline runs several forwards before their backwards),
where eager training, through ``.data``, does not. Reads of tensors the tracer does not follow (real
constants) and ``.data = ...`` assignments are left as torch does them. Capture runs the cut graph once to
record each block's inputs, which would clamp the parameters already: those read through ``.data`` are put back
after (:func:`as_found`), as capture leaves the model as it found it. Such a write feeds no output, yet changes
the model: the comparison of the training and evaluation graphs counts it (:func:`writes_data`), so a clamp made
in training only is a branch on the mode ([Note: Python branches on the mode] in ``modes.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, fx
from torch.fx.experimental import proxy_tensor

__all__ = ["as_found", "tensor_data", "trace_data_reads", "untie_data_reads", "writes_data"]

#: ``Tensor.data`` as torch defines it (a C getset descriptor on the tensor base class).
_DATA = torch._C.TensorBase.__dict__["data"]
#: The node metadata key marking a ``detach`` that stands for a ``.data`` read.
_MARK = "autopart_data_read"


def tensor_data(tensor: Tensor) -> Tensor:
    """``tensor.data``: what a ``.data`` read in an exported forward runs as (see [Note: .data in the
    forward])."""
    return tensor.data


def writes_data(node: fx.Node) -> bool:
    """Whether ``node`` writes in place the tensor a ``.data`` read gave (made so by :func:`untie_data_reads`)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.is_mutable or not node.args:
        return False
    first = node.args[0]
    return isinstance(first, fx.Node) and first.target is tensor_data


def _read(tensor: Tensor) -> Tensor:
    """``tensor.data`` while a forward is exported: ``detach()``, marked, for a tensor the tracer follows."""
    mode = proxy_tensor.get_proxy_mode()
    if mode is None or not proxy_tensor.has_proxy_slot(tensor, mode.tracer):
        return _DATA.__get__(tensor)
    out = tensor.detach()
    if proxy_tensor.has_proxy_slot(out, mode.tracer):
        proxy_tensor.get_proxy_slot(out, mode.tracer).proxy.node.meta[_MARK] = True
    return out


def _write(tensor: Tensor, value: Tensor) -> None:
    _DATA.__set__(tensor, value)


@contextmanager
def trace_data_reads() -> Iterator[None]:
    """Run the body (an export) with ``.data`` reads of traced tensors recorded as marked ``detach`` nodes;
    :func:`untie_data_reads` then makes them reads again (see [Note: .data in the forward])."""
    before = torch.Tensor.__dict__.get("data")
    torch.Tensor.data = property(_read, _write)  # type: ignore[assignment]
    try:
        yield
    finally:
        if before is None:
            del torch.Tensor.data
        else:
            torch.Tensor.data = before


def untie_data_reads(graph_module: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``graph_module`` (nested graphs too) that stand for a ``.data`` read, made calls of
    :func:`tensor_data` (see [Note: .data in the forward])."""
    found = []
    for sub in graph_module.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        marked = [n for n in sub.graph.nodes if n.op == "call_function" and n.meta.pop(_MARK, False)]
        for node in marked:
            node.target = tensor_data
        if marked:
            sub.recompile()
        found += marked
    return found


@contextmanager
def as_found(reads: list[fx.Node], attrs: dict[fx.Node, tuple[str, str, Any]]) -> Iterator[None]:
    """Put back on exit the values of the parameters, buffers and constants that the nodes ``reads`` (from
    :func:`untie_data_reads`) read ``.data`` of, which the body may write in place; ``attrs`` as
    :func:`~lightning_autopart.capture.programs.lift_inputs` gives them."""
    tensors = _distinct(attrs[a][2] for n in reads for a in n.all_input_nodes if a in attrs)
    saved = [t.detach().clone() for t in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in zip(tensors, saved, strict=True):
                _DATA.__get__(tensor).copy_(value)


def _distinct(values: Iterable[Any]) -> list[Tensor]:
    return list({id(v): v for v in values if isinstance(v, Tensor) and v.device.type != "meta"}.values())
