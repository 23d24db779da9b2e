"""Bad inputs to the strategy refused before any work, each with the problem and the fix: a pipeline depth the
devices cannot hold, a loader with no first batch to plan from, a model with nothing to train.

Each check runs where its facts are first known and before anything expensive: the depth against the world size
in ``setup_environment``, before the process group waits for its peers (every rank refuses alike, and a missing
peer cannot turn the message into a rendezvous timeout); the loader and the parameters in ``setup``, before
capture and profiling. Nothing here imports Lightning: loaders and modules are plain objects.
"""

from __future__ import annotations

from collections.abc import Sequence, Sized
from typing import Any

from torch import Tensor, nn

from lightning_autopart.errors import ConfigError

__all__ = ["check_input_shapes", "check_stages", "check_trainable", "empty_loader_message"]


def check_stages(num_stages: int | None, world_size: int) -> None:
    """Refuse a pipeline depth the devices cannot hold: more stages than devices, or a depth that leaves some
    devices without a stage (every stage runs on the same number of replicas)."""
    if num_stages is None:
        return
    if num_stages > world_size:
        raise ConfigError(
            f"num_stages={num_stages} is more than the {world_size} devices; use at most {world_size} stages, or "
            f"launch at least {num_stages} processes"
        )
    if world_size % num_stages:
        below = world_size // num_stages * num_stages
        counts = " or ".join(str(n) for n in (below, below + num_stages) if n)
        fits = " or ".join(str(s) for s in range(1, world_size + 1) if world_size % s == 0)
        raise ConfigError(
            f"num_stages={num_stages} does not divide the {world_size} devices: every stage runs on the same "
            f"number of replicas, so {world_size % num_stages} device(s) would hold no stage; use a multiple of "
            f"{num_stages} devices ({counts}), or num_stages={fits}"
        )


def empty_loader_message(name: str, loader: Any) -> str:
    """Why the ``name`` loader ("train", "val", ...) ``loader`` yields no batch, as far as its sampler and batch
    size tell, and the fix."""
    batch, drop_last = getattr(loader, "batch_size", None), bool(getattr(loader, "drop_last", False))
    sampler = getattr(loader, "sampler", None)
    try:
        samples: int | None = len(sampler) if isinstance(sampler, Sized) else None
    except TypeError:  # an iterable dataset's sampler has no length
        samples = None
    if samples == 0:
        why, fix = "its dataset is empty", "give it data"
    elif samples is not None and batch and drop_last and samples < batch:
        why = (
            f"it draws {samples} sample(s) on this rank, fewer than batch_size={batch}, and drop_last=True drops "
            "that one short batch"
        )
        fix = f"use batch_size={samples} or less, drop_last=False, or more data"
    else:
        why, fix = "it is empty", "give it data (check its dataset's length, batch_size, drop_last and sampler)"
    return (
        f"the {name} dataloader yields no batch ({why}), and autopart plans the pipeline from the first batch "
        f"of the {name} loop: {fix}"
    )


def check_trainable(root: nn.Module, root_name: str, module: Any) -> None:
    """Refuse to fit a pipelined model ``root`` (``module``'s submodule ``root_name``, "" for ``module`` itself)
    with no parameter to train: plain Lightning would fail in backward with a bare autograd error, or, with no
    optimizer, "train" without changing anything and exit 0."""
    params = list(root.parameters())
    if any(p.requires_grad for p in params):
        return
    name = f"{type(module).__name__}.{root_name}" if root_name else type(module).__name__
    if params:
        why = f"has {len(params)} parameter tensor(s), all frozen (requires_grad=False)"
        fix = "unfreeze the ones to train (requires_grad_(True))"
    else:
        why = "has no parameters"
        fix = "make training_step call the module that holds the layers to train (autopart pipelines the first one)"
    raise ConfigError(
        f"nothing to train: the pipelined model {name}, the module training_step calls first, {why}; {fix}, or "
        "run trainer.validate, test or predict instead of fit"
    )


def check_input_shapes(tensors: Sequence[Any], captured: Sequence[tuple[int, ...]], model: str) -> None:
    """Refuse a step whose tensors for ``model`` differ from the captured inputs past the batch dimension (a
    batch padded to its own longest sample): the stages run fixed shapes, and another length would fail
    deep inside a stage on one rank, or run on shapes nothing planned."""
    if len(tensors) != len(captured):
        raise ConfigError(
            f"the step passes {len(tensors)} tensor(s) to {model}, which was captured with {len(captured)}; "
            "pass the same inputs in every step (an optional input such as attention_mask in all or none)"
        )
    for i, (t, shape) in enumerate(zip(tensors, captured, strict=True)):
        if isinstance(t, Tensor) and tuple(t.shape[1:]) != tuple(shape[1:]):
            planned = ", ".join(["batch", *map(str, shape[1:])])
            raise ConfigError(
                f"input {i} of {model} has shape {tuple(t.shape)}, but the pipeline was captured with "
                f"({planned}): pipelined shapes are fixed, so give every batch the same shape past the batch "
                "dimension (pad text to a fixed length, e.g. tokenizer(..., padding='max_length', "
                "max_length=N), not to each batch's longest sample)"
            )
