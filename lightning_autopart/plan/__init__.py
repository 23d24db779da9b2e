"""The plan: its JSON file and checks (``file``), its tables (``report``) and its pictures (``visualize``).

A plan is the one boundary between planning and running: the planner writes it, every rank reads it.
"""

from __future__ import annotations

from lightning_autopart.plan.file import (
    LAYOUTS,
    PROFILE_MODES,
    SCHEDULES,
    SCHEMA_VERSION,
    Plan,
    Prediction,
    StagePlan,
    check_compatible,
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
    "load_plan",
    "save_plan",
]
