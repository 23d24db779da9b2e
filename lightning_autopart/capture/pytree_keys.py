"""Pytree containers registered without keys, given keys while torch.export runs.

[Note: pytree keys] torch.export names the inputs and outputs of the module, and of every submodule call it
records, by their paths in the pytree (``tree_flatten_with_path``), so each container type on the way needs a
``flatten_with_keys_fn``. transformers before 5.0 registers its ``ModelOutput`` classes without one, and
exporting any Hugging Face model there failed with "Did not find a flatten_with_keys_fn". While capture
exports, each registered container without keys gets them from its own flattening: the context's names where
the context is one string per child (a ``ModelOutput``'s field names, keyed as transformers 5 keys them),
else the child's position. The registry is put back afterwards; the keys only name the graph's values.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from torch.utils import _pytree as pytree

__all__ = ["keyed_pytree_nodes"]


@contextlib.contextmanager
def keyed_pytree_nodes() -> Iterator[None]:
    """While the block runs, every registered pytree node has a ``flatten_with_keys_fn`` (see the note)."""
    keyless = {cls: node for cls, node in list(pytree.SUPPORTED_NODES.items()) if node.flatten_with_keys_fn is None}
    for cls, node in keyless.items():
        keyed = functools.partial(_flatten_with_keys, node.flatten_fn)
        pytree.SUPPORTED_NODES[cls] = node._replace(flatten_with_keys_fn=keyed)
    try:
        yield
    finally:
        for cls, node in keyless.items():
            pytree.SUPPORTED_NODES[cls] = node


def _flatten_with_keys(flatten: Any, tree: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """``flatten``'s children, each with a key: a name from the context, or its position."""
    children, context = flatten(tree)
    names = list(context) if isinstance(context, (list, tuple)) else []
    if len(names) == len(children) and all(isinstance(n, str) for n in names):
        return [(pytree.MappingKey(n), c) for n, c in zip(names, children, strict=True)], context
    return [(pytree.SequenceKey(i), c) for i, c in enumerate(children)], context
