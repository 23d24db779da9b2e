"""Where a rank sits in a plan: its stages, its pipeline group and its data-parallel group.

Every rank creates the same groups in the same order (:func:`build_groups`): each replica's pipeline, each
stage's replicas, the ranks holding a tied weight.

Replica ``r`` of the pipeline is the ``r``-th rank of every stage (``StagePlan.ranks[r]``). A pipeline group
holds one rank per stage position of one replica, in stage order; a data-parallel group holds the replicas of
one stage. With interleaving, stage ``s`` lives on pipeline position ``s % pp_size`` (torch's "loop" layout).

[Note: a subgroup's timeout] ``dist.new_group`` (and ``DeviceMesh``, for a dimension smaller than the world)
gives a group torch's default timeout, 30 minutes on gloo and 10 on NCCL, not the one the job passed to
``init_process_group`` (the strategy's ``timeout``). A rank waiting there for a frozen peer waited 30 minutes
where the job said 20 s: the log channel's broadcast, the pre-emption flag, the pipeline of a plan with several
replicas. Every group autopart creates takes the default group's timeout (:func:`new_group`). It is given at
creation: ``_set_pg_timeout`` afterwards reaches gloo's collectives, not its point-to-point transfers (the
pipeline's), which keep the timeout of the group's connections. So the groups are not a ``DeviceMesh``'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from lightning_autopart.errors import ConfigError
from lightning_autopart.plan import Plan

__all__ = [
    "Placement",
    "build_groups",
    "data_parallel_ranks",
    "group_ranks",
    "job_timeout",
    "new_group",
    "pipeline_ranks",
    "place",
    "tied_ranks",
]


@dataclass(frozen=True, slots=True)
class Placement:
    """One rank's share of a plan."""

    #: Global rank.
    rank: int
    #: Indices of the stages the rank holds, ascending (several with interleaving).
    stages: tuple[int, ...]
    #: Data-parallel replica index of the rank (its position in each of its stages' ``ranks``).
    replica: int
    #: Global ranks of its pipeline group, one per stage position, in stage order.
    pp_ranks: tuple[int, ...]
    #: Global ranks of its data-parallel group (the replicas of its stages), ascending.
    dp_ranks: tuple[int, ...]

    @property
    def pp_rank(self) -> int:
        """Position of the rank in its pipeline group."""
        return self.pp_ranks.index(self.rank)

    @property
    def is_first(self) -> bool:
        """Whether the rank holds the first stage (it is fed the batch's inputs)."""
        return self.stages[0] == 0

    def is_last(self, num_stages: int) -> bool:
        """Whether the rank holds the last stage (it computes the loss)."""
        return self.stages[-1] == num_stages - 1


def pipeline_ranks(plan: Plan, replica: int) -> tuple[int, ...]:
    """Global ranks of replica ``replica``'s pipeline, one per stage position, in stage order.

    Raises:
        ConfigError: A rank repeats out of the "loop" layout, or the ranks do not increase along the
            pipeline (torch numbers a group's ranks in ascending order, and stage ``i`` must be group rank
            ``i``).
    """
    if not 0 <= replica < plan.replicas:
        raise ConfigError(f"replica {replica} is outside the plan's {plan.replicas} replicas")
    along = [s.ranks[replica] for s in plan.stages]
    ranks = tuple(dict.fromkeys(along))
    for s, r in enumerate(along):
        if r != ranks[s % len(ranks)]:
            raise ConfigError(
                f"stage {s} of replica {replica} is on rank {r}, but interleaved stages must follow the loop "
                f"layout (stage s on pipeline position s % {len(ranks)}, rank {ranks[s % len(ranks)]}); "
                f"re-plan, or lay the stages out in that order"
            )
    if list(ranks) != sorted(ranks):
        raise ConfigError(
            f"the pipeline of replica {replica} runs over ranks {list(ranks)}; the ranks must increase along "
            f"the pipeline; re-plan with layout 'pipeline-major' or 'stage-major'"
        )
    return ranks


