"""Cost curves from profiles taken at several batch sizes (see [Note: cost curves] in records.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_map

from lightning_autopart.errors import ProfileError
from lightning_autopart.profile.loss import LossCost
from lightning_autopart.profile.records import CostPoint, ModelProfile, with_curve

__all__ = ["add_loss", "curve_sizes", "estimate_sizes", "join_curves", "resize_batch"]


def curve_sizes(largest: int) -> list[int]:
    """The batch sizes a measured curve is taken at: 1 and every fourth power of two below ``largest``, and
    ``largest`` itself (1, 4, 16, 64, ... -- a few points, each a capture and a profile)."""
    sizes = {largest}
    size = 1
    while size < largest:
        sizes.add(size)
        size *= 4
    return sorted(sizes)


def estimate_sizes(largest: int) -> list[int]:
    """The batch sizes an estimated curve has points at: every power of two below ``largest``, and ``largest``
    (meta runs cost nothing, so each size the planner may use is priced, not interpolated, up to a factor 2)."""
    sizes = {largest}
    size = 1
    while size < largest:
        sizes.add(size)
        size *= 2
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


def join_curves(profiles: Mapping[int, ModelProfile]) -> ModelProfile:
    """One profile whose blocks carry curves through ``profiles`` (by batch size); its other fields are those of
    the largest batch's profile.

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
                "the model's structure depends on the batch size: make forward call the same modules at every "
                "batch size (no branch on x.shape[0])"
            )
    blocks = []
    for k, block in enumerate(base.blocks):
        points: list[CostPoint] = []
        for size in sizes:
            b = profiles[size].blocks[k]
            points.append((size, b.fwd_us, b.bwd_us, b.activation_bytes, b.transient_bytes, b.cut_bytes))
        blocks.append(with_curve(block, points))
    return dataclasses.replace(base, blocks=tuple(blocks), meta={**base.meta, "curve_sizes": sizes})


def add_loss(profile: ModelProfile, losses: Mapping[int, LossCost]) -> ModelProfile:
    """``profile`` with the training loss (see [Note: the loss] in loss.py) added to its last block.

    ``losses`` holds the loss's cost at some batch sizes; at the last block's other curve sizes it is the line
    through the nearest two (beyond the largest: through the largest two). Without a curve, the loss at the
    profile's batch size is added to the block's figures.
    """
    if not losses or not profile.blocks:
        return profile
    last = profile.blocks[-1]
    points = list(last.curve) or [
        (profile.batch_size, last.fwd_us, last.bwd_us, last.activation_bytes, last.transient_bytes, last.cut_bytes)
    ]
    joined = []
    for n, fwd, bwd, saved, transient, cut in points:
        loss = _loss_at(losses, n)
        # what the loss saves of the output, less what the block saves of it already (one tensor)
        of_output = max(0, loss.output_saved_bytes - round(last.saved_output_share * cut))
        joined.append(
            (
                n,
                fwd + loss.fwd_us,
                bwd + loss.bwd_us,
                saved + loss.saved_bytes + of_output,
                max(transient, loss.transient_bytes),
                cut,
            )
        )
    # the loss's backward runs from the last block: its transient is no forward's any more
    block = dataclasses.replace(with_curve(last, joined), forward_only=False)
    if not last.curve:
        block = dataclasses.replace(block, curve=())
    meta = {**profile.meta, "loss_priced": True}
    return dataclasses.replace(profile, blocks=(*profile.blocks[:-1], block), meta=meta)


def _loss_at(losses: Mapping[int, LossCost], n: int) -> LossCost:
    """The loss at ``n`` samples: measured there, else the line through the nearest two measured sizes."""
    if n in losses:
        return losses[n]
    sizes = sorted(losses)
    if len(sizes) == 1:
        only = losses[sizes[0]]
        scale = n / sizes[0]
        return LossCost(
            only.fwd_us * scale,
            only.bwd_us * scale,
            round(only.saved_bytes * scale),
            round(only.transient_bytes * scale),
            round(only.output_saved_bytes * scale),
        )
    k = 1
    while k < len(sizes) - 1 and sizes[k] < n:
        k += 1
    a, b = sizes[k - 1], sizes[k]
    t = (n - a) / (b - a)
    la, lb = losses[a], losses[b]

    def line(x: float, y: float) -> float:
        return max(0.0, x + (y - x) * t)

    return LossCost(
        line(la.fwd_us, lb.fwd_us),
        line(la.bwd_us, lb.bwd_us),
        round(line(la.saved_bytes, lb.saved_bytes)),
        round(line(la.transient_bytes, lb.transient_bytes)),
        round(line(la.output_saved_bytes, lb.output_saved_bytes)),
    )
