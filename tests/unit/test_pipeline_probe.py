"""The pipeline probe's arithmetic ([Note: pipeline probe]): its command, its workload, and how its measured
overhead becomes the cluster's per-action host time. The two-rank run is in tests/distributed."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from lightning_autopart.profile.measure import trimmed_mean
from lightning_autopart.profile.pipeline_probe import (
    COMMAND_SIZE,
    ProbeCommand,
    command_for,
    is_command,
    overhead_per_micro_batch,
    probe_workload,
    unit_us,
    with_overhead,
)
from tests.unit.test_cost import PROFILE, _cluster


def test_command_travels_as_a_tensor() -> None:
    command = ProbeCommand(7, 15, 8192, micro_batches=4, warmup=1, steps=3)
    data = command.to_tensor()
    assert data.shape == (COMMAND_SIZE,) and is_command(data)
    assert ProbeCommand.from_tensor(data) == command
    assert not is_command(torch.zeros(COMMAND_SIZE, dtype=torch.float64))  # zeros end planning


def test_command_splits_the_math_a_third_forward_and_clamps_it() -> None:
    assert command_for(3000.0, 4096, 100.0) == ProbeCommand(10, 20, 1024)
    assert command_for(10.0, 4, 100.0) == ProbeCommand(1, 2, 1)  # at least 300 us and one float
    big = command_for(1e9, 1 << 40, 100.0)
    assert (big.fwd_reps + big.bwd_reps, big.message_floats) == (80, (16 << 20) // 4)  # 8 ms, 16 MiB


def test_workload_is_an_even_stage_of_the_model_at_the_micro_batch() -> None:
    # PROFILE is profiled at batch 2: forwards 100 + 50 + 80, backwards twice that; cuts 400, 200, 50 bytes.
    slot, message = probe_workload(PROFILE, local_batch=4, stages=2, micro_batches=2)
    assert slot == pytest.approx(3 * 230 / 2) and message == 200
    slot1, message1 = probe_workload(PROFILE, local_batch=4, stages=2, micro_batches=4)  # 1 sample each
    assert slot1 < slot and message1 == 100


def test_overhead_is_what_the_step_takes_beyond_its_math() -> None:
    # M = 4 micro-batches of f + b = 300 us on the cost model's clock K = M + 1 = 5, plus 50 us each.
    assert overhead_per_micro_batch(5 * 350, 4, 300.0) == pytest.approx(50.0)
    assert overhead_per_micro_batch(1000, 4, 300.0) == 0.0  # faster than the math: no overhead
    # [Note: the probe's own clock]: the probe's own math (contention only slows it) bounds the clock's,
    # which may have caught a slower phase of the machine; a slower own math is contention, the clock stays.
    assert overhead_per_micro_batch(5 * 350, 4, 340.0, own_math_us=300.0) == pytest.approx(50.0)
    assert overhead_per_micro_batch(5 * 350, 4, 300.0, own_math_us=330.0) == pytest.approx(50.0)
    assert trimmed_mean([1.0] * 9 + [100.0]) == pytest.approx(1.0)
    assert trimmed_mean([2.0, 4.0]) == pytest.approx(3.0)


def test_the_probe_clock_spans_its_budget() -> None:
    """[Note: the probe's own clock]: one product is timed over a budget of time, not a fixed count of runs."""
    began = time.perf_counter()
    assert unit_us(budget_s=0.05, min_trials=1) > 0
    assert time.perf_counter() - began >= 0.05


def test_overhead_becomes_action_time_beyond_the_priced_message() -> None:
    cluster = dataclasses.replace(_cluster(), action_us=40.0)  # 1e6 B/s inside a node, 5 us latency
    tuned = with_overhead(cluster, 3005.0, 1000)  # the message is priced 1000 + 5 us: 2000 us are two actions
    assert tuned.action_us == pytest.approx(1000.0)
    assert with_overhead(cluster, 500.0, 1000).action_us == 40.0  # never below the probe of idle threads
    across = with_overhead(_cluster(nodes=2, per_node=1), 20_005.0, 1000)  # 1e5 B/s between nodes
    assert across.action_us == pytest.approx(5000.0)
