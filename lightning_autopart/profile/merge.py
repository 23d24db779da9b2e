"""Joining the partial profiles that several ranks took of disjoint block subsets into one profile."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_autopart.errors import ProfileError
from lightning_autopart.profile.records import BlockProfile, ModelProfile, TiedParam

__all__ = ["merge_profiles", "profiled_blocks"]

#: Fields every part must agree on.
_SHARED = ("model", "batch_size", "input_bytes", "mode", "optimizer", "dtype", "capture")


def profiled_blocks(profile: ModelProfile) -> list[int]:
    """Indices (in the captured model) of the blocks a profile holds, from ``meta["profiled_blocks"]``.

    A profile without that key is taken to be complete.
    """
    return [int(i) for i in profile.meta.get("profiled_blocks", range(profile.num_blocks))]


def _merged_device(parts: Sequence[ModelProfile]) -> str:
    devices = sorted({p.device for p in parts})
    if len(devices) == 1:
        return devices[0]
    kinds = {d.split(":")[0] for d in devices}
    if len(kinds) == 1:
        return kinds.pop()
    raise ProfileError(f"cannot merge profiles taken on different kinds of device ({', '.join(devices)})")


def merge_profiles(parts: Sequence[ModelProfile]) -> ModelProfile:
    """Combine per-rank partial profiles (``profile(..., blocks=...)``) into one complete profile.

    Each part names its blocks in ``meta["profiled_blocks"]`` and the model's block count in
    ``meta["num_blocks"]``. Every block must be held by exactly one part; the parts must agree on the
    model, batch size, mode, optimizer, dtype and capture method. Device names that differ only by index
    ("cuda:0", "cuda:1") merge to the bare type ("cuda").

    Raises:
        ProfileError: no parts, parts that disagree, a block held twice, or blocks that no part holds.
    """
    if not parts:
        raise ProfileError("merge_profiles needs at least one partial profile, got none")
    first = parts[0]
    for i, part in enumerate(parts[1:], start=1):
        for name in _SHARED:
            if getattr(part, name) != getattr(first, name):
                raise ProfileError(
                    f"cannot merge profiles: part {i} has {name}={getattr(part, name)!r} "
                    f"but part 0 has {name}={getattr(first, name)!r}"
                )
    counts = {int(p.meta.get("num_blocks", p.num_blocks)) for p in parts}
    if len(counts) != 1:
        raise ProfileError(f"cannot merge profiles of models with different block counts ({sorted(counts)})")
    num_blocks = counts.pop()

    held: dict[int, tuple[int, BlockProfile, dict[str, Any] | None]] = {}
    for i, part in enumerate(parts):
        indices = profiled_blocks(part)
        if len(indices) != part.num_blocks:
            raise ProfileError(
                f"part {i} lists {len(indices)} profiled blocks but holds {part.num_blocks} block records"
            )
        extras = {int(e["index"]): e for e in part.meta.get("per_block", [])}
        for index, block in zip(indices, part.blocks, strict=True):
            if index in held:
                raise ProfileError(
                    f"block {index} ({block.name!r}) is held by both part {held[index][0]} and part {i}"
                )
            held[index] = (i, block, extras.get(index))
    missing = sorted(set(range(num_blocks)) - set(held))
    if missing:
        raise ProfileError(f"no part holds blocks {missing}; profile them too before merging")

    tied: dict[str, TiedParam] = {}
    for part in parts:
        for t in part.tied:
            tied.setdefault(t.name, t)
    meta = dict(first.meta)
    meta["profiled_blocks"] = list(range(num_blocks))
    meta["merged_from"] = len(parts)
    per_block = [held[i][2] for i in range(num_blocks)]
    if all(e is not None for e in per_block):
        meta["per_block"] = per_block
    else:
        meta.pop("per_block", None)
    return ModelProfile(
        model=first.model,
        blocks=tuple(held[i][1] for i in range(num_blocks)),
        batch_size=first.batch_size,
        input_bytes=first.input_bytes,
        tied=tuple(tied.values()),
        mode=first.mode,
        device=_merged_device(parts),
        optimizer=first.optimizer,
        dtype=first.dtype,
        capture=first.capture,
        meta=meta,
    )
