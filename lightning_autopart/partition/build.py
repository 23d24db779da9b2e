"""Turn a scored partition into a :class:`~lightning_autopart.plan.Plan`, or into a PlanError with a memory table."""

from __future__ import annotations

from typing import Any

from lightning_autopart.cluster import Cluster, format_bytes
from lightning_autopart.errors import ConfigError, PlanError
from lightning_autopart.partition.cost import CostTables
from lightning_autopart.partition.placement import stage_ranks
from lightning_autopart.partition.scoring import Evaluation
from lightning_autopart.plan import Plan, Prediction, StagePlan
from lightning_autopart.profile.loader import LoaderCost
from lightning_autopart.profile.records import ModelProfile

__all__ = [
    "batch_statistics_note",
    "build_plan",
    "growth_note",
    "infeasible_error",
    "memory_table",
    "mixing_note",
    "one_micro_batch",
    "single_reasons",
    "transformed_note",
]

#: Rows of the memory table shown before eliding the rest.
_MAX_ROWS = 24


def _ranges(indices: list[int]) -> str:
    """Compact "0-3, 7, 9-12" form of sorted indices."""
    parts = []
    start = prev = indices[0]
    for x in [*indices[1:], None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(parts)


def build_plan(
    profile: ModelProfile, cluster: Cluster, batch_size: int, ev: Evaluation, notes: dict[str, Any]
) -> Plan:
    """The Plan of evaluation ``ev`` (stages, ranks, predictions); ``notes`` goes into ``Plan.notes``."""
    cfg = ev.config
    stages = []
    for sc in ev.stages:
        blocks = profile.blocks[sc.block_start : sc.block_end]
        modules: dict[str, None] = {}
        for b in blocks:
            modules.update(dict.fromkeys(b.modules))
        stages.append(
            StagePlan(
                index=sc.index,
                block_start=sc.block_start,
                block_end=sc.block_end,
                blocks=tuple(b.name for b in blocks),
                modules=tuple(modules),
                ranks=stage_ranks(sc.index % cfg.stages, cfg.stages, cfg.replicas, cfg.layout),
                checkpoint=sc.checkpoint,
                param_count=sc.param_count,
                fwd_us=sc.fwd_us,
                bwd_us=sc.bwd_us,
                p2p_us=sc.p2p_us,
                allreduce_us=sc.allreduce_us,
                param_bytes=sc.param_bytes,
                grad_bytes=sc.grad_bytes,
                optimizer_bytes=sc.optimizer_bytes,
                activation_bytes=sc.activation_bytes,
                in_flight=sc.in_flight,
                memory_bytes=sc.memory_bytes,
                transient_bytes=sc.transient_bytes,
                io_bytes=sc.io_bytes,
                optimizer_us=sc.optimizer_us,
            )
        )
    bn = ev.stages[ev.bottleneck]
    v, mb = cfg.chunks, cfg.micro_batches
    step = ev.step_us
    prediction = Prediction(
        step_us=step,
        compute_us=v * mb * (bn.fwd_us + bn.bwd_us),
        bubble_us=(cfg.stages - 1) * bn.time_us,
        p2p_us=v * mb * bn.p2p_us,
        allreduce_us=v * bn.allreduce_us,
        samples_per_s=batch_size / (step / 1e6) if step > 0 else float("inf"),
        peak_memory_bytes=ev.peak_memory_bytes,
        optimizer_us=v * bn.optimizer_us,
        host_us=v * mb * bn.host_us + cluster.step_host_us,
        data_us=bn.data_us,
    )
    ckpt = [sc.index for sc in ev.stages if sc.checkpoint]
    notes = dict(notes)
    notes["bottleneck_stage"] = ev.bottleneck
    if cfg.chunks > 1:  # how each rank's device was split among its chunks ([Note: chunk shares])
        notes["chunk_shares"] = cfg.shares
    loader = LoaderCost.from_meta(profile.meta.get("loader"))
    if loader is not None:
        every = loader.readback_every
        reads = "never" if every == 0 else ("every step" if every == 1 else f"every {every} steps")
        notes["loader"] = f"{loader.sample_us / 1e3:.3g} ms/sample, {loader.workers} workers, reads back {reads}"
    if profile.mode == "estimate" and profile.meta.get("opaque_ops"):  # priced by their bytes alone
        notes["unpriced_ops"] = ", ".join(profile.meta["opaque_ops"])
    if mixed := profile.meta.get("batch_mixing"):  # [Note: values that mix samples] in capture/batch_stats.py
        notes["batch_mixing"] = f"{mixing_note(mixed)}: one micro-batch per replica, as more would change it"
    if (growth := profile.meta.get("loss_growth")) is not None:  # [Note: a loss that grows] in step_checks.py
        notes["loss_growth"] = f"{growth_note(growth)}: one micro-batch per replica, as more would scale it"
    if origin := profile.meta.get("loss_transformed"):  # [Note: statistics transformed] in sample_flow.py
        notes["loss_transformed"] = f"{transformed_note(origin)}: one micro-batch per replica, as more would change it"
    if mb > 1 and (logs := profile.meta.get("log_transformed")):
        shown = ", ".join(f"{name!r} ({where})" for name, where in logs.items())
        notes["log_transformed"] = (
            f"logged {shown} transform a statistic of the batch: each step logs the mean of its {mb} micro-batches' "
            "values, not the value over the batch (a torchmetrics metric, or micro_batches=1, logs the batch's)"
        )
    if combines := profile.meta.get("log_combines"):  # [Note: logged values over micro-batches]
        notes["log_combines"] = dict(combines)
    if combines := profile.meta.get("output_combines"):  # [Note: a step's other outputs] in lightning/steps.py
        notes["output_combines"] = dict(combines)
    if profile.meta.get("loss_reduction") == "sum":  # each micro-batch's loss added ([Note: a loss that grows])
        notes["loss_reduction"] = "sum"
    if mb > 1 and (norms := profile.meta.get("batch_statistics")):
        notes["batch_statistics"] = batch_statistics_note(norms, batch_size // (cfg.replicas * mb), mb)
    if ckpt:
        notes["checkpointing"] = (
            f"{len(ckpt)} of {len(ev.stages)} stages ({_ranges(ckpt)}) recompute activations in backward: "
            f"without it they exceed "
            + (f"their share of {format_bytes(cluster.usable_memory_bytes)} per device" if v > 1
               else f"{format_bytes(cluster.usable_memory_bytes)} per device")
        )
    return Plan(
        fingerprint=profile.fingerprint(),
        cluster=cluster,
        batch_size=batch_size,
        micro_batches=mb,
        micro_batch_size=batch_size // (cfg.replicas * mb),
        schedule=cfg.schedule,
        chunks_per_rank=v,
        stages=tuple(stages),
        prediction=prediction,
        optimizer=profile.optimizer,
        profile_mode=profile.mode,
        device=profile.device,
        layout=cfg.layout,
        notes=notes,
    )


def batch_statistics_note(norms: list[str], samples: int, micro_batches: int) -> str:
    """What a pipeline changes in a model that normalizes over the batch ([Note: batch statistics] in
    capture/batch_stats.py), and the fix."""
    named = ", ".join(norms[:3]) + (f" and {len(norms) - 3} more" if len(norms) > 3 else "")
    one = len(norms) == 1
    return (
        f"{len(norms)} batch norm{'' if one else 's'} ({named}) normalize{'s' if one else ''} each micro-batch "
        f"of {samples} sample{'s' if samples != 1 else ''} on its own, not the replica's "
        f"{samples * micro_batches}, and update{'s' if one else ''} running statistics {micro_batches} times a "
        "step: training differs from plain Lightning. "
        "To train the same, pass micro_batches=1 (no overlap between stages), or normalize per sample "
        "(GroupNorm, LayerNorm)"
    )


def memory_table(ev: Evaluation) -> str:
    """Per-stage memory table (params / grads / optimizer / activations / total vs limit) of ``ev``."""
    # An interleaved chunk is judged alone ([Note: a rank's chunks] in ranks.py): its bound, then its share.
    head: tuple[str, ...] = ("stage", "blocks", "params", "grads", "optimizer", "activations", "transient", "total",
                             "limit", "")
    if ev.config.chunks > 1:
        head = (*head[:7], "alone", "share at peak", *head[8:])
    rows = []
    stages = list(ev.stages)
    over = [s for s in stages if not s.fits]
    shown = stages if len(stages) <= _MAX_ROWS else sorted(over or stages, key=lambda s: -s.bound_bytes)
    shown = sorted(shown[:_MAX_ROWS], key=lambda s: s.index)
    for s in shown:
        rows.append(
            (
                str(s.index),
                f"{s.block_start}..{s.block_end - 1}",
                format_bytes(s.param_bytes),
                format_bytes(s.grad_bytes),
                format_bytes(s.optimizer_bytes),
                format_bytes(s.activation_bytes + s.buffer_bytes),
                format_bytes(s.transient_bytes),
                format_bytes(s.bound_bytes),
                *([format_bytes(s.memory_bytes)] if ev.config.chunks > 1 else []),
                format_bytes(s.limit_bytes),
                "OVER" if not s.fits else "ok",
            )
        )
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
    lines = ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in [head, *rows]]
    if len(shown) < len(stages):
        lines.append(f"... {len(stages) - len(shown)} more stages not shown (the largest ones are listed)")
    return "\n".join(lines)


def infeasible_error(
    profile: ModelProfile, tables: CostTables, batch_size: int, ev: Evaluation | None, plan: Plan | None
) -> PlanError:
    """The PlanError for 'nothing fits', naming the closest plan and what to change."""
    cl = tables.cluster
    fix = _fix_advice(tables, profile.optimizer)
    head = (
        f"no plan for {profile.model} fits in {format_bytes(cl.usable_memory_bytes)} usable memory per device "
        f"({format_bytes(cl.device_memory_bytes)} with {cl.memory_reserve:.0%} reserved) at global batch "
        f"{batch_size} on {cl.world_size} devices ({cl.nodes} x {cl.devices_per_node})"
    )
    if ev is None:
        return PlanError(f"{head}; even one block does not fit: {fix}")
    cfg = ev.config
    worst = max(ev.stages, key=lambda s: s.bound_bytes / max(1, s.limit_bytes))
    mbs = batch_size // (cfg.replicas * cfg.micro_batches)
    msg = (
        f"{head}.\nClosest plan: {cfg.stages} stage(s) x {cfg.replicas} replica(s), {cfg.micro_batches} "
        f"micro-batch(es) of {mbs} sample(s), {cfg.schedule}; stage {worst.index} needs "
        f"{format_bytes(worst.bound_bytes)} > {format_bytes(worst.limit_bytes)}.\n"
        f"{memory_table(ev)}\nTo fix: {fix}."
    )
    return PlanError(msg, closest=plan)


def _fix_advice(tables: CostTables, optimizer: str) -> str:
    """What to change, from what does not fit: the model state itself, or the activations of the batch."""
    cl = tables.cluster
    state = tables.params[-1] + tables.grads[-1] + tables.optim[-1]
    need = -(-state // max(1, cl.usable_memory_bytes))
    advice = []
    if need > cl.world_size:
        advice.append(
            f"parameters, gradients and optimizer state alone take {format_bytes(state)}, which needs at least "
            f"{need} devices of this size (this cluster has {cl.world_size}): add devices or use larger ones"
        )
    else:
        advice.append(
            "the activations of one micro-batch do not fit next to the model state: lower the batch size, "
            "allow activation checkpointing, or add devices"
        )
    if tables.optim[-1] > 0:
        advice.append(
            f"an optimizer with less state than {optimizer!r} (e.g. 'sgd') saves {format_bytes(tables.optim[-1])}"
        )
    return "; ".join(advice)


def mixing_note(mixed: list[str]) -> str:
    """What a model whose forward or steps mix samples does, in a phrase (``mixed``: places as
    ``mixed_samples`` in capture/batch_stats.py and ``step_flow`` in profile/step_checks.py name them)."""
    steps = ("training_step", "validation_step", "test_step")
    where = {next((s for s in steps if m.startswith(f"{s}: ")), "the forward") for m in mixed}
    who = " and ".join(w for w in ("the forward", *steps) if w in where)
    places = [m.split(": ", 1)[1] if m.split(": ", 1)[0] in steps else m for m in mixed]
    shown = "; ".join(places[:2]) + (f" and {len(places) - 2} more" if len(places) > 2 else "")
    verb = "combine" if len(where) > 1 else "combines"
    return f"{who} {verb} samples of the batch into one value ({shown})"


def growth_note(growth: float) -> str:
    """What a training step whose loss grows with its samples does, in a phrase (``growth``: ``loss_growth`` in
    profile/step_checks.py)."""
    return (
        f"training_step's loss on one sample repeated twice is {growth:.3g} times its loss on the sample once "
        "(neither a mean over samples nor a sum)"
    )


def transformed_note(origin: str) -> str:
    """What a training step whose loss transforms a statistic of the batch does, in a phrase (``origin``: where,
    as ``loss_transformed`` in profile/step_checks.py names it)."""
    operation = origin.split(": ", 1)[-1]  # "training_step: sqrt"
    return (
        f"training_step's loss transforms a statistic of the whole batch by {operation!r} (not a sum or mean of its "
        "samples' terms)"
    )


def single_reasons(meta: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Why a profile's model needs one micro-batch per replica, as (what it does, what micro-batches would do,
    the fix besides micro_batches=1): samples mixed ([Note: values that mix samples] in capture/batch_stats.py),
    a loss that grows with its samples ([Note: a loss that grows] in profile/step_checks.py)."""
    reasons = []
    if mixed := meta.get("batch_mixing"):
        reasons.append((
            mixing_note(mixed),
            "each micro-batch would see only its own samples (a sample scored against its micro-batch's alone, "
            "a statistic of the batch taken over a micro-batch)",
            "compute that value outside the pipelined step",
        ))  # fmt: skip
    if origin := meta.get("loss_transformed"):
        reasons.append((
            transformed_note(origin),
            "the pipeline averages its micro-batches' losses, and the mean of that transformation over micro-batches "
            "is not its value over the batch (a root-mean-square, a ratio of two sums, a variance)",
            "apply it per sample and average (a mean over the batch's samples), or minimize the statistic itself "
            "(the mean squared error, not its square root)",
        ))  # fmt: skip
    if (growth := meta.get("loss_growth")) is not None:
        reasons.append((
            growth_note(growth),
            "the pipeline averages its micro-batches' losses (or adds them, for a sum over samples), and neither "
            "gives this loss of the whole batch",
            "make it a mean over the batch's samples (reduction='mean') or a sum (reduction='sum')",
        ))  # fmt: skip
    return reasons


def one_micro_batch(reasons: list[tuple[str, str, str]], requested: int | None) -> int:
    """1, the micro-batches per replica of a model with ``reasons`` (:func:`single_reasons`); ConfigError, with
    the fix, where ``requested`` is more."""
    if requested is not None and requested > 1:
        what, effect, fix = reasons[0]
        raise ConfigError(
            f"micro_batches={requested}, but {what}: {effect}, and training would differ from plain Lightning's. "
            "Pass micro_batches=1 (or leave it unset: each replica then computes on its whole share, as DDP does), "
            f"or {fix}"
        )
    return 1
