"""lightning_autopart: automatic pipeline x data-parallel partitioning for PyTorch Lightning."""

from __future__ import annotations

from lightning_autopart.cluster import Cluster
from lightning_autopart.errors import AutopartError, PlanError
from lightning_autopart.plan import Plan, load_plan, save_plan
from lightning_autopart.planner import plan_model

__version__ = "0.1.0"

__all__ = ["AutopartError", "Cluster", "Plan", "PlanError", "__version__", "load_plan", "plan_model", "save_plan"]
