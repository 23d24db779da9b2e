"""The Plan: stages, replicas, ranks, micro-batches, schedule and predictions; the JSON boundary of planning.

Format and fields: docs/plan-format.md. A plan is immutable; ``save``/``load`` round-trip it exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_autopart.cluster import Cluster

__all__ = ["SCHEMA_VERSION", "SCHEDULES", "Plan", "Prediction", "StagePlan"]

#: Version of the plan file format; bumped on any incompatible change.
SCHEMA_VERSION = 1

#: Schedule names a plan may carry (names of torch.distributed.pipelining schedules without "Schedule").
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: a contiguous range of blocks, replicated on ``len(ranks)`` devices."""

    #: Stage index in pipeline order (with interleaving, the virtual stage index).
    index: int
    #: First block of the stage (inclusive).
    block_start: int
    #: One past the last block of the stage.
    block_end: int
    #: Names of the blocks, in order.
    blocks: tuple[str, ...]
    #: FQNs of the modules the stage instantiates.
    modules: tuple[str, ...]
    #: Global ranks holding a replica of this stage, one per data-parallel replica.
    ranks: tuple[int, ...]
    #: Whether activations are recomputed in backward (activation checkpointing).
    checkpoint: bool
    #: Parameter elements in the stage (tied parameters counted in every stage that holds a copy).
    param_count: int
    #: Forward time of one micro-batch, microseconds (recompute not included).
    fwd_us: float
    #: Backward time of one micro-batch, microseconds (recompute included when checkpointing).
    bwd_us: float
    #: Point-to-point time per micro-batch charged to this stage (send activations, send input gradients).
    p2p_us: float
    #: Gradient all-reduce time among the stage's replicas, once per step.
    allreduce_us: float
    #: Parameter bytes on one device.
    param_bytes: int
    #: Gradient bytes on one device.
    grad_bytes: int
    #: Optimizer-state bytes on one device.
    optimizer_bytes: int
    #: Activation bytes at peak (in-flight micro-batches of the schedule) on one device.
    activation_bytes: int
    #: Micro-batches whose activations the stage holds at peak under the schedule.
    in_flight: int
    #: Predicted peak memory on one device: params + grads + optimizer + activations + buffers.
    memory_bytes: int

    @property
    def replicas(self) -> int:
        """Number of data-parallel replicas of the stage."""
        return len(self.ranks)


@dataclass(frozen=True)
class Prediction:
    """Predicted time of one optimizer step (one global batch) and its parts, in microseconds."""

    #: Whole step.
    step_us: float
    #: Compute of the bottleneck stage over all micro-batches.
    compute_us: float
    #: Pipeline fill and drain (idle time of the bottleneck stage).
    bubble_us: float
    #: Point-to-point communication of the bottleneck stage not hidden by compute.
    p2p_us: float
    #: Gradient all-reduce at the end of the step.
    allreduce_us: float
    #: Global samples per second.
    samples_per_s: float
    #: Largest predicted per-device memory over all stages.
    peak_memory_bytes: int


@dataclass(frozen=True)
class Plan:
    """A complete partition plan for one model on one cluster at one global batch size."""

    #: What identifies the model: ``ModelProfile.fingerprint()``.
    fingerprint: dict[str, Any]
    #: The cluster the plan is for.
    cluster: Cluster
    #: Global batch size (samples per optimizer step over all replicas).
    batch_size: int
    #: Micro-batches per replica per step.
    micro_batches: int
    #: Samples in one micro-batch: batch_size / (replicas * micro_batches).
    micro_batch_size: int
    #: Schedule name, one of :data:`SCHEDULES`.
    schedule: str
    #: Model chunks per rank (1, or 2+ for interleaved schedules).
    chunks_per_rank: int
    #: Stages in pipeline order.
    stages: tuple[StagePlan, ...]
    #: Predicted step time and memory.
    prediction: Prediction
    #: Optimizer the memory figures assume.
    optimizer: str = "sgd"
    #: "measure" or "estimate": how the profile was taken.
    profile_mode: str = "estimate"
    #: Device the times refer to.
    device: str = "cpu"
    #: How ranks were laid out: "pipeline-major" (a pipeline's stages on consecutive ranks) or "stage-major".
    layout: str = "pipeline-major"
    #: Plan file schema version.
    schema_version: int = SCHEMA_VERSION
    #: Free-form notes from the planner (search statistics, why checkpointing was turned on, ...).
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        """Number of (virtual) pipeline stages."""
        return len(self.stages)

    @property
    def replicas(self) -> int:
        """Data-parallel replicas per stage (the same for every stage in schema version 1)."""
        return self.stages[0].replicas

    @property
    def world_size(self) -> int:
        """Ranks the plan uses."""
        return len({r for s in self.stages for r in s.ranks})

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (see docs/plan-format.md)."""
        return asdict(self)
