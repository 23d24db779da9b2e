"""One point of the planner's outer search (replicas, stages, micro-batches, schedule, rank layout), the
schedule constraints of torch.distributed.pipelining that make it valid, and what a schedule keeps in flight."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from lightning_autopart.partition.placement import LAYOUTS
from lightning_autopart.plan import SCHEDULES

__all__ = [
    "CHUNKS",
    "SHARES",
    "Config",
    "check_config",
    "chunk_counts",
    "in_flight",
    "interleaved_moments",
    "shares_for",
]

#: Model chunks per rank for each schedule.
CHUNKS = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2}
#: How a rank's device is split among its chunks ([Note: chunk shares] in tables.py): equally, or in proportion
#: to what an average chunk with the chunk's in-flight micro-batches holds.
SHARES = ("even", "in-flight")


def shares_for(chunks: int) -> tuple[str, ...]:
    """The splits worth trying with ``chunks`` per rank: one chunk takes the whole device."""
    return SHARES if chunks > 1 else ("even",)


@dataclass(frozen=True, slots=True)
class Config:
    """One point of the outer search: replicas, pipeline depth, micro-batches, schedule and rank layout."""

    replicas: int
    stages: int
    micro_batches: int
    schedule: str
    layout: str = "pipeline-major"
    #: How a rank's device is split among its chunks (one of SHARES; one chunk per rank takes it all).
    shares: str = "even"

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
    def messages(self) -> int:
        """Micro-batches of each cut a chunk's messages keep: its receive buffers, and under Interleaved1F1B the
        sends torch's runtime waits on only at the step's end ([Note: pipeline buffers] in cost.py)."""
        return self.micro_batches if self.chunks == 1 else 2 * self.micro_batches - 1

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
    if cfg.shares not in SHARES:
        return f"unknown shares {cfg.shares!r}"
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


def in_flight(schedule: str, stages: int, position: int, micro_batches: int, chunk: int = 0) -> int:
    """Most micro-batches whose activations the stage at ``position`` (its ``chunk``-th model chunk) holds at
    once under ``schedule``; a single stage runs each micro-batch's forward and backward in turn (the
    runtime's [Note: one stage]). Interleaved: the chunk's most over the rank's backwards
    ([Note: interleaved in flight])."""
    if stages == 1:
        return 1
    if schedule == "GPipe":
        return micro_batches
    if schedule == "1F1B":
        return min(stages - position, micro_batches)
    return chunk_counts(stages, micro_batches, CHUNKS[schedule])[position][chunk]


@lru_cache(maxsize=4096)
def chunk_counts(stages: int, micro_batches: int, chunks: int) -> tuple[tuple[int, ...], ...]:
    """Per rank, per chunk: its most micro-batches in flight under Interleaved1F1B."""
    return tuple(
        tuple(max(held[c] for held, _, _ in interleaved_moments(stages, micro_batches, chunks, rank))
              for c in range(chunks))
        for rank in range(stages)
    )  # fmt: skip


@lru_cache(maxsize=256)
def interleaved_moments(
    stages: int, micro_batches: int, chunks: int, rank: int
) -> tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]:
    """At each backward of ``rank`` under torch's ScheduleInterleaved1F1B, in order: the micro-batches each of
    its chunks holds (the one backward runs on included), those each has finished, and the chunk it runs on.

    [Note: interleaved in flight] The order is torch's (``_get_1f1b_rank_ops`` with its warm-up, checked
    against torch in tests/unit/test_schedule_moments.py): rounds of ``R = M / max(1, M // S)`` micro-batches;
    forward ``f`` runs chunk ``(f // R) % v``, backward ``b`` chunk ``v - 1 - (b // R) % v``; ``w = min((v-1) R
    + 2 (S - 1 - rank), v M)`` forwards warm up, then each backward follows one more forward. A rank's
    activations peak at one of these moments. The chunks do not peak together: on 2 ranks x 2 chunks and 4
    micro-batches rank 0 holds (3, 2) then (4, 1) chunk micro-batches, at most 4 of chunk 0 and 2 of chunk 1,
    and 5 in all. The planner prices each chunk with its own most (a bound it can add up stage by stage);
    :func:`~lightning_autopart.partition.scoring.evaluate_config` reports the rank's true peak over these
    moments.
    """
    v, m = chunks, micro_batches
    per_round = m // max(1, m // stages)
    warmup = min((v - 1) * per_round + 2 * (stages - 1 - rank), v * m)
    held, done = [0] * v, [0] * v
    for f in range(warmup):
        held[(f // per_round) % v] += 1
    out = []
    for b in range(v * m):
        f = warmup + b
        if f < v * m:
            held[(f // per_round) % v] += 1
        c = v - 1 - (b // per_round) % v
        out.append((tuple(held), tuple(done), c))
        held[c] -= 1
        done[c] += 1
    return tuple(out)
