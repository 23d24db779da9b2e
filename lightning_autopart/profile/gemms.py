"""The matrix products of an aten op, as [Note: GEMM waves] in opcount.py prices them, read off its arguments."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from lightning_autopart.capture.meta_layouts import conv_memory_format

__all__ = ["CONVOLUTIONS", "GROUPED", "Gemm", "conv_gemms", "gemms_of", "relayout_bytes"]

_aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class Gemm:
    """``batch`` independent ``(m x k) @ (k x n)`` products, of ``kind`` "matmul" or "conv"."""

    kind: str
    batch: int
    m: int
    n: int
    k: int

    @property
    def flops(self) -> float:
        """Multiply-adds times two."""
        return 2.0 * self.batch * self.m * self.n * self.k


def _mm(a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[Gemm, ...]:
    return (Gemm("matmul", 1, a.shape[0], b.shape[1], a.shape[1]),)


def _addmm(c: Any, a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[Gemm, ...]:
    return _mm(a, b)


def _bmm(a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[Gemm, ...]:
    return (Gemm("matmul", a.shape[0], a.shape[1], b.shape[2], a.shape[2]),)


def _baddbmm(c: Any, a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[Gemm, ...]:
    return _bmm(a, b)


def conv_gemms(
    weight_shape: tuple[int, ...], groups: int, positions: int, which: tuple[str, ...]
) -> tuple[Gemm, ...]:
    """A convolution's products as implicit GEMMs, per group (so ``batch`` is ``groups``).

    Write the convolution as the plain (not transposed) one it is built on: ``weight_shape`` is
    ``(Co, Ci / groups, *kernel)`` for it (a transposed convolution's weight, ``(C_in, C_out / groups, *k)``,
    is that of the plain convolution from its output to its input), and ``positions`` is batch times the
    spatial size of that plain convolution's output (a transposed convolution's input). Then, with
    ``P = positions``, ``R = Ci / groups * prod(kernel)``:

    - "fwd": the plain forward (im2col), ``P x (Co / groups)`` outputs over ``K = R``;
    - "dgrad": the gradient of its input, or a transposed convolution's forward (col2im), ``P x R`` outputs
      over ``K = Co / groups``;
    - "wgrad": the weight gradient, ``(Co / groups) x R`` outputs over ``K = P``.

    Each has the FLOPs ``torch.utils.flop_counter`` gives the convolution (except grouped weight gradients,
    which it counts ``groups`` times over).
    """
    co, ci_g = weight_shape[0], weight_shape[1]
    r = ci_g * math.prod(weight_shape[2:])
    co_g = co // max(1, groups)
    shapes = {"fwd": (positions, co_g, r), "dgrad": (positions, r, co_g), "wgrad": (co_g, r, positions)}
    return tuple(Gemm("conv", groups, *shapes[w]) for w in which)


def _convolution(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: bool,
    output_padding: Any,
    groups: int,
    *args: Any,
    out_val: Any = None,
    **kwargs: Any,
) -> tuple[Gemm, ...]:
    plain_out = x if transposed else out_val
    positions = plain_out.shape[0] * math.prod(plain_out.shape[2:])
    return conv_gemms(tuple(w.shape), groups, positions, ("dgrad",) if transposed else ("fwd",))


def _convolution_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    bias_sizes: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: bool,
    output_padding: Any,
    groups: int,
    output_mask: Any,
    *args: Any,
    out_val: Any = None,
    **kwargs: Any,
) -> tuple[Gemm, ...]:
    plain_out = x if transposed else grad_out
    positions = plain_out.shape[0] * math.prod(plain_out.shape[2:])
    which = []
    if output_mask[0]:
        which.append("fwd" if transposed else "dgrad")
    if output_mask[1]:
        which.append("wgrad")
    return conv_gemms(tuple(w.shape), groups, positions, tuple(which))


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[Gemm, ...]:
    """A grouped product (``torch._grouped_mm``, a mixture of experts' matmul): each group's rows, or its
    slice of K, against its own matrix. Priced as one product of all the rows (a group's last partial tile is
    not modelled), with the FLOPs the groups do together."""
    if a.dim() == 2 and b.dim() == 3:  # (rows, K) @ (groups, K, N): every routed token through its expert
        return (Gemm("matmul", 1, a.shape[0], b.shape[2], a.shape[1]),)
    if a.dim() == 3 and b.dim() == 3:  # (groups, M, K) @ (groups, K, N): a batched product
        return (Gemm("matmul", a.shape[0], a.shape[1], b.shape[2], a.shape[2]),)
    if a.dim() == 2 and b.dim() == 2:  # (M, K total) @ (K total, N) -> (groups, M, N): the weight gradient
        return (Gemm("matmul", 1, a.shape[0], b.shape[1], a.shape[1]),)
    if a.dim() == 3 and b.dim() == 2:  # (groups, M, K) @ (K, N total)
        return (Gemm("matmul", 1, a.shape[1], b.shape[1], a.shape[2]),)
    return ()


def _grouped_mm_backward(
    x: torch.Tensor, weight: torch.Tensor, offs: Any, grad_out: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[Gemm, ...]:
    """Both gradients of a (rows, K) @ (groups, K, N) grouped product: rows x N @ N x K, and K x rows @ rows x N
    summed per group."""
    rows, k, n = x.shape[0], weight.shape[1], weight.shape[2]
    return (Gemm("matmul", 1, rows, k, n), Gemm("matmul", 1, k, n, rows))


#: The matrix products of an op, from its arguments (and ``out_val``), as [Note: GEMM waves] prices them.
_GEMMS: dict[Any, Any] = {
    _aten.mm: _mm,
    _aten.addmm: _addmm,
    _aten.bmm: _bmm,
    _aten.baddbmm: _baddbmm,
    _aten.convolution: _convolution,
    _aten._convolution: _convolution,
    _aten.convolution_backward: _convolution_backward,
}


#: Grouped products by op name, whether or not the library that defines them is loaded: torch's own, and the
#: fallback of Hugging Face transformers' mixture-of-experts layers (a custom op, opaque to a dispatch mode:
#: the products inside it are not seen one by one). Mixtral's experts counted no FLOPs before these.
GROUPED: dict[str, Any] = {
    "aten._grouped_mm": _grouped_mm,
    "transformers.grouped_mm_fallback": _grouped_mm,
    "transformers.grouped_mm_fallback_backward": _grouped_mm_backward,
}


#: Convolution ops, whose channels-first operands cuDNN transposes on tensor cores.
CONVOLUTIONS = {_aten.convolution, _aten._convolution, _aten.convolution_backward}


def relayout_bytes(packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float:
    """Bytes cuDNN moves to run a channels-first convolution on tensor cores: its tensor-core kernels take
    channels-last (NHWC) operands, so each activation operand (input, output, their gradients) in NCHW is
    transposed in and out, one read and one write of it each. Where the input or the weight is channels-last,
    cuDNN runs channels-last and copies in only the operands that are not (0 for a channels-last model).

    [Note: conv relayout] Seen on an H100 (torch 2.11, cuDNN 9): ResNet-50 x 4 in float32 with TF32 spends
    13 of its 107 ms per step in ``nchwToNhwcKernel``/``nhwcToNchwKernel`` around the ``sm90_xmma`` kernels.
    """
    backward = packet is _aten.convolution_backward
    x, weight = (args[1], args[2]) if backward else (args[0], args[1])
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or x.dim() < 3:
        return 0.0
    channels_last = conv_memory_format(x, weight)
    # Run channels-last, cuDNN copies in the operands that are not and makes its outputs channels-last.
    moved = tree_flatten(args if channels_last is not None else (args, out))[0]
    acts = [t for t in moved if isinstance(t, torch.Tensor) and t.dim() == x.dim()]
    acts = [t for t in acts if t.shape[0] == x.shape[0] and t.shape != weight.shape]
    if channels_last is not None:
        acts = [t for t in acts if not t.is_contiguous(memory_format=channels_last)]
    return 2.0 * sum(t.numel() * t.element_size() for t in acts)


def gemms_of(packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> tuple[Gemm, ...]:
    """The matrix products op ``packet`` runs on ``args``; () for other ops or arguments it cannot read."""
    shapes = _GEMMS.get(packet) or GROUPED.get(str(packet))
    if shapes is None:
        return ()
    try:
        return tuple(shapes(*args, **kwargs, out_val=out))
    except (AttributeError, IndexError, TypeError, ValueError):
        return ()
