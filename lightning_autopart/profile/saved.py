"""The meter of the tensors autograd saves for backward: a block's activation bytes, measured not guessed."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

__all__: list[str] = []


def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind ``t`` (views share it; works on meta tensors)."""
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, AttributeError):  # storage-less tensor subclasses
        return id(t)


class SavedTensorMeter:
    """Bytes of the tensors autograd saves for backward, deduplicated by storage, parameters excluded.

    Use :meth:`hooks` as the context manager around the forward.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {storage_key(t) for t in exclude}
        self._saved: dict[int, int] = {}
        self._holders: dict[int, list[weakref.ref[_Saved]]] = {}

    @property
    def nbytes(self) -> int:
        """Bytes saved so far."""
        return sum(self._saved.values())

    def nbytes_of(self, tensors: Iterable[Any]) -> int:
        """Bytes saved so far whose storage is that of one of ``tensors`` (a block's inputs or outputs)."""
        keys = {storage_key(t) for t in tensors if isinstance(t, torch.Tensor)}
        return sum(n for key, n in self._saved.items() if key in keys)

    def keys(self) -> set[int]:
        """Storage keys (see :func:`storage_key`) of what is saved so far."""
        return set(self._saved)

    def nbytes_of_keys(self, keys: Iterable[int]) -> int:
        """Bytes saved so far whose storage key (see :func:`storage_key`) is among ``keys``."""
        return sum(self._saved.get(key, 0) for key in set(keys))

    def pack(self, t: torch.Tensor) -> _Saved:
        """Record ``t`` (once per storage) and save a detached alias of it (same storage), in a holder that
        lives as long as the graph node that saved it (see :meth:`forget_freed`)."""
        key = storage_key(t)
        holder = _Saved(t.detach())  # detached: a saved output would otherwise keep its own node alive
        if key not in self._exclude:
            before = self._holders.get(key)
            if before and all(ref() is None for ref in before):
                # Every node that saved a storage at this address is gone, and the storage may be too: this
                # can be another one, made where it was freed. Counted as the first's, it was lost (a MoE
                # router's dropped scores: a block's saves varied by 7 % from one profile to the next).
                self._saved.pop(key, None)
                before.clear()
            if key not in self._saved:
                try:
                    self._saved[key] = int(t.untyped_storage().nbytes())
                except (RuntimeError, NotImplementedError):
                    self._saved[key] = t.numel() * t.element_size()
            self._holders.setdefault(key, []).append(weakref.ref(holder))
        return holder

    @staticmethod
    def unpack(holder: _Saved) -> torch.Tensor:
        """Hand the saved alias back (autograd re-attaches what it needs)."""
        return holder.tensor

    def forget_freed(self) -> None:
        """Stop counting what no graph node saves any more: the saves of a forward's part whose outputs were
        dropped before backward (outputs nothing differentiates), freed with its graph as in training."""
        for key, holders in self._holders.items():
            if key in self._saved and all(ref() is None for ref in holders):
                del self._saved[key]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context manager that meters a forward."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Saved:
    """A saved tensor as its graph node keeps it: the holder dies with the node, the tensor may live on."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
