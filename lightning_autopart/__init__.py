"""lightning_autopart: automatic pipeline x data-parallel partitioning for PyTorch Lightning.

Importing the package registers the strategy name "autopart", so ``Trainer(strategy="autopart")`` works.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from lightning_autopart.cluster import Cluster
from lightning_autopart.errors import AutopartError, PlanError
from lightning_autopart.plan import Plan, load_plan, save_plan
from lightning_autopart.planner import plan_model

# The core (capture, profile, partition, plan, runtime) runs without Lightning; the strategy needs it.
_HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None

if _HAS_LIGHTNING or TYPE_CHECKING:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_autopart.lightning.strategy import AutoPartitionStrategy

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

if _HAS_LIGHTNING:
    AutoPartitionStrategy.register_strategies(StrategyRegistry)


def __getattr__(name: str) -> Any:
    """Explain a missing strategy when Lightning is not installed, instead of a bare AttributeError."""
    if name == "AutoPartitionStrategy":
        raise ImportError("AutoPartitionStrategy needs Lightning; install it with `pip install lightning`")
    raise AttributeError(f"module 'lightning_autopart' has no attribute {name!r}")
