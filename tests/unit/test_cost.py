"""The cost model's formulas on hand-computed examples."""

from __future__ import annotations

import dataclasses
from itertools import pairwise

import pytest

from lightning_autopart.cluster import Cluster
from lightning_autopart.errors import ConfigError
from lightning_autopart.partition.cost import (
    Config,
    CostTables,
    check_config,
    config_costs,
    in_flight,
    stage_cost,
)
from lightning_autopart.partition.fresh import fresh_excess
from lightning_autopart.partition.placement import link_pattern, rank_of, stage_ranks
from lightning_autopart.partition.scoring import evaluate, evaluate_config
from lightning_autopart.partition.tables import BackwardPeak
from lightning_autopart.profile.records import BlockProfile, ModelProfile, TiedParam


def _block(name: str, fwd: float, ffix: float, act: int, cut: int, params: int, buf: int = 0) -> BlockProfile:
    return BlockProfile(
        name=name,
        modules=(name,),
        param_shapes=((f"{name}.w", (params // 4,)),),
        param_count=params // 4,
        param_bytes=params,
        grad_bytes=params,
        optimizer_bytes=2 * params,
        buffer_bytes=buf,
        fwd_us=fwd,
        bwd_us=2 * fwd,
        fwd_fixed_us=ffix,
        bwd_fixed_us=2 * ffix,
        activation_bytes=act,
        cut_bytes=cut,
    )


#: Three blocks profiled at batch 2. At m = 1 sample: f = 60, 30, 40; b = 120, 60, 80 (microseconds);
#: activations 500, 300, 400 bytes; cuts 200, 100 (after blocks 0 and 1); input 150 bytes.
PROFILE = ModelProfile(
    model="Toy",
    blocks=(
        _block("a", 100.0, 20.0, 1000, 400, 100, buf=10),
        _block("b", 50.0, 10.0, 600, 200, 40),
        _block("c", 80.0, 0.0, 800, 50, 60),
    ),
    batch_size=2,
    input_bytes=300,
    optimizer="adam",
)


def _cluster(memory: int = 10**9, nodes: int = 1, per_node: int = 4) -> Cluster:
    return Cluster(
        nodes=nodes,
        devices_per_node=per_node,
        device_memory_bytes=memory,
        intra_node_bw=1e6,
        inter_node_bw=1e5,
        intra_allreduce_bw=1e3,
        inter_allreduce_bw=1e2,
        latency_us=5.0,
        memory_reserve=0.0,
    )


def test_block_times_scale_with_micro_batch() -> None:
    tables = CostTables(PROFILE, _cluster())
    pf, pb, big = tables.times(1)
    assert pf == pytest.approx([0, 60, 90, 130])  # 20 + 80*1/2, 10 + 40/2, 0 + 80/2
    assert pb == pytest.approx([0, 120, 180, 260])
    assert big == pytest.approx(180)
    pf4, _, _ = tables.times(4)
    assert pf4[1] == pytest.approx(20 + 80 * 4 / 2)


def test_p2p_time_of_each_cut() -> None:
    tables = CostTables(PROFILE, _cluster())
    # x[j] sends the cut before block j: 200 bytes (at m=1) / 1e6 B/s = 200 us, + 5 us latency.
    assert tables.p2p(1, True) == pytest.approx([0.0, 205.0, 105.0, 0.0])
    assert tables.p2p(1, False) == pytest.approx([0.0, 2005.0, 1005.0, 0.0])


def test_in_flight_per_schedule() -> None:
    assert in_flight("GPipe", 4, 3, 8) == 8
    assert [in_flight("1F1B", 4, p, 8) for p in range(4)] == [4, 3, 2, 1]
    assert in_flight("1F1B", 4, 0, 2) == 2
    # Interleaved, per chunk (tests/unit/test_schedule_moments.py): S=4, M=8, rank 0 warms up 8 forwards, 4 of
    # each chunk, then runs 4 more of chunk 0 before its first backward on it; the last rank warms up 4 of chunk 0
    # and takes one more before each backward of chunk 1.
    assert [in_flight("Interleaved1F1B", 4, 0, 8, c) for c in (0, 1)] == [8, 4]
    assert [in_flight("Interleaved1F1B", 4, 3, 8, c) for c in (0, 1)] == [5, 1]
    assert [in_flight("Interleaved1F1B", 4, 0, 4, c) for c in (0, 1)] == [4, 4]


def test_two_stage_gpipe_step_time() -> None:
    tables = CostTables(PROFILE, _cluster())
    ev = evaluate_config(tables, Config(1, 2, 4, "GPipe"), 4, (0, 2, 3))
    s0, s1 = ev.stages
    # Stage 0: F = 90, Bw = 180, sends the 100-byte cut after block 1: 105 us. t = 375, K = 4 + 2 - 1 = 5.
    assert (s0.fwd_us, s0.bwd_us, s0.p2p_us, s0.time_us) == pytest.approx((90, 180, 105, 375))
    assert s0.term_us == pytest.approx(5 * 375)
    # Stage 1: F = 40, Bw = 80, sends input gradients back over the same cut. t = 225.
    assert s1.term_us == pytest.approx(5 * 225)
    assert ev.step_us == pytest.approx(1875) and ev.bottleneck == 0
    assert s0.allreduce_us == 0.0 and not s0.checkpoint


def test_allreduce_ring_formula() -> None:
    tables = CostTables(PROFILE, _cluster())
    ev = evaluate_config(tables, Config(2, 1, 2, "GPipe"), 4, (0, 3))
    (s,) = ev.stages
    # 2(r-1)/r * 200 grad bytes / 1e3 B/s * 1e6 + 2(r-1) * 5 us = 200010 us; K = 2; t = 130 + 260.
    assert s.allreduce_us == pytest.approx(200_010)
    assert ev.step_us == pytest.approx(2 * 390 + 200_010)


def test_allreduce_across_nodes_uses_inter_bandwidth() -> None:
    tables = CostTables(PROFILE, _cluster(nodes=2, per_node=1))
    ev = evaluate_config(tables, Config(2, 1, 2, "GPipe"), 4, (0, 3))
    assert ev.stages[0].allreduce_us == pytest.approx(200 / 1e2 * 1e6 + 10)


def test_checkpointing_turns_on_only_where_needed() -> None:
    # GPipe, S = 2, M = 4, m = 1; every rank holds the batch, 4 x 150 bytes ([Note: pipeline buffers]).
    # Stage 0 static: (100+100+200+10) + (40+40+80) = 570 bytes; activations per micro-batch 800 bytes; it keeps
    # 4 gradient receive buffers (4*100) and 4 outputs (4*100); its gradients are fresh (D = min(800, 140)).
    # Plain: 570 + 600 + 400 + 4*800 - 140 + 400 = 5030 > 3000. Checkpointed: the kept inputs are the batch's
    # views, 570 + 1000 + (4*150 + 800 - 140 - 4*150 + 400) = 2630 <= 3000.
    # Stage 1: 240 + 600 + 4*100 (receive buffers) + 4*400 - 60 + 4*25 (the model's outputs, kept until each
    # micro-batch's backward) = 2880 <= 3000, no checkpointing.
    tables = CostTables(PROFILE, _cluster(memory=3000))
    ev = evaluate_config(tables, Config(1, 2, 4, "GPipe"), 4, (0, 2, 3))
    s0, s1 = ev.stages
    assert s0.checkpoint and s0.fits and s0.memory_bytes == 2630 and s0.io_bytes == 1000 - 200
    assert s0.activation_bytes == 1400 - 140  # the first backward frees more than its transient
    assert s0.bwd_us == pytest.approx(180 + 90)  # recompute of the forward
    assert s0.time_us == pytest.approx(90 + 270 + 105)
    assert not s1.checkpoint and s1.memory_bytes == 2880
    assert (s0.param_bytes, s0.grad_bytes, s0.optimizer_bytes) == (140, 140, 280)
    assert ev.fits and ev.peak_memory_bytes == 2880
    for sc in ev.stages:  # the parts add up
        parts = sc.param_bytes + sc.grad_bytes + sc.optimizer_bytes + sc.buffer_bytes
        assert parts + sc.io_bytes + sc.activation_bytes + sc.transient_bytes == sc.memory_bytes


def test_not_fitting_reports_memory_and_evaluate_returns_none() -> None:
    tables = CostTables(PROFILE, _cluster(memory=1900))
    ev = evaluate_config(tables, Config(1, 2, 4, "GPipe"), 4, (0, 2, 3))
    assert not ev.fits and not ev.stages[0].fits and ev.max_excess > 1
    assert evaluate(PROFILE, _cluster(memory=1900), 4, [0, 2, 3], 1, 4, "GPipe", tables=tables) is None
    ev2 = evaluate_config(tables, Config(1, 2, 4, "GPipe"), 4, (0, 2, 3), checkpointing=False)
    assert not ev2.stages[0].checkpoint and ev2.stages[0].memory_bytes == 5030


def test_one_f_one_b_holds_fewer_micro_batches() -> None:
    # 1F1B, S=2: stage 0 holds 2 micro-batches and their 2 outputs, stage 1 holds 1; neither has fresh gradients.
    # Stage 0: 570 + 600 + 4*100 + 2*800 + 2*100 = 3370 > 3000 -> checkpoint: 2570.
    tables = CostTables(PROFILE, _cluster(memory=3000))
    ev = evaluate_config(tables, Config(1, 2, 4, "1F1B"), 4, (0, 2, 3))
    assert [s.in_flight for s in ev.stages] == [2, 1]
    assert ev.stages[0].memory_bytes == 570 + 1000 + (2 * 150 + 800 + 2 * (100 - 150))
    # Stage 1's later backwards meet the previous micro-batch's input gradients (100), held for their send
    # ([Note: input gradients in flight] in fresh.py).
    assert ev.stages[1].memory_bytes == 240 + 1000 + 400 + 25 + 100


def test_interleaved_chunks_and_step_time() -> None:
    prof = ModelProfile("Toy4", (*PROFILE.blocks, _block("d", 80.0, 0.0, 800, 50, 60)), 2, 300)
    tables = CostTables(prof, _cluster())
    cfg = Config(1, 2, 2, "Interleaved1F1B")
    ev = evaluate_config(tables, cfg, 2, (0, 1, 2, 3, 4))
    # K = v*M + S - 1 = 2*2 + 1 = 5; chunk 1 (block b, position 1): F=30, Bw=60, p2p in 205 + out 105.
    assert ev.stages[1].term_us == pytest.approx(5 * (90 + 205 + 105))
    assert [s.index % 2 for s in ev.stages] == [0, 1, 0, 1]
    # Each chunk must fit in its share of the device ([Note: chunk shares]): half, or by in-flight micro-batches
    # (rank 0 holds 2 of each chunk; rank 1 holds 2 of its first and 1 of its second; each rank's first chunk
    # holds the batch too: the first gets more).
    assert all(s.limit_bytes == tables.usable // 2 for s in ev.stages)
    by = evaluate_config(tables, dataclasses.replace(cfg, shares="in-flight"), 2, (0, 1, 2, 3, 4)).stages
    assert by[0].limit_bytes > by[2].limit_bytes and by[1].limit_bytes > by[3].limit_bytes
    assert by[0].limit_bytes + by[2].limit_bytes == by[1].limit_bytes + by[3].limit_bytes == tables.usable
    # The batch is held once per rank, by its first chunk.
    assert [s.io_bytes > 0 for s in ev.stages] == [True, True, True, True]
    assert ev.stages[0].parts is not None and ev.stages[2].parts is not None
    assert ev.stages[2].parts.io == 2 * (ev.stages[2].parts.sent)  # M = 2 receive and send buffers, no batch
    # The rank holding chunks 0 and 2 adds both chunks' memory.
    assert ev.peak_memory_bytes == max(
        ev.stages[0].memory_bytes + ev.stages[2].memory_bytes,
        ev.stages[1].memory_bytes + ev.stages[3].memory_bytes,
    )


def test_tied_parameter_copy_counted_once_per_stage() -> None:
    tied = ModelProfile(
        "Tied", PROFILE.blocks, 2, 300, tied=(TiedParam("a.w", 40, (0, 2)),), optimizer="adam"
    )
    tables = CostTables(tied, _cluster())
    cc = config_costs(tables, Config(1, 2, 4, "GPipe"), 4)
    owner = stage_cost(tables, cc, 0, 0, 2)
    copy = stage_cost(tables, cc, 1, 2, 3)
    assert owner.param_bytes == 140  # the owner block already counts it
    assert (copy.param_bytes, copy.grad_bytes, copy.optimizer_bytes) == (60 + 40, 60 + 40, 120 + 80)
    assert copy.param_count == 15 + 25  # its shape in block a: (25,)
    both = stage_cost(tables, cc, 0, 0, 3)
    assert both.param_bytes == 200


def test_a_tied_parameter_two_chunks_of_a_rank_use_is_one_tensor_there() -> None:
    # Rank 0 holds virtual stages 0 (block a, the owner of a.w) and 2 (block c, a copy): one tensor on the rank,
    # as for ALBERT's one layer in every chunk. Judged alone, chunk 2 still counts its copy.
    blocks = (*PROFILE.blocks, _block("d", 80.0, 0.0, 800, 50, 60))
    plain = ModelProfile("Toy4", blocks, 2, 300, optimizer="adam")
    tied = ModelProfile("Toy4", blocks, 2, 300, tied=(TiedParam("a.w", 40, (0, 2)),), optimizer="adam")
    cfg, bounds = Config(1, 2, 2, "Interleaved1F1B"), (0, 1, 2, 3, 4)
    # gradients kept over steps: the moments see every gradient, so the tied one only changes the copy
    ev = evaluate_config(CostTables(tied, _cluster(), persistent_grads=True), cfg, 2, bounds)
    ref = evaluate_config(CostTables(plain, _cluster(), persistent_grads=True), cfg, 2, bounds)
    assert ev.stages[2].param_bytes == ref.stages[2].param_bytes == 60
    assert ev.stages[2].memory_bytes == ref.stages[2].memory_bytes
    assert ev.peak_memory_bytes == ref.peak_memory_bytes
    assert ev.stages[2].bound_bytes == ref.stages[2].bound_bytes + 40 + 40 + 80
    # dropped at the step's start: chunk 2's backward may make the tied gradient before chunk 0's first one, so
    # it counts as there from the start; the owner's other gradients still appear at its own first backward
    ev = evaluate_config(CostTables(tied, _cluster()), cfg, 2, bounds)
    ref = evaluate_config(CostTables(plain, _cluster()), cfg, 2, bounds)
    got, want = ev.stages[0].parts, ref.stages[0].parts
    assert got is not None and want is not None
    assert (want.grads, got.grads) == (100, 100 - 40)
    assert ev.stages[2].parts is not None and ev.stages[2].parts.grads == ref.stages[2].parts.grads == 60
    assert ev.peak_memory_bytes - ref.peak_memory_bytes in (0, 40)


def test_config_validity_rules() -> None:
    assert check_config(Config(1, 2, 1, "1F1B"), 3, 4, 4) is not None  # M < S
    assert check_config(Config(1, 2, 3, "Interleaved1F1B"), 4, 4, 6) is not None  # M % S
    assert check_config(Config(1, 2, 2, "Interleaved1F1B"), 3, 4, 4) is not None  # V = 4 > 3 blocks
    assert check_config(Config(1, 1, 2, "1F1B"), 3, 4, 4) is not None  # one stage: GPipe only
    assert check_config(Config(3, 1, 1, "GPipe"), 3, 4, 4) is not None  # 3 does not divide 4
    assert check_config(Config(2, 3, 2, "GPipe"), 3, 4, 4) is not None  # 6 devices > 4
    assert check_config(Config(2, 2, 2, "1F1B"), 3, 4, 8) is None
    with pytest.raises(ConfigError, match="boundaries"):
        evaluate(PROFILE, _cluster(), 4, [0, 2, 2, 3], 1, 1, "GPipe")
    with pytest.raises(ConfigError, match="invalid configuration"):
        evaluate(PROFILE, _cluster(), 4, [0, 2, 3], 1, 1, "1F1B")


def test_layouts_and_links() -> None:
    # 2 nodes x 2 devices, S = 2, r = 2.
    assert [rank_of(q, p, 2, 2, "pipeline-major") for q in (0, 1) for p in (0, 1)] == [0, 1, 2, 3]
    assert stage_ranks(0, 2, 2, "stage-major") == (0, 1)
    assert stage_ranks(0, 2, 2, "pipeline-major") == (0, 2)
    pm = link_pattern(2, 2, 2, "pipeline-major")
    assert pm.p2p_intra[0] and pm.allreduce_intra == (False, False)
    sm = link_pattern(2, 2, 2, "stage-major")
    assert not sm.p2p_intra[0] and sm.allreduce_intra == (True, True)
    with pytest.raises(ValueError):
        rank_of(0, 0, 1, 1, "diagonal")


def test_evaluate_picks_faster_layout() -> None:
    cl = _cluster(nodes=2, per_node=2)
    ev = evaluate(PROFILE, cl, 8, [0, 2, 3], 2, 2, "GPipe")
    assert ev is not None
    other = [
        evaluate(PROFILE, cl, 8, [0, 2, 3], 2, 2, "GPipe", lay) for lay in ("pipeline-major", "stage-major")
    ]
    assert ev.step_us == min(e.step_us for e in other if e is not None)


def test_single_stage_holds_one_micro_batch() -> None:
    # The runtime runs a 1-stage plan's micro-batches one after the other ([Note: one stage]).
    assert in_flight("GPipe", 1, 0, 8) == 1


def test_fresh_gradients_leave_the_peak() -> None:
    # One replica, GPipe, S = 2, M = 4 (every micro-batch in flight at once): each stage's first backward starts
    # without gradients and makes them as it goes; later backwards hold them all, one micro-batch fewer
    # ([Note: fresh gradients], [Note: backward's peak] in tables.py).
    blocks = tuple(dataclasses.replace(b, transient_bytes=2 * b.activation_bytes) for b in PROFILE.blocks)
    prof = dataclasses.replace(PROFILE, blocks=blocks)
    cfg = Config(1, 2, 4, "GPipe")
    fresh = evaluate_config(CostTables(prof, _cluster()), cfg, 4, (0, 2, 3), checkpointing=False)
    kept = evaluate_config(
        CostTables(prof, _cluster(), persistent_grads=True), cfg, 4, (0, 2, 3), checkpointing=False
    )
    # Stage 0 at m = 1: static 570, batch and buffers 1000, outputs held 400, u = 500 + 300, grads 100 + 40,
    # transients 1000 and 600. Block 0's backward meets its own 500 bytes, block 1's all 800:
    # X = max(500 + 1000, 800 + 600) - 800 = 700 -> 570 + 1000 + 3200 + 700 + 400.
    assert kept.stages[0].memory_bytes == 570 + 1000 + 4 * 800 + 700 + 400
    # Fresh: the first backward meets block 1's gradients at block 0, max(500 + 1000 + 40, 1400) - 800 = 740;
    # a later one all 140 and one micro-batch fewer, 700 + 140 - 800; less the 140 the state counts.
    assert fresh.stages[0].memory_bytes == 570 + 1000 + 4 * 800 + 740 - 140 + 400
    assert fresh.stages[0].transient_bytes == 740 - 140
    # Block 0's backward has made 100 bytes of its own gradients by its peak ([Note: gradients made by the
    # peak] in profile/transient.py): 740 + 100; a stage whose gradients exist already does not change.
    made = dataclasses.replace(prof, blocks=(dataclasses.replace(blocks[0], fresh_extra_bytes=100), *blocks[1:]))
    ev = evaluate_config(CostTables(made, _cluster()), cfg, 4, (0, 2, 3), checkpointing=False)
    assert ev.stages[0].memory_bytes == fresh.stages[0].memory_bytes + 100
    kept_made = evaluate_config(CostTables(made, _cluster(), persistent_grads=True), cfg, 4, (0, 2, 3), False)
    assert kept_made.stages[0].memory_bytes == kept.stages[0].memory_bytes
    # Replicas keep their all-reduce buckets, so their gradients always exist.
    tables = CostTables(prof, _cluster())
    two = evaluate_config(tables, Config(2, 1, 2, "GPipe"), 4, (0, 3), checkpointing=False)
    # one micro-batch of 1200 bytes at a time; X = max(1500, 1400, 1200 + 800) - 1200
    assert two.stages[0].memory_bytes == 810 + 300 + 1200 + 800
    # 1F1B with more micro-batches than in flight: each stage runs a forward after its first backward.
    ev = evaluate_config(tables, Config(1, 2, 4, "1F1B"), 4, (0, 2, 3), checkpointing=False)
    # Stage 1's later backwards meet one earlier micro-batch's input gradients too (100 bytes).
    assert [s.memory_bytes for s in ev.stages] == [
        570 + 1000 + 2 * 800 + 700 + 200,
        240 + 1000 + 400 + 800 + 25 + 100,
    ]
    # One stage, one micro-batch: plain training; the gradients are made during its only backward, and last
    # step's outlive the forward (plain Lightning): at m = 2, the larger of the forward's end with them (u + 200)
    # and the last block's backward (its 1600 over all 2400 bytes of activations, none of the state's 200 bytes
    # of gradients made yet).
    one = evaluate_config(tables, Config(1, 1, 1, "GPipe"), 2, (0, 3), checkpointing=False)
    assert one.stages[0].memory_bytes == 810 - 200 + 300 + 2 * 1200 + 1600


def test_a_backward_meets_the_activations_of_the_blocks_before_it_only() -> None:
    """[Note: backward's peak]: block k's transient meets the activations of blocks i..k, and where this backward
    makes the gradients, those of the blocks after k."""
    acts, transients, grads = [0, 500, 800, 1200], [1000, 600, 800], [0, 100, 140, 200]
    peak = BackwardPeak(acts, transients)
    assert peak(0, 1) == 1000 and peak(2, 3) == 800
    assert peak(0, 2) == max(500 + 1000, 800 + 600) - 800  # block 0's large transient comes last
    assert peak(0, 3) == peak(1, 3) == 1200 + 800 - 1200  # block 2's meets them all
    fresh = BackwardPeak(acts, transients, grads)
    assert fresh(0, 2) == max(500 + 1000 + 40, 800 + 600) - 800  # block 1's 40 bytes of gradients made by then
    assert fresh(0, 1) == 1000 and fresh(1, 1) == 0
    # The forward's end (last step's 140 bytes of gradients), the first backward, or a later one (x, all of the
    # gradients, one micro-batch of 800 fewer), less the gradients the state counts.
    assert fresh_excess(700, 740, 140, 140, 800, True) == 740 - 140
    assert fresh_excess(700, 740, 140, 900, 800, False) == 900 - 140
    assert fresh_excess(700, 740, 1000, 0, 800, True) == 700 + 1000 - 800 - 1000


def test_later_micro_batches_add_into_the_gradients() -> None:
    """[Note: gradient accumulation]: of M micro-batches, M - 1 add into the gradients the first made; all M
    when the gradients outlive the step (accumulation over steps)."""
    grads = (30.0, 6.0, 12.0)
    pairs = zip(PROFILE.blocks, grads, strict=True)
    blocks = tuple(dataclasses.replace(b, accumulate_us=g) for b, g in pairs)
    profile = dataclasses.replace(PROFILE, blocks=blocks)
    for persistent, mb, share in ((False, 1, 0.0), (False, 4, 0.75), (True, 1, 1.0), (True, 4, 1.0)):
        tables = CostTables(profile, _cluster(), persistent_grads=persistent)
        plain = CostTables(PROFILE, _cluster(), persistent_grads=persistent)
        cfg = Config(1, 1, mb, "GPipe")
        got = stage_cost(tables, config_costs(tables, cfg, 4), 0, 0, 3)
        base = stage_cost(plain, config_costs(plain, cfg, 4), 0, 0, 3)
        assert got.bwd_us == pytest.approx(base.bwd_us + share * 48.0), (persistent, mb)
        assert got.fwd_us == base.fwd_us
        assert evaluate_config(tables, cfg, 4, (0, 3)).step_us == pytest.approx(  # type: ignore[union-attr]
            evaluate_config(plain, cfg, 4, (0, 3)).step_us + mb * share * 48.0  # type: ignore[union-attr]
        )


def test_a_stage_holds_the_batch_and_its_pipeline_buffers() -> None:
    # [Note: pipeline buffers]: 1F1B, S = 2, M = 4, m = 1, split after block a; 400 bytes per sample of batch
    # (labels too); block b saves half its input (the receive buffer), block a saves a quarter of its output.
    a, b, c = PROFILE.blocks
    prof = dataclasses.replace(
        PROFILE,
        blocks=(
            dataclasses.replace(a, saved_output_share=0.25),
            dataclasses.replace(b, saved_input_share=0.5),
            c,
        ),
        meta={"batch_bytes": 400.0},
    )
    ev = evaluate_config(CostTables(prof, _cluster()), Config(1, 2, 4, "1F1B"), 4, (0, 1, 3), checkpointing=False)
    s0, s1 = ev.stages
    # Stage 0: the batch (4 x 400), 4 gradient receive buffers (4 x 200); 2 micro-batches in flight, each with
    # its output kept but for what block a saves (2 x 150).
    assert s0.io_bytes == 1600 + 4 * 200 + 2 * 150
    assert s0.memory_bytes == 410 + s0.io_bytes + 2 * 500
    # Stage 1: the batch, 4 activation receive buffers (4 x 200), of which its one micro-batch in flight saves
    # 100 bytes (counted in its activations already), and the model's output (25) kept until its backward.
    assert s1.io_bytes == 1600 + 4 * 200 - 100 + 25
    # Its later backwards meet the previous micro-batch's input gradients (200), held for their send.
    assert s1.memory_bytes == 400 + s1.io_bytes + 700 + 200
    # One stage runs no schedule: the batch alone, its input views saved by block a (none) not counted twice.
    one = evaluate_config(CostTables(prof, _cluster()), Config(1, 1, 4, "GPipe"), 4, (0, 3), checkpointing=False)
    assert one.stages[0].io_bytes == 1600


@pytest.mark.parametrize("stages, schedule", [(1, "GPipe"), (2, "GPipe"), (1, "Interleaved1F1B")])
def test_weight_casts_live_per_micro_batch_in_flight_not_through_the_optimizer_step(stages: int, schedule: str) -> None:
    """[Note: weight casts]: autocast's weight copies add to the forward/backward term, one per micro-batch in
    flight (a single stage runs one at a time), and are gone when the optimizer step's temporaries peak; the
    reported parts still add up to the memory."""
    bounds = (0, 1, 3) if stages * (2 if schedule == "Interleaved1F1B" else 1) == 2 else (0, 3)

    def peaks(casts: int, optimizer_bound: bool) -> list[tuple[int, int]]:
        blocks = tuple(
            dataclasses.replace(
                b, cast_bytes=casts, optimizer_bytes=0,
                **({"activation_bytes": 0, "transient_bytes": 0, "cut_bytes": 0} if optimizer_bound else {}),
            )
            for b in PROFILE.blocks
        )
        prof = dataclasses.replace(PROFILE, blocks=blocks, input_bytes=0, optimizer="adam")
        tables = CostTables(prof, _cluster(per_node=stages))
        if optimizer_bound:
            tables.opt_transient = 50.0  # the optimizer's temporaries outweigh every micro-batch
        ev = evaluate_config(tables, Config(1, stages, 4, schedule), 4, bounds, checkpointing=False)
        for s in ev.stages:
            parts = s.param_bytes + s.grad_bytes + s.optimizer_bytes + s.buffer_bytes + s.activation_bytes
            assert parts + s.transient_bytes + s.io_bytes == s.memory_bytes
        return [(s.memory_bytes, s.in_flight) for s in ev.stages]

    def ranks(got: list[tuple[int, int]]) -> list[int]:
        return [sum(m for m, _ in got[p::stages]) for p in range(stages)]

    plain, cast = peaks(0, False), peaks(7, False)
    assert [n for _, n in cast] == [n for _, n in plain]
    assert [c - p for (c, _), (p, _) in zip(cast, plain, strict=True)] == [
        n * 7 * (j - i) for (_, n), (i, j) in zip(cast, pairwise(bounds), strict=True)
    ]
    if schedule == "GPipe":  # a single stage runs one micro-batch at a time; a GPipe pipeline holds all four
        assert max(n for _, n in cast) == (1 if stages == 1 else 4)
    assert ranks(peaks(7, True)) == ranks(peaks(0, True))  # gone by the optimizer step


def test_a_backward_frees_its_weight_casts_and_a_recompute_makes_its_own() -> None:
    """[Note: weight casts]: under GPipe (every micro-batch in flight, gradients fresh) a backward frees its
    micro-batch's weight copies with its activations before the gradients grow, so the gradients take their
    place; a checkpointed stage keeps none between its forward and its backward, only its recompute's."""
    casts = 30  # per block and micro-batch; one micro-batch (1 sample) saves 10 bytes a block, grads 100

    def stage(cast_bytes: int, memory: int = 10**9) -> tuple[int, bool]:
        blocks = tuple(
            _block(n, 10.0, 0.0, act, cut=4, params=100)
            for n, act in (("a", 20), ("b", 20 if memory == 10**9 else 20000))
        )
        blocks = tuple(dataclasses.replace(b, cast_bytes=cast_bytes, optimizer_bytes=0) for b in blocks)
        prof = dataclasses.replace(PROFILE, blocks=blocks, input_bytes=0, optimizer="sgd")
        ev = evaluate_config(CostTables(prof, _cluster(memory)), Config(1, 2, 4, "GPipe"), 4, (0, 1, 2))
        s = ev.stages[1]
        parts = s.param_bytes + s.grad_bytes + s.optimizer_bytes + s.buffer_bytes + s.activation_bytes
        assert parts + s.transient_bytes + s.io_bytes == s.memory_bytes
        return s.memory_bytes, s.checkpoint

    # Plain: four micro-batches' copies (120), less the one the first backward frees: the fresh gradients'
    # credit grows from one micro-batch's activations (10) to its activations and copies (40).
    (plain, ck0), (cast, ck1) = stage(0), stage(casts)
    assert not ck0 and not ck1 and cast - plain == 4 * casts - casts
    # Checkpointed (activations of 10,000 bytes a sample do not fit four times): one recompute's copies.
    big = stage(0)[0] + 3 * 10000
    (plain, ck0), (cast, ck1) = stage(0, big), stage(casts, big)
    assert ck0 and ck1 and cast - plain == casts


def test_a_head_the_loss_never_reaches_has_gradients_only_in_replicas_buckets() -> None:
    """Block c's parameters get no gradient ([Note: unreached gradients] in fresh.py): one replica holds no
    buffer for them; replicas' all-reduce buckets do, and all-reduce them."""
    c = dataclasses.replace(PROFILE.blocks[2], optimizer_bytes=0, unreached_grad_bytes=60)
    unreached = dataclasses.replace(PROFILE, blocks=(*PROFILE.blocks[:2], c))
    reached = dataclasses.replace(PROFILE, blocks=(*PROFILE.blocks[:2], dataclasses.replace(c, unreached_grad_bytes=0)))
    one = Config(1, 2, 4, "1F1B")  # the last stage runs one micro-batch at a time: its gradients are not fresh
    ev, ev_reached = (evaluate_config(CostTables(p, _cluster()), one, 4, (0, 2, 3)) for p in (unreached, reached))
    assert (ev.stages[1].grad_bytes, ev_reached.stages[1].grad_bytes) == (0, 60)
    assert ev_reached.stages[1].memory_bytes - ev.stages[1].memory_bytes == 60
    assert ev.stages[0] == ev_reached.stages[0]
    two = evaluate_config(CostTables(unreached, _cluster()), Config(2, 2, 2, "1F1B"), 4, (0, 2, 3))
    assert two.stages[1].grad_bytes == 60
    assert two.stages[1].allreduce_us == evaluate_config(
        CostTables(reached, _cluster()), Config(2, 2, 2, "1F1B"), 4, (0, 2, 3)
    ).stages[1].allreduce_us > 0


def test_later_backwards_meet_the_input_gradients_still_being_sent() -> None:
    """[Note: input gradients in flight] in fresh.py: r bytes of input gradients per micro-batch, u freed by a
    finished micro-batch."""
    from lightning_autopart.partition.fresh import sent_back

    assert sent_back(100, 300, 1, 4, gpipe=False) == 100  # 1F1B, fewer in flight than micro-batches
    assert sent_back(100, 30, 4, 4, gpipe=False) == 70  # all in flight: one fewer by its second backward
    assert sent_back(100, 300, 4, 4, gpipe=False) == 0
    assert sent_back(100, 30, 4, 4, gpipe=True) == 3 * 70  # GPipe's last backward holds three earlier sends
    assert sent_back(100, 30, 1, 1, gpipe=False) == sent_back(0, 0, 2, 4, gpipe=True) == 0
    # A fresh stage's first backward holds none; its later backwards' moment has one micro-batch fewer already:
    # there 1F1B adds r, GPipe's k-th backward r + (k - 1)(r - u).
    assert sent_back(100, 300, 4, 4, gpipe=True, fresh=True) == sent_back(100, 30, 4, 4, False, fresh=True) == 100
    assert sent_back(100, 30, 4, 4, gpipe=True, fresh=True) == 100 + 2 * 70
    assert fresh_excess(700, 740, 1000, 0, 800, True, back=100) == 700 + 1000 - 800 + 100 - 1000
    # GPipe x 4, stage 1 (block c) with 2000 bytes of gradients: the second backward peaks, 3 x 400 bytes of
    # activations, X = 800, every gradient and the first micro-batch's 100 bytes of input gradients; beyond
    # 4 x 400 and the state's gradients: 800 + 2000 - 400 + 100 - 2000 (it read 100 less, r - u < 0 counting none).
    blocks = (*PROFILE.blocks[:2], _block("c", 80.0, 0.0, 800, 50, 2000))
    prof = dataclasses.replace(PROFILE, blocks=tuple(dataclasses.replace(b, transient_bytes=2 * b.activation_bytes)
                                                     for b in blocks))  # fmt: skip
    stage = evaluate_config(CostTables(prof, _cluster()), Config(1, 2, 4, "GPipe"), 4, (0, 2, 3), False).stages[1]
    assert (stage.activation_bytes, stage.transient_bytes) == (4 * 400, 500)
