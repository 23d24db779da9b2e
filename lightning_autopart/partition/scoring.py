"""Score a given partition under the cost model of :mod:`.cost`: per-stage costs, step time, bottleneck, peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from lightning_autopart.cluster import Cluster
from lightning_autopart.errors import ConfigError
from lightning_autopart.partition.configs import shares_for
from lightning_autopart.partition.cost import (
    CHUNKS,
    Config,
    CostTables,
    StageCost,
    check_config,
    config_costs,
    stage_cost,
)
from lightning_autopart.partition.placement import LAYOUTS
from lightning_autopart.partition.ranks import share_rank_peaks
from lightning_autopart.profile.records import ModelProfile

__all__ = ["Evaluation", "evaluate", "evaluate_config", "share_rank_peaks"]


@dataclass(frozen=True, slots=True)
class Evaluation:
    """A scored partition: its configuration, boundaries, per-stage costs and step time."""

    config: Config
    boundaries: tuple[int, ...]
    stages: tuple[StageCost, ...]
    fits: bool
    step_us: float
    #: Index of the stage with the largest term (the bottleneck).
    bottleneck: int
    #: Largest memory of one device (sum of the chunks it holds).
    peak_memory_bytes: int

    @property
    def max_excess(self) -> float:
        """Largest ``memory / limit`` over stages as feasibility judges it (> 1 means it does not fit)."""
        return max(s.bound_bytes / max(1, s.limit_bytes) for s in self.stages)


def evaluate_config(
    tables: CostTables, cfg: Config, batch_size: int, boundaries: tuple[int, ...], checkpointing: bool = True
) -> Evaluation:
    """Score ``boundaries`` (``0 = b_0 < b_1 < ... < b_V = L``) under a valid ``cfg``, fitting or not."""
    cc = config_costs(tables, cfg, batch_size, checkpointing)
    stages = tuple(
        stage_cost(tables, cc, k, boundaries[k], boundaries[k + 1]) for k in range(len(boundaries) - 1)
    )
    if cfg.chunks > 1:
        stages = share_rank_peaks(cfg, stages, tables.tied)
    bottleneck = max(range(len(stages)), key=lambda k: stages[k].term_us)
    per_rank = [0] * cfg.stages
    for st in stages:
        per_rank[st.index % cfg.stages] += st.memory_bytes
    return Evaluation(
        config=cfg,
        boundaries=tuple(boundaries),
        stages=stages,
        fits=all(s.fits for s in stages),
        step_us=stages[bottleneck].term_us,
        bottleneck=bottleneck,
        peak_memory_bytes=max(per_rank),
    )


def evaluate(
    profile: ModelProfile,
    cluster: Cluster,
    batch_size: int,
    boundaries: list[int] | tuple[int, ...],
    replicas: int,
    micro_batches: int,
    schedule: str,
    layout: str | None = None,
    *,
    checkpointing: bool = True,
    tables: CostTables | None = None,
) -> Evaluation | None:
    """Score any partition with the planner's cost model; None when it does not fit in memory.

    ``boundaries`` has ``V + 1`` entries from 0 to L (``V = stages * chunks``). With ``layout=None`` both layouts
    are scored and the faster one is returned. Raises ConfigError for an invalid configuration.
    """
    tables = tables if tables is not None else CostTables(profile, cluster)
    b = tuple(boundaries)
    n = tables.num_blocks
    if len(b) < 2 or b[0] != 0 or b[-1] != n or any(x >= y for x, y in pairwise(b)):
        raise ConfigError(f"boundaries must rise strictly from 0 to {n}, got {list(b)}")
    v = CHUNKS.get(schedule, 1)
    if (len(b) - 1) % v:
        raise ConfigError(f"{schedule} needs a multiple of {v} stages, got {len(b) - 1}")
    best: Evaluation | None = None
    for lay in (layout,) if layout is not None else LAYOUTS:
        for shares in shares_for(v):  # [Note: chunk shares] in tables.py
            cfg = Config(replicas, (len(b) - 1) // v, micro_batches, schedule, lay, shares)
            why = check_config(cfg, n, cluster.world_size, batch_size)
            if why is not None:
                raise ConfigError(f"invalid configuration: {why}")
            ev = evaluate_config(tables, cfg, batch_size, b, checkpointing)
            if ev.fits and (best is None or ev.step_us < best.step_us):
                best = ev
    return best
