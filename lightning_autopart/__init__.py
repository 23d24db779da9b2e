"""lightning_autopart: automatic pipeline x data-parallel partitioning for PyTorch Lightning."""

from __future__ import annotations

from lightning_autopart.cluster import Cluster
from lightning_autopart.errors import AutopartError, PlanError
from lightning_autopart.plan import Plan

__version__ = "0.1.0"

__all__ = ["AutopartError", "Cluster", "Plan", "PlanError", "__version__"]
