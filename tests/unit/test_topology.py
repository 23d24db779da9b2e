"""Topology: stages, replicas and process groups of a rank under various plans."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from lightning_autopart.errors import ConfigError
from lightning_autopart.runtime import topology
from lightning_autopart.runtime.topology import (
    build_groups,
    data_parallel_ranks,
    group_ranks,
    pipeline_ranks,
    place,
    tied_ranks,
)
from tests.pipeline_plans import make_plan


def test_pipeline_major_two_by_two() -> None:
    plan = make_plan(8, 2, 2)  # stage 0 on ranks (0, 2), stage 1 on (1, 3)
    assert [pipeline_ranks(plan, r) for r in range(2)] == [(0, 1), (2, 3)]
    assert [data_parallel_ranks(plan, s) for s in range(2)] == [(0, 2), (1, 3)]
    p = place(plan, 3)
    assert (p.stages, p.replica, p.pp_ranks, p.dp_ranks, p.pp_rank) == ((1,), 1, (2, 3), (1, 3), 1)
    assert not p.is_first and p.is_last(plan.num_stages)


def test_stage_major_two_by_two() -> None:
    plan = make_plan(8, 2, 2, layout="stage-major")  # stage 0 on (0, 1), stage 1 on (2, 3)
    assert [pipeline_ranks(plan, r) for r in range(2)] == [(0, 2), (1, 3)]
    p = place(plan, 1)
    assert (p.stages, p.replica, p.pp_ranks, p.dp_ranks) == ((0,), 1, (1, 3), (0, 1))


@pytest.mark.parametrize(("stages", "replicas"), [(1, 1), (1, 4), (4, 1), (2, 3), (3, 2)])
def test_every_rank_is_placed_once(stages: int, replicas: int) -> None:
    plan = make_plan(12, stages, replicas)
    world = stages * replicas
    placements = [place(plan, r) for r in range(world)]
    assert sorted(s for p in placements for s in p.stages) == sorted(list(range(stages)) * replicas)
    for p in placements:
        assert p.rank in p.pp_ranks and p.rank in p.dp_ranks
        assert len(p.pp_ranks) == stages and len(p.dp_ranks) == replicas


def test_interleaved_rank_holds_stages_in_a_loop() -> None:
    plan = make_plan(8, 4, 1, schedule="Interleaved1F1B", chunks_per_rank=2, micro_batches=4)
    p = place(plan, 1)
    assert (p.stages, p.pp_ranks, p.dp_ranks) == ((1, 3), (0, 1), (1,))


def test_rank_outside_the_plan_is_refused() -> None:
    with pytest.raises(ConfigError, match="rank 4 holds no stage"):
        place(make_plan(8, 2, 2), 4)


def test_decreasing_pipeline_ranks_are_refused() -> None:
    plan = make_plan(8, 2)
    swapped = tuple(dataclasses.replace(s, ranks=(1 - s.ranks[0],)) for s in plan.stages)
    with pytest.raises(ConfigError, match="must increase"):
        pipeline_ranks(dataclasses.replace(plan, stages=swapped), 0)


def test_group_ranks_are_unique_and_ordered() -> None:
    plan = make_plan(8, 2, 2)
    tied = [("tok.weight", (0, 1))]
    assert tied_ranks(plan, (0, 1)) == (0, 1, 2, 3)
    assert group_ranks(plan, tied) == [(0, 1), (2, 3), (0, 2), (1, 3), (0, 1, 2, 3)]
    assert group_ranks(make_plan(8, 1, 1)) == [(0,)]


def test_build_groups_creates_every_group_in_order_with_the_jobs_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank creates every group of ``group_ranks``, in its order, each with the default group's timeout
    (torch would give it 30 minutes: [Note: a subgroup's timeout]); a rank keeps the groups it is in."""
    plan = make_plan(8, 3, 2)  # pipelines (0, 1, 2) and (3, 4, 5), replicas (0, 3) (1, 4) (2, 5)
    timeout = timedelta(seconds=9)
    calls: list[tuple[list[int], Any]] = []

    def new_group(ranks: list[int], backend: Any = None, timeout: Any = None) -> tuple[int, ...]:
        calls.append((ranks, timeout))
        return tuple(ranks)

    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 6)
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(topology, "job_timeout", lambda: timeout)
    groups = build_groups(plan, [("head.weight", (0, 2))])
    order = [[0, 1, 2], [3, 4, 5], [0, 3], [1, 4], [2, 5], [0, 2, 3, 5]]
    assert calls == [(ranks, timeout) for ranks in order]
    assert groups == {(3, 4, 5): (3, 4, 5), (0, 3): (0, 3), (0, 2, 3, 5): (0, 2, 3, 5)}
