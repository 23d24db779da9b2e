"""The strategy's init contexts: ``init_module(empty_init=True)`` and ``configure_model`` build on the meta device,
and each rank later materialises only its own stages (see [Note: meta init] in
:mod:`lightning_autopart.runtime.materialize`)."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

__all__ = ["MetaInit"]


class MetaInit:
    """Strategy methods that build models on ``meta``, remembering the random state construction starts from."""

    _init_rng: Tensor | None
    precision_plugin: Any

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``empty_init=True`` builds on the meta device: each rank later initialises only its own stages (see
        [Note: meta init] in :mod:`lightning_autopart.runtime.materialize`)."""
        if not empty_init:
            with super().tensor_init_context(empty_init):  # type: ignore[misc]
                yield
            return
        with self._on_meta(), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device, as ``init_module(empty_init=True)`` does."""
        with self._on_meta():
            yield

    def _on_meta(self) -> torch.device:
        """Build on ``meta``, remembering the random state construction starts from, which materialising replays
        so that the weights equal a plain construction's."""
        self._init_rng = torch.random.get_rng_state()
        return torch.device("meta")
