"""Block choice: which modules of the module tree become blocks, at most about ``max_blocks`` of them."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__: list[str] = []

#: Modules that only hold children: they are always replaced by their children.
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def block_modules(root: nn.Module, max_blocks: int, weight: Callable[[str], int]) -> list[str]:
    """FQNs of the modules to use as blocks, in module-tree order.

    Start from the root's children with containers expanded into their children (recursively). Then,
    while there are fewer than ``max_blocks`` blocks, replace the heaviest block that has children and holds
    more than ``2 / max_blocks`` of the root's ``weight`` by its children, unless that would make more than
    ``max_blocks`` blocks. A root without children is a single block, ``""``.

    Args:
        root: The captured module.
        max_blocks: The block count refinement may grow to (containers are expanded regardless).
        weight: Parameters (or operations) under a module FQN; ``weight("")`` is the total.
    """
    modules = dict(root.named_modules())
    blocks = children(root, "")
    if not blocks:
        return [""]
    total = weight("")
    stuck: set[str] = set()
    while len(blocks) < max_blocks:
        candidates = [
            b
            for b in blocks
            if b not in stuck and children(modules[b], b) and weight(b) * max_blocks > 2 * total
        ]
        if not candidates:
            break
        heaviest = max(candidates, key=weight)
        kids = children(modules[heaviest], heaviest)
        if len(blocks) - 1 + len(kids) > max_blocks:
            stuck.add(heaviest)
            continue
        at = blocks.index(heaviest)
        blocks[at : at + 1] = kids
    return blocks


def children(module: nn.Module, prefix: str) -> list[str]:
    """FQNs of ``module``'s children, with containers replaced by their own children, recursively."""
    found: list[str] = []
    for name, child in module.named_children():
        fqn = f"{prefix}.{name}" if prefix else name
        if isinstance(child, _CONTAINERS):
            found += children(child, fqn)
        else:
            found.append(fqn)
    return found


def collapse(blocks: list[str], owner: str) -> list[str]:
    """``blocks`` with every block inside ``owner`` replaced by ``owner`` itself (placed at the first one)."""
    inside = [b for b in blocks if b == owner or b.startswith(owner + ".")]
    if not inside:
        return [*blocks, owner]
    at = blocks.index(inside[0])
    rest = [b for b in blocks if b not in inside]
    return [*rest[:at], owner, *rest[at:]]


def ancestors(fqn: str) -> list[str]:
    """The proper non-root ancestors of a module FQN, outermost first ("a.b.c" -> ["a", "a.b"])."""
    parts = fqn.split(".") if fqn else []
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def param_weight(root: nn.Module) -> Callable[[str], int]:
    """Parameter elements under a module FQN (each shared parameter counted once per module)."""
    modules = dict(root.named_modules())
    return lambda fqn: sum(p.numel() for p in modules[fqn].parameters())
