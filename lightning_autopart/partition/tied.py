"""Tied parameters: a stage that uses one without holding its owner block keeps a full copy of it."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_autopart.errors import ConfigError
from lightning_autopart.profile.optimizers import optimizer_state_factor
from lightning_autopart.profile.records import ModelProfile

__all__ = ["TiedCopy", "tied_copies"]

_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8": 1}


@dataclass(frozen=True, slots=True)
class TiedCopy:
    """A tied parameter: stages that use it without holding its owner block keep a full copy."""

    name: str
    owner: int
    #: ``next_user[i]``: smallest user block index >= i (L when none).
    next_user: tuple[int, ...]
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    param_count: int
    #: Optimizer step time of the copy (the owner block's, in proportion to the parameter's bytes).
    optimizer_us: float = 0.0

    def copied_by(self, i: int, j: int) -> bool:
        """Whether a stage of blocks ``[i, j)`` uses the parameter without its owner block: it keeps a copy."""
        return i > self.owner and self.next_user[i] < j


def tied_copies(profile: ModelProfile) -> tuple[TiedCopy, ...]:
    """Each tied parameter of ``profile`` with its owner block, its users and what a copy of it costs."""
    blocks = profile.blocks
    n = len(blocks)
    try:
        factor = optimizer_state_factor(profile.optimizer)
    except ConfigError:
        total = sum(b.param_bytes for b in blocks)
        factor = sum(b.optimizer_bytes for b in blocks) / total if total else 0.0
    copies = []
    for t in profile.tied:
        users = sorted({u for u in t.blocks if 0 <= u < n})
        if len(users) < 2:
            continue
        owner = users[0]
        count = 0
        for name, shape in blocks[owner].param_shapes:
            if name == t.name:
                count = 1
                for d in shape:
                    count *= d
        if count == 0:
            count = t.param_bytes // _ITEMSIZE.get(profile.dtype, 4)
        trainable = blocks[owner].grad_bytes > 0
        share = t.param_bytes / blocks[owner].param_bytes if blocks[owner].param_bytes else 0.0
        nxt = [n] * (n + 1)
        k, cur = len(users) - 1, n
        for i in range(n, -1, -1):
            if k >= 0 and users[k] == i:
                cur = i
                k -= 1
            nxt[i] = cur
        copies.append(
            TiedCopy(
                t.name,
                owner,
                tuple(nxt),
                t.param_bytes,
                t.param_bytes if trainable else 0,
                round(t.param_bytes * factor) if trainable else 0,
                count,
                blocks[owner].optimizer_us * share if trainable else 0.0,
            )
        )
    return tuple(copies)
