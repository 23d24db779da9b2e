"""Running a saved plan (``load_plan``): no capture for profiling, no profile and no search, only the one capture
at the plan's micro-batch size that the runtime builds its stages from, checked against the plan.

A plan made by the strategy or by ``autopart plan`` records how long it took to make
(:func:`~lightning_autopart.plan.with_planning_time`); loading it says how much of that was skipped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_autopart.errors import PlanMismatchError
from lightning_autopart.lightning.hooks import ForwardCall, slice_batch
from lightning_autopart.plan import Plan, check_compatible, check_every_rank, load_plan, planning_seconds
from lightning_autopart.profile.records import capture_fingerprint

if TYPE_CHECKING:
    from torch import nn

    from lightning_autopart.capture.graph import CapturedModel

__all__ = ["LoadedPlan", "capture_at_micro_batch", "load_for_job", "loaded_message"]


@dataclass(frozen=True)
class LoadedPlan:
    """A plan file checked against this job and model, and the capture that checked it (the runtime's)."""

    path: str
    plan: Plan
    captured: CapturedModel
    #: Seconds spent reading the file, capturing at the micro-batch size and checking.
    seconds: float


def capture_at_micro_batch(plan: Plan, root: nn.Module, call: ForwardCall, local_batch: int) -> CapturedModel:
    """``root`` captured on the first ``plan.micro_batch_size`` samples of ``call``'s inputs (export bakes the batch
    size into reshapes, so stages are built from this capture), cut into blocks as the plan was (its max_blocks)."""
    from lightning_autopart.capture import capture

    args = slice_batch((call.args, call.kwargs), 0, plan.micro_batch_size, local_batch)
    # Its stages run evaluation steps too: see [Note: Python branches on the mode].
    return capture(root, args, max_blocks=int(plan.notes.get("max_blocks", 64)), check_eval=True)


def load_for_job(
    path: str, root: nn.Module, call: ForwardCall, local_batch: int, world_size: int
) -> LoadedPlan:
    """The plan file at ``path``, checked against this job (world size, batch per replica, then the model's
    fingerprint from its capture at the plan's micro-batch size).

    Raises:
        PlanFileError: The file is missing or not a valid plan.
        PlanMismatchError: The plan is for another job or model; the message names the difference and the fix.
    """
    start = time.perf_counter()
    plan = load_plan(path)
    try:
        check_compatible(plan, world_size=world_size, loading=True)
        check_every_rank(plan, loading=True)
        _check_local_batch(plan, local_batch)
        captured = capture_at_micro_batch(plan, root, call, local_batch)
        check_compatible(plan, fingerprint=capture_fingerprint(captured), loading=True)
    except PlanMismatchError as error:
        raise PlanMismatchError(f"load_plan {path}: {error}") from None
    return LoadedPlan(path, plan, captured, time.perf_counter() - start)


def loaded_message(loaded: LoadedPlan) -> str:
    """The line rank 0 logs for a loaded plan: its shape, and the planning it skipped and how long that took."""
    plan = loaded.plan
    made = planning_seconds(plan)
    when = f"{made:.1f} s when it was made; " if made is not None else ""
    depth = plan.num_stages // plan.chunks_per_rank  # an interleaved schedule runs several stages per rank
    return (
        f"autopart: loaded plan {loaded.path} ({_count(depth, 'stage')} x {_count(plan.replicas, 'replica')}, "
        f"{plan.schedule}); skipped capture, profiling and planning ({when}loading and checking took "
        f"{loaded.seconds:.1f} s)"
    )


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _check_local_batch(plan: Plan, local_batch: int) -> None:
    """The loader's batch (one replica's share of the global batch) must be the plan's."""
    per_replica = plan.batch_size // plan.replicas
    if local_batch != per_replica:
        raise PlanMismatchError(
            f"the plan was made for a global batch of {plan.batch_size} samples ({per_replica} per replica x "
            f"{_count(plan.replicas, 'replica')}), this job's loader gives batches of {local_batch} "
            f"({local_batch * plan.replicas} in all); set the DataLoader's batch_size to {per_replica}, or "
            "re-plan for this batch: drop load_plan (save_plan writes the new plan)"
        )
