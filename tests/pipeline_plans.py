"""Hand-made plans for runtime tests: even block ranges, ranks laid out pipeline- or stage-major."""

from __future__ import annotations

from lightning_autopart.cluster import Cluster
from lightning_autopart.plan import Plan, Prediction, StagePlan

__all__ = ["make_plan"]


def make_plan(
    num_blocks: int,
    num_stages: int,
    replicas: int = 1,
    *,
    schedule: str = "GPipe",
    batch_size: int = 8,
    micro_batches: int = 2,
    layout: str = "pipeline-major",
    chunks_per_rank: int = 1,
) -> Plan:
    """A plan splitting ``num_blocks`` blocks evenly into ``num_stages`` stages of ``replicas`` replicas.

    With ``chunks_per_rank > 1`` the stages are interleaved: stage ``s`` of replica ``r`` runs on pipeline
    position ``s % (num_stages // chunks_per_rank)``.
    """
    positions = num_stages // chunks_per_rank
    world = positions * replicas

    def rank(stage: int, replica: int) -> int:
        p = stage % positions
        return replica * positions + p if layout == "pipeline-major" else p * replicas + replica

    stages = []
    for s in range(num_stages):
        start, end = s * num_blocks // num_stages, (s + 1) * num_blocks // num_stages
        stages.append(
            StagePlan(
                index=s,
                block_start=start,
                block_end=end,
                blocks=tuple(f"block{k}" for k in range(start, end)),
                modules=(),
                ranks=tuple(rank(s, r) for r in range(replicas)),
                checkpoint=False,
                param_count=0,
                fwd_us=1.0,
                bwd_us=2.0,
                p2p_us=0.0,
                allreduce_us=0.0,
                param_bytes=0,
                grad_bytes=0,
                optimizer_bytes=0,
                activation_bytes=0,
                in_flight=1,
                memory_bytes=0,
            )
        )
    return Plan(
        fingerprint={
            "model": "test",
            "param_count": 0,
            "blocks": [
                {"name": f"block{k}", "param_count": 0, "shapes_sha256": ""} for k in range(num_blocks)
            ],
        },
        cluster=Cluster(1, world, 10**10, 1e9, 1e9, 1e9, 1e9),
        batch_size=batch_size,
        micro_batches=micro_batches,
        micro_batch_size=batch_size // (replicas * micro_batches),
        schedule=schedule,
        chunks_per_rank=chunks_per_rank,
        stages=tuple(stages),
        prediction=Prediction(1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0),
        layout=layout,
    )
