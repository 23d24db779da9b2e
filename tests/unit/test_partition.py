"""partition(): forced values, error messages, the closest plan, and the shape of the Plan it returns."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from lightning_autopart.cluster import Cluster
from lightning_autopart.errors import ConfigError, PlanError
from lightning_autopart.partition import evaluate, partition
from lightning_autopart.partition.heuristics import (
    deepspeed_parameters,
    deepspeed_uniform,
    min_max_split,
    torchgpipe_balance_by_time,
)
from lightning_autopart.plan import Plan
from lightning_autopart.profile.records import BlockProfile, ModelProfile, TiedParam


def _profile(
    layers: int = 6, params: int = 4_000_000, act: int = 2_000_000, fwd: float = 1000.0
) -> ModelProfile:
    """Embedding, ``layers`` equal layers, a tied head; profiled at batch 4, Adam."""

    def blk(name: str, p: int, f: float, a: int, cut: int) -> BlockProfile:
        return BlockProfile(
            name,
            (name, f"{name}.sub"),
            ((f"{name}.weight", (p // 4,)),),
            p // 4,
            p,
            p,
            2 * p,
            0,
            f,
            2 * f,
            10.0,
            20.0,
            a,
            cut,
        )

    blocks = [blk("embed", params, 50.0, act // 4, 100_000)]
    blocks += [blk(f"layers.{i}", params, fwd, act, 100_000) for i in range(layers)]
    blocks.append(blk("head", 0, fwd, act, 1000))
    return ModelProfile(
        "Net",
        tuple(blocks),
        4,
        10_000,
        tied=(TiedParam("embed.weight", params, (0, layers + 1)),),
        optimizer="adam",
    )


def _cluster(devices: int = 4, nodes: int = 1, memory: int = 10**12) -> Cluster:
    return Cluster(nodes, devices, memory, 1e11, 1e10, 1e11, 1e10, latency_us=5.0, memory_reserve=0.0)


def test_small_model_on_two_devices_is_pure_data_parallel() -> None:
    plan = partition(_profile(), _cluster(2), 8)
    assert plan.num_stages == 1 and plan.replicas == 2
    assert plan.schedule == "GPipe" and plan.stages[0].ranks == (0, 1)
    assert plan.stages[0].block_start == 0 and plan.stages[0].block_end == 8


def test_plan_fields() -> None:
    prof = _profile()
    plan = partition(prof, _cluster(4), 16, num_stages=2)
    assert isinstance(plan, Plan)
    assert plan.fingerprint == prof.fingerprint()
    assert plan.optimizer == "adam" and plan.profile_mode == prof.mode and plan.device == prof.device
    assert plan.micro_batch_size * plan.replicas * plan.micro_batches == 16
    assert plan.stages[0].blocks[0] == "embed" and "embed.sub" in plan.stages[0].modules
    covered = [b for s in plan.stages for b in s.blocks]
    assert covered == [b.name for b in prof.blocks]
    search = plan.notes["search"]
    assert search["configs"] >= search["candidates"] > 0 and search["seconds"] >= 0
    pred = plan.prediction
    assert pred.step_us == pytest.approx(pred.compute_us + pred.bubble_us + pred.p2p_us + pred.allreduce_us)
    assert pred.samples_per_s == pytest.approx(16 / (pred.step_us / 1e6))
    # Peak memory is per device: a rank holding several chunks adds them up.
    per_rank: dict[int, int] = {}
    for st in plan.stages:
        per_rank[st.ranks[0]] = per_rank.get(st.ranks[0], 0) + st.memory_bytes
    assert pred.peak_memory_bytes == max(per_rank.values())
    json.dumps(plan.to_dict())  # JSON-ready
    # The head holds a copy of the tied embedding: its parameters are counted in its stage.
    assert plan.stages[-1].param_bytes >= prof.tied[0].param_bytes


def test_forced_values_are_honoured() -> None:
    plan = partition(
        _profile(), _cluster(4), 16, num_stages=2, replicas=2, micro_batches=4, schedules=["1F1B"]
    )
    assert (plan.num_stages, plan.replicas, plan.micro_batches, plan.schedule) == (2, 2, 4, "1F1B")
    alone = partition(_profile(), _cluster(8), 16, num_stages=4)
    assert alone.num_stages // alone.chunks_per_rank == 4 and alone.replicas == 2
    mb = partition(_profile(), _cluster(4), 16, micro_batches=2)
    assert mb.micro_batches == 2


def test_ranks_cover_every_rank_once_per_chunk() -> None:
    for devices, nodes, batch in ((4, 2, 32), (2, 2, 16), (8, 1, 64)):
        for sched in ("GPipe", "1F1B", "Interleaved1F1B"):
            plan = partition(
                _profile(layers=10), _cluster(devices, nodes), batch, num_stages=2, schedules=[sched]
            )
            s = plan.num_stages // plan.chunks_per_rank
            for chunk in range(plan.chunks_per_rank):
                ranks = [r for st in plan.stages[chunk * s : (chunk + 1) * s] for r in st.ranks]
                assert sorted(ranks) == list(range(s * plan.replicas))
            # A rank holds the chunks p, p + S, ...
            for st in plan.stages:
                assert st.ranks == plan.stages[st.index % s].ranks


def test_interleaved_only_when_valid() -> None:
    seen = set()
    for devices, batch, max_mb in itertools.product((2, 4, 8), (8, 12, 24, 48), (1, 3, 8, 64)):
        plan = partition(
            _profile(layers=12, act=10_000), _cluster(devices), batch, max_micro_batches=max_mb, num_stages=2
        )
        seen.add(plan.schedule)
        if plan.schedule == "Interleaved1F1B":
            s = plan.num_stages // 2
            assert plan.chunks_per_rank == 2 and s >= 2
            assert plan.micro_batches >= s and plan.micro_batches % s == 0
            assert plan.num_stages <= _profile(layers=12).num_blocks
        else:
            assert plan.chunks_per_rank == 1
        if plan.schedule == "1F1B":
            assert plan.micro_batches >= plan.num_stages
    assert "Interleaved1F1B" in seen


def test_checkpointing_switches_on_under_memory_pressure() -> None:
    prof = _profile(act=400_000_000)
    plan = partition(
        prof,
        _cluster(4, memory=3 * 10**9),
        16,
        num_stages=4,
        replicas=1,
        micro_batches=16,
        schedules=["GPipe"],
    )
    assert any(s.checkpoint for s in plan.stages)
    assert "recompute" in plan.notes["checkpointing"]
    assert all(s.memory_bytes <= 3 * 10**9 for s in plan.stages)
    with pytest.raises(PlanError, match="activations of one micro-batch do not fit next to the model state"):
        partition(
            prof,
            _cluster(4, memory=3 * 10**9),
            16,
            num_stages=4,
            replicas=1,
            micro_batches=16,
            schedules=["GPipe"],
            checkpointing=False,
        )


def test_nothing_fits_raises_plan_error_with_closest_plan_and_table() -> None:
    prof = _profile(params=400_000_000)
    with pytest.raises(PlanError) as info:
        partition(prof, _cluster(2, memory=4 * 10**9), 8)
    err = info.value
    msg = str(err)
    for word in ("params", "grads", "optimizer", "activations", "total", "limit", "OVER"):
        assert word in msg
    assert "which needs at least 3 devices of this size (this cluster has 2): add devices" in msg
    assert "an optimizer with less state than 'adam' (e.g. 'sgd') saves" in msg
    assert "Closest plan: 2 stage(s) x 1 replica(s)" in msg
    assert isinstance(err.closest, Plan)
    assert err.closest.prediction.peak_memory_bytes > 4 * 10**9
    assert err.closest.fingerprint == prof.fingerprint()


@pytest.mark.parametrize(
    ("kwargs", "batch", "devices", "pattern"),
    [
        ({}, 0, 4, "batch_size must be a positive integer"),
        (
            {"replicas": 8},
            4,
            8,
            "global batch 4 is smaller than 8 replicas; raise the batch size or lower the replica",
        ),
        ({"replicas": 3}, 8, 4, r"does not split evenly into 3 replicas.*1, 2, 4, 8"),
        (
            {"micro_batches": 3, "replicas": 1},
            8,
            4,
            r"micro_batches=3 does not divide the per-replica batch 8.*1, 2, 4, 8",
        ),
        ({"micro_batches": 3}, 8, 4, r"micro_batches=3 does not divide the global batch 8"),
        (
            {"schedules": ["ZeroBubble"]},
            8,
            4,
            r"unknown schedule\(s\) \['ZeroBubble'\].*GPipe, 1F1B, Interleaved1F1B",
        ),
        ({"num_stages": 9}, 8, 16, "num_stages=9 exceeds the model's 8 blocks"),
        ({"num_stages": 5}, 8, 4, "num_stages=5 exceeds the 4 devices"),
        (
            {"num_stages": 2, "replicas": 4},
            8,
            4,
            "2 stages x 4 replicas need 8 devices but the cluster has 4",
        ),
        ({"schedules": ["1F1B"]}, 8, 1, "no configuration satisfies the constraints"),
    ],
)
def test_config_errors(kwargs: dict[str, Any], batch: int, devices: int, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        partition(_profile(), _cluster(devices), batch, **kwargs)


def test_zero_devices_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="at least one node and one device"):
        Cluster(1, 0, 10**9, 1e9, 1e9, 1e9, 1e9)


def test_heuristics_are_valid_partitions_and_never_beat_the_planner() -> None:
    prof = _profile(layers=9)
    cl = _cluster(4)
    plan = partition(prof, cl, 16, num_stages=4, replicas=1, schedules=["1F1B"])
    for fn in (deepspeed_uniform, deepspeed_parameters, torchgpipe_balance_by_time):
        b = fn(prof, 4)
        assert b[0] == 0 and b[-1] == prof.num_blocks and all(x < y for x, y in itertools.pairwise(b))
        ev = evaluate(prof, cl, 16, b, 1, plan.micro_batches, "1F1B")
        assert ev is None or ev.step_us >= plan.prediction.step_us * (1 - 1e-12)
    assert deepspeed_uniform(prof, 4) == [0, 3, 6, 9, 11]


def test_min_max_split_is_optimal() -> None:
    weights = [5.0, 1.0, 1.0, 9.0, 2.0, 2.0, 3.0, 7.0]
    for parts in range(1, len(weights) + 1):
        got = min_max_split(weights, parts)
        value = max(sum(weights[a:b]) for a, b in itertools.pairwise(got))
        best = min(
            max(sum(weights[a:b]) for a, b in itertools.pairwise((0, *cut, len(weights))))
            for cut in itertools.combinations(range(1, len(weights)), parts - 1)
        )
        assert value == pytest.approx(best)
