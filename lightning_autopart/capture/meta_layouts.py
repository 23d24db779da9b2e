"""Convolutions on meta tensors laid out as a GPU lays them out: channels-last in, channels-last out.

[Note: channels-last on meta] A model trained channels-last (``model.to(memory_format=torch.channels_last)``,
the layout cuDNN's tensor-core kernels take) keeps that layout from one convolution to the next on a GPU:
cuDNN returns channels-last when the input or the weight is channels-last (oneDNN on a CPU agrees when the
input is). The meta kernel returns a contiguous tensor whatever it is given. So a capture or an estimate on
meta saw every convolution after the first fed a channels-first input, and priced the transposes cuDNN runs
around channels-first operands ([Note: conv relayout] in profile/gemms.py) where the GPU runs none: 2.3x the
price of the same layer run channels-last (64 channels, 3x3, 56x56, batch 32, on the ``h100`` spec).
:class:`MetaLayouts` gives meta convolutions (forward and backward) the layout the GPU's kernels choose. It
must be entered before the modes that count or meter operations, so it sits nearest the kernels and its
re-layout (free on meta: no data) is seen by none of them.

[Note: gradient layouts on meta] Three backward kernels return their input's gradient in another layout
than their meta functions: layer norm's and log-softmax's return it contiguous, batch norm's in the input's
own layout (channels-last or contiguous), on the CPU and on CUDA alike, where meta follows the incoming
gradient's strides. After a permute (SegFormer's ``(B, C, H, W)`` to ``(B, H*W, C)``) the next view of that
gradient then copied it on meta only: estimate mode priced 64 KB more transient memory in SegFormer's first
stage than its CPU run measured. :class:`MetaLayouts` gives those gradients the kernels' layouts too.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MetaLayouts", "conv_memory_format", "meta_layouts"]

_aten = torch.ops.aten
_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def conv_memory_format(x: torch.Tensor, weight: torch.Tensor) -> torch.memory_format | None:
    """The channels-last format cuDNN runs a convolution of ``x`` by ``weight`` in (either of them
    channels-last), or None for channels-first."""
    last = _LAST.get(x.dim())
    if last is None or weight.dim() != x.dim():
        return None
    return last if _is_last(x, last) or _is_last(weight, last) else None


def _is_last(t: torch.Tensor, last: torch.memory_format) -> bool:
    """Whether ``t`` has channels-last strides; a depthwise weight (one channel per group) fits both
    layouts, and is channels-last when its strides are channels-last's, as ``suggest_memory_format`` says."""
    if not t.is_contiguous(memory_format=last):
        return False
    rows, strides = 1, []
    for size in reversed(t.shape):
        strides.append(rows)
        rows *= max(size, 1)
    return t.stride() != tuple(reversed(strides))


def _as(t: Any, fmt: torch.memory_format | None) -> Any:
    if fmt is None or not isinstance(t, torch.Tensor) or t.dim() != _DIMS[fmt]:
        return t
    if t.is_contiguous(memory_format=fmt):
        return t
    return torch.empty_like(t, memory_format=fmt)


_DIMS = {torch.channels_last: 4, torch.channels_last_3d: 5}


class MetaLayouts(TorchDispatchMode):
    """Meta convolutions return the layout a GPU's convolution returns (see [Note: channels-last on meta]);
    every other op, and every op on a real device, runs untouched."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        packet = func._overloadpacket
        if packet is _aten.convolution:
            x, weight = args[0], args[1]
            if isinstance(x, torch.Tensor) and x.is_meta:
                return _as(out, conv_memory_format(x, weight))
        elif packet is _aten.convolution_backward:
            x, weight = args[1], args[2]
            if isinstance(x, torch.Tensor) and x.is_meta:
                fmt = conv_memory_format(x, weight)
                return (_as(out[0], fmt), _as(out[1], fmt), out[2])
        elif packet in _GRADIENT_LAYOUT and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            decides = _GRADIENT_LAYOUT[packet]  # [Note: gradient layouts on meta]
            fmt = _layout(args[decides]) if decides is not None else torch.contiguous_format
            first = out[0] if isinstance(out, tuple) else out
            if isinstance(first, torch.Tensor) and not first.is_contiguous(memory_format=fmt):
                first = torch.empty_like(first, memory_format=fmt)
            return (first, *out[1:]) if isinstance(out, tuple) else first
        return out


#: Backward kernels whose input gradient takes a fixed layout: the position of the argument whose layout it
#: takes (batch norm's input), or None for contiguous.
_GRADIENT_LAYOUT: dict[Any, int | None] = {
    _aten.native_layer_norm_backward: None,
    _aten._log_softmax_backward_data: None,
    _aten.native_batch_norm_backward: 1,
}


def _layout(x: Any) -> torch.memory_format:
    """Contiguous, or channels-last where ``x`` is (as ``suggest_memory_format`` tells)."""
    last = _LAST.get(x.dim()) if isinstance(x, torch.Tensor) else None
    return last if last is not None and _is_last(x, last) else torch.contiguous_format


def meta_layouts(tensors: Any) -> contextlib.AbstractContextManager[Any]:
    """:class:`MetaLayouts` where any of ``tensors`` is on meta, else nothing (no mode on real runs)."""
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors):
        return MetaLayouts()
    return contextlib.nullcontext()
