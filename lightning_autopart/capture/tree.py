"""Block choice: which modules of the module tree become blocks, at most about ``max_blocks`` of them.

[Note: repeated layers] The elements of a container holding several modules of one class (the layers of a
transformer, the residual blocks of a ResNet stage) are the natural pipeline units, and every pipelining
system cuts only between them: inside one, a residual skip or an attention's shared input crosses every inner
cut. They are never split into their children.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

__all__: list[str] = []

#: Modules that only hold children: they are always replaced by their children.
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def block_modules(root: nn.Module, max_blocks: int, weight: Callable[[str], int]) -> list[str]:
    """FQNs of the modules to use as blocks, in module-tree order.

    Start from the root's children with containers expanded into their children (recursively). Then,
    while there are fewer than ``max_blocks`` blocks, replace the heaviest block that has children and holds
    more than ``2 / max_blocks`` of the root's ``weight`` by its children, unless that would make more than
    ``max_blocks`` blocks; repeated layers are never split (see [Note: repeated layers]). A root without
    children is a single block, ``""``.

    Args:
        root: The captured module.
        max_blocks: The block count refinement may grow to (containers are expanded regardless).
        weight: Parameters (or operations) under a module FQN; ``weight("")`` is the total.
    """
    modules = dict(root.named_modules(remove_duplicate=False))  # a module at two paths: both
    blocks = children(root, "")
    if not blocks:
        return [""]
    total = weight("")
    stuck: set[str] = repeated_layers(root)
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


def repeated_layers(root: nn.Module) -> set[str]:
    """FQNs of the elements of containers that hold several modules of their class (see [Note: repeated layers])."""
    found: set[str] = set()
    for fqn, module in root.named_modules():
        if not isinstance(module, _CONTAINERS):
            continue
        kinds: dict[type, list[str]] = {}
        for name, child in module.named_children():
            kinds.setdefault(type(child), []).append(f"{fqn}.{name}" if fqn else name)
        found.update(n for names in kinds.values() if len(names) > 1 for n in names)
    return found


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


def keep_whole(blocks: list[str], modules: Sequence[str]) -> list[str]:
    """``blocks`` with each of ``modules`` one block (:func:`collapse`), unless a block already holds it."""
    for fqn in modules:
        if not any(fqn == b or fqn.startswith(b + ".") for b in blocks):
            blocks = collapse(blocks, fqn)
    return blocks


def ancestors(fqn: str) -> list[str]:
    """The proper non-root ancestors of a module FQN, outermost first ("a.b.c" -> ["a", "a.b"])."""
    parts = fqn.split(".") if fqn else []
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def param_weight(root: nn.Module) -> Callable[[str], int]:
    """Parameter elements under a module FQN (each shared parameter counted once per module)."""
    modules = dict(root.named_modules(remove_duplicate=False))  # a module at two paths: both
    return lambda fqn: sum(p.numel() for p in modules[fqn].parameters())
