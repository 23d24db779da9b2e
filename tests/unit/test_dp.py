"""The planner against brute force: every composition of blocks x every configuration, same cost model."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from lightning_autopart.cluster import Cluster
from lightning_autopart.errors import PlanError
from lightning_autopart.partition import partition
from lightning_autopart.partition.bounds import Relaxation
from lightning_autopart.partition.configs import SHARES
from lightning_autopart.partition.cost import (
    INF,
    Config,
    CostTables,
    config_costs,
    stage_cost,
)
from lightning_autopart.partition.dp import solve
from lightning_autopart.partition.placement import LAYOUTS
from lightning_autopart.partition.scoring import evaluate, evaluate_config
from lightning_autopart.profile.records import BlockProfile, ModelProfile, TiedParam

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _valid(schedule: str, s: int, r: int, mb: int, n: int, world: int) -> bool:
    """The schedule constraints, restated independently of the planner."""
    v = 2 if schedule == "Interleaved1F1B" else 1
    if s * r > world or s * v > n:
        return False
    if s == 1:
        return schedule == "GPipe"
    if schedule == "1F1B":
        return mb >= s
    if schedule == "Interleaved1F1B":
        return mb >= s and mb % s == 0
    return True


def _compositions(n: int, parts: int) -> list[tuple[int, ...]]:
    return [(0, *cut, n) for cut in itertools.combinations(range(1, n), parts - 1)]


def brute_force(
    tables: CostTables, batch: int, schedules: tuple[str, ...], max_mb: int, checkpointing: bool
) -> tuple[float, Config | None, tuple[int, ...]]:
    """Smallest step time over every configuration, layout and composition (INF when nothing fits)."""
    n, world = tables.num_blocks, tables.cluster.world_size
    best: tuple[float, Config | None, tuple[int, ...]] = (INF, None, ())
    for r in _divisors(batch):
        for mb in [d for d in _divisors(batch // r) if d <= max_mb]:
            for s in range(1, world + 1):
                for sched in schedules:
                    if not _valid(sched, s, r, mb, n, world):
                        continue
                    v = 2 if sched == "Interleaved1F1B" else 1
                    for lay, shares in itertools.product(LAYOUTS, SHARES if v > 1 else ("even",)):
                        cfg = Config(r, s, mb, sched, lay, shares)
                        cc = config_costs(tables, cfg, batch, checkpointing)
                        memo: dict[tuple[int, int, int], tuple[bool, float]] = {}
                        for bounds in _compositions(n, s * v):
                            worst = 0.0
                            for k in range(s * v):
                                key = (k, bounds[k], bounds[k + 1])
                                if key not in memo:
                                    sc = stage_cost(tables, cc, *key)
                                    memo[key] = (sc.fits, sc.term_us)
                                fits, term = memo[key]
                                if not fits:
                                    worst = INF
                                    break
                                worst = max(worst, term)
                            if worst < best[0]:
                                best = (worst, cfg, bounds)
    return best


@st.composite
def _curves(draw: st.DrawFn, b0: int) -> tuple[tuple[int, float, float, int, int, int], ...]:
    """Empty (linear in the batch), or costs at 1, 4 and 16 samples, not necessarily linear."""
    if draw(st.booleans()):
        return ()
    points = []
    for samples in (1, 4, 16):
        points.append(
            (
                samples,
                draw(st.floats(1.0, 1000.0)),
                draw(st.floats(1.0, 2000.0)),
                draw(st.integers(0, 100000)),
                draw(st.integers(0, 60000)),
                draw(st.integers(0, 3000)),
            )
        )
    return tuple(points)


@st.composite
def instances(
    draw: st.DrawFn, pipeline: bool = False
) -> tuple[ModelProfile, Cluster, int, tuple[str, ...], int, bool, bool]:
    """Random small instances (the last two fields: checkpointing allowed, gradients persistent); ``pipeline`` biases them towards deep pipelines (equal layers, slow all-reduce)."""
    n = draw(st.sampled_from([4, 6, 7]) if pipeline else st.integers(1, 7))
    b0 = draw(st.sampled_from([1, 2, 4]))
    blocks = []
    uniform = pipeline or draw(st.booleans())  # transformer-like
    fixed = (
        0.1 if pipeline else 1.0
    )  # launch overheads penalise many small chunks: equal layers, where interleaving pays off
    fwd0, bwd0 = draw(st.floats(1.0, 1000.0)), draw(st.floats(1.0, 2000.0))
    for k in range(n):
        fwd = fwd0 if uniform else draw(st.floats(1.0, 1000.0))
        bwd = bwd0 if uniform else draw(st.floats(1.0, 2000.0))
        params = draw(st.integers(0, 4000))
        skip_heavy = not pipeline and draw(st.booleans())
        blocks.append(
            BlockProfile(
                name=f"b{k}",
                modules=(f"m{k}",),
                param_shapes=((f"m{k}.w", (params,)),),
                param_count=params,
                param_bytes=4 * params,
                grad_bytes=4 * params,
                # a head the loss never reaches: no gradient on one replica, no optimizer state
                **(
                    {"unreached_grad_bytes": 4 * params, "optimizer_bytes": 0}
                    if draw(st.integers(0, 4)) == 0
                    else {"optimizer_bytes": draw(st.sampled_from([0, 4, 8])) * params}
                ),
                buffer_bytes=draw(st.integers(0, 500)),
                fwd_us=fwd,
                bwd_us=bwd,
                fwd_fixed_us=fwd * draw(st.floats(0.0, fixed)),
                bwd_fixed_us=bwd * draw(st.floats(0.0, fixed)),
                activation_bytes=draw(st.integers(0, 100000)),
                cut_bytes=draw(st.integers(50000, 400000)) if skip_heavy else draw(st.integers(0, 3000)),
                transient_bytes=draw(st.integers(0, 60000)),
                # its own gradients made by that peak where backward makes them ([Note: gradients made by the peak])
                fresh_extra_bytes=draw(st.sampled_from([0, 0]) | st.integers(0, 4 * params)),
                optimizer_us=draw(st.floats(0.0, 500.0)),
                # autocast's weight copies, up to a large transient ([Note: weight casts] in cost.py)
                cast_bytes=draw(st.integers(0, 300) | st.integers(0, 60000)),
                # the saves of a dead part, held by the forward alone ([Note: a dead part's saves] in cost.py)
                dropped_bytes=draw(st.sampled_from([0, 0]) | st.integers(0, 80000)),
                forward_only=draw(st.sampled_from([False, False, True])),
                saved_by_previous=draw(st.sampled_from([0.0, 0.0, 0.5, 1.0])),
                # what a stage's receive buffers and held outputs share with the saved tensors
                saved_input_share=draw(st.sampled_from([0.0, 0.3, 1.0])),
                saved_output_share=draw(st.sampled_from([0.0, 0.6, 1.0])),
                # outputs a stage sends on as it received them (made before it): not held twice
                passed_shares=draw(st.sampled_from([(), ((-1, 0.3),), ((-1, 0.2), *(((k - 1, 0.5),) if k else ()))])),
                # and those it saves as it passes them on: their sends are no copy either
                saved_passed_shares=draw(st.sampled_from([(), ((-1, 0.1),), (((k - 1, 0.2),) if k else ())])),
                curve=draw(_curves(b0)),
                # host-bound blocks (host time beyond the device's: priced as max(device, host) per stage)
                host_fwd_us=draw(st.sampled_from([0.0, 0.0, fwd * 3.0]) | st.floats(0.0, 3000.0)),
                host_bwd_us=draw(st.sampled_from([0.0, bwd * 2.0]) | st.floats(0.0, 3000.0)),
                # gradient accumulation, every micro-batch but the first: it favours fewer micro-batches
                accumulate_us=draw(st.sampled_from([0.0, bwd * 0.5]) | st.floats(0.0, 1000.0)),
            )
        )
    tied: tuple[TiedParam, ...] = ()
    if n >= 2 and draw(st.booleans()):
        users = sorted(draw(st.sets(st.integers(0, n - 1), min_size=2, max_size=min(3, n))))
        owner = users[0]
        nbytes = draw(st.integers(0, blocks[owner].param_bytes))
        tied = (TiedParam(f"m{owner}.w", nbytes, tuple(users)),)
    profile = ModelProfile(
        model="Rand",
        blocks=tuple(blocks),
        batch_size=b0,
        input_bytes=draw(st.integers(0, 5000)),
        tied=tied,
        optimizer="adam",
        # the whole batch (labels too) that every rank holds, per sample; none: the inputs alone
        meta={"batch_bytes": draw(st.sampled_from([0.0, 700.0]))},
    )
    batch = draw(st.sampled_from([4, 8, 12, 16] if pipeline else [1, 2, 3, 4, 6, 8, 12, 16]))
    nodes = draw(st.integers(1, 2))
    # Interleaving pays when devices are few for the blocks (otherwise a deeper plain pipeline wins).
    per_node = draw(st.integers(3 - nodes, 3 - nodes) if pipeline else st.integers(1, 8 // nodes))
    statics = [b.param_bytes + b.grad_bytes + b.optimizer_bytes + b.buffer_bytes for b in blocks]
    acts = [b.activation_bytes * batch // b0 for b in blocks]
    # Memory between "the largest block alone barely fits" and "everything fits on one device", so that
    # pipelines, checkpointing and small micro-batches are often needed (and sometimes nothing fits).
    low = max(statics) + max(b.activation_bytes for b in blocks) // b0
    high = sum(statics) + sum(acts)
    fracs = [0.1, 0.2, 0.4, 0.7, 1.0] if pipeline else [-0.05, 0.0, 0.03, 0.1, 0.2, 0.4, 0.7, 1.0]
    frac = draw(st.sampled_from(fracs))
    memory = max(1, int(low + frac * (high - low)) + draw(st.integers(0, 999)))
    ar_scale = (
        1e3 if pipeline else draw(st.sampled_from([1e3, 1e5, 1e7]))
    )  # slow all-reduce favours deep pipelines
    cluster = Cluster(
        nodes=nodes,
        devices_per_node=per_node,
        device_memory_bytes=memory,
        intra_node_bw=draw(st.floats(1e7, 1e10)),
        inter_node_bw=draw(st.floats(1e6, 1e9)),
        intra_allreduce_bw=ar_scale * draw(st.floats(1.0, 100.0)),
        inter_allreduce_bw=ar_scale * draw(st.floats(0.1, 10.0)),
        latency_us=draw(st.floats(0.0, 2.0 if pipeline else 50.0)),
        memory_reserve=0.0,
        # Host overheads: none, or per action and per step, adding to the math (CPU) or hidden behind it.
        action_us=draw(st.sampled_from([0.0, 0.0, 5.0, 300.0])),
        step_us=draw(st.sampled_from([0.0, 40.0])),
        async_host=draw(st.booleans()),
    )
    both = ("1F1B", "Interleaved1F1B")
    extra: tuple[str, ...] = draw(st.sampled_from([(), ("1F1B",), ("Interleaved1F1B",), both, both]))
    schedules = ("GPipe", *both) if pipeline else ("GPipe", *extra)
    max_mb = draw(st.integers(4 if pipeline else 1, 8))
    return profile, cluster, batch, schedules, max_mb, draw(st.booleans()), draw(st.booleans())


Case = tuple[ModelProfile, Cluster, int, tuple[str, ...], int, bool, bool]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_planner_matches_brute_force(case: Case) -> None:
    _check_against_brute_force(case)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(pipeline=True))
def test_planner_matches_brute_force_on_pipeline_friendly_instances(case: Case) -> None:
    _check_against_brute_force(case)


def _check_against_brute_force(case: Case) -> None:
    """The planner's step time equals the brute-force optimum, and both agree on feasibility."""
    profile, cluster, batch, schedules, max_mb, ck, persistent = case
    tables = CostTables(profile, cluster, persistent_grads=persistent)
    want, cfg, bounds = brute_force(tables, batch, schedules, max_mb, ck)
    event(f"blocks={profile.num_blocks}")
    event(f"feasible={want < INF}")
    event(f"stages={cfg.stages if cfg else 0} replicas={cfg.replicas if cfg else 0}")
    if cfg:
        event(f"schedule={cfg.schedule}")
    try:
        plan = partition(
            profile,
            cluster,
            batch,
            schedules=schedules,
            max_micro_batches=max_mb,
            checkpointing=ck,
            persistent_grads=persistent,
        )
    except PlanError as err:
        assert want == INF, f"planner found nothing, brute force found {want} with {cfg} {bounds}"
        assert err.closest is not None
        return
    assert want < INF, "planner found a plan that brute force says cannot fit"
    got = plan.prediction.step_us
    event(
        f"plan={plan.schedule} S={len(plan.stages) // plan.chunks_per_rank} ck={any(x.checkpoint for x in plan.stages)}"
    )
    assert got <= want * (1 + 1e-9), (got, want, cfg, bounds)
    assert got >= want * (1 - 1e-9), (got, want)
    # The plan's own partition, re-scored through the public evaluate(), gives the same step time.
    b = [s.block_start for s in plan.stages] + [profile.num_blocks]
    ev = evaluate(
        profile,
        cluster,
        batch,
        b,
        plan.replicas,
        plan.micro_batches,
        plan.schedule,
        plan.layout,
        checkpointing=ck,
        tables=tables,
    )
    assert ev is not None and ev.step_us == pytest.approx(got, rel=1e-12)


