"""The plan: its JSON file (``file``), its checks against a model and a job (``checks``), its tables (``report``)
and its pictures (``visualize``).

A plan is the one boundary between planning and running: the planner writes it, every rank reads it.
"""

from __future__ import annotations

from lightning_autopart.plan.checks import (
    check_compatible,
    check_every_rank,
    planning_seconds,
    with_planning_time,
)
from lightning_autopart.plan.file import (
    LAYOUTS,
    PROFILE_MODES,
    SCHEDULES,
    SCHEMA_VERSION,
    Plan,
    Prediction,
    StagePlan,
    load_plan,
    save_plan,
)

__all__ = [
    "LAYOUTS",
    "PROFILE_MODES",
    "SCHEDULES",
    "SCHEMA_VERSION",
    "Plan",
    "Prediction",
    "StagePlan",
    "check_compatible",
    "check_every_rank",
    "load_plan",
    "planning_seconds",
    "save_plan",
    "with_planning_time",
]
