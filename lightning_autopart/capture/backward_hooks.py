"""Backward hooks, which a captured graph would leave out.

[Note: backward hooks] A captured graph's backward is autograd's derivative of its operations. Hooks that change
or read gradients are not operations: a hook the forward registers on a tensor (``y.register_hook(lambda g: g
* 0.5)``) and a module's backward hooks (``register_full_backward_hook``, ``register_full_backward_pre_hook``)
were left out of an exported graph, silently. So the export is refused when a module holds backward hooks or
the forward registers a tensor hook, and capture falls back to module hooks, whose blocks call the modules,
their hooks included. There, a tensor hook registered between blocks, or backward hooks on a module above the
blocks, make that module one block; on the root they are refused with the fix. Hooks on parameters
(``p.register_hook``, what gradient loggers use) need nothing: the stages accumulate into the user's own
parameters, which run them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_globals
from torch.utils.hooks import RemovableHandle

from lightning_autopart.errors import CaptureError

__all__ = ["TensorHooks", "backward_hooked", "has_backward_hooks", "record_tensor_hooks", "watch_tensor_hooks"]


class TensorHooks(CaptureError):
    """An export refused because forwards register tensor hooks; ``owners`` names the modules whose forwards
    did ("" for the root): module hooks must keep each of them one block, so that it registers them."""

    def __init__(self, message: str, owners: list[str]) -> None:
        super().__init__(message)
        self.owners = owners


def has_backward_hooks(module: nn.Module) -> bool:
    """Whether ``module`` holds backward hooks of its own, or a global module backward hook is registered."""
    global_hooks = module_globals._global_backward_hooks or module_globals._global_backward_pre_hooks
    return bool(module._backward_hooks or module._backward_pre_hooks or global_hooks)


def backward_hooked(module: nn.Module) -> list[str]:
    """Names of the modules of ``module`` that hold backward hooks ("" for the root; every module when a global
    backward hook is registered)."""
    return [name for name, sub in module.named_modules() if has_backward_hooks(sub)]


@contextmanager
def watch_tensor_hooks(on_register: Callable[[], None], *, no_grad_run: bool = False) -> Iterator[None]:
    """Call ``on_register`` whenever a tensor that is not a parameter gets a hook in the body (an export, or a
    hooks capture's forward); it may raise to refuse the hook. ``no_grad_run``: the body runs without
    gradients (a hooks capture), where registering on a tensor that needs none would raise, and is skipped."""
    register = torch.Tensor.register_hook

    def watched(tensor: torch.Tensor, hook: Any) -> Any:
        if not isinstance(tensor, nn.Parameter):
            on_register()
        if no_grad_run and not tensor.requires_grad:
            return RemovableHandle(OrderedDict())  # the hook could never run in this forward
        return register(tensor, hook)

    torch.Tensor.register_hook = watched  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.register_hook = register  # type: ignore[method-assign]


@contextmanager
def record_tensor_hooks(module: nn.Module) -> Iterator[list[str]]:
    """Record, for each tensor hook registered in the body (an export of ``module``), the module whose forward
    registered it: the innermost module of ``module`` running then ("" for the root)."""
    names = {id(sub): name for name, sub in module.named_modules()}
    running: list[str] = []
    owners: list[str] = []

    def enter(sub: nn.Module, *_: Any) -> None:
        running.append(names.get(id(sub), running[-1] if running else ""))

    def leave(sub: nn.Module, *_: Any) -> None:
        if running:
            running.pop()

    handles = [
        module_globals.register_module_forward_pre_hook(enter),
        module_globals.register_module_forward_hook(leave, always_call=True),
    ]
    try:
        with watch_tensor_hooks(lambda: owners.append(running[-1] if running else "")):
            yield owners
    finally:
        for handle in handles:
            handle.remove()