def _chain(cuts: list[int], fwd: list[float]) -> ModelProfile:
    blocks = tuple(
        BlockProfile(f"b{k}", (f"b{k}",), (), 0, 0, 0, 0, 0, f, 2 * f, 0.0, 0.0, 0, c)
        for k, (c, f) in enumerate(zip(cuts, fwd, strict=True))
    )
    return ModelProfile("Chain", blocks, 1, 0)


def test_dp_avoids_a_heavy_cut() -> None:
    # Cutting after block 1 costs a 1 GB transfer; the balanced split (2 | 2) must move to (1 | 3) or (3 | 1).
    prof = _chain([10, 10**9, 10, 10], [100.0, 100.0, 100.0, 100.0])
    cl = Cluster(1, 2, 10**12, 1e9, 1e9, 1e9, 1e9, latency_us=0.0, memory_reserve=0.0)
    tables = CostTables(prof, cl)
    cfg = Config(1, 2, 4, "GPipe")
    cc = config_costs(tables, cfg, 4)
    got = solve(tables, cc)
    assert got is not None
    assert got[1] in ((0, 1, 4), (0, 3, 4))
    assert got[0] == pytest.approx(evaluate_config(tables, cfg, 4, got[1]).step_us)


def test_a_block_that_fits_only_where_fewer_micro_batches_are_in_flight() -> None:
    """1F1B with 3 stages and 3 micro-batches holds 3, 2 and 1 in flight. A 500-byte block fits a 600-byte
    device only on the last stage; a 100-byte one fits anywhere. The farthest first stage (blocks 0-1) leaves the
    second nothing it can hold, yet the plan exists: the relaxation's bands must not rule it out."""
    blocks = tuple(
        BlockProfile(f"b{k}", (f"b{k}",), (), 0, 0, 0, 0, 0, 10.0, 20.0, 0.0, 0.0, act, 0)
        for k, act in enumerate((0, 100, 500, 0))
    )
    prof = ModelProfile("Chain", blocks, 1, 0)
    cl = Cluster(1, 3, 600, 1e9, 1e9, 1e9, 1e9, latency_us=0.0, memory_reserve=0.0)
    tables = CostTables(prof, cl)
    cfg = Config(1, 3, 3, "1F1B")
    assert Relaxation(tables, cfg, 3, checkpointing=False).bands(INF) is not None
    got = solve(tables, config_costs(tables, cfg, 3, checkpointing=False))
    assert got is not None and got[1] == (0, 1, 2, 4)  # the only one without recomputing
    assert evaluate_config(tables, cfg, 3, got[1], checkpointing=False).fits


