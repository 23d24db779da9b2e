"""An interleaved rank's micro-batches in flight, from torch's own schedule, and its chunks' shares of its peak."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

from lightning_autopart.cluster import Cluster
from lightning_autopart.partition.configs import SHARES, in_flight, interleaved_moments
from lightning_autopart.partition.cost import Config, CostTables, StageCost
from lightning_autopart.partition.scoring import evaluate_config
from lightning_autopart.profile.records import BlockProfile, ModelProfile


def _torch_ops(stages: int, micro_batches: int, chunks: int, rank: int) -> list[tuple[str, int]]:
    """``(F or B, local chunk)`` of ``rank`` in torch's own order (its order needs no process group)."""
    sched = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = stages, chunks, micro_batches
    sched.number_of_rounds = max(1, micro_batches // stages)
    sched.microbatches_per_round = micro_batches // sched.number_of_rounds
    ops = []
    for a in sched._calculate_single_rank_operations(rank):
        if a is None:
            continue
        kind = "F" if a.computation_type == _ComputationType.FORWARD else "B"
        assert kind == "F" or a.computation_type == _ComputationType.FULL_BACKWARD
        ops.append((kind, a.stage_index // stages))
    return ops


CASES = [(s, m, v) for s in (2, 3, 4, 8) for m in (s, 2 * s, 4 * s) for v in (2, 3)]


@pytest.mark.parametrize(("stages", "micro_batches", "chunks"), CASES)
def test_moments_follow_torch_s_order(stages: int, micro_batches: int, chunks: int) -> None:
    for rank in range(stages):
        held, done, seen = [0] * chunks, [0] * chunks, []
        for kind, c in _torch_ops(stages, micro_batches, chunks, rank):
            if kind == "F":
                held[c] += 1
            else:
                seen.append((tuple(held), tuple(done), c))
                held[c] -= 1
                done[c] += 1
        assert tuple(seen) == interleaved_moments(stages, micro_batches, chunks, rank)
        assert sum(done) == chunks * micro_batches


def test_chunks_hold_unequal_counts() -> None:
    # 2 ranks x 2 chunks, 4 micro-batches: rank 0 warms up (v-1) S + 2 (S-1) = 4 forwards, 2 of each chunk, and
    # runs one more of chunk 0 before its first backward: (3, 2), then (4, 1); at most 4 + 2, never 6 at once.
    assert [m[0] for m in interleaved_moments(2, 4, 2, 0)[:3]] == [(3, 2), (4, 1), (4, 1)]
    assert [in_flight("Interleaved1F1B", 2, 0, 4, c) for c in (0, 1)] == [4, 2]
    # The last of 8 ranks holds 9 chunk micro-batches at its peak (8 of chunk 0): the old per-chunk formula,
    # ceil((S - p)(1 + (S - 1)/(S v))) = 2 each, left 5 of them out.
    assert max(sum(h) for h, _, _ in interleaved_moments(8, 16, 2, 7)) == 9
    assert [in_flight("Interleaved1F1B", 8, 7, 16, c) for c in (0, 1)] == [9, 1]


def _profile(seed: int, n: int) -> ModelProfile:
    rnd = random.Random(seed)
    blocks = []
    for k in range(n):
        act = rnd.randrange(100, 2000)
        params = 4 * rnd.randrange(10, 400)
        blocks.append(
            BlockProfile(
                name=f"b{k}", modules=(f"b{k}",), param_shapes=((f"b{k}.w", (params // 4,)),),
                param_count=params // 4, param_bytes=params, grad_bytes=params, optimizer_bytes=2 * params,
                buffer_bytes=0, fwd_fixed_us=1.0, bwd_fixed_us=2.0,
                fwd_us=rnd.uniform(10, 100), bwd_us=rnd.uniform(20, 200), activation_bytes=act,
                cut_bytes=rnd.randrange(10, act), transient_bytes=rnd.randrange(0, 3000),
                saved_input_share=rnd.choice((0.0, 0.5, 1.0)), saved_output_share=rnd.choice((0.0, 0.5)),
            )
        )  # fmt: skip
    return ModelProfile(f"Random{seed}", tuple(blocks), 2, 300, optimizer="adam", meta={"batch_bytes": 500.0})


def _replay(parts: list, stages: int, micro_batches: int, rank: int) -> int:
    """A rank's peak, replaying torch's actions: a forward keeps a micro-batch's activations and output, a
    backward adds its recomputation and transient while it runs, then leaves what its messages keep. A chunk's
    gradients appear at its first backward, which holds ``first`` (those it makes as it goes) instead."""
    base = sum(q.state + q.io for q in parts)
    now = top = -sum(q.grads for q in parts)
    made = set()
    for kind, c in _torch_ops(stages, micro_batches, len(parts), rank):
        q = parts[c]
        if kind == "F":
            now += q.activation + q.held
        else:
            top = max(top, now + q.recompute + (q.transient if c in made else q.first))
            now += q.sent - q.activation - q.held + (0 if c in made else q.grads)
            made.add(c)
    return base + max(top, sum(q.optimizer for q in parts))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8)])
@pytest.mark.parametrize("shares", SHARES)
def test_a_rank_s_chunks_add_up_to_its_replayed_peak(
    seed: int, stages: int, micro_batches: int, shares: str
) -> None:
    prof = _profile(seed, 2 * stages + 3)
    cluster = Cluster(
        nodes=1, devices_per_node=4, device_memory_bytes=10**5 * (1 + seed % 3), intra_node_bw=1e6,
        inter_node_bw=1e5, intra_allreduce_bw=1e3, inter_allreduce_bw=1e2, latency_us=5.0, memory_reserve=0.0,
    )  # fmt: skip
    tables = CostTables(prof, cluster)
    cfg = Config(1, stages, micro_batches, "Interleaved1F1B", shares=shares)
    rnd = random.Random(seed)
    cuts = sorted(rnd.sample(range(1, len(prof.blocks)), 2 * stages - 1))
    ev = evaluate_config(tables, cfg, 2 * micro_batches, (0, *cuts, len(prof.blocks)))
    per_rank = []
    for p in range(stages):
        chunks = [ev.stages[p + c * stages] for c in (0, 1)]
        parts = [sc.parts for sc in chunks]
        peak = _replay(parts, stages, micro_batches, p)
        assert sum(sc.memory_bytes for sc in chunks) == peak
        # each share adds its parts, and feasibility judges each chunk alone, at least its share
        for sc in chunks:
            assert sc.memory_bytes == (
                sc.param_bytes + sc.grad_bytes + sc.optimizer_bytes + sc.buffer_bytes + sc.io_bytes
                + sc.activation_bytes + sc.transient_bytes
            )  # fmt: skip
            assert sc.bound_bytes >= sc.memory_bytes
            assert sc.fits == (sc.bound_bytes <= sc.limit_bytes)
        # the chunks' shares add up to the device, the first chunk (most in flight) taking the larger
        assert sum(sc.limit_bytes for sc in chunks) == tables.usable
        assert chunks[0].limit_bytes >= chunks[1].limit_bytes
        per_rank.append(peak)
    assert ev.peak_memory_bytes == max(per_rank)


def test_one_chunk_schedules_keep_their_own_memory() -> None:
    prof = _profile(0, 5)
    cluster = Cluster(
        nodes=1, devices_per_node=2, device_memory_bytes=10**9, intra_node_bw=1e6, inter_node_bw=1e5,
        intra_allreduce_bw=1e3, inter_allreduce_bw=1e2, latency_us=5.0, memory_reserve=0.0,
    )  # fmt: skip
    ev = evaluate_config(CostTables(prof, cluster), Config(1, 2, 4, "1F1B"), 8, (0, 2, 5))
    assert all(s.parts is None and s.bound_bytes == s.memory_bytes for s in ev.stages)
    assert [s.in_flight for s in ev.stages] == [2, 1]


def test_the_chunk_holding_more_gets_the_larger_share() -> None:
    # 4 ranks x 2 chunks, 8 micro-batches, 8 equal blocks: the last rank holds 5 micro-batches of its first chunk
    # and 1 of its second. The device is sized so that every chunk fits its share, and some first chunk alone
    # needs more than half of it: an equal split would refuse the plan.
    block = _profile(1, 1).blocks[0]
    blocks = tuple(replace(block, name=f"b{k}", modules=(f"b{k}",)) for k in range(8))
    prof = ModelProfile("Even", blocks, 2, 300, meta={"batch_bytes": 500.0})

    def stages(memory: int, shares: str = "in-flight") -> tuple[tuple[StageCost, ...], bool]:
        cluster = Cluster(
            nodes=1, devices_per_node=4, device_memory_bytes=memory, intra_node_bw=1e6, inter_node_bw=1e5,
            intra_allreduce_bw=1e3, inter_allreduce_bw=1e2, latency_us=5.0, memory_reserve=0.0,
        )  # fmt: skip
        cfg = Config(1, 4, 8, "Interleaved1F1B", shares=shares)
        ev = evaluate_config(CostTables(prof, cluster), cfg, 16, tuple(range(9)))
        return ev.stages, ev.fits

    big = 10**12
    wide, _ = stages(big)
    assert [in_flight("Interleaved1F1B", 4, 3, 8, c) for c in (0, 1)] == [5, 1]
    assert wide[3].limit_bytes > wide[7].limit_bytes
    memory = max(int(s.bound_bytes * big / s.limit_bytes) for s in wide) + 64
    tight, fits = stages(memory)
    assert fits
    assert all(s.bound_bytes <= s.limit_bytes for s in tight)
    assert max(s.bound_bytes for s in tight) > memory // 2
    assert not any(s.checkpoint for s in tight)
    even, fits = stages(memory, "even")  # half each: refused, or some chunk recomputes its activations
    assert not fits or any(s.checkpoint for s in even)
