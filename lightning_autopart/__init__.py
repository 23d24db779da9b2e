"""lightning_autopart: automatic pipeline x data-parallel partitioning for PyTorch Lightning.

Importing the package registers the strategy name "autopart", so ``Trainer(strategy="autopart")`` works.
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_autopart.cluster import Cluster
from lightning_autopart.errors import AutopartError, PlanError
from lightning_autopart.plan import Plan, load_plan, save_plan
from lightning_autopart.planner import plan_model
from lightning_autopart.strategy import AutoPartitionStrategy

__version__ = "0.1.0"

__all__ = [
    "AutoPartitionStrategy",
    "AutopartError",
    "Cluster",
    "Plan",
    "PlanError",
    "__version__",
    "load_plan",
    "plan_model",
    "save_plan",
]

AutoPartitionStrategy.register_strategies(StrategyRegistry)
