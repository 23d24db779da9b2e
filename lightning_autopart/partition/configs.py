"""One point of the planner's outer search (replicas, stages, micro-batches, schedule, rank layout), the
schedule constraints of torch.distributed.pipelining that make it valid, and what a schedule keeps in flight."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_autopart.partition.placement import LAYOUTS
from lightning_autopart.plan import SCHEDULES

__all__ = ["CHUNKS", "Config", "check_config", "in_flight"]

#: Model chunks per rank for each schedule.
CHUNKS = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2}


@dataclass(frozen=True, slots=True)
class Config:
    """One point of the outer search: replicas, pipeline depth, micro-batches, schedule and rank layout."""

    replicas: int
    stages: int
    micro_batches: int
    schedule: str
    layout: str = "pipeline-major"

    @property
    def chunks(self) -> int:
        """Model chunks per rank (``v``)."""
        return CHUNKS[self.schedule]

    @property
    def pipelined(self) -> bool:
        """Whether a schedule runs the model's micro-batches as actions between stages (``V > 1``)."""
        return self.stages * self.chunks > 1

    @property
    def virtual_stages(self) -> int:
        """``V = S * v``."""
        return self.stages * CHUNKS[self.schedule]

    @property
    def ticks(self) -> int:
        """``K = v*M + S - 1``: clock ticks of one step."""
        return CHUNKS[self.schedule] * self.micro_batches + self.stages - 1


def check_config(cfg: Config, num_blocks: int, world_size: int, batch_size: int) -> str | None:
    """Why ``cfg`` is not a valid configuration (schedule constraints of torch.distributed.pipelining), or None."""
    r, s, mb = cfg.replicas, cfg.stages, cfg.micro_batches
    if cfg.schedule not in SCHEDULES:
        return f"unknown schedule {cfg.schedule!r}"
    if cfg.layout not in LAYOUTS:
        return f"unknown layout {cfg.layout!r}"
    if r < 1 or s < 1 or mb < 1:
        return "replicas, stages and micro-batches must be >= 1"
    if batch_size % r or (batch_size // r) % mb:
        return f"batch {batch_size} does not split into {r} replicas x {mb} micro-batches"
    if s * r > world_size:
        return f"{s} stages x {r} replicas need more than {world_size} devices"
    if cfg.virtual_stages > num_blocks:
        return f"{cfg.virtual_stages} virtual stages exceed {num_blocks} blocks"
    if s == 1 and cfg.schedule != "GPipe":
        return "a single stage runs only as GPipe (data parallel with gradient accumulation)"
    if cfg.schedule in ("1F1B", "Interleaved1F1B") and mb < s:
        return f"{cfg.schedule} needs micro-batches >= stages ({mb} < {s})"
    if cfg.schedule == "Interleaved1F1B" and mb % s:
        return f"Interleaved1F1B needs micro-batches divisible by stages ({mb} % {s} != 0)"
    return None


def in_flight(schedule: str, stages: int, position: int, micro_batches: int) -> int:
    """Micro-batches whose activations a stage (chunk) at ``position`` holds at peak under ``schedule``; a
    single stage runs each micro-batch's forward and backward in turn (the runtime's [Note: one stage])."""
    if stages == 1:
        return 1
    if schedule == "GPipe":
        return micro_batches
    if schedule == "1F1B":
        return min(stages - position, micro_batches)
    v = CHUNKS[schedule]
    # ceil((S - p) * (1 + (S - 1) / (S * v))) in exact integer arithmetic.
    held = -(-(stages - position) * (stages * v + stages - 1) // (stages * v))
    return min(micro_batches, held)
