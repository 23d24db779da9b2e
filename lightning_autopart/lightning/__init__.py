"""The thin Lightning adapter: the strategy, the step glue, the log channel and the planning step.

Submodules are imported by name; :mod:`lightning_autopart.lightning.hooks` needs no Lightning install.
"""

from __future__ import annotations

__all__: list[str] = []
