"""How a block's time splits into a batch-independent part and a per-sample part, from two measured batches.

[Note: two batch sizes] The planner prices a micro-batch of ``m`` samples as
``fixed + (t(b0) - fixed) * m / b0`` from a profile taken at ``b0`` samples. Counting kernels x launch
cost gives only part of ``fixed``: on a CPU a Linear(512, 512) also reads its 1 MiB weight and writes its
1 MiB weight gradient whatever the batch, so 16 samples cost about twice a quarter of 64. Measuring again at
``b1 < b0`` and drawing the line through both points gives ``fixed = (t1 b0 - t0 b1) / (b0 - b1)``,
kept between the launch estimate and 0.9 t0 (noise can tilt the line either way).
"""

from __future__ import annotations

import dataclasses

from lightning_autopart.errors import ProfileError
from lightning_autopart.records import BlockProfile, ModelProfile

__all__ = ["fit_fixed_costs", "small_batch"]


def small_batch(batch_size: int) -> int:
    """The second batch size measured: an eighth of the first, at least 1 (0 when there is none)."""
    return max(1, batch_size // 8) if batch_size > 1 else 0


def _fixed(t0: float, t1: float, b0: int, b1: int, floor: float) -> float:
    line = (t1 * b0 - t0 * b1) / (b0 - b1)
    return min(max(line, floor), 0.9 * t0)


def fit_fixed_costs(large: ModelProfile, small: ModelProfile) -> ModelProfile:
    """``large`` with each block's fixed forward and backward times fitted through ``small``'s times.

    Raises:
        ProfileError: the profiles are of different blocks, or ``small`` is not of a smaller batch.
    """
    b0, b1 = large.batch_size, small.batch_size
    if not 0 < b1 < b0:
        raise ProfileError(f"fitting fixed costs needs a smaller second batch, got {b1} against {b0}")
    names = [b.name for b in large.blocks]
    if names != [b.name for b in small.blocks]:
        raise ProfileError(
            f"the profile at batch {b1} has other blocks than the one at batch {b0}; "
            "the model's structure depends on the batch size"
        )
    blocks: list[BlockProfile] = []
    for big, little in zip(large.blocks, small.blocks, strict=True):
        blocks.append(
            dataclasses.replace(
                big,
                fwd_fixed_us=_fixed(big.fwd_us, little.fwd_us, b0, b1, big.fwd_fixed_us),
                bwd_fixed_us=_fixed(big.bwd_us, little.bwd_us, b0, b1, big.bwd_fixed_us),
            )
        )
    return dataclasses.replace(
        large, blocks=tuple(blocks), meta={**large.meta, "fixed_fit_batches": [b0, b1]}
    )
