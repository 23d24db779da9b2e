"""The plan as rich tables: per-stage blocks, ranks and times, per-device memory, and the predicted step; and the
progress of profiling, as ``autopart plan`` shows it."""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from lightning_autopart.cluster import format_bytes
from lightning_autopart.plan import Plan, StagePlan

__all__ = [
    "format_count",
    "format_ms",
    "format_plan",
    "format_ranks",
    "print_plan",
    "profiling_progress",
    "stages_by_rank",
]

#: Widest the plan tables get; they fit a 120-column terminal and CI logs.
WIDTH = 120
#: Set in every process mpirun starts (Open MPI; MPICH and Intel MPI's Hydra).
_MPI_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK")


def format_plan(plan: Plan) -> RenderableType:
    """The plan as a rich renderable: a title, a stage table, a memory table and a summary of the step."""
    return Group(_title(plan), _stage_table(plan), _memory_table(plan), _summary(plan))


def print_plan(plan: Plan, console: Console | None = None) -> None:
    """Print :func:`format_plan` to ``console`` (default: stdout, 120 columns when it is not a terminal).

    Under mpirun, stdout is a pseudo-terminal of 80 columns that mpirun copies into its own output (a log, most
    often): it is printed as to a file, 120 columns and no colour codes, not squeezed into 80."""
    if console is None:
        console = Console(file=sys.stdout)
        if not console.is_terminal or any(os.environ.get(v) for v in _MPI_RANK_VARIABLES):
            console = Console(file=sys.stdout, width=WIDTH, force_terminal=False)
    console.print(format_plan(plan))


def _title(plan: Plan) -> Text:
    fp = plan.fingerprint
    c = plan.cluster
    params = fp.get("param_count")
    blocks = fp.get("blocks")
    what = [f"{params:,} parameters" if isinstance(params, int) else None]
    what.append(f"{len(blocks)} blocks" if isinstance(blocks, list) else None)
    nodes = f"{c.nodes} nodes" if c.nodes > 1 else "1 node"
    title = Text.assemble(
        ("Plan for ", "bold"),
        (str(fp.get("model", "?")), "bold cyan"),
        f" ({', '.join(w for w in what if w)})" if any(what) else "",
        f" on {nodes} × {c.devices_per_node} {c.device} ({format_bytes(c.device_memory_bytes)} each)",
    )
    return title


