"""A plan checked against the model and job about to run it, its structure checked (:func:`structure_problems`,
what ``Plan.validate`` reports), and its record of how long it took to make.

Every check raises :class:`PlanMismatchError` naming the field that differs, both values and the fix; a check of
a loaded plan is cheap (no profile): the model's fingerprint comes from its capture (see
:func:`~lightning_autopart.profile.records.capture_fingerprint`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import fields
from typing import Any

from lightning_autopart.errors import PlanMismatchError
from lightning_autopart.plan.file import LAYOUTS, PROFILE_MODES, SCHEDULES, SCHEMA_VERSION, Plan

__all__ = [
    "PLANNING_SECONDS",
    "check_compatible",
    "check_every_rank",
    "planning_seconds",
    "replan_hint",
    "structure_problems",
    "with_planning_time",
]

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
    loading: bool = False,
) -> None:
    """Raise :class:`PlanMismatchError` naming the field if ``plan`` was made for another model, world or batch.

    Args:
        plan: A loaded plan.
        fingerprint: ``ModelProfile.fingerprint()``, or ``capture_fingerprint()`` of a capture, of the model about
            to run (None: not checked).
        world_size: Ranks of the job about to run (None: not checked).
        batch_size: Global batch size of the job about to run (None: not checked).
        loading: The plan is the strategy's ``load_plan``: the fixes offer dropping it (the strategy then plans
            for the job) beside re-planning with ``autopart plan``; otherwise (``autopart show``) they name
            ``autopart plan`` alone, since ``load_plan`` is no option of the command.
    """
    if fingerprint is not None:
        _check_fingerprint(plan.fingerprint, fingerprint, loading)
    planned_world = plan.cluster.world_size
    if world_size is not None and world_size != planned_world:
        raise PlanMismatchError(
            f"plan was made for world size {planned_world}, this job has {world_size} ranks; "
            + replan_hint(f"for {world_size} ranks", f"... --devices {world_size}", loading)
        )
    if batch_size is not None and batch_size != plan.batch_size:
        raise PlanMismatchError(
            f"plan was made for global batch size {plan.batch_size}, this job uses {batch_size}; "
            + replan_hint(f"for batch {batch_size}", f"... --batch-size {batch_size}", loading)
        )


def replan_hint(what: str, arguments: str, loading: bool) -> str:
    """The fix of a plan that does not fit the job: re-plan ``what`` ("for 4 ranks") with ``autopart plan
    {arguments}``, or, for the strategy's ``load_plan`` (``loading``), drop it so the strategy plans itself."""
    command = f"`autopart plan {arguments} -o PLAN.json`"
    if loading:
        return (
            f"re-plan {what}: drop load_plan (the strategy then plans for this job; save_plan keeps the new plan), "
            f"or make a plan with {command}"
        )
    return f"re-plan {what} with {command}"


def _check_fingerprint(planned: dict[str, Any], actual: dict[str, Any], loading: bool = False) -> None:
    """Compare two model fingerprints field by field, most telling difference first."""
    another = "the plan is for another model; " + replan_hint("for this model", "--model CLASS ...", loading)
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


def check_every_rank(plan: Plan, *, loading: bool = False) -> None:
    """Refuse a plan that leaves some of its cluster's ranks idle (``--replicas`` x ``--num-stages`` below the
    devices): every rank of a job runs a stage. ``loading``: as for :func:`check_compatible`."""
    world = plan.cluster.world_size
    depth = plan.num_stages // plan.chunks_per_rank  # an interleaved schedule runs several stages per rank
    if plan.world_size != world:
        fix = (
            f"re-plan with stages x replicas = {world} (leave --replicas out), or with --devices {plan.world_size}"
        )
        raise PlanMismatchError(
            f"the plan runs on {plan.world_size} of the {world} ranks it was made for ({depth} stages x "
            f"{plan.replicas} replicas) and every rank of a job must hold a stage; {fix}"
            + ("; or drop load_plan: the strategy then plans for this job" if loading else "")
        )


