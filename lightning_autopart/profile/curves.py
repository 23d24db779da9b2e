"""Cost curves from profiles taken at several batch sizes (see [Note: cost curves] in records.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_map

from lightning_autopart.errors import ProfileError
from lightning_autopart.profile.loss import LossCost
from lightning_autopart.records import CostPoint, ModelProfile

__all__ = ["curve_sizes", "join_curves", "resize_batch"]


def curve_sizes(largest: int) -> list[int]:
    """The batch sizes a measured curve is taken at: 1 and every fourth power of two below ``largest``, and
    ``largest`` itself (1, 4, 16, 64, ... -- a few points, each a capture and a profile)."""
    sizes = {largest}
    size = 1
    while size < largest:
        sizes.add(size)
        size *= 4
    return sorted(sizes)


def resize_batch(inputs: Any, batch: int, size: int) -> Any:
    """``inputs`` with every tensor whose leading dim is ``batch`` cut or repeated to ``size`` samples."""

    def resize(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != batch:
            return x
        if size <= batch:
            return x[:size]
        return x.repeat(-(-size // batch), *([1] * (x.dim() - 1)))[:size]

    return tree_map(resize, inputs)


def join_curves(profiles: Mapping[int, ModelProfile], losses: Mapping[int, LossCost] | None = None) -> ModelProfile:
    """One profile whose blocks carry curves through ``profiles`` (by batch size), the loss added to the last
    block (see [Note: the loss] in loss.py); its other fields are those of the largest batch's profile.

    Raises:
        ProfileError: the profiles are of different blocks (the model's structure depends on the batch size).
    """
    sizes = sorted(profiles)
    base = profiles[sizes[-1]]
    names = [b.name for b in base.blocks]
    for size in sizes:
        if [b.name for b in profiles[size].blocks] != names:
            raise ProfileError(
                f"the profile at batch {size} has other blocks than the one at batch {sizes[-1]}; "
                "the model's structure depends on the batch size"
            )
    last = len(names) - 1
    blocks = []
    for k, block in enumerate(base.blocks):
        points: list[CostPoint] = []
        for size in sizes:
            b = profiles[size].blocks[k]
            fwd, bwd, saved, transient = b.fwd_us, b.bwd_us, b.activation_bytes, b.transient_bytes
            loss = losses.get(size) if losses is not None and k == last else None
            if loss is not None:
                fwd, bwd = fwd + loss.fwd_us, bwd + loss.bwd_us
                saved, transient = saved + loss.saved_bytes, max(transient, loss.transient_bytes)
            points.append((size, fwd, bwd, saved, transient, b.cut_bytes))
        top = points[-1]
        blocks.append(
            dataclasses.replace(
                block,
                curve=tuple(points),
                fwd_us=top[1],
                bwd_us=top[2],
                activation_bytes=top[3],
                transient_bytes=top[4],
            )
        )
    meta = {**base.meta, "curve_sizes": sizes, "loss_priced": bool(losses)}
    return dataclasses.replace(base, blocks=tuple(blocks), meta=meta)