def _stage_table(plan: Plan) -> Table:
    mb = plan.micro_batch_size
    ranks = plan.num_stages // plan.chunks_per_rank
    virtual = f"; stage s runs on the ranks of stage s mod {ranks}" if plan.chunks_per_rank > 1 else ""
    table = Table(
        title=f"Stages (ms per {mb}-sample micro-batch; all-reduce, optimizer per step{virtual})",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("Stage", justify="right")
    table.add_column("Blocks", justify="right", no_wrap=True)
    table.add_column("Names", max_width=28, overflow="ellipsis", no_wrap=True)
    table.add_column("Params", justify="right")
    table.add_column("Replicas × ranks", no_wrap=True)
    table.add_column("Ckpt", justify="center")
    table.add_column("Fwd", justify="right")
    table.add_column("Bwd", justify="right")
    table.add_column("P2P", justify="right")
    table.add_column("All-reduce", justify="right")
    table.add_column("Optim", justify="right")
    slowest = max(s.fwd_us + s.bwd_us for s in plan.stages)
    for s in plan.stages:
        bottleneck = s.fwd_us + s.bwd_us == slowest and plan.num_stages > 1
        table.add_row(
            str(s.index),
            _block_range(s),
            _block_names(s.blocks),
            format_count(s.param_count),
            f"{s.replicas} × {format_ranks(s.ranks)}",
            "yes" if s.checkpoint else "no",
            Text(format_ms(s.fwd_us), style="bold" if bottleneck else ""),
            Text(format_ms(s.bwd_us), style="bold" if bottleneck else ""),
            format_ms(s.p2p_us),
            format_ms(s.allreduce_us),
            format_ms(s.optimizer_us),
        )
    return table


def _memory_table(plan: Plan) -> Table:
    c = plan.cluster
    table = Table(
        title=f"Memory per device (optimizer {plan.optimizer}; {format_bytes(c.usable_memory_bytes)} usable of "
        f"{format_bytes(c.device_memory_bytes)}, {c.memory_reserve:.0%} kept free)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("Stage" if plan.chunks_per_rank == 1 else "Stages", justify="right")
    for name in ("Params", "Grads", "Optimizer", "Activations", "Transient", "Batch+I/O", "Total"):
        table.add_column(name, justify="right")
    table.add_column("In flight", justify="right")
    table.add_column(f"Of {format_bytes(c.device_memory_bytes)}", no_wrap=True)
    for held in stages_by_rank(plan):
        total = sum(s.memory_bytes for s in held)
        table.add_row(
            ",".join(str(s.index) for s in held),
            *(format_bytes(sum(getattr(s, f) for s in held)) for f in _MEMORY_PARTS),
            Text(format_bytes(total), style=_memory_style(total, c.usable_memory_bytes)),
            "+".join(str(s.in_flight) for s in held),
            _bar(total, c.device_memory_bytes),
        )
    return table


def stages_by_rank(plan: Plan) -> list[tuple[StagePlan, ...]]:
    """The stages each device of a pipeline holds: one each, or ``chunks_per_rank`` with interleaving."""
    ranks = max(1, plan.num_stages // plan.chunks_per_rank)
    return [plan.stages[r::ranks] for r in range(ranks)]


#: StagePlan fields that add up to a device's memory, in table order.
_MEMORY_PARTS = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "transient_bytes", "io_bytes")


def _summary(plan: Plan) -> Table:
    p = plan.prediction
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    chunks = f", {plan.chunks_per_rank} chunks per rank" if plan.chunks_per_rank > 1 else ""
    grid.add_row(
        "Schedule",
        f"{plan.schedule}{chunks}: {plan.num_stages} stage{'s' if plan.num_stages != 1 else ''} × "
        f"{plan.replicas} replica{'s' if plan.replicas != 1 else ''} on {plan.world_size} ranks ({plan.layout})",
    )
    grid.add_row(
        "Batch",
        f"{plan.batch_size} = {plan.micro_batches} micro-batches × {plan.micro_batch_size} sample{'s' if plan.micro_batch_size != 1 else ''} × "
        f"{plan.replicas} replica{'s' if plan.replicas != 1 else ''}",
    )
    search = plan.notes.get("search")
    if isinstance(search, dict) and "configs" in search:
        grid.add_row(
            "Search", f"{search['configs']:,} configurations in {1000 * search.get('seconds', 0.0):,.1f} ms"
        )
    parts = [
        ("compute", p.compute_us),
        ("bubble", p.bubble_us),
        ("p2p", p.p2p_us),
        ("all-reduce", p.allreduce_us),
        ("optimizer", p.optimizer_us),
        *([("host", p.host_us)] if p.host_us else []),
        *([("data", p.data_us)] if p.data_us else []),
    ]
    shares = " + ".join(f"{name} {format_ms(us)}{_share(us, p.step_us)}" for name, us in parts)
    grid.add_row("Step time", Text.assemble((f"{format_ms(p.step_us)} ms", "bold"), f" = {shares}"))
    grid.add_row("Throughput", f"{p.samples_per_s:,.1f} samples/s")
    usable = plan.cluster.usable_memory_bytes
    grid.add_row(
        "Peak memory",
        Text.assemble(
            (format_bytes(p.peak_memory_bytes), _memory_style(p.peak_memory_bytes, usable)),
            f" per device, {_share(p.peak_memory_bytes, plan.cluster.device_memory_bytes, bare=True)} of "
            f"{format_bytes(plan.cluster.device_memory_bytes)}",
        ),
    )
    grid.add_row("Profile", f"{plan.profile_mode} on {plan.device}; schema version {plan.schema_version}")
    titles = (("checkpointing", "Checkpointing"), ("batch_statistics", "Batch norm"), ("batch_mixing", "Batch"),
              ("loss_growth", "Loss"), ("loss_transformed", "Loss"), ("log_transformed", "Logged"))  # fmt: skip
    for key, title in titles:
        if isinstance(plan.notes.get(key), str):
            grid.add_row(title, plan.notes[key])
    notes = [
        f"{k}={v}"
        for k, v in sorted(plan.notes.items())
        if k not in {key for key, _ in titles}
        and (isinstance(v, int | float | bool) or (isinstance(v, str) and len(v) <= 40))
    ]
    if notes:
        grid.add_row("Notes", ", ".join(notes))
    return grid


def format_count(n: int) -> str:
    """A parameter count in three significant digits: 1.05M, 2.50B, 512."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.3g}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return str(n)


def format_ms(us: float) -> str:
    """Microseconds as milliseconds with a precision that suits the size: 0.05, 27.52, 437.8, 1,234."""
    ms = us / 1000.0
    if ms == 0:
        return "0"
    if ms < 0.01:
        return "<0.01"
    if ms < 10:
        return f"{ms:.2f}"
    if ms < 1000:
        return f"{ms:.1f}"
    return f"{ms:,.0f}"


def format_ranks(ranks: Sequence[int]) -> str:
    """Ranks in short form: "0-7" (consecutive), "0,4,8,12" (four or fewer), "0,2,…,14", "0,1,3,…,15"."""
    r = sorted(ranks)
    if len(r) <= 2:
        return ",".join(map(str, r))
    step = r[1] - r[0]
    even = all(b - a == step for a, b in itertools.pairwise(r))
    if even and step == 1:
        return f"{r[0]}-{r[-1]}"
    if len(r) <= 4:
        return ",".join(map(str, r))
    head = r[:2] if even else r[:3]
    return ",".join(map(str, head)) + f",…,{r[-1]}"


def _block_range(s: StagePlan) -> str:
    last = s.block_end - 1
    return str(s.block_start) if last == s.block_start else f"{s.block_start}-{last}"


def _block_names(names: Sequence[str]) -> str:
    def short(name: str) -> str:
        return name if len(name) <= 15 else "…" + name[-14:]

    if not names:
        return ""
    if len(names) == 1:
        return names[0] if len(names[0]) <= 34 else "…" + names[0][-33:]
    return f"{short(names[0])} .. {short(names[-1])}"


def _memory_style(used: int, usable: int) -> str:
    if used > usable:
        return "bold red"
    return "yellow" if used > 0.9 * usable else "green"


def _bar(used: int, limit: int, width: int = 10) -> Text:
    fraction = used / limit if limit else 0.0
    filled = min(width, round(fraction * width))
    style = "red" if fraction > 1 else "cyan"
    return Text.assemble(("█" * filled, style), ("░" * (width - filled), "dim"), f" {fraction:4.0%}")


def _share(part: float, whole: float, *, bare: bool = False) -> str:
    if whole <= 0:
        return ""
    share = f"{part / whole:.0%}"
    return share if bare else f" ({share})"


@contextmanager
def profiling_progress(console: Console) -> Iterator[Any]:
    """A rich progress bar driven by ``progress(done, total, block_name)`` callbacks; shown from the first call."""
    bar = Progress(
        TextColumn("profiling {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    task: list[Any] = []
    start = time.perf_counter()

    def update(done: int, total: int, name: str) -> None:
        if not task:
            if console.is_terminal:  # a live bar only where it can redraw itself; a CI log gets the summary
                bar.start()
            task.append(bar.add_task(name, total=total))
        bar.update(task[0], completed=done, total=total, description=name)

    try:
        yield update
    finally:
        if task and console.is_terminal:
            bar.stop()
    blocks = int(bar.tasks[0].total or 0) if task else 0
    console.print(
        f"profiled {blocks} blocks in {time.perf_counter() - start:.1f} s", style="dim", highlight=False
    )
