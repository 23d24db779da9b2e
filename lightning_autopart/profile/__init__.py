"""Per-block time and memory records of a captured model: measured on a device or estimated for a spec."""

from __future__ import annotations

from lightning_autopart.profile.calibrate import calibrate_cpu
from lightning_autopart.profile.merge import merge_profiles, profiled_blocks
from lightning_autopart.profile.profiler import profile, resolve_spec

__all__ = ["calibrate_cpu", "merge_profiles", "profile", "profiled_blocks", "resolve_spec"]
