"""Causal attention masks that torch.export materialised, given back to attention as ``is_causal=True``.

[Note: causal masks] Run eagerly, a Hugging Face decoder (Llama, Mistral, Qwen, GPT-2 with "sdpa", ...) sees
that it has no padding and calls ``scaled_dot_product_attention(q, k, v, is_causal=True)``, which runs the
flash kernel. Under torch.export that decision is a data-dependent branch, so the library builds the full
boolean mask instead (from aranges, position ids and a packed-sequence check) and passes it as ``attn_mask``.
The captured graph then needs a masked kernel: on an H100 a tiny Llama's step ran 20 % slower captured than
plain (the mask's 40 small ops and the memory-efficient kernel instead of flash, forward and backward).

:func:`fold_causal_masks` finds every attention whose mask depends on no user input (only on constants, shapes
and lifted tensors), computes that mask once, and when it is exactly the causal pattern (query and key of one
length, ``tril`` over the last two dimensions, broadcast over the rest; boolean, or 0 / very negative floats)
rewrites the call to ``attn_mask=None, is_causal=True`` and drops the mask's operations nothing else reads. A
constant mask that masks nothing (an encoder's or a vision model's mask without padding, all true: ViT, BART's
encoder) is dropped the same way, as eager code passes no mask there and runs flash. A mask built from the
user's ``attention_mask`` (padding) reads a user input and is left alone, and so is one computed from a
parameter: a learned bias is trained, whatever its values at capture (BEiT's relative-position tables start at
zero, which reads as a mask that masks nothing). A graph captured on the meta device (a model built with
``init_module(empty_init=True)``, or planned by estimate) computes its mask on meta, where values are unknown:
when the mask reads nothing but the graph's own factories (aranges, ones) and lifted tensors with values, its
operations are run again on the CPU, where they are exact; a mask that reads a meta buffer is left alone.
Folding on meta matters twice: such a graph is the one the stages run, and estimate mode prices the kernel it
finds (a masked kernel also saves the mask, converted to the query's dtype, for backward).
"""

from __future__ import annotations

import builtins
import operator
from functools import partial
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves, tree_map

from lightning_autopart.capture.grouped_heads import fold_repeated_heads

__all__ = ["fold_causal_masks"]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_CHECK = torch.ops.aten._assert_tensor_metadata.default
_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
#: Non-tensor helpers a mask's computation may call besides aten operators.
_PLAIN = (builtins.getattr, operator.getitem)
_CPU = torch.device("cpu")


def fold_causal_masks(graph: fx.Graph, values: dict[fx.Node, Any]) -> int:
    """Rewrite attention calls of ``graph`` whose mask is a constant causal mask, or one that masks nothing;
    returns how many.

    Args:
        graph: an exported graph (aten operators).
        values: the values of its lifted placeholders (parameters, buffers, constants); a mask whose
            computation reads any other placeholder (a user input) is not folded.
    """
    folded = 0
    known: dict[fx.Node, str | None] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        call = dict(zip(_ARGS, node.args, strict=False)) | dict(node.kwargs)
        mask = call.get("attn_mask")
        if not isinstance(mask, fx.Node) or call.get("is_causal", False):
            continue
        if mask not in known:
            known[mask] = _kind(mask, call, values)
        if known[mask] is None:
            continue
        call.pop("attn_mask")
        if known[mask] == "causal":
            call["is_causal"] = True
        node.args = (call.pop("query"), call.pop("key"), call.pop("value"))
        node.kwargs = call
        fold_repeated_heads(node)  # the grouped heads eager code then asks for ([Note: grouped heads])
        folded += 1
    for mask, kind in known.items():
        if kind is not None:
            _drop_unused(graph, mask)
    return folded


def _kind(mask: fx.Node, call: dict[str, Any], values: dict[fx.Node, Any]) -> str | None:
    """"causal" when ``mask`` depends on no user input and is the causal mask of this query and key length,
    "full" when it depends on no user input and masks nothing (a bidirectional mask without padding), else
    None."""
    q, k = (n.meta.get("val") if isinstance(n, fx.Node) else None for n in (call["query"], call["key"]))
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return None
    value = _evaluate(mask, values)
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        value = _evaluate(mask, values, device=_CPU)  # its factories again, on the CPU (see the note)
    if not isinstance(value, torch.Tensor) or value.device.type == "meta" or value.dim() < 2:
        return None
    allowed = value if value.dtype == torch.bool else value == 0
    if value.is_floating_point():
        blocked = value[~allowed]
        if blocked.numel() and not bool((blocked <= torch.finfo(value.dtype).min / 2).all()):
            return None
    elif value.dtype != torch.bool:
        return None
    if bool(allowed.all()):
        return "full"
    size = q.shape[-2]
    if k.shape[-2] != size or tuple(value.shape[-2:]) != (size, size):
        return None
    causal = torch.ones(size, size, dtype=torch.bool, device=value.device).tril()
    return "causal" if bool(torch.equal(allowed, causal.expand_as(allowed))) else None


def _evaluate(target: fx.Node, values: dict[fx.Node, Any], device: torch.device | None = None) -> Any:
    """The value of ``target`` computed from lifted buffers and constants alone, or None when it reads
    anything else (a user input, a parameter).

    With ``device``, operations that name the meta device run on ``device`` instead, and a lifted value on
    meta (unknown) makes the answer None.
    """
    env: dict[fx.Node, Any] = {}
    order: list[fx.Node] = []
    stack, seen = [target], {target}
    while stack:  # the cone of target, then evaluated in graph order
        node = stack.pop()
        order.append(node)
        for arg in node.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                stack.append(arg)
    position = {n: i for i, n in enumerate(target.graph.nodes)}
    with torch.no_grad():
        for node in sorted(order, key=position.__getitem__):
            if node.op == "placeholder":
                if node not in values or isinstance(values[node], nn.Parameter):
                    return None  # a user input (the mask is data), or a parameter (the mask is learned)
                if device is not None and _on_meta(values[node]):
                    return None  # a value unknown on meta
                env[node] = values[node]
                continue
            fn: Any = node.target
            if node.op != "call_function" or not (isinstance(fn, torch._ops.OpOverload) or fn in _PLAIN):
                return None
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            if device is not None:
                args, kwargs = tree_map(partial(_off_meta, device), (args, kwargs))
            try:
                env[node] = fn(*args, **kwargs)
            except Exception:
                return None  # not computable here (a data-dependent op on meta, ...): leave the mask alone
    return env[target]


def _on_meta(value: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves(value))


def _off_meta(device: torch.device, value: Any) -> Any:
    """``device`` in place of the meta device (a factory's ``device=`` argument)."""
    return device if isinstance(value, torch.device) and value.type == "meta" else value


def _drop_unused(graph: fx.Graph, root: fx.Node) -> None:
    """Erase ``root`` and the operations of its cone that nothing reads any more (placeholders stay)."""
    stack, gone = [root], set()
    while stack:
        node = stack.pop()
        if node in gone:  # reached twice (an operation that read it twice)
            continue
        for user in list(node.users):  # export's checks of a removed value's dtype and device go with it
            if user.target is _CHECK and not user.users:
                graph.erase_node(user)
        if node.users or node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        gone.add(node)
        stack.extend(inputs)
