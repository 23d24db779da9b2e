"""Materialize a model built on the ``meta`` device: each rank allocates and initialises only the tensors it keeps.

[Note: meta init] A model built under ``torch.device("meta")`` (``Trainer.init_module(empty_init=True)``, or
``configure_model`` under autopart) holds no memory, so a model larger than any one device can be planned.
After planning, :func:`materialize` visits the modules in registration order, as Lightning's own meta-device
path does, gives every module that owns meta tensors real storage on the CPU and calls its
``reset_parameters()``. Tensors this rank keeps stay; the others go back to ``meta`` right after their
module is initialised, so a rank holds its stages plus at most one other module at a time, never the whole
model. Initialising the modules of other ranks too, in order, from the random state the model was built
with, consumes the random stream exactly as construction did: every module gets the weights a plain
construction with the same seed gives (for modules initialised by ``reset_parameters`` at construction, as
``torch.nn``'s are). Tensors keep their identity (``torch.utils.swap_tensors``), so optimizers, the captured
graph and the stage modules, all made over the meta tensors, now hold the real ones.

Nothing is left silently uninitialised: a module that owns tensors but has no ``reset_parameters``, a float
tensor ``reset_parameters`` did not write (it stays NaN, checked once) and torchmetrics states made on
``meta`` are refused, naming the module and the fix.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_autopart.capture.strays import swap_in_place
from lightning_autopart.errors import ConfigError

__all__ = ["Materialized", "check_initialisable", "has_meta_tensors", "materialize"]


@dataclass(frozen=True)
class Materialized:
    """What :func:`materialize` did on this rank: bytes kept, the most bytes held at once, modules initialised."""

    kept_bytes: int
    peak_bytes: int
    modules: int


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the ``meta`` device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def check_initialisable(module: nn.Module) -> None:
    """Refuse, before any work, a meta model that :func:`materialize` cannot initialise exactly."""
    missing = [
        (name or "<root>", type(sub))
        for name, sub in module.named_modules()
        if _direct_meta(sub, set()) and not callable(getattr(sub, "reset_parameters", None))
    ]
    if missing:
        names = ", ".join(f"{name} ({kind.__name__})" for name, kind in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        hf = any(kind.__module__.startswith("transformers") for _, kind in missing)
        raise ConfigError(
            f"modules {names}{more} own tensors on the meta device but have no reset_parameters(), so autopart "
            "cannot initialise them on the ranks that hold them: add a reset_parameters() that initialises the "
            "module's own parameters and buffers, or build the model on the CPU (outside "
            "init_module(empty_init=True) and configure_model)"
            + ("; Hugging Face models initialise in post_init(): build them on the CPU" if hf else "")
        )
    metrics = [
        name
        for name, sub in module.named_modules()
        if any(isinstance(v, Tensor) and v.is_meta for v in getattr(sub, "_defaults", {}).values())
    ]
    if metrics:
        raise ConfigError(
            f"torchmetrics metrics {', '.join(metrics[:5])} were created on the meta device, where their "
            "states have no values: create metrics in the LightningModule's __init__ outside "
            "init_module(empty_init=True) (configure_model builds on meta under autopart)"
        )


def materialize(module: nn.Module, keep: set[int], rng: Tensor | None = None) -> Materialized:
    """Give ``module``'s meta tensors CPU storage and initialise them (see [Note: meta init]).

    Args:
        module: The model; modules are visited in ``named_modules`` order.
        keep: Ids of the tensors this rank keeps; every other tensor is back on ``meta`` afterwards.
        rng: The CPU random state the model was built with (None: the current one); the caller's state is
            restored afterwards.
    """
    check_initialisable(module)
    done: set[int] = set()
    kept = peak = count = 0
    with _random_state(rng):
        for _, sub in module.named_modules():
            direct = _direct_meta(sub, done)
            if not direct:
                continue
            for t in direct:
                _swap_device(t, "cpu", fill=True)
            sub.reset_parameters()
            count += 1
            size = sum(t.nbytes for t in direct)
            peak = max(peak, kept + size)
            for t in direct:
                done.add(id(t))
                _check_written(sub, t)
                if id(t) in keep:
                    kept += t.nbytes
                else:
                    _swap_device(t, "meta")
    return Materialized(kept, peak, count)


def _direct_meta(module: nn.Module, done: set[int]) -> list[Tensor]:
    """The module's own (not its children's) meta tensors, each once, skipping those already initialised."""
    seen: dict[int, Tensor] = {}
    for t in (*module._parameters.values(), *module._buffers.values()):
        if t is not None and t.is_meta and id(t) not in done:
            seen.setdefault(id(t), t)
    return list(seen.values())


def _swap_device(t: Tensor, device: str, fill: bool = False) -> None:
    """Move ``t`` to ``device`` keeping the Python object (its holders keep seeing it); new storage is empty
    (NaN-filled with ``fill`` for floating tensors, so an uninitialised one is caught)."""
    new = torch.empty_like(t, device=device)
    if fill and new.is_floating_point():
        new.fill_(float("nan"))
    if isinstance(t, nn.Parameter):
        new = nn.Parameter(new, requires_grad=t.requires_grad)
    swap_in_place(t, new)


def _check_written(module: nn.Module, t: Tensor) -> None:
    """Refuse a floating tensor that ``reset_parameters`` left wholly uninitialised (still NaN)."""
    if t.is_floating_point() and t.numel() and bool(torch.isnan(t).all()):
        name = next(
            (n for n, v in (*module._parameters.items(), *module._buffers.items()) if v is t), "a tensor"
        )
        raise ConfigError(
            f"{type(module).__name__}.reset_parameters() does not initialise {name!r}, built on the meta "
            "device: make reset_parameters() initialise every parameter and buffer the module owns, or build "
            "the model on the CPU"
        )


@contextmanager
def _random_state(state: Tensor | None) -> Iterator[None]:
    """Run with the CPU generator at ``state`` (if given), then put the caller's state back."""
    saved: Any = torch.random.get_rng_state()
    if state is not None:
        torch.random.set_rng_state(state)
    try:
        yield
    finally:
        torch.random.set_rng_state(saved)
