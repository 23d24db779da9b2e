"""Capture of a model as an ordered sequence of blocks, by torch.export or by module hooks."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_autopart.capture.attributes import keep_attributes
from lightning_autopart.capture.backward_hooks import TensorHooks, has_backward_hooks
from lightning_autopart.capture.glue import first_line
from lightning_autopart.capture.graph import CapturedModel
from lightning_autopart.capture.host_random import keep_host_random
from lightning_autopart.capture.keywords import keyword_safe_codegen, refuse_keyword_names
from lightning_autopart.capture.libraries import library_hint
from lightning_autopart.capture.outputs import report_dropped
from lightning_autopart.capture.pytree_keys import keyed_pytree_nodes
from lightning_autopart.capture.strays import strays_on_meta
from lightning_autopart.capture.via_export import capture_export
from lightning_autopart.capture.via_hooks import capture_modules
from lightning_autopart.errors import CaptureError, ConfigError

__all__ = ["METHODS", "capture", "split_inputs"]

#: Values of ``capture(method=...)``.
METHODS = ("auto", "export", "modules")

_log = logging.getLogger(__name__)


def capture(
    module: nn.Module,
    example_inputs: Any,
    *,
    max_blocks: int = 64,
    method: str = "auto",
    check_eval: bool = False,
) -> CapturedModel:
    """Capture ``module`` as blocks: the units a pipeline stage boundary may fall between.

    Blocks follow the module tree: the root's children in execution order, containers (``nn.ModuleList``,
    ``nn.Sequential``, ``nn.ModuleDict``) always expanded, and the heaviest block split into its children
    while it holds more than ``2 / max_blocks`` of the parameters and the count stays within ``max_blocks``.
    The module is never modified: no hooks stay behind, parameters are the user's own tensors, and training
    mode and buffers are restored. Module and inputs may live on the meta device (a model with a parameter or
    buffer there is captured as wholly on meta: [Note: tensors the meta device missed]).

    Args:
        module: The model (an ``nn.Module`` or a ``LightningModule``; its ``forward`` is captured).
        example_inputs: A Tensor, a tuple of positional arguments, a dict of keyword arguments, or
            ``(args_tuple, kwargs_dict)``.

    Keyword Args:
        max_blocks: The block count the refinement may grow to (containers are always expanded).
        method: "export" (torch.export, non-strict; glue in any forward is fine), "modules" (hooks on
            one eager forward; glue must live inside block modules) or "auto" (export, else modules).
        check_eval: Export again in evaluation mode, to find forwards that branch on ``self.training`` in
            Python (``CapturedModel.eval_branches``, empty without it). The strategy's capture, whose stages
            also run evaluation steps, turns it on; a capture only planned or profiled need not pay for it.

    Returns:
        The captured model.

    Raises:
        ConfigError: An unknown ``method``, ``max_blocks < 1`` or malformed ``example_inputs``.
        CaptureError: The model cannot be captured; the message names the module and the fix.
    """
    if method not in METHODS:
        raise ConfigError(f"unknown capture method {method!r}; use one of: {', '.join(METHODS)}")
    if max_blocks < 1:
        raise ConfigError(f"max_blocks must be at least 1 (got {max_blocks})")
    if not isinstance(module, nn.Module):
        raise ConfigError(f"capture needs an nn.Module (got {type(module).__name__})")
    cls = type(module).__name__
    if next(module.parameters(), None) is None and next(module.children(), None) is None:
        raise CaptureError(
            f"cannot capture {cls}: it has no parameters and no submodules, so there is nothing to "
            f"partition; pass the model that holds the layers"
        )
    if not keyword_safe_codegen():  # [Note: keyword names]
        refuse_keyword_names(module)
    args, kwargs = split_inputs(example_inputs)
    kwargs = _signature_order(module, kwargs)
    # [Note: pytree keys]: export names values by their pytree paths.
    with (
        _preserved(module),
        keep_host_random(module),
        keep_attributes(module),
        keyed_pytree_nodes(),
        strays_on_meta(module),  # [Note: tensors the meta device missed]
    ):
        module.train()  # dropout probabilities as in training; modes are read when programs run
        try:
            captured = _capture(module, args, kwargs, max_blocks, method, check_eval)
        except CaptureError as error:  # [Note: transformers before 5]
            if not (hint := library_hint(module)):
                raise
            raise CaptureError(f"{error}{hint}") from error
    report_dropped(captured.output, cls)
    return captured


def _capture(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    max_blocks: int,
    method: str,
    check_eval: bool,
) -> CapturedModel:
    cls = type(module).__name__
    if has_backward_hooks(module):  # see [Note: backward hooks]
        raise CaptureError(
            f"cannot capture {cls}: it has backward hooks (register_full_backward_hook or a global module "
            f"hook), which run only when {cls} itself is called, and a pipeline calls its parts; register "
            "them on its submodules, or on its parameters (Tensor.register_hook)"
        )
    if method == "modules":
        return capture_modules(module, args, kwargs, max_blocks, None, check_eval=check_eval)
    try:
        return capture_export(module, args, kwargs, max_blocks, check_eval)
    except Exception as error:
        reason = first_line(error)
        whole = error.owners if isinstance(error, TensorHooks) else []  # see [Note: backward hooks]
        if method == "export":
            raise CaptureError(
                f"cannot capture {cls} with torch.export: {type(error).__name__}: {reason}. "
                f"Remove data-dependent control flow from the forward, or use method='modules'"
            ) from error
    _log.warning("torch.export cannot trace %s (%s); capturing with module hooks instead", cls, reason)
    captured = capture_modules(module, args, kwargs, max_blocks, reason, whole, check_eval)
    _log.info("captured %s with module hooks: %d blocks", cls, captured.num_blocks)
    return captured


def split_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``example_inputs`` as (positional args, keyword args)."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        if not all(isinstance(key, str) for key in example_inputs):
            raise ConfigError("example_inputs given as a dict must map forward's argument names to values")
        return (), dict(example_inputs)
    if (
        isinstance(example_inputs, tuple)
        and len(example_inputs) == 2
        and isinstance(example_inputs[0], tuple)
        and isinstance(example_inputs[1], dict)
    ):
        return tuple(example_inputs[0]), split_inputs(example_inputs[1])[1]
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _signature_order(module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` in the order of forward's parameters (as torch.export flattens them); others last."""
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return kwargs
    rank = {name: i for i, name in enumerate(names)}
    return {key: kwargs[key] for key in sorted(kwargs, key=lambda key: rank.get(key, len(names)))}


@contextmanager
def _preserved(module: nn.Module) -> Iterator[None]:
    """Restore every submodule's training flag and every buffer (object and value) on exit."""
    modes = [(m, m.training) for m in module.modules()]
    buffers = [
        (m, name, b, b.detach().clone())
        for m in module.modules()
        for name, b in m._buffers.items()
        if b is not None
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, name, b, saved in buffers:
                m._buffers[name] = b
                b.copy_(saved)
        for m, training in modes:
            m.training = training
