"""Baseline partitioners of other libraries, reimplemented from their descriptions, for comparison only.

Each returns block boundaries ``[0, b_1, ..., L]`` for ``parts`` contiguous parts; score them with
:func:`lightning_autopart.partition.scoring.evaluate` to compare with the planner under one cost model.

- DeepSpeed ``PipelineModule(partition_method="uniform")``: ``partition_uniform`` gives every part
  ``L // parts`` blocks and the first ``L % parts`` parts one more.
- DeepSpeed ``partition_method="parameters"``: weights = trainable parameter counts per block, split by
  ``partition_balanced``, which minimises the heaviest part (a bisection on the bottleneck with a greedy probe;
  optimal for min-max). Here exactly, on integers.
- torchgpipe ``balance_by_time``: weights = profiled forward + backward time per block, split by
  ``blockpartition.solve`` (a block-partition heuristic aiming at the same min-max). As a documented stand-in we
  use the optimal min-max contiguous split of those times, i.e. the best that heuristic can reach; it ignores
  memory, communication and the schedule, which is what the comparison is about.
"""

from __future__ import annotations

from bisect import bisect_right

from lightning_autopart.profile.records import ModelProfile

__all__ = ["deepspeed_parameters", "deepspeed_uniform", "min_max_split", "torchgpipe_balance_by_time"]


def _check(n: int, parts: int) -> None:
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} blocks into {parts} non-empty parts (need 1 <= parts <= {n})")


def deepspeed_uniform(profile: ModelProfile, parts: int) -> list[int]:
    """DeepSpeed ``partition_uniform``: equal block counts, the remainder on the first parts."""
    n = profile.num_blocks
    _check(n, parts)
    size, rest = divmod(n, parts)
    bounds = [0]
    for p in range(parts):
        bounds.append(bounds[-1] + size + (1 if p < rest else 0))
    return bounds


def _greedy(prefix: list[float], parts: int, limit: float) -> list[int] | None:
    """Farthest-reaching split with every part <= ``limit`` and exactly ``parts`` non-empty parts, or None."""
    n = len(prefix) - 1
    bounds = [0]
    for p in range(1, parts + 1):
        pos = bounds[-1]
        j = min(n - (parts - p), bisect_right(prefix, prefix[pos] + limit) - 1)
        if j <= pos:
            return None
        bounds.append(j)
    return bounds if bounds[-1] == n else None


def min_max_split(weights: list[float], parts: int) -> list[int]:
    """Contiguous split of ``weights`` into ``parts`` non-empty parts minimising the heaviest part.

    Exact: the optimum is one of the O(L^2) interval sums; bisection over the sorted candidate bottlenecks of
    each start is replaced by bisection on the value with a greedy probe, finished on the exact interval sums.
    """
    n = len(weights)
    _check(n, parts)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + max(0.0, w))
    lo, hi = max([*weights, 0.0]), prefix[-1]
    best = _greedy(prefix, parts, hi)
    for _ in range(200):
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
        mid = 0.5 * (lo + hi)
        got = _greedy(prefix, parts, mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    assert best is not None
    return best


def deepspeed_parameters(profile: ModelProfile, parts: int) -> list[int]:
    """DeepSpeed ``partition_method="parameters"``: balance trainable parameter counts (min-max)."""
    weights = [float(b.param_count if b.grad_bytes > 0 else 0) for b in profile.blocks]
    return min_max_split(weights, parts)


def torchgpipe_balance_by_time(profile: ModelProfile, parts: int) -> list[int]:
    """torchgpipe ``balance_by_time`` stand-in: balance per-block forward + backward time (min-max)."""
    return min_max_split([b.fwd_us + b.bwd_us for b in profile.blocks], parts)
