"""While rank 0 plans on CPUs, the other ranks of its machine keep their cores busy, as they will in training.

[Note: planning under load] Rank 0 profiles the blocks and probes the host (gloo messages, per-action
bookkeeping) while the other ranks wait for the plan. On a GPU node that is how training runs too: each rank has
its own device. On CPUs the ranks of a machine share its cores, caches and memory bandwidth, and gloo's I/O
threads compete with the compute: on a 2-core machine a 2-stage MLP's stage computed 12.2 ms per step in
training against 9.3 ms profiled alone, and a gloo message took 5x longer with both cores busy. So, on CPUs,
the ranks of rank 0's machine compute (products and copies) until rank 0 is done, and the profile sees the
machine as training will. Rank 0 may also ask rank 1 to run the pipeline probe with it (see
[Note: pipeline probe] in :mod:`lightning_autopart.profile.pipeline_probe`): one broadcast command per probe,
then zeros when planning is over.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from lightning_autopart.cluster import Cluster
from lightning_autopart.profile.pipeline_probe import (
    COMMAND_SIZE,
    ProbeCommand,
    command_for,
    follow_probe,
    is_command,
    lead_probe,
    overhead_per_micro_batch,
    probe_workload,
    unit_us,
    with_overhead,
)
from lightning_autopart.profile.records import ModelProfile

__all__ = ["PlanningProbe", "planning_load"]

#: Side of the products and bytes of the copies of one unit of load (a few milliseconds on one core).
_SIDE = 256
_COPY_FLOATS = 1 << 20


def _applies(device: torch.device, measure: bool, world_size: int) -> bool:
    return device.type == "cpu" and measure and world_size > 1 and dist.is_available() and dist.is_initialized()


class PlanningProbe:
    """Rank 0's handle inside :func:`planning_load`: runs the pipeline probe with rank 1."""

    def __init__(self) -> None:
        #: What the last :meth:`tune` measured (recorded in the plan's notes): its micro-batch's math (us),
        #: message (bytes), the overhead per micro-batch beyond both (us) and the resulting ``action_us``.
        self.measured: dict[str, float] = {}

    def pipeline_overhead_us(self, slot_us: float, message_bytes: int) -> float:
        """Host time per micro-batch of a 2-stage pipeline whose micro-batches compute ``slot_us`` and send
        ``message_bytes``, beyond both (see [Note: pipeline probe])."""
        before = unit_us()
        command = command_for(slot_us, message_bytes, before)
        dist.broadcast(command.to_tensor(), src=0)
        step_us, own_math_us = lead_probe(command, peer=1)
        product_us = (before + unit_us()) / 2  # rank 1 loads again: see [Note: the probe's own clock]
        clock_math_us = (command.fwd_reps + command.bwd_reps) * product_us
        return overhead_per_micro_batch(step_us, command.micro_batches, clock_math_us, own_math_us)

    def tune(
        self, cluster: Cluster, prof: ModelProfile, local_batch: int, micro_batches: int | None
    ) -> Cluster:
        """``cluster`` with the per-action host time that a probe sized like ``prof``'s stages shows (even
        stages over every rank; ``micro_batches``, or two per rank, of ``local_batch``)."""
        stages = cluster.nodes * cluster.devices_per_node
        slot_us, message = probe_workload(prof, local_batch, stages, micro_batches or 2 * stages)
        overhead = self.pipeline_overhead_us(slot_us, message)
        tuned = with_overhead(cluster, overhead, message)
        self.measured = {
            "slot_us": round(slot_us, 1),
            "message_bytes": message,
            "overhead_us": round(overhead, 1),
            "action_us": round(tuned.action_us, 1),
        }
        return tuned


@contextlib.contextmanager
def planning_load(
    rank: int, world_size: int, ranks_per_node: int, device: torch.device, measure: bool
) -> Iterator[PlanningProbe | None]:
    """Around rank 0's planning: on CPUs with a measured profile (see [Note: planning under load]) the other
    ranks of rank 0's machine load their cores until rank 0 leaves the block, and rank 1 follows the probes
    that rank 0 asks for; every rank takes part (broadcasts mark each probe and the end), so call it on all
    ranks with the same arguments. Yields the probe handle on rank 0 where the load applies, else None."""
    if not _applies(device, measure, world_size):
        yield None
        return
    if rank == 0:
        try:
            yield PlanningProbe()
        finally:
            dist.broadcast(torch.zeros(COMMAND_SIZE, dtype=torch.float64), src=0)
        return
    loads = rank < ranks_per_node  # rank 0's machine (ranks are node-major)
    a, b = torch.randn(_SIDE, _SIDE), torch.randn(_SIDE, _SIDE)
    src, dst = torch.ones(_COPY_FLOATS), torch.empty(_COPY_FLOATS)
    while True:
        command = torch.zeros(COMMAND_SIZE, dtype=torch.float64)
        work = dist.broadcast(command, src=0, async_op=True)
        while loads and not work.is_completed():
            torch.mm(a, b)
            dst.copy_(src)
        work.wait()
        if not is_command(command):
            break
        if rank == 1:
            follow_probe(ProbeCommand.from_tensor(command), leader=0)
    yield None
