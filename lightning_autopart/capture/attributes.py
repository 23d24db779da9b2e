"""Python attributes a forward assigns, which a captured graph would freeze.

[Note: Python state in the forward] A forward may keep Python state on its modules: a call counter that
switches a warm-up branch (``self.calls += 1; if self.calls > warmup: ...``), a list it appends to, a flag it
flips, a field of a plain object it keeps (``self.state.step += 1``), a submodule's mode (``self.bn.eval()``;
the stages read modes when they run, so the forward's own call would be lost). torch.export runs the forward
once, records tensor operations only, and puts every module attribute back as it found it: the branch taken
at capture is frozen into the graph and the counter never moves again, with no warning. So the export is
watched: when a forward left a module attribute holding a plain value (numbers, strings, ``None``,
containers of them), or such an attribute of a plain object a module holds (one level down; a config shared
by every layer is compared once), different from before (set-ups done once aside: an attribute added, or one
set from ``None``), the export is refused and :func:`capture` falls back to module hooks, whose blocks run
the forward's Python at every call. Module hooks freeze the Python between blocks in turn, so an assignment
there makes that parent one block, or refuses the root (as for host random numbers, [Note: host random
numbers]). Capture puts the attributes back in either case
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

from lightning_autopart.capture.host_random import plain_object
from lightning_autopart.errors import CaptureError

__all__ = ["AttributeWatch", "keep_attributes", "state_fix", "watch_attributes"]

_ATOMS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)
# nn.Module's own attributes but its mode, and "forward", which flat_forward shadows during export.
_MODULE_ATTRS = (frozenset(nn.Module().__dict__) - {"training"}) | {"forward"}
MODE_FIX = "set a module's mode in an override of train(), which the stages call, not in the forward"
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


class AttributeWatch:
    """The plain-valued attributes ``module`` and its submodules hold now, to tell which a forward changes.

    Copies are taken once; a check compares the live values with them in one list comparison (identity
    first, so unchanged numbers cost almost nothing), which keeps a check per block boundary cheap on models
    of thousands of modules.
    """

    def __init__(self, module: nn.Module) -> None:
        self.names: list[tuple[str, str]] = []  # (module name, attribute path)
        self._dicts: list[dict[str, Any]] = []  # the __dict__ holding each attribute
        self._keys: list[str] = []  # the attribute's key in it
        self.copies: list[Any] = []
        objects: set[int] = set()  # plain objects already watched (a config shared by every layer)
        for fqn, sub in module.named_modules(remove_duplicate=False):
            for name, value in vars(sub).items():
                if name in _MODULE_ATTRS:
                    continue
                self._watch(fqn, name, vars(sub), name)
                if plain_object(value) and id(value) not in objects:  # ``self.state.step += 1``
                    objects.add(id(value))
                    for key in list(vars(value)):
                        self._watch(fqn, f"{name}.{key}", vars(value), key)

    def _watch(self, fqn: str, shown: str, holder: dict[str, Any], key: str) -> None:
        copied = _plain(holder[key])
        if copied is not _OPAQUE:
            self.names.append((fqn, shown))
            self._dicts.append(holder)
            self._keys.append(key)
            self.copies.append(copied)

    def _live(self, i: int) -> Any:
        return self._dicts[i].get(self._keys[i], _OPAQUE)

    def changed(self) -> list[int]:
        """Positions whose live value differs from the copy (one that is no longer plain, such as a tensor,
        is not compared: torch.export refuses tensor attributes itself)."""
        live = [d.get(key, _OPAQUE) for d, key in zip(self._dicts, self._keys, strict=True)]
        try:  # the common case, nothing changed, in one comparison
            if live == self.copies:
                return []
        except Exception:  # a value now a tensor cannot say whether it is equal: look closer
            pass
        found = []
        for i, (old, new) in enumerate(zip(self.copies, live, strict=True)):
            if new is old or new is _OPAQUE or old is None:  # None -> a value: a set-up done once
                continue
            if type(new) is not type(old) or not isinstance(new, _ATOMS):
                new = _plain(new)
                if new is _OPAQUE:
                    continue
            if new != old:
                found.append(i)
        return found

    def changes(self) -> list[str]:
        """The changed attributes as "module.attribute (old -> new)". Attributes the forward added, or set
        from ``None``, are not compared: those are set-ups done once (transformers marks so the hooks its
        first call installs, and a classifier's ``config.problem_type`` is chosen at its first call)."""
        shown = []
        for i in self.changed():
            fqn, name = self.names[i]
            old, new = _short(self.copies[i]), _short(self._live(i))
            shown.append(f"{fqn + '.' if fqn else ''}{name} ({old} -> {new})")
        return shown

    def rebase(self) -> None:
        """Take the live values as the copies to compare with from now on."""
        for i in self.changed():
            self.copies[i] = _plain(self._live(i))

    def restore(self) -> None:
        """Put the copies back where the live values differ, were deleted or are no longer plain."""
        for i, old in enumerate(self.copies):
            new = _plain(self._live(i))
            if new is _OPAQUE or new != old:
                self._dicts[i][self._keys[i]] = _plain(old)


def state_fix(changes: list[str]) -> str:
    """How to keep the state ``changes`` (from :meth:`AttributeWatch.changes`) out of the forward: a mode
    set there (``self.bn.eval()``, a frozen batch norm) belongs in ``train()``; other state in a buffer."""
    if any(c.startswith("training (") or ".training (" in c for c in changes):
        return MODE_FIX
    return "keep such state in a buffer, or out of the forward"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@contextmanager
def keep_attributes(module: nn.Module) -> Iterator[None]:
    """Put the plain-valued attributes of ``module``'s submodules back on exit, as torch.export does
    (attributes the forward added stay): capturing runs the forward, and must leave the model's Python state
    as it found it."""
    watch = AttributeWatch(module)
    try:
        yield
    finally:
        watch.restore()


@contextmanager
def watch_attributes(module: nn.Module, cls: str) -> Iterator[None]:
    """Raise :class:`CaptureError` after the body if a forward of ``module`` changed a plain-valued attribute
    (see [Note: Python state in the forward]). The state is read by a forward hook, before torch.export puts
    the attributes back."""
    watch = AttributeWatch(module)
    seen: list[list[str]] = []
    handle = module.register_forward_hook(lambda *_: seen.append(watch.changes()))
    try:
        yield
    finally:
        handle.remove()
        watch.restore()  # torch.export puts modules' attributes back, not those of plain objects
    changes = next((c for c in seen if c), [])
    if changes:
        raise CaptureError(
            f"{cls}.forward changes the Python attribute{'s' if len(changes) > 1 else ''} "
            f"{', '.join(changes[:3])}, which torch.export would freeze into the graph (every step would run "
            f"as at capture); {state_fix(changes)}"
        )