def structure_problems(plan: Plan) -> list[str]:
    """Every structural inconsistency of ``plan``, as sentences (empty when the plan is sound)."""
    problems: list[str] = []
    if plan.schema_version != SCHEMA_VERSION:
        problems.append(
            f"schema_version is {plan.schema_version}, this lightning_autopart writes {SCHEMA_VERSION}"
        )
    if plan.schedule not in SCHEDULES:
        problems.append(f"unknown schedule {plan.schedule!r}; known schedules: {', '.join(SCHEDULES)}")
    if plan.profile_mode not in PROFILE_MODES:
        problems.append(f"profile_mode must be one of {', '.join(PROFILE_MODES)}, got {plan.profile_mode!r}")
    if plan.layout not in LAYOUTS:
        problems.append(f"layout must be one of {', '.join(LAYOUTS)}, got {plan.layout!r}")
    for name in ("batch_size", "micro_batches", "micro_batch_size", "chunks_per_rank"):
        if getattr(plan, name) < 1:
            problems.append(f"{name} must be at least 1, got {getattr(plan, name)}")
    if plan.chunks_per_rank > 1 and plan.schedule != "Interleaved1F1B":
        problems.append(
            f"chunks_per_rank is {plan.chunks_per_rank} but only Interleaved1F1B runs several chunks"
        )
    if not plan.stages:
        return [*problems, "the plan has no stages"]
    problems += _block_problems(plan)
    problems += _rank_problems(plan)
    replicas = plan.replicas
    if plan.micro_batch_size * replicas * plan.micro_batches != plan.batch_size:
        problems.append(
            f"micro_batch_size {plan.micro_batch_size} x replicas {replicas} x micro_batches "
            f"{plan.micro_batches} = {plan.micro_batch_size * replicas * plan.micro_batches}, "
            f"not the batch size {plan.batch_size}"
        )
    for s in plan.stages:
        for f in fields(s):
            value = getattr(s, f.name)
            if isinstance(value, int | float) and value < 0:
                problems.append(f"stage {s.index}: {f.name} is negative ({value})")
    return problems


def _block_problems(plan: Plan) -> list[str]:
    """Stages must be numbered in order and cover the blocks 0..n-1 contiguously, each with at least one block."""
    problems: list[str] = []
    expected_start = 0
    for position, s in enumerate(plan.stages):
        if s.index != position:
            problems.append(f"stage at position {position} has index {s.index}")
        if s.block_start != expected_start:
            where = (
                "the first block (0)"
                if position == 0
                else f"block {expected_start}, where stage {position - 1} ends"
            )
            problems.append(f"stage {s.index} starts at block {s.block_start}, not at {where}")
        if s.block_end <= s.block_start:
            problems.append(
                f"stage {s.index} has no blocks (block_start {s.block_start}, block_end {s.block_end})"
            )
        elif len(s.blocks) != s.block_end - s.block_start:
            problems.append(
                f"stage {s.index} names {len(s.blocks)} blocks but spans {s.block_end - s.block_start} "
                f"(blocks {s.block_start}..{s.block_end - 1})"
            )
        expected_start = s.block_end
    fp = plan.fingerprint
    blocks = fp.get("blocks")
    entry = {"name": str, "param_count": int, "shapes_sha256": str}
    if not (
        isinstance(fp.get("model"), str)
        and isinstance(fp.get("param_count"), int)
        and isinstance(blocks, list)
        and all(
            isinstance(b, dict) and all(isinstance(b.get(k), t) for k, t in entry.items()) for b in blocks
        )
    ):
        problems.append(
            "fingerprint must hold model (a string), param_count (an integer) and blocks (a list of "
            "{name, param_count, shapes_sha256})"
        )
    elif expected_start != len(blocks):
        problems.append(f"the stages end at block {expected_start} but the model has {len(blocks)} blocks")
    return problems


def _rank_problems(plan: Plan) -> list[str]:
    """Ranks must lie in the cluster, replicas be equal, and every rank hold ``chunks_per_rank`` stages."""
    problems: list[str] = []
    world = plan.cluster.world_size
    replicas = plan.stages[0].replicas
    holds: dict[int, int] = {}
    for s in plan.stages:
        if not s.ranks:
            problems.append(f"stage {s.index} has no ranks")
        if s.replicas != replicas:
            problems.append(
                f"stage {s.index} has {s.replicas} replicas, stage 0 has {replicas}; they must be equal"
            )
        if len(set(s.ranks)) != len(s.ranks):
            problems.append(f"stage {s.index} lists a rank twice: {list(s.ranks)}")
        outside = [r for r in s.ranks if not 0 <= r < world]
        if outside:
            problems.append(f"stage {s.index} uses ranks {outside} outside the world size {world}")
        for r in set(s.ranks):
            holds[r] = holds.get(r, 0) + 1
    wrong = sorted(r for r, n in holds.items() if n != plan.chunks_per_rank)
    if wrong:
        r = wrong[0]
        problems.append(
            f"rank {r} holds {holds[r]} stages, expected chunks_per_rank = {plan.chunks_per_rank}"
            + (f" (and {len(wrong) - 1} more ranks like it)" if len(wrong) > 1 else "")
        )
    return problems

