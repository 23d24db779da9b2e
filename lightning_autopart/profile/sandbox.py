"""Sandboxed copies of a block's program and arguments on the device a profiler runs them on."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

from lightning_autopart.capture.graph import Block
from lightning_autopart.capture.portable import stays_put

__all__: list[str] = []

# The live model is never moved, cast or run: every helper here works on copies.

# [Note: no copy outlives the profiler] A profiler's copies (programs, parameters, inputs, outputs, gradients)
# must be freed when ``profile()`` returns, by reference counting alone: memory held by a reference cycle
# stays allocated (on the GPU too) until Python's collector happens to run, and the training step that follows
# the planning would pay for it (a full copy of every window's weights, measured on a CPU MLP). What kept them:
# every ``fx.GraphModule`` points at its graph and the graph back at it (``Graph.owning_module``), so a copied
# block program (and the parameters it holds) lived on after its Runner was gone; a user's module may be in a
# cycle of its own (a bound method kept as an attribute), and deep copies keep it; and a failed block's
# traceback keeps the frames, with their runners, outputs and autograd graphs. So a copy's graphs are detached
# from it as soon as it is made (``copy_program``), every Runner is emptied when its profiler is done with it,
# even on failure (``Runner.release``), and the frames of a failure are cleared before it is re-raised
# (``profiler._forget_frames``). No gc.collect() is needed, and none is done.


def convert_tensor(
    t: torch.Tensor, device: torch.device, dtype: torch.dtype | None, fill: str
) -> torch.Tensor:
    """A detached copy of ``t`` on ``device``, floats cast to ``dtype``; meta tensors become real random ones.

    ``fill`` says how to make values for a meta tensor: "param" (normal, std 0.02), "buffer" (floats one,
    others zero) or "arg" (floats randn, integers zero to stay in range, bools one).
    """
    target = dtype if dtype is not None and t.is_floating_point() else t.dtype
    if device.type == "meta":
        return torch.empty_like(t, device=device, dtype=target)
    if not t.is_meta:
        return t.detach().to(device=device, dtype=target, copy=True)
    if target.is_floating_point or target.is_complex:
        if fill == "param":
            return torch.randn(t.shape, dtype=target, device=device) * 0.02
        if fill == "buffer":
            return torch.ones(t.shape, dtype=target, device=device)
        return torch.randn(t.shape, dtype=target, device=device)
    if target == torch.bool:
        return torch.ones(t.shape, dtype=target, device=device)
    return torch.zeros(t.shape, dtype=target, device=device)


def attribute_tensors(program: nn.Module) -> list[torch.Tensor]:
    """Tensors a program holds outside its parameters and buffers: fx constants, constant call leaves."""
    found: dict[int, torch.Tensor] = {}
    for module in program.modules():
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers", "_modules"):
                continue
            leaves = tree_leaves(value) if isinstance(value, list | tuple | dict) else [value]
            found.update((id(t), t) for t in leaves if isinstance(t, torch.Tensor))
    return list(found.values())


def copy_program(program: nn.Module, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
    """Deep-copy a block program with every tensor it holds converted straight onto ``device``.

    Parameters, buffers and other tensor attributes are pre-seeded in the deepcopy memo, so their storage
    is never duplicated on the source device: copying a block of a 10 GB model to meta costs no memory.
    Floating parameters and buffers are cast to ``dtype`` (as ``module.to(dtype)`` does); constants keep
    theirs, and a constant on another device than the program was captured on stays there (see
    :func:`~lightning_autopart.capture.portable.stays_put`).
    """
    memo: dict[int, Any] = {}
    for t in attribute_tensors(program):
        if isinstance(t, nn.Parameter):
            memo[id(t)] = nn.Parameter(
                convert_tensor(t, device, dtype, "param"), requires_grad=t.requires_grad
            )
        else:
            memo[id(t)] = convert_tensor(t, t.device if stays_put(program, t) else device, None, "buffer")
    for p in program.parameters():
        memo[id(p)] = nn.Parameter(convert_tensor(p, device, dtype, "param"), requires_grad=p.requires_grad)
    for b in program.buffers():  # lifted constants are buffers of the program too
        memo[id(b)] = convert_tensor(b, b.device if stays_put(program, b) else device, dtype, "buffer")
    with warnings.catch_warnings():  # deep-copying pytree specs held by a program warns in torch >= 2.10
        warnings.filterwarnings("ignore", message=".*treespec", category=FutureWarning)
        clone = copy.deepcopy(program, memo)
    originals = {id(m) for m in program.modules()}
    for module in clone.modules():
        # A copied GraphModule and its (copied) graph point at each other: a cycle that would keep the copy's
        # parameters alive until the next garbage collection (see [Note: no copy outlives the profiler]).
        # Running the generated forward never reads Graph.owning_module; only graph edits do, and a copy is
        # never edited. Modules of the original (never expected in a deep copy) are left alone.
        if isinstance(module, fx.GraphModule) and id(module) not in originals:
            graph = module.graph
            if graph.owning_module is module:
                graph.owning_module = None
    return clone.train()


def release_program(clone: nn.Module, original: nn.Module) -> None:
    """Drop every reference a copy made by :func:`copy_program` holds: parameters, buffers, other attributes.

    The copy's modules are left empty and unusable, so whatever may still reach them (a cycle in a user's
    module, a traceback) holds no tensor. Modules of ``original`` are never touched.
    """
    originals = {id(m) for m in original.modules()}
    for module in list(clone.modules()):
        if id(module) in originals:
            continue
        module._parameters.clear()
        module._buffers.clear()
        vars(module).clear()


def needs_input_grad(block: Block) -> list[bool]:
    """Per argument: True for floating tensors produced by an earlier block that depend on a trainable
    parameter (``TensorInfo.requires_grad``); model inputs get no grad.

    [Note: inputs without a gradient] A float value made from buffers alone (a rotary table, a float
    attention mask) gets no gradient in training: within a stage autograd never tracks it, and across a
    cut the runtime detaches it ([Note: wire format]). Profiled as needing one, every block that reads it
    ran backward kernels training never runs: a Llama layer's backward, 106 kernels instead of 96 (the
    cos and sin gradients' products, broadcast sums and fan-in adds), about 20 % more host time.
    """
    matched = len(block.inputs) == len(block.args)
    flags = []
    for i, arg in enumerate(block.args):
        if matched:
            info = block.inputs[i]
            wanted = info.producer >= 0 and info.requires_grad
        else:
            wanted = block.index != 0
        flags.append(isinstance(arg, torch.Tensor) and arg.is_floating_point() and wanted)
    return flags


def make_args(block: Block, device: torch.device, dtype: torch.dtype | None) -> tuple[Any, ...]:
    """Fresh leaf copies of the block's arguments on ``device``; those that get a gradient require one."""

    def conv(t: Any) -> Any:
        return convert_tensor(t, device, dtype, "arg") if isinstance(t, torch.Tensor) else t

    out = []
    for arg, grad in zip(block.args, needs_input_grad(block), strict=True):
        value = tree_map(conv, arg)
        if grad:
            value.requires_grad_(True)
        out.append(value)
    return tuple(out)


def fresh_inputs(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Per-run inputs: leaves that require grad are cloned, so in-place ops in the block stay legal."""
    return tuple(a.clone() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)


def grad_outputs(outputs: Any) -> list[torch.Tensor]:
    """The outputs backward starts from: floating tensors that require grad."""
    leaves, _ = tree_flatten(outputs)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]


def clear_grads(program: nn.Module, args: Iterable[Any]) -> None:
    """Drop accumulated gradients so every run pays the same AccumulateGrad cost."""
    for p in program.parameters():
        p.grad = None
    for a in args:
        if isinstance(a, torch.Tensor):
            a.grad = None


def state_tensors(program: nn.Module) -> list[torch.Tensor]:
    """Parameters, buffers and constants of a program: saved copies of these are not activations."""
    return [*program.parameters(), *program.buffers(), *attribute_tensors(program)]
