"""Pictures of a plan: the simulated pipeline timeline of one replica and the per-stage memory bars.

The timeline comes from :func:`simulate_schedule`, a pure function that plays each rank's actions of the
plan's schedule in order against the plan's per-stage forward/backward times. matplotlib (the ``plot`` extra)
is imported only when drawing, and only its Agg canvas is used, so no display and no global backend change.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

from lightning_autopart.errors import ConfigError
from lightning_autopart.plan import Plan
from lightning_autopart.plan.report import stages_by_rank

__all__ = ["ScheduleEvent", "draw_memory", "draw_timeline", "schedule_order", "simulate_schedule"]


class ScheduleEvent(NamedTuple):
    """One forward or backward of one micro-batch on one (virtual) stage, with its simulated interval."""

    #: Virtual stage index; it runs on pipeline rank ``stage % (num_stages // chunks_per_rank)``.
    stage: int
    #: "F" (forward) or "B" (backward, recompute included).
    kind: str
    #: Micro-batch index.
    microbatch: int
    #: Start, microseconds from the beginning of the step.
    start_us: float
    #: End, microseconds from the beginning of the step.
    end_us: float


#: One action of a rank's program: (kind, virtual stage, micro-batch).
Action = tuple[str, int, int]


def schedule_order(
    schedule: str, num_ranks: int, micro_batches: int, chunks_per_rank: int = 1
) -> list[list[Action]]:
    """The actions each pipeline rank runs, in order, for ``"GPipe"``, ``"1F1B"`` or ``"Interleaved1F1B"``.

    GPipe runs all forwards, then all backwards. 1F1B runs ``num_ranks - rank - 1`` warm-up forwards, then
    alternates one forward and one backward, then drains the remaining backwards. Interleaved1F1B follows
    ``torch.distributed.pipelining.ScheduleInterleaved1F1B``: micro-batches go in rounds of ``group =
    micro_batches // max(1, micro_batches // num_ranks)`` through chunk 0, then chunk 1, ...; the warm-up is
    ``(chunks - 1) group + 2 (num_ranks - 1 - rank)`` forwards; backwards visit the chunks in reverse.
    Virtual stage ``c * num_ranks + rank`` is chunk ``c`` of rank ``rank``.
    """
    p, m, c = num_ranks, micro_batches, chunks_per_rank
    if c > 1 and schedule != "Interleaved1F1B":
        raise ConfigError(f"{schedule} runs one chunk per rank, got chunks_per_rank={c}; use Interleaved1F1B")
    if schedule in ("GPipe", "1F1B"):
        orders = []
        for r in range(p):
            fwd = [("F", r, k) for k in range(m)]
            bwd = [("B", r, k) for k in range(m)]
            warmup = m if schedule == "GPipe" else min(p - r - 1, m)
            orders.append(_one_f_one_b(fwd, bwd, warmup))
        return orders
    if schedule == "Interleaved1F1B":
        rounds = max(1, m // p)
        group = -(-m // rounds)  # micro-batches per round (torch requires m % rounds == 0; we round up)
        seq = [
            (chunk, k) for g in range(0, m, group) for chunk in range(c) for k in range(g, min(g + group, m))
        ]
        orders = []
        for r in range(p):
            fwd = [("F", chunk * p + r, k) for chunk, k in seq]
            bwd = [("B", (c - 1 - chunk) * p + r, k) for chunk, k in seq]
            warmup = min((c - 1) * group + 2 * (p - 1 - r), len(seq))
            orders.append(_one_f_one_b(fwd, bwd, warmup))
        return orders
    raise ConfigError(f"unknown schedule {schedule!r}; use GPipe, 1F1B or Interleaved1F1B")


def _one_f_one_b(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Action]:
    """``warmup`` forwards, then one forward and one backward in turn, then the remaining backwards."""
    order = fwd[:warmup]
    for i in range(len(fwd) - warmup):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[len(fwd) - warmup :]


def simulate_schedule(
    fwd_us: Sequence[float],
    bwd_us: Sequence[float],
    micro_batches: int,
    schedule: str = "1F1B",
    *,
    chunks_per_rank: int = 1,
    p2p_us: Sequence[float] | None = None,
) -> list[ScheduleEvent]:
    """Play :func:`schedule_order` against per-stage times; events sorted by start time.

    A forward of stage ``s`` starts when its rank is free and the forward of stage ``s - 1`` ended plus half of
    ``p2p_us[s - 1]`` (the activation send); a backward needs its own forward and the backward of ``s + 1``
    plus half of ``p2p_us[s + 1]`` (the gradient send). Idle time between boxes is the pipeline bubble.

    Args:
        fwd_us: Forward time of one micro-batch per (virtual) stage, microseconds.
        bwd_us: Backward time of one micro-batch per stage, microseconds.
        micro_batches: Micro-batches per step.
        schedule: ``"GPipe"``, ``"1F1B"`` or ``"Interleaved1F1B"``.
        chunks_per_rank: Virtual stages per rank (interleaved schedules).
        p2p_us: Point-to-point time per micro-batch charged to each stage (both directions); None: free.
    """
    stages = len(fwd_us)
    if len(bwd_us) != stages or stages == 0 or stages % chunks_per_rank:
        raise ConfigError(
            f"need one forward and one backward time per stage and a stage count divisible by chunks_per_rank; "
            f"got {stages} forward times, {len(bwd_us)} backward times, {chunks_per_rank} chunks per rank"
        )
    p2p = list(p2p_us) if p2p_us is not None else [0.0] * stages
    ranks = stages // chunks_per_rank
    orders = schedule_order(schedule, ranks, micro_batches, chunks_per_rank)
    done: dict[Action, float] = {}
    free = [0.0] * ranks
    position = [0] * ranks
    events: list[ScheduleEvent] = []
    while len(events) < 2 * stages * micro_batches:
        progressed = False
        for r in range(ranks):
            while position[r] < len(orders[r]):
                kind, s, k = orders[r][position[r]]
                if kind == "F":
                    deps = [(("F", s - 1, k), p2p[s - 1] / 2)] if s > 0 else []
                else:
                    deps = [(("F", s, k), 0.0)]
                    deps += [(("B", s + 1, k), p2p[s + 1] / 2)] if s < stages - 1 else []
                if any(d not in done for d, _ in deps):
                    break
                start = max([free[r]] + [done[d] + delay for d, delay in deps])
                end = start + (fwd_us[s] if kind == "F" else bwd_us[s])
                done[(kind, s, k)] = free[r] = end
                events.append(ScheduleEvent(s, kind, k, start, end))
                position[r] += 1
                progressed = True
        if not progressed:  # a schedule order that waits on itself: a bug in schedule_order
            waiting = {r: orders[r][position[r]] for r in range(ranks) if position[r] < len(orders[r])}
            raise RuntimeError(
                f"{schedule} with {ranks} ranks and {micro_batches} micro-batches deadlocks: {waiting}"
            )
    return sorted(events, key=lambda e: (e.start_us, e.stage))


def plan_events(plan: Plan) -> list[ScheduleEvent]:
    """:func:`simulate_schedule` for one pipeline (one data-parallel replica) of ``plan``."""
    return simulate_schedule(
        [s.fwd_us for s in plan.stages],
        [s.bwd_us for s in plan.stages],
        plan.micro_batches,
        plan.schedule,
        chunks_per_rank=plan.chunks_per_rank,
        p2p_us=[s.p2p_us for s in plan.stages],
    )


def draw_timeline(plan: Plan, path: str | os.PathLike[str], *, memory: bool = True) -> None:
    """Draw the simulated timeline of one pipeline of ``plan`` (and, below it, the memory bars) to ``path``.

    Rows are the pipeline's ranks (stage 0 on top); boxes are forwards (solid) and backwards (hatched),
    coloured by micro-batch; grey boxes at the end are the gradient all-reduce; gaps are the bubble.
    """
    figure_cls, canvas_cls = _matplotlib()
    ranks = plan.num_stages // plan.chunks_per_rank
    fig = figure_cls(figsize=(12, 1.6 + 0.45 * ranks + (3.2 if memory else 0.0)), layout="constrained")
    canvas_cls(fig)
    if memory:
        top, bottom = fig.subplots(2, 1, height_ratios=[1.2 + 0.45 * ranks, 3.2])
        _draw_timeline(top, plan)
        _draw_memory(bottom, plan)
    else:
        _draw_timeline(fig.subplots(), plan)
    _save(fig, path)


def draw_memory(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Draw per-stage memory as stacked bars (params, grads, optimizer, activations) against the device limit."""
    figure_cls, canvas_cls = _matplotlib()
    fig = figure_cls(figsize=(max(6.0, 1.0 + 0.6 * plan.num_stages), 4.0), layout="constrained")
    canvas_cls(fig)
    _draw_memory(fig.subplots(), plan)
    _save(fig, path)


