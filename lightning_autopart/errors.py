"""The one small hierarchy of errors that lightning_autopart raises.

Every message states the offending values and what the user can change, e.g.
"stage 2 needs 43.1 GB > 40.0 GB device memory; add devices, enable activation checkpointing or lower
micro-batch size".
"""

from __future__ import annotations

__all__ = [
    "AutopartError",
    "CaptureError",
    "CheckpointError",
    "ConfigError",
    "NonFiniteLossError",
    "PlanError",
    "PlanFileError",
    "PlanMismatchError",
    "ProfileError",
]


class AutopartError(Exception):
    """Base class of every error raised by lightning_autopart."""


class ConfigError(AutopartError, ValueError):
    """A user-supplied setting is invalid: an unknown device spec, a memory string that does not parse, ..."""


class CaptureError(AutopartError):
    """The model could not be turned into a sequence of blocks; the message names the module and the fix."""


class ProfileError(AutopartError):
    """Profiling a block failed (it raised, or produced no time or memory figures)."""


class PlanError(AutopartError):
    """No plan satisfies the constraints; carries the closest plan found and a per-stage memory table."""

    def __init__(self, message: str, closest: object | None = None) -> None:
        super().__init__(message)
        #: The closest (infeasible) plan the planner found, a :class:`~lightning_autopart.plan.Plan`, or None.
        self.closest = closest


class PlanFileError(AutopartError):
    """A plan file is unreadable: not JSON, a wrong schema version, or a missing or malformed field."""


class PlanMismatchError(PlanFileError):
    """A valid plan file was made for another model, world size or batch; the message names the field."""


class CheckpointError(AutopartError):
    """A checkpoint cannot be written or read for this model: a missing entry, another model's shapes, ..."""


class NonFiniteLossError(AutopartError, FloatingPointError):
    """The training loss became NaN or infinite; the message names the first such step, the stage and rank that
    computed it, and the fix (see [Note: non-finite loss] in ``lightning/finite.py``)."""