def test_the_seed_partition_never_has_an_empty_stage() -> None:
    """The search seeds its incumbent with the relaxation's greedy partition. Interleaved chunks hold different
    micro-batches in flight, so a stage's band may end where the one before ends (1000 bytes of activations
    on block 3 here): those ends are no partition (a stage of no blocks), and the greedy one is None."""
    blocks = tuple(
        BlockProfile(f"b{k}", (f"b{k}",), ((f"b{k}.w", (p // 4,)),), p // 4, p, p, 2 * p, 0, 10.0, 20.0, 0.0, 0.0, a, c)
        for k, (a, c, p) in enumerate([(0, 100, 0), (0, 100, 0), (0, 100, 100), (1000, 100, 400), (0, 100, 100),
                                       (0, 0, 100)])
    )  # fmt: skip
    prof = ModelProfile("Chain", blocks, 2, 0, optimizer="sgd")
    cl = Cluster(1, 2, 10000, 1e9, 1e9, 1e9, 1e9, latency_us=0.0, memory_reserve=0.0)
    tables = CostTables(prof, cl)
    relax = Relaxation(tables, Config(1, 2, 4, "Interleaved1F1B", shares="in-flight"), 8, checkpointing=False)
    bands = relax.bands(INF)
    assert bands is not None and [b for _, b in bands] == [0, 3, 3, 3, 6]
    assert relax.greedy(INF) is None
    part = relax.lower_bound()[1]
    assert part is None or all(a < b for a, b in itertools.pairwise(part))
    plan = partition(prof, cl, 8, schedules=("Interleaved1F1B",), max_micro_batches=4, checkpointing=False)
    starts = [s.block_start for s in plan.stages]
    assert all(a < b for a, b in itertools.pairwise([*starts, 6]))


def test_the_last_stage_relays_nothing() -> None:
    """The last block passing on part of the model's input (ViT-MAE's images, read by the loss) makes no kept
    send on the last stage, which sends no output: crediting it once made that stage's memory negative."""
    blocks = tuple(
        BlockProfile(f"b{k}", (f"b{k}",), (), 0, 0, 0, 0, 0, 10.0, 20.0, 0.0, 0.0, 100, c,
                     passed_shares=((-1, 0.3),) if k == 3 else ())
        for k, c in enumerate((100, 100, 100, 50000))
    )  # fmt: skip
    prof = ModelProfile("Chain", blocks, 1, 0, optimizer="sgd", meta={"batch_bytes": 100.0})
    tables = CostTables(prof, Cluster(1, 2, 10**9, 1e9, 1e9, 1e9, 1e9, latency_us=0.0, memory_reserve=0.0))
    assert tables.at(1).relayed[4] == () and tables.at(1).relayed_through(2, 4) == 0
    ev = evaluate_config(tables, Config(1, 2, 4, "Interleaved1F1B"), 4, (0, 1, 2, 3, 4), checkpointing=False)
    assert all(s.io_bytes >= 0 and s.bound_bytes > 0 for s in ev.stages)


def test_a_device_too_small_for_a_chunks_byte_is_refused_not_divided_by() -> None:
    """Interleaved chunks share a device: on a 1-byte device one gets no byte. Nothing fits, and the closest
    plan's search (memory over limit) must still run."""
    blocks = tuple(BlockProfile(f"b{k}", (f"b{k}",), (), 0, 0, 0, 0, 0, 1.0, 2.0, 0.0, 0.0, 8, 1) for k in range(4))
    prof = ModelProfile("Chain", blocks, 1, 0)
    cl = Cluster(1, 2, 1, 1e9, 1e9, 1e9, 1e9, latency_us=0.0, memory_reserve=0.0)
    with pytest.raises(PlanError) as got:
        partition(prof, cl, 4, schedules=("GPipe", "1F1B", "Interleaved1F1B"), max_micro_batches=4)
    assert got.value.closest is not None


def test_tau_prunes_but_keeps_equal_values() -> None:
    prof = _chain([1, 1, 1, 1, 1, 1], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    cl = Cluster(1, 3, 10**12, 1e9, 1e9, 1e9, 1e9, latency_us=0.0, memory_reserve=0.0)
    tables = CostTables(prof, cl)
    cc = config_costs(tables, Config(1, 3, 3, "GPipe"), 3)
    best = solve(tables, cc)
    assert best is not None
    assert solve(tables, cc, best[0]) == best
    assert solve(tables, cc, best[0] * (1 - 1e-6)) is None
    relax = Relaxation(tables, cc.cfg, 3)
    lb, part = relax.lower_bound()
    assert lb <= best[0] and part is not None


def test_a_stage_costs_the_larger_of_its_device_and_host_time() -> None:
    """Where the host runs ahead of the device, a stage costs max(device, host) per micro-batch, and a
    checkpointed stage runs its blocks' forward host work twice; the DP and stage_cost agree on both."""

    def block(k: int, host_fwd: float, host_bwd: float) -> BlockProfile:
        return BlockProfile(
            f"b{k}", (f"b{k}",), (), 0, 0, 0, 0, 0, 100.0, 200.0, 0.0, 0.0, 10_000, 10,
            host_fwd_us=host_fwd, host_bwd_us=host_bwd,
        )  # fmt: skip

    prof = ModelProfile("Chain", (block(0, 50.0, 50.0), block(1, 400.0, 100.0)), 1, 10)
    for memory, ck in ((10**9, False), (15_000, True)):  # 2 micro-batches of 10 kB saved: 20 kB, or 10 kB + inputs
        cl = Cluster(1, 2, memory, 1e9, 1e9, 1e9, 1e9, latency_us=0.0, memory_reserve=0.0, action_us=0.0)
        tables = CostTables(prof, cl)
        cc = config_costs(tables, Config(1, 2, 2, "GPipe"), 2)
        first, second = stage_cost(tables, cc, 0, 0, 1), stage_cost(tables, cc, 1, 1, 2)
        assert first.checkpoint is second.checkpoint is ck
        # block 0: device 300 (+100 recomputed) beats host 100 (+50); block 1: host 500 (+400) beats device
        assert first.fwd_us + first.bwd_us + first.host_us == pytest.approx(400.0 if ck else 300.0)
        assert first.host_us == 0.0
        assert second.fwd_us + second.bwd_us + second.host_us == pytest.approx(900.0 if ck else 500.0)
        got = solve(tables, cc)
        assert got is not None and got[0] == pytest.approx(max(first.term_us, second.term_us))
        # where the host does the math (CPU), the blocks' own host time is already in their device time
        cpu = CostTables(prof, Cluster(1, 2, memory, 1e9, 1e9, 1e9, 1e9, latency_us=0.0, memory_reserve=0.0,
                                       action_us=0.0, async_host=False))  # fmt: skip
        assert stage_cost(cpu, config_costs(cpu, cc.cfg, 2), 1, 1, 2).host_us == 0.0