def data_parallel_ranks(plan: Plan, stage: int) -> tuple[int, ...]:
    """Global ranks holding a replica of stage ``stage``, ascending."""
    return tuple(sorted(plan.stages[stage].ranks))


def place(plan: Plan, rank: int) -> Placement:
    """The stages, replica, pipeline group and data-parallel group of ``rank``.

    Raises:
        ConfigError: The plan gives ``rank`` no stage, or its stages disagree on its replica or replicas.
    """
    stages = tuple(s.index for s in plan.stages if rank in s.ranks)
    if not stages:
        raise ConfigError(
            f"rank {rank} holds no stage of the plan (it uses ranks 0..{plan.world_size - 1}); launch "
            f"{plan.world_size} processes or re-plan for this world size"
        )
    replicas = {plan.stages[s].ranks.index(rank) for s in stages}
    dp = {data_parallel_ranks(plan, s) for s in stages}
    if len(replicas) != 1 or len(dp) != 1:
        raise ConfigError(
            f"rank {rank} holds stages {list(stages)} with different replica positions or replica ranks; "
            f"all stages on a rank must be replicated on the same ranks"
        )
    replica = replicas.pop()
    return Placement(rank, stages, replica, pipeline_ranks(plan, replica), dp.pop())


def tied_ranks(plan: Plan, stages: Sequence[int]) -> tuple[int, ...]:
    """Global ranks holding any of ``stages`` in any replica, ascending: the group a tied gradient sums over."""
    return tuple(sorted({r for s in stages for r in plan.stages[s].ranks}))


def group_ranks(plan: Plan, tied: Sequence[tuple[str, Sequence[int]]] = ()) -> list[tuple[int, ...]]:
    """Every process group the runtime needs, in creation order: pipelines, then stages' replicas, then ties.

    Groups are sorted tuples of global ranks and appear once each. ``tied`` is
    :func:`lightning_autopart.runtime.stages.tied_groups`'s output.
    """
    candidates = [pipeline_ranks(plan, r) for r in range(plan.replicas)]
    candidates += [data_parallel_ranks(plan, s.index) for s in plan.stages]
    candidates += [tied_ranks(plan, stages) for _, stages in tied]
    return list(dict.fromkeys(tuple(sorted(g)) for g in candidates))


def build_groups(
    plan: Plan, tied: Sequence[tuple[str, Sequence[int]]] = ()
) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """This rank's groups of :func:`group_ranks`, by sorted ranks, all with the job's timeout: a group of every
    rank is the default group, any other comes from :func:`new_group`.

    Must be called on every rank of the default process group, with the same arguments, at the same point:
    each rank creates every group, in the same order, even groups it is not in.
    """
    me, world = dist.get_rank(), dist.get_world_size()
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for ranks in group_ranks(plan, tied):
        group = dist.group.WORLD if len(ranks) == world else new_group(ranks)
        if me in ranks and group is not None:
            groups[ranks] = group
    return groups


def job_timeout() -> timedelta | None:
    """The default group's timeout (``init_process_group(timeout=...)``), None where its backends do not say."""
    world = dist.group.WORLD
    if world is None:
        return None
    for device in getattr(world, "_device_types", ()):
        with contextlib.suppress(Exception):  # a backend without options
            timeout = world._get_backend(device).options._timeout
            if isinstance(timeout, timedelta):
                return timeout
    return None


def new_group(ranks: Sequence[int] | None = None, backend: str | None = None) -> dist.ProcessGroup:
    """``dist.new_group`` with the job's timeout, not torch's default ([Note: a subgroup's timeout]); collective
    over the default group, as ``dist.new_group`` (which returns a placeholder on a rank outside ``ranks``)."""
    return dist.new_group(None if ranks is None else list(ranks), backend=backend, timeout=job_timeout())
