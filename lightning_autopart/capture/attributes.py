"""Python attributes a forward assigns, which a captured graph would freeze.

[Note: Python state in the forward] A forward may keep Python state on its modules: a call counter that
switches a warm-up branch (``self.calls += 1; if self.calls > warmup: ...``), a list it appends to, a flag it
flips. torch.export runs the forward once, records tensor operations only, and puts every attribute back as
it found it: the branch taken at capture is frozen into the graph and the counter never moves again, with no
warning. So the export is watched: when a forward left a module attribute holding a plain value (numbers,
strings, ``None``, containers of them) different from before, the export is refused and :func:`capture`
falls back to module hooks, whose blocks run the forward's Python at every call. Module hooks freeze the
Python between blocks in turn, so an assignment there makes that parent one block, or refuses the root (as
for host random numbers, [Note: host random numbers]). Capture puts the attributes back in either case
(:func:`keep_attributes`). Tensors are not plain values: assigning a tensor attribute makes torch.export fail
on its own, and a buffer changed in place is an operation of the graph.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_autopart.errors import CaptureError

__all__ = ["attribute_state", "changed_attributes", "keep_attributes", "watch_attributes"]

_ATOMS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)
# nn.Module's own attributes, and "forward", which flat_forward shadows during export.
_MODULE_ATTRS = frozenset(nn.Module().__dict__) | {"forward"}
_OPAQUE = object()  # a value that is not plain: not compared


def _plain(value: Any, depth: int = 0) -> Any:
    """A copy of ``value`` if it is built of plain values only (compared with ``==``), else ``_OPAQUE``."""
    if isinstance(value, _ATOMS):
        return value
    if depth > 4 or not isinstance(value, (tuple, list, dict, set, frozenset)) or len(value) > 10_000:
        return _OPAQUE
    if isinstance(value, dict):
        items = {k: _plain(v, depth + 1) for k, v in value.items() if isinstance(k, _ATOMS)}
        ok = len(items) == len(value) and all(v is not _OPAQUE for v in items.values())
        return items if ok else _OPAQUE
    copied = [_plain(v, depth + 1) for v in value]
    if any(v is _OPAQUE for v in copied):
        return _OPAQUE
    return type(value)(copied) if not isinstance(value, tuple) else tuple(copied)


def attribute_state(module: nn.Module) -> dict[tuple[str, str], Any]:
    """Copies of the plain-valued attributes of ``module`` and its submodules, keyed by (module name,
    attribute); compare two with :func:`changed_attributes`."""
    state = {}
    for fqn, sub in module.named_modules(remove_duplicate=False):
        for name, value in vars(sub).items():
            if name not in _MODULE_ATTRS:
                state[fqn, name] = _plain(value)
    return state


def changed_attributes(before: dict[tuple[str, str], Any], after: dict[tuple[str, str], Any]) -> list[str]:
    """Attributes whose plain value differs between two :func:`attribute_state`, as "module.attribute (old
    -> new)". Attributes the forward added are not compared: those are set-ups done once (transformers
    marks hooks it installs on the first call so), and a value that was or became opaque is not compared."""
    changes = []
    for key, old in before.items():
        new = after.get(key, _OPAQUE)
        if old is not _OPAQUE and new is not _OPAQUE and old != new:
            fqn, name = key
            changes.append(f"{fqn + '.' if fqn else ''}{name} ({_short(old)} -> {_short(new)})")
    return changes


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@contextmanager
def keep_attributes(module: nn.Module) -> Iterator[None]:
    """Put the plain-valued attributes of ``module``'s submodules back on exit, as torch.export does
    (attributes the forward added stay): capturing runs the forward, and must leave the model's Python state
    as it found it."""
    modules = dict(module.named_modules(remove_duplicate=False))
    before = attribute_state(module)
    try:
        yield
    finally:
        after = attribute_state(module)
        for key, value in before.items():
            if value is not _OPAQUE and after.get(key, _OPAQUE) != value and key[0] in modules:
                setattr(modules[key[0]], key[1], value)


@contextmanager
def watch_attributes(module: nn.Module, cls: str) -> Iterator[None]:
    """Raise :class:`CaptureError` after the body if a forward of ``module`` changed a plain-valued attribute
    (see [Note: Python state in the forward]). The state is read by a forward hook, before torch.export puts
    the attributes back."""
    before = attribute_state(module)
    seen: list[list[str]] = []
    handle = module.register_forward_hook(
        lambda *_: seen.append(changed_attributes(before, attribute_state(module)))
    )
    try:
        yield
    finally:
        handle.remove()
    changes = next((c for c in seen if c), [])
    if changes:
        raise CaptureError(
            f"{cls}.forward changes the Python attribute{'s' if len(changes) > 1 else ''} "
            f"{', '.join(changes[:3])}, which torch.export would freeze into the graph (every step would run "
            "as at capture); keep such state in a buffer, or out of the forward"
        )