def _draw_timeline(ax: Any, plan: Plan) -> None:
    from matplotlib import colormaps
    from matplotlib.patches import Patch

    ranks = plan.num_stages // plan.chunks_per_rank
    events = plan_events(plan)
    cmap = colormaps["tab20" if plan.micro_batches <= 20 else "viridis"]
    colours = [
        cmap(k % 20 if plan.micro_batches <= 20 else k / max(1, plan.micro_batches - 1))
        for k in range(plan.micro_batches)
    ]
    for kind, hatch in (("F", None), ("B", "///")):
        chosen = [e for e in events if e.kind == kind]
        ax.barh(
            [e.stage % ranks for e in chosen],
            [(e.end_us - e.start_us) / 1000 for e in chosen],
            left=[e.start_us / 1000 for e in chosen],
            height=0.8,
            color=[colours[e.microbatch] for e in chosen],
            edgecolor="black",
            linewidth=0.4,
            hatch=hatch,
        )
    end_ms = max(e.end_us for e in events) / 1000
    label_boxes = len(events) <= 400
    for e in events if label_boxes else ():
        width = (e.end_us - e.start_us) / 1000
        if width > end_ms / 60:
            ax.text(
                e.start_us / 1000 + width / 2,
                e.stage % ranks,
                str(e.microbatch),
                ha="center",
                va="center",
                fontsize=7,
            )
    for r in range(ranks):
        last = max(e.end_us for e in events if e.stage % ranks == r) / 1000
        reduce_ms = max(s.allreduce_us for s in plan.stages[r::ranks]) / 1000
        ax.barh(r, reduce_ms, left=last, height=0.8, color="0.7", edgecolor="black", linewidth=0.4)
    ax.set_yticks(range(ranks), [_row_label(plan, r, ranks) for r in range(ranks)], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    step = max(e.end_us for e in events) / 1000
    ax.set_title(
        f"{plan.schedule}: {ranks} pipeline ranks, {plan.micro_batches} micro-batches of {plan.micro_batch_size} "
        f"(one of {plan.replicas} replicas); simulated {step:,.1f} ms + all-reduce, "
        f"predicted step {plan.prediction.step_us / 1000:,.1f} ms",
        fontsize=9,
    )
    ax.legend(
        handles=[
            Patch(facecolor="white", edgecolor="black", label="forward"),
            Patch(facecolor="white", edgecolor="black", hatch="///", label="backward"),
            Patch(facecolor="0.7", edgecolor="black", label="all-reduce"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )


def _row_label(plan: Plan, row: int, ranks: int) -> str:
    held = plan.stages[row::ranks]
    names = ",".join(str(s.index) for s in held)
    return f"stage {names}\nrank {min(held[0].ranks)}"


def _draw_memory(ax: Any, plan: Plan) -> None:
    groups = stages_by_rank(plan)
    x = list(range(len(groups)))
    fields = {"params": "param_bytes", "grads": "grad_bytes", "optimizer": "optimizer_bytes"}
    fields["activations"] = "activation_bytes"
    fields["batch & I/O"] = "io_bytes"
    parts = {name: [sum(getattr(s, f) for s in held) for held in groups] for name, f in fields.items()}
    totals = [sum(s.memory_bytes for s in held) for held in groups]
    parts["other"] = [max(0, t - sum(p[i] for p in parts.values())) for i, t in enumerate(totals)]
    bottom = [0.0] * len(x)
    for (name, values), colour in zip(parts.items(), ("C0", "C1", "C2", "C3", "C4", "C7"), strict=True):
        gb = [v / 1e9 for v in values]
        if any(gb) or name != "other":
            ax.bar(x, gb, bottom=bottom, color=colour, label=name, width=0.7)
        bottom = [b + g for b, g in zip(bottom, gb, strict=True)]
    c = plan.cluster
    ax.axhline(
        c.device_memory_bytes / 1e9,
        color="red",
        linewidth=1.2,
        label=f"device memory {c.device_memory_bytes / 1e9:.1f} GB",
    )
    ax.axhline(
        c.usable_memory_bytes / 1e9,
        color="red",
        linewidth=0.8,
        linestyle="--",
        label="usable (after reserve)",
    )
    ax.set_xticks(x, [",".join(str(s.index) for s in held) for held in groups])
    ax.set_xlabel("stage" if plan.chunks_per_rank == 1 else "stages held by one device")
    ax.set_ylabel("GB per device")
    ax.set_ylim(0, max(max(bottom), c.device_memory_bytes / 1e9) * 1.08)
    ax.set_title(f"Predicted memory per device (optimizer {plan.optimizer})", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)


def _matplotlib() -> tuple[Any, Any]:
    """matplotlib's Figure and Agg canvas classes, or a ConfigError saying how to install matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError(
            "drawing plans needs matplotlib, which is not installed; "
            "pip install 'lightning_autopart[plot]' (or matplotlib)"
        ) from None
    return Figure, FigureCanvasAgg


def _save(fig: Any, path: str | os.PathLike[str]) -> None:
    try:
        fig.savefig(os.fspath(path), dpi=120)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot write picture {os.fspath(path)}: {err}") from None
