"""Partition a profiled model into pipeline stages x data-parallel replicas: ``partition(profile, cluster, batch)``.

Pure Python (no torch, no numpy). The pieces, in reading order:

- :mod:`.tables`: prefix sums of the profile, so that every interval costs O(1);
- :mod:`.cost`: the cost model (stage time, memory, step time);
- :mod:`.scoring`: ``evaluate``, the cost model's score of any given partition;
- :mod:`.bounds`: monotone lower bounds of a configuration, which the DP and the search prune with;
- :mod:`.placement`: rank layouts and which links stay inside a node;
- :mod:`.dp`: the exact dynamic program over contiguous partitions for one configuration;
- :mod:`.search`: branch and bound over replicas x stages x micro-batches x schedule x layout;
- :mod:`.build`: the Plan (or the PlanError with a memory table) from the winner;
- :mod:`.heuristics`: baseline partitioners (DeepSpeed, torchgpipe) for comparison only.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_autopart.cluster import Cluster
from lightning_autopart.errors import ConfigError
from lightning_autopart.partition.build import build_plan, infeasible_error, one_micro_batch, single_reasons
from lightning_autopart.partition.cost import CostTables
from lightning_autopart.partition.scoring import evaluate
from lightning_autopart.partition.search import Constraints, closest, divisors
from lightning_autopart.partition.search import search as run_search
from lightning_autopart.plan import SCHEDULES, Plan
from lightning_autopart.profile.records import ModelProfile

__all__ = ["evaluate", "partition"]


def _divisor_hint(n: int, limit: int = 12) -> str:
    ds = divisors(n)
    shown = ", ".join(str(d) for d in ds[:limit])
    return shown + (", ..." if len(ds) > limit else "")


def _validate(
    profile: ModelProfile,
    cluster: Cluster,
    batch_size: int,
    num_stages: int | None,
    replicas: int | None,
    micro_batches: int | None,
    schedules: Sequence[str] | None,
    max_micro_batches: int,
) -> tuple[int | None, tuple[str, ...]]:
    """Check the user's settings; returns the replica count (derived when only stages are forced) and schedules."""
    n, world = profile.num_blocks, cluster.world_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer (the global batch), got {batch_size!r}")
    if world < 1:
        raise ConfigError(f"the cluster has {world} devices; pass at least one device")
    if n < 1:
        raise ConfigError("the profile has no blocks; capture the model again (it produced 0 blocks)")
    if max_micro_batches < 1:
        raise ConfigError(f"max_micro_batches must be >= 1, got {max_micro_batches}")
    if schedules is None:
        scheds = tuple(SCHEDULES)
    else:
        scheds = tuple(dict.fromkeys(schedules))
        unknown = [s for s in scheds if s not in SCHEDULES]
        if unknown or not scheds:
            raise ConfigError(
                f"unknown schedule(s) {unknown or list(scheds)}; use one or more of: {', '.join(SCHEDULES)}"
            )
    if num_stages is not None:
        if num_stages < 1:
            raise ConfigError(f"num_stages must be >= 1, got {num_stages}")
        if num_stages > n:
            raise ConfigError(
                f"num_stages={num_stages} exceeds the model's {n} blocks; lower num_stages to at most {n}"
            )
        if num_stages > world:
            raise ConfigError(
                f"num_stages={num_stages} exceeds the {world} devices; lower num_stages or add devices"
            )
    if replicas is not None:
        if replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {replicas}")
        if replicas > world:
            raise ConfigError(
                f"replicas={replicas} exceeds the {world} devices; lower replicas or add devices"
            )
        if num_stages is not None and num_stages * replicas > world:
            raise ConfigError(
                f"{num_stages} stages x {replicas} replicas need {num_stages * replicas} devices but the cluster "
                f"has {world}; lower num_stages or replicas"
            )
    elif num_stages is not None:
        replicas = world // num_stages
    if replicas is not None:
        if batch_size < replicas:
            raise ConfigError(
                f"global batch {batch_size} is smaller than {replicas} replicas; raise the batch size or lower "
                f"the replica count"
            )
        if batch_size % replicas:
            raise ConfigError(
                f"global batch {batch_size} does not split evenly into {replicas} replicas; use a replica count "
                f"that divides it ({_divisor_hint(batch_size)}) or change the batch size"
            )
    if micro_batches is not None:
        if micro_batches < 1:
            raise ConfigError(f"micro_batches must be >= 1, got {micro_batches}")
        per = batch_size // replicas if replicas is not None else batch_size
        if per % micro_batches:
            where = (
                f"per-replica batch {per} (global {batch_size} / {replicas} replicas)"
                if replicas
                else (f"global batch {batch_size}")
            )
            raise ConfigError(
                f"micro_batches={micro_batches} does not divide the {where}; use one of: {_divisor_hint(per)}"
            )
    return replicas, scheds


