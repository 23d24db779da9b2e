"""The structure of a forward's output: flattened to the tensors a pipeline carries, rebuilt for the user's step.

[Note: output structure] Models return structures: a tensor, a tuple, a dict, a named tuple, a dataclass, a
Hugging Face ``ModelOutput`` (``out.loss``, ``out.logits``). A pipeline carries tensors only, so capture
flattens the output with torch's pytree (which knows all of these, ``ModelOutput`` included) and records an
:class:`OutputSpec`; the last stage rebuilds the exact structure from the tensors before the user's
``training_step`` sees it. Leaves that are not tensors are kept as constants when they are plain values
(None, numbers, strings) and dropped (rebuilt as None) otherwise: a key/value cache object (``DynamicCache``,
``use_cache=True``) holds every layer's keys and values, which the loss never needs and which would cross every
cut. Dropping is logged with the field's name and the fix (``use_cache=False``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_autopart.capture.graph import OutputSpec

__all__ = ["flat_forward", "flatten_output", "report_dropped"]

#: Leaf values kept as constants in the rebuilt output.
_CONSTANTS = (type(None), bool, int, float, complex, str, torch.dtype, torch.device)


def _is_cache(value: Any) -> bool:
    """A key/value cache object of Hugging Face transformers (never carried, see [Note: output structure])."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache = getattr(cache_utils, "Cache", None) if cache_utils is not None else None
    if cache is not None and isinstance(value, cache):
        return True
    return type(value).__name__.endswith("Cache") and not isinstance(value, torch.Tensor)


def flatten_output(output: Any) -> tuple[list[Any], OutputSpec]:
    """The tensor leaves of ``output`` in order, and the spec that rebuilds it from them.

    ``spec.slots`` numbers the tensor leaves 0, 1, ... in order (a tensor appearing twice has two slots).
    """
    with_paths, spec = pytree.tree_flatten_with_path(output, is_leaf=_is_cache)
    tensors: list[Any] = []
    slots: list[int | None] = []
    constants: list[Any] = []
    dropped: list[str] = []
    for path, leaf in with_paths:
        if isinstance(leaf, torch.Tensor):
            slots.append(len(tensors))
            constants.append(None)
            tensors.append(leaf)
            continue
        slots.append(None)
        if isinstance(leaf, _CONSTANTS):
            constants.append(leaf)
        else:
            constants.append(None)
            dropped.append(f"{pytree.keystr(path) or 'output'} ({type(leaf).__name__})")
    return tensors, OutputSpec(spec, tuple(slots), tuple(constants), tuple(dropped))


@contextlib.contextmanager
def flat_forward(module: nn.Module, found: list[OutputSpec]) -> Iterator[None]:
    """Make ``module(...)`` return its output's tensor leaves as a tuple; append each call's spec to ``found``.

    The forward is shadowed by an instance attribute with the same signature (what torch.export reads), so
    parameter names and hooks stay as they are.
    """
    forward = module.forward
    missing = object()
    shadowed = module.__dict__.get("forward", missing)

    @functools.wraps(forward)
    def flat(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        tensors, spec = flatten_output(forward(*args, **kwargs))
        found.append(spec)
        return tuple(tensors)

    module.__dict__["forward"] = flat
    try:
        yield
    finally:
        if shadowed is missing:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = shadowed


def report_dropped(spec: OutputSpec, cls: str) -> None:
    """Log what the pipeline will not carry (see [Note: output structure])."""
    if spec.dropped:
        warnings.warn(
            f"{cls}.forward returns {', '.join(spec.dropped)}; autopart carries only tensors through the "
            "pipeline, so training_step sees None there. Pass use_cache=False (or return only what the loss "
            "needs) to skip computing it",
            stacklevel=3,
        )
