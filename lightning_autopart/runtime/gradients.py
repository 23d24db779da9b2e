"""Gradient plumbing around stage modules: contiguous tensors across cuts and clipping by the global norm."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["agree_on_overflow", "clip_by_global_norm", "keep_contiguous"]


def keep_contiguous(module: nn.Module) -> nn.Module:
    """Make a stage's outputs and the gradients of its inputs contiguous; returns ``module``.

    torch.distributed.pipelining sizes its receive buffers by the strides of what is sent, and refuses
    strided buffers; a cut may be a view and a gradient through ``cat`` is a strided slice.
    """
    module.register_forward_pre_hook(_contiguous_input_grads)
    module.register_forward_hook(_contiguous_outputs)
    return module


def clip_by_global_norm(
    params: Iterable[nn.Parameter],
    clip_val: float,
    counted_elsewhere: set[int],
    group: dist.ProcessGroup | None,
) -> Tensor:
    """``clip_grad_norm_`` over the parameters of every rank of ``group`` (one pipeline); returns the norm.

    Parameters whose id is in ``counted_elsewhere`` (tied copies another rank counts) are scaled but not
    counted. With ``group=None`` the norm is this rank's alone.
    """
    with_grads = [p for p in params if p.grad is not None]
    device = (
        with_grads[0].grad.device if with_grads and with_grads[0].grad is not None else torch.device("cpu")
    )
    square = torch.zeros((), dtype=torch.float32, device=device)
    for p in with_grads:
        if id(p) not in counted_elsewhere and p.grad is not None:
            square += torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float32) ** 2
    if group is not None:
        dist.all_reduce(square, group=group)
    norm = square.sqrt()
    coefficient = (float(clip_val) / (norm + 1e-6)).clamp(max=1.0)
    for p in with_grads:
        if p.grad is not None:
            p.grad.detach().mul_(coefficient.to(p.grad.dtype))
    return norm


def agree_on_overflow(found_inf: Mapping[Any, Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Make a gradient scaler's inf/NaN flags (``found_inf_per_device`` after ``unscale_``) the maximum over
    ``group`` (default: every rank), in place: one stage overflowing makes every stage skip the step and lower
    the scale, as one process would. One small all-reduce, no host sync."""
    if not found_inf:
        return
    flags = list(found_inf.values())
    total = torch.stack([f.reshape(()).to(flags[0].device) for f in flags]).amax().reshape(1)
    dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    for f in flags:
        f.copy_(total.reshape(f.shape).to(f.device))


def _contiguous_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    """A forward hook returning the stage's output tensors contiguous."""
    if isinstance(output, tuple):
        return tuple(t.contiguous() if isinstance(t, Tensor) else t for t in output)
    return output.contiguous() if isinstance(output, Tensor) else output


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _contiguous_input_grads(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A forward pre-hook routing float inputs that need gradients through :class:`_ContiguousGrad`."""
    return tuple(_ContiguousGrad.apply(a) if isinstance(a, Tensor) and a.requires_grad else a for a in args)
