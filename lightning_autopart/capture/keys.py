"""Structural keys: names for a graph's values that every rank gives alike, whatever order its forward ran in.

[Note: rank-independent values] Each rank captures the model itself, and a graph node's name says where it
came in the run. A forward may run independent parts in an order that changes from process to process:
transformers' Gemma 3 computes its rotary tables in a loop over ``set(config.layer_types)``, whose order
follows Python's per-process string hash seed. Then ``to_5`` is the global table on one rank and the local one
on the next, both of one shape, and a pipeline sending its cut tensors in run order would swap them silently.
So a value is named instead by what computes it (a Merkle key: the operation, its constants, the parameters
and buffers it reads by FQN, and the keys of its inputs), the cuts list each block's outputs in key order
(:func:`lightning_autopart.capture.assemble.assemble`), and the ranks compare a digest of the whole layout
before training (:func:`layout_digest`), refusing where even the blocks differ.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

import torch
from torch import fx

from lightning_autopart.capture.graph import CapturedModel

__all__ = ["layout_digest", "registration_digest", "value_keys"]

_SCALARS = (bool, int, float, str, type(None))


def value_keys(
    graph: fx.Graph, attrs: dict[fx.Node, tuple[str, str, Any]], canonical: dict[fx.Node, str], inputs: list[fx.Node]
) -> dict[str, str]:
    """The structural key of every node of an exported ``graph``, by node name (see [Note: rank-independent
    values]); ``attrs``, ``canonical`` and ``inputs`` as :func:`~lightning_autopart.capture.programs.lift_inputs`
    gives them. Seeded random operations are numbered in order, so two alike draws keep apart."""
    keys: dict[fx.Node, str] = {node: f"input{i}" for i, node in enumerate(inputs)}
    drawn = 0
    for node in graph.nodes:
        if node in keys:
            continue
        if node in attrs:
            kind, target, obj = attrs[node]
            part: Any = [kind, canonical.get(node) or _constant(target, obj)]
        elif node.op == "get_attr":
            part = ["get_attr", str(node.target)]
        else:
            args = fx.node.map_arg((node.args, node.kwargs), lambda n: keys.get(n, n.name))
            part = [node.op, _target(node.target), _plain(args)]
            if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
                part.append(drawn)
                drawn += 1
        keys[node] = _digest(part)
    return {node.name: key for node, key in keys.items()}


def layout_digest(captured: CapturedModel) -> str:
    """A digest of what a pipeline's ranks must agree on: each block's parameters, buffers and the keys of
    what it produces, and each cut's tensors in order (key, shape, dtype)."""
    blocks = [
        [sorted(b.params), sorted(b.buffers), sorted(_described(b.outputs))] for b in captured.blocks
    ]
    cuts = [_described(cut) for cut in captured.cuts]
    inputs = _described(captured.inputs)
    return _digest([captured.method, inputs, blocks, cuts])


def registration_digest(module: torch.nn.Module) -> str:
    """A digest of the order ``module`` registers its parameters in, which replicas' gradient buckets follow."""
    return _digest([name for name, _ in module.named_parameters()])


def _described(tensors: Iterable[Any]) -> list[list[Any]]:
    return [[t.key or t.name, list(t.shape), t.dtype] for t in tensors]


def _constant(target: str, obj: Any) -> Any:
    """A lifted constant by content where it holds data: its lifted name follows the run order. A ``meta``
    constant keeps its name too, so two alike in shape never share a key (a rank naming them the other way
    round is refused, not swapped)."""
    if isinstance(obj, torch.Tensor) and obj.device.type != "meta" and obj.layout == torch.strided:
        data = obj.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return [str(obj.dtype), list(obj.shape), hashlib.sha256(data).hexdigest()]
    if isinstance(obj, torch.Tensor):
        return [str(obj.dtype), list(obj.shape), target]
    return target


def _target(target: Any) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', None) or getattr(target, '__name__', None) or target}"


def _plain(value: Any) -> Any:
    """``value`` with only what reads alike in every process (no object addresses, no device index)."""
    if isinstance(value, _SCALARS):
        return value if not isinstance(value, float) else repr(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return [[str(k), _plain(v)] for k, v in sorted(value.items(), key=lambda item: str(item[0]))]
    if isinstance(value, torch.device):  # each rank's own GPU: the kind is what the graph means
        return value.type
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format, slice)):
        return str(value)
    if isinstance(value, torch.Tensor):
        return _constant("tensor", value)
    return type(value).__qualname__


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, separators=(",", ":")).encode()).hexdigest()[:20]
