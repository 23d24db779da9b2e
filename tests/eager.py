"""A captured model's blocks, chained and trained, against the eager model they came from."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.runtime.stages import build_stage_module

__all__ = ["assert_grads_equal_eager", "run_captured", "run_stages"]


def assert_grads_equal_eager(model: nn.Module, captured: CapturedModel, x: torch.Tensor) -> None:
    """One backward of ``sum(output ** 2)`` through the captured blocks, chained (each takes the previous
    block's first output), gives every parameter the gradient eager training gives."""
    model(x).square().sum().backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    y = x
    for block in captured.blocks:
        y = block.program(y)[0]
    y.square().sum().backward()
    for name, p in model.named_parameters():
        assert (p.grad is None) == (name not in eager), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, eager[name], msg=name)


def run_captured(captured: CapturedModel, *inputs: torch.Tensor) -> Any:
    """The captured model's output for its tensor ``inputs`` (in capture's order), its blocks run in turn
    on the values each reads, the output rebuilt in the forward's own structure."""
    values = {info.name: t for info, t in zip(captured.inputs, inputs, strict=True)}
    for block in captured.blocks:
        outs = block.program(*(values[info.name] for info in block.inputs))
        values.update({info.name: t for info, t in zip(block.outputs, outs, strict=True)})
    return captured.output.rebuild([values[info.name] for info in captured.cuts[-1]])


def run_stages(captured: CapturedModel, count: int, *inputs: torch.Tensor) -> Any:
    """The captured model's output for its tensor ``inputs``, run as ``count`` stage modules in a chain (the
    last as long as the rest take), each stage as the runtime builds it."""
    size = max(1, captured.num_blocks // count)
    bounds = sorted({*range(0, size * (count - 1), size), captured.num_blocks})
    values: tuple[torch.Tensor, ...] = inputs
    for start, end in itertools.pairwise(bounds):
        values = build_stage_module(captured, start, end)(*values)
    return captured.output.rebuild(list(values))

