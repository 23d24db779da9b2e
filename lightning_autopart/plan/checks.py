"""A plan checked against the model and job about to run it, and its record of how long it took to make.

Every check raises :class:`PlanMismatchError` naming the field that differs, both values and the fix; a check of
a loaded plan is cheap (no profile): the model's fingerprint comes from its capture (see
:func:`~lightning_autopart.profile.records.capture_fingerprint`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from lightning_autopart.errors import PlanMismatchError

if TYPE_CHECKING:
    from lightning_autopart.plan.file import Plan

__all__ = ["PLANNING_SECONDS", "check_compatible", "check_every_rank", "planning_seconds", "with_planning_time"]

#: The note of a plan holding the seconds its capture, profile and partition took.
PLANNING_SECONDS = "planning_s"


def with_planning_time(plan: Plan, seconds: float) -> Plan:
    """``plan`` recording that capture, profiling and partitioning took ``seconds`` (what loading it saves)."""
    return dataclasses.replace(plan, notes={**plan.notes, PLANNING_SECONDS: round(seconds, 2)})


def planning_seconds(plan: Plan) -> float | None:
    """The seconds ``plan`` took to make (see :func:`with_planning_time`); None when it does not say."""
    value = plan.notes.get(PLANNING_SECONDS)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def check_compatible(
    plan: Plan,
    *,
    fingerprint: dict[str, Any] | None = None,
    world_size: int | None = None,
    batch_size: int | None = None,
) -> None:
    """Raise :class:`PlanMismatchError` naming the field if ``plan`` was made for another model, world or batch.

    Args:
        plan: A loaded plan.
        fingerprint: ``ModelProfile.fingerprint()``, or ``capture_fingerprint()`` of a capture, of the model about
            to run (None: not checked).
        world_size: Ranks of the job about to run (None: not checked).
        batch_size: Global batch size of the job about to run (None: not checked).
    """
    if fingerprint is not None:
        _check_fingerprint(plan.fingerprint, fingerprint)
    planned_world = plan.cluster.world_size
    if world_size is not None and world_size != planned_world:
        raise PlanMismatchError(
            f"plan was made for world size {planned_world}, this job has {world_size} ranks; "
            f"re-plan with --devices {world_size} or drop load_plan"
        )
    if batch_size is not None and batch_size != plan.batch_size:
        raise PlanMismatchError(
            f"plan was made for global batch size {plan.batch_size}, this job uses {batch_size}; "
            f"re-plan with --batch-size {batch_size} or drop load_plan"
        )


def _check_fingerprint(planned: dict[str, Any], actual: dict[str, Any]) -> None:
    """Compare two model fingerprints field by field, most telling difference first."""
    another = "the plan is for another model; re-plan for this model or drop load_plan"
    if planned.get("model") != actual.get("model"):
        raise PlanMismatchError(
            f"plan was made for model {planned.get('model')!r}, this model is {actual.get('model')!r}: {another}"
        )
    old, new = planned.get("blocks", []), actual.get("blocks", [])
    if len(old) != len(new):
        raise PlanMismatchError(
            f"the plan has {len(old)} blocks, this model has {len(new)} (or was captured with another "
            f"--max-blocks): {another}"
        )
    for i, (a, b) in enumerate(zip(old, new, strict=True)):
        if a.get("name") != b.get("name"):
            raise PlanMismatchError(
                f"block {i} is {a.get('name')!r} in the plan, {b.get('name')!r} in this model: {another}"
            )
        if a.get("param_count") != b.get("param_count"):
            raise PlanMismatchError(
                f"block {i} {a.get('name')!r} has {a.get('param_count'):,} parameters in the plan, "
                f"{b.get('param_count'):,} in this model: {another}"
            )
        if a.get("shapes_sha256") != b.get("shapes_sha256"):
            raise PlanMismatchError(
                f"block {i} {a.get('name')!r} has parameters of other shapes in the plan than in this model "
                f"(same count, shape digest {a.get('shapes_sha256')} vs {b.get('shapes_sha256')}): {another}"
            )
    if planned.get("param_count") != actual.get("param_count"):
        raise PlanMismatchError(
            f"the plan's model has {planned.get('param_count'):,} parameters, this model "
            f"{actual.get('param_count'):,}: {another}"
        )


def check_every_rank(plan: Plan) -> None:
    """Refuse a plan that leaves some of its cluster's ranks idle (``--replicas`` x ``--num-stages`` below the
    devices): every rank of a job runs a stage."""
    world = plan.cluster.world_size
    depth = plan.num_stages // plan.chunks_per_rank  # an interleaved schedule runs several stages per rank
    if plan.world_size != world:
        raise PlanMismatchError(
            f"the plan runs on {plan.world_size} of the {world} ranks it was made for ({depth} stages x "
            f"{plan.replicas} replicas) and every rank of a job must hold a stage; re-plan with stages x "
            f"replicas = {world} (leave --replicas out), or with --devices {plan.world_size}"
        )
