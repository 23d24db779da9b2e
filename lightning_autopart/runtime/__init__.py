"""The pipeline core: one rank's stages, its place in the plan, what crosses a cut, and the training step.

Nothing here imports Lightning; :mod:`lightning_autopart.lightning` adapts it to a ``Trainer``.
"""

from __future__ import annotations

from lightning_autopart.runtime.runner import PipelineRunner, move_in_place

__all__ = ["PipelineRunner", "move_in_place"]
