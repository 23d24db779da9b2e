"""Grouped key/value heads that a materialised mask made repeated, given back to attention as ``enable_gqa``.

[Note: grouped heads] Run eagerly without padding, a Hugging Face decoder with fewer key/value heads than
query heads (Llama 3, Mistral, Qwen2, ...) passes no mask and calls ``scaled_dot_product_attention(q, k, v,
is_causal=True, enable_gqa=True)``: flash attention reads each key/value head for its whole group. Under
torch.export the mask is built (see [Note: causal masks]), and with a mask the library first repeats every
key/value head for each query head of its group (``unsqueeze``, ``expand``, ``reshape``: a copy of the keys
and values, ``heads / kv_heads`` times larger, which backward also keeps). Once the mask is folded away the
captured attention is the eager one again but for those copies, so :func:`fold_repeated_heads` passes the
unrepeated keys and values with ``enable_gqa=True`` and drops the copies nothing else reads. As eagerly, a
float32 step on a GPU then takes the math path (memory-efficient attention has no grouped heads); half
precision runs flash. Only calls whose mask the capture removed are rewritten: a call that kept its mask
was not grouped eagerly either.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

__all__ = ["fold_repeated_heads"]

_aten = torch.ops.aten
_UNSQUEEZE = {_aten.unsqueeze.default}
_EXPAND = {_aten.expand.default}
_RESHAPE = {_aten.reshape.default, _aten.view.default, _aten._unsafe_view.default}
#: Largest head size for which eager Hugging Face code asks for grouped heads (flash attention's limit).
_GROUPED_HEAD_SIZE = 256


def fold_repeated_heads(node: fx.Node) -> bool:
    """Rewrite attention ``node`` (unmasked, query, key and value positional) to read the keys and values
    before their heads were repeated, with ``enable_gqa=True``; False (and nothing changed) when they were
    not repeated that way."""
    if len(node.args) != 3 or node.kwargs.get("enable_gqa") or node.kwargs.get("attn_mask") is not None:
        return False
    q, k, v = node.args
    if not (isinstance(q, fx.Node) and isinstance(k, fx.Node) and isinstance(v, fx.Node)):
        return False
    heads = _shape(q)
    sources = [_unrepeated(n) for n in (k, v)]
    if heads is None or len(heads) != 4 or sources[0] is None or sources[1] is None:
        return False
    (key, k_groups), (value, v_groups) = sources[0], sources[1]
    key_shape, value_shape = _shape(key), _shape(value)
    if key_shape is None or value_shape is None or k_groups != v_groups or k_groups < 2:
        return False
    if key_shape[1] != value_shape[1] or key_shape[1] * k_groups != heads[1]:
        return False
    if not key_shape[-1] == value_shape[-1] <= _GROUPED_HEAD_SIZE:
        return False
    node.args = (q, key, value)
    node.kwargs = {**node.kwargs, "enable_gqa": True}
    for repeated in (k, v):
        _drop_chain(node.graph, repeated)
    return True


def _shape(node: Any) -> tuple[int, ...] | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor) or any(not isinstance(s, int) for s in value.shape):
        return None
    return tuple(value.shape)


def _unrepeated(node: fx.Node) -> tuple[fx.Node, int] | None:
    """``(x, groups)`` when ``node`` is ``x`` (batch, kv heads, length, size) with each head repeated
    ``groups`` times in place: ``x.unsqueeze(2).expand(b, kv, groups, t, d).reshape(b, kv * groups, t, d)``
    (the reshape possibly decomposed into a clone and a view)."""
    if node.target not in _RESHAPE or not node.args:
        return None
    expand = node.args[0]
    if isinstance(expand, fx.Node) and expand.target is _aten.clone.default and len(expand.users) == 1:
        expand = expand.args[0]  # a reshape decomposed: the copy it makes, then a view
    if not isinstance(expand, fx.Node) or expand.target not in _EXPAND or len(expand.users) != 1:
        return None
    unsqueeze = expand.args[0]
    if not isinstance(unsqueeze, fx.Node) or unsqueeze.target not in _UNSQUEEZE or unsqueeze.args[1:] != (2,):
        return None
    source = unsqueeze.args[0]
    before, wide, after = _shape(source), _shape(expand), _shape(node)
    if not isinstance(source, fx.Node) or before is None or wide is None or after is None or len(before) != 4:
        return None
    b, kv, t, d = before
    groups = wide[2]
    if wide != (b, kv, groups, t, d) or after != (b, kv * groups, t, d):
        return None
    return source, groups


def _drop_chain(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and the repeat that made it, as far as nothing else reads them."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        for user in list(node.users):  # export's checks of a removed value's dtype and device go with it
            if user.target is _aten._assert_tensor_metadata.default and not user.users:
                graph.erase_node(user)
        if node.users:
            return
        parent = node.args[0]
        graph.erase_node(node)
        if not isinstance(parent, fx.Node) or parent.op == "placeholder":
            return
        node = parent