def partition(
    profile: ModelProfile,
    cluster: Cluster,
    batch_size: int,
    *,
    num_stages: int | None = None,
    replicas: int | None = None,
    micro_batches: int | None = None,
    schedules: Sequence[str] | None = None,
    max_micro_batches: int = 64,
    checkpointing: bool = True,
    persistent_grads: bool = False,
) -> Plan:
    """The fastest plan for ``profile`` on ``cluster`` at global batch ``batch_size`` under the cost model.

    Args:
        profile: the profiled blocks.
        cluster: devices, memory and links.
        batch_size: global batch (samples per optimizer step over all replicas).
        num_stages: force the pipeline depth S (ranks per pipeline); with it alone, replicas = world // S.
        replicas: force the data-parallel degree.
        micro_batches: force the micro-batches per replica per step.
        schedules: schedules to consider (default all of :data:`~lightning_autopart.plan.SCHEDULES`).
        max_micro_batches: largest micro-batch count searched (ignored when ``micro_batches`` is given).
        checkpointing: allow activation checkpointing on stages that do not fit without it.
        persistent_grads: gradients live through every step (accumulated over several steps), so no stage
            is priced without them at its peak (see [Note: fresh gradients] in :mod:`.fresh`).

    Raises:
        ConfigError: an invalid setting (the message names the value and what to use instead).
        PlanError: nothing fits in memory; carries the closest plan and a per-stage memory table.
    """
    if reasons := single_reasons(profile.meta):  # samples mixed, a loss that transforms a statistic or grows
        micro_batches = one_micro_batch(reasons, micro_batches)
    reps, scheds = _validate(
        profile, cluster, batch_size, num_stages, replicas, micro_batches, schedules, max_micro_batches
    )
    tables = CostTables(profile, cluster, persistent_grads=persistent_grads)
    cons = Constraints(num_stages, reps, micro_batches, scheds, max_micro_batches, checkpointing)
    res = run_search(tables, batch_size, cons)
    if res.valid == 0:
        raise ConfigError(
            f"no configuration satisfies the constraints (num_stages={num_stages}, replicas={reps}, "
            f"micro_batches={micro_batches}, schedules={list(scheds)}) for {profile.num_blocks} blocks on "
            f"{cluster.world_size} devices at global batch {batch_size}: 1F1B needs micro-batches >= stages, "
            f"Interleaved1F1B also needs micro-batches divisible by stages and 2 x stages <= blocks, one stage "
            f"runs only as GPipe; allow more schedules or change the forced values"
        )
    notes = {"search": res.notes(), "checkpointing_allowed": checkpointing}
    if res.best is None:
        ev = closest(tables, batch_size, cons)
        plan = build_plan(profile, cluster, batch_size, ev, notes) if ev is not None else None
        raise infeasible_error(profile, tables, batch_size, ev, plan)
    return build_plan(profile, cluster, batch_size, res.best, notes)
