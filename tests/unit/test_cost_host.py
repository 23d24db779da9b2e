"""The cost model's host overheads: per pipeline action and per step, adding to the math or hidden behind it."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_autopart.cluster import Cluster
from lightning_autopart.devices import device_spec
from lightning_autopart.errors import ConfigError
from lightning_autopart.partition import partition
from lightning_autopart.partition.bounds import Relaxation
from lightning_autopart.partition.cost import Config, CostTables, config_costs
from lightning_autopart.partition.dp import solve
from lightning_autopart.partition.scoring import evaluate_config
from tests.unit.test_cost import PROFILE, _cluster


def _host(action_us: float, step_us: float, async_host: bool) -> Cluster:
    return dataclasses.replace(_cluster(), action_us=action_us, step_us=step_us, async_host=async_host)


def test_host_adds_to_the_math_on_a_synchronous_host() -> None:
    # Without host terms: stage 0 t = 270 + 105 = 375, K = 5 (test_two_stage_gpipe_step_time).
    ev = evaluate_config(CostTables(PROFILE, _host(10.0, 1000.0, False)), Config(1, 2, 4, "GPipe"), 4, (0, 2, 3))
    s0 = ev.stages[0]
    # Two actions of 10 us per micro-batch add to F + Bw = 270; the step adds 1000 once.
    assert (s0.host_us, s0.time_us) == pytest.approx((20.0, 395.0))
    assert ev.step_us == pytest.approx(5 * 395 + 1000)


def test_host_hides_behind_the_device_where_it_runs_ahead() -> None:
    tables = CostTables(PROFILE, _host(100.0, 0.0, True))
    s0, s1 = evaluate_config(tables, Config(1, 2, 4, "GPipe"), 4, (0, 2, 3)).stages
    # Stage 0's math (270) exceeds its host time (200): hidden. Stage 1's (120) does not: 200 counts.
    assert s0.host_us == 0.0 and s0.time_us == pytest.approx(375)
    assert s1.host_us == pytest.approx(80.0) and s1.time_us == pytest.approx(200 + 105)


def test_prediction_shows_the_host_part() -> None:
    cluster = _host(10.0, 1000.0, False)
    plan = partition(PROFILE, cluster, 4, num_stages=2, replicas=1, micro_batches=4, schedules=["GPipe"])
    p = plan.prediction
    assert p.host_us == pytest.approx(4 * 20.0 + 1000.0)
    parts = p.compute_us + p.bubble_us + p.p2p_us + p.allreduce_us + p.optimizer_us + p.host_us
    assert parts == pytest.approx(p.step_us)


@pytest.mark.parametrize("async_host", [False, True])
def test_relaxation_stays_a_lower_bound_with_host_terms(async_host: bool) -> None:
    tables = CostTables(PROFILE, _host(30.0, 500.0, async_host))
    cfg = Config(1, 2, 4, "1F1B")
    got = solve(tables, config_costs(tables, cfg, 4))
    assert got is not None
    low, _ = Relaxation(tables, cfg, 4).lower_bound()
    assert low <= got[0]


def test_specs_carry_host_overheads() -> None:
    assert device_spec("cpu").async_host is False
    h100 = device_spec("h100")
    assert h100.async_host and h100.action_us > 0 and h100.step_us > 0
    cl = Cluster.from_spec(h100, devices=8)
    assert (cl.action_us, cl.step_us, cl.async_host) == (h100.action_us, h100.step_us, True)
    with pytest.raises(ConfigError, match=r"host overheads must be >= 0"):
        dataclasses.replace(_cluster(), action_us=-1.0)


def test_a_host_running_ahead_hides_the_steps_fixed_work() -> None:
    """Where kernels queue while the host works, the step's fixed host work overlaps the device's."""
    cluster = _host(0.0, 1000.0, True)
    assert cluster.step_host_us == 0.0 and _host(0.0, 1000.0, False).step_host_us == 1000.0
    ev = evaluate_config(CostTables(PROFILE, cluster), Config(1, 2, 4, "GPipe"), 4, (0, 2, 3))
    assert ev.step_us == pytest.approx(5 * 375)  # as without host terms (test_two_stage_gpipe_step_time)


def test_a_single_stage_pays_no_schedule_actions() -> None:
    """One stage runs its micro-batches in its own loop (no schedule, no messages): only the step's host time."""
    tables = CostTables(PROFILE, _host(500.0, 1000.0, False))
    one = evaluate_config(tables, Config(1, 1, 4, "GPipe"), 4, (0, 3))
    bare = evaluate_config(CostTables(PROFILE, _host(0.0, 1000.0, False)), Config(1, 1, 4, "GPipe"), 4, (0, 3))
    assert one.stages[0].host_us == 0.0 and one.step_us == pytest.approx(bare.step_us)
    two = evaluate_config(tables, Config(1, 2, 4, "GPipe"), 4, (0, 2, 3))
    assert two.stages[0].host_us == pytest.approx(1000.0)  # two actions of 500 us per micro-batch
    low, _ = Relaxation(tables, Config(1, 1, 4, "GPipe"), 4).lower_bound()
    assert low <= one.step_us
