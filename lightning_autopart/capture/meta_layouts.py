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

[Note: kernel layouts on meta] Some kernels lay out their output otherwise than their meta functions do.
Layer norm's and log-softmax's backward return the input's gradient contiguous, and batch norm's backward
in the input's own layout (channels-last or contiguous), on the CPU and on CUDA alike, where meta follows the
incoming gradient's strides. Batch norm's forward on CUDA keeps its input's strides (``empty_like``), also a
transposed input's, where the CPU's lays it out contiguous or channels-last; meta follows CUDA, where users
train (an H200 showed the difference). After a permute (SegFormer's ``(B, C, H, W)`` to
``(B, H*W, C)``) the next view of that gradient then copied it on meta only: estimate mode priced 64 KB more
transient memory in SegFormer's first stage than its CPU run measured. A few elementwise backward kernels
(softplus's, hardswish's, ELU's) follow the incoming gradient where their meta functions follow the input.
Log-sigmoid's forward returns a buffer for the backward that CUDA's kernel leaves empty and the CPU's and
meta's fill: meta keeps CUDA's empty one, so an estimate does not count an input-sized tensor saved for
backward that a GPU never holds; its output keeps a transposed input's strides on CUDA (an H200), where the
CPU's comes out contiguous.
:class:`MetaLayouts` gives those outputs the kernels' layouts too (:data:`_KERNEL_LAYOUT`; each checked
against the CPU in tests/unit/test_meta_layouts.py and against CUDA in tests/gpu/).
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
        elif packet in _KERNEL_LAYOUT and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return _relaid(out, _KERNEL_LAYOUT[packet], args)  # [Note: kernel layouts on meta]
        elif packet is _aten.log_sigmoid_forward and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            # CUDA's kernel keeps no buffer (the CPU's backward reads one): an empty one is saved for backward;
            # its output follows the input's strides (seen on an H200; the CPU's comes out contiguous)
            return _relaid(out[0], ("like", 0), args), out[1].new_empty((0,))
        return out


#: Kernels whose (first) output takes another layout than their meta function gives it: "contiguous",
#: ("format", i) for the layout argument i suggests (contiguous or channels-last), ("like", i) for the
#: strides of argument i (an elementwise kernel, whose TensorIterator follows its first operand, or CUDA's
#: batch norm, which allocates its output ``empty_like`` its input).
_KERNEL_LAYOUT: dict[Any, Any] = {
    _aten.native_layer_norm_backward: "contiguous",
    _aten._log_softmax_backward_data: "contiguous",
    _aten.mse_loss_backward: "contiguous",
    _aten.native_batch_norm_backward: ("format", 1),
    _aten.batch_norm_backward: ("format", 1),
    _aten.native_batch_norm: ("like", 0),
    _aten._native_batch_norm_legit: ("like", 0),
    _aten._native_batch_norm_legit_functional: ("like", 0),
    _aten._native_batch_norm_legit_no_training: ("like", 0),
    _aten._batch_norm_with_update: ("like", 0),
    _aten._batch_norm_no_update: ("like", 0),
    _aten.softplus_backward: ("like", 0),
    _aten.hardswish_backward: ("like", 0),
    _aten.elu_backward: ("like", 0),
}


def _relaid(out: Any, rule: Any, args: tuple[Any, ...]) -> Any:
    """``out`` with its first tensor in the layout ``rule`` gives (an entry of :data:`_KERNEL_LAYOUT`)."""
    first = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(first, torch.Tensor):
        return out
    if rule == "contiguous" or rule[0] == "format":
        fmt = torch.contiguous_format if rule == "contiguous" else _layout(args[rule[1]])
        if not first.is_contiguous(memory_format=fmt):
            first = torch.empty_like(first, memory_format=fmt)
    else:
        like = args[rule[1]]
        if isinstance(like, torch.Tensor) and like.shape == first.shape and like.stride() != first.stride():
            first = torch.empty_like(like, dtype=first.dtype)  # dense: its strides kept
    return (first, *out[1:]) if isinstance(out, (tuple, list)) else first


def _layout(x: Any) -> torch.memory_format:
    """Contiguous, or channels-last where ``x`` is (as ``suggest_memory_format`` tells)."""
    last = _LAST.get(x.dim()) if isinstance(x, torch.Tensor) else None
    return last if last is not None and _is_last(x, last) else torch.contiguous_format


def meta_layouts(tensors: Any) -> contextlib.AbstractContextManager[Any]:
    """:class:`MetaLayouts` where any of ``tensors`` is on meta, else nothing (no mode on real runs)."""
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors):
        return MetaLayouts()
    return contextlib.nullcontext()
