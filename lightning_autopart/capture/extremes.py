"""Captured fill values that follow their tensor's dtype: ``torch.finfo(x.dtype).min`` under autocast.

[Note: dtype extremes] Attention masks are often filled with the most negative value of the scores' dtype:
``scores.masked_fill(~mask, torch.finfo(scores.dtype).min)`` (DeBERTa-v2's attention). torch.export records
that value as a constant of the capture's dtype, float32's -3.4e38. Under "bf16-mixed" or "16-mixed" the
scores are bfloat16 or float16 when the pipelined stage runs, and ``masked_fill`` refuses a value they cannot
hold ("value cannot be converted to type c10::BFloat16 without overflow"), where the eager model filled the
low-precision dtype's own minimum; ``where`` with such a scalar would silently make it infinite (and a fully
masked row's softmax NaN). So in those operations a float32 extreme (plus or minus ``finfo(float32).max``,
which no lower-precision dtype holds) becomes a read of the extreme of its tensor's dtype when the program
runs: the same value in float32, the eager model's in a lower precision.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

__all__ = ["dtype_extreme", "follow_extremes"]

_aten = torch.ops.aten

#: float32's largest magnitude: a constant equal to it (either sign) is read as "the dtype's extreme".
FLOAT32_EXTREME = torch.finfo(torch.float32).max

#: Operations whose scalar becomes their tensor's dtype: (position of that tensor, position of the scalar).
_FILLS: dict[Any, tuple[int, int]] = {
    _aten.masked_fill.Scalar: (0, 2),
    _aten.masked_fill_.Scalar: (0, 2),
    _aten.fill.Scalar: (0, 1),
    _aten.fill_.Scalar: (0, 1),
    _aten.where.ScalarOther: (1, 2),
    _aten.where.ScalarSelf: (2, 1),
}


def dtype_extreme(tensor: torch.Tensor, sign: float) -> float:
    """``sign`` times the largest finite value of ``tensor``'s dtype (float32's for a non-floating tensor)."""
    top = torch.finfo(tensor.dtype).max if tensor.is_floating_point() else FLOAT32_EXTREME
    return math.copysign(top, sign)


def follow_extremes(graph: fx.Graph) -> int:
    """Make every float32-extreme fill value in ``graph`` read its tensor's dtype at run time, in place (see
    [Note: dtype extremes]); returns how many were rewritten."""
    rewritten = 0
    for node in list(graph.nodes):
        where = _FILLS.get(node.target) if node.op == "call_function" else None
        if where is None or len(node.args) <= max(where):
            continue
        tensor, value = node.args[where[0]], node.args[where[1]]
        if not isinstance(tensor, fx.Node) or not isinstance(value, float) or abs(value) != FLOAT32_EXTREME:
            continue
        with graph.inserting_before(node):
            read = graph.call_function(dtype_extreme, (tensor, value))
        args = list(node.args)
        args[where[1]] = read
        node.args = tuple(args)
        rewritten += 1
    return rewritten
