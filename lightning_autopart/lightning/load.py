"""While rank 0 plans on CPUs, the other ranks of its machine keep their cores busy, as they will in training.

[Note: planning under load] Rank 0 profiles the blocks and probes the host (gloo messages, per-action
bookkeeping) while the other ranks wait for the plan. On a GPU node that is how training runs too: each rank has
its own device. On CPUs the ranks of a machine share its cores, caches and memory bandwidth, and gloo's I/O
threads compete with the compute: on a 2-core machine a 2-stage MLP's stage computed 12.2 ms per step in
training against 9.3 ms profiled alone, and a gloo message took 5x longer with both cores busy. So, on CPUs,
the ranks of rank 0's machine compute (products and copies) until rank 0 is done, and the profile sees the
machine as training will.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = ["planning_load"]

#: Side of the products and bytes of the copies of one unit of load (a few milliseconds on one core).
_SIDE = 256
_COPY_FLOATS = 1 << 20


def _applies(device: torch.device, measure: bool, world_size: int) -> bool:
    return device.type == "cpu" and measure and world_size > 1 and dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def planning_load(
    rank: int, world_size: int, ranks_per_node: int, device: torch.device, measure: bool
) -> Iterator[None]:
    """Around rank 0's planning: on CPUs with a measured profile (see [Note: planning under load]) the other
    ranks of rank 0's machine load their cores until rank 0 leaves the block; every rank takes part (one
    asynchronous broadcast marks the end), so call it on all ranks with the same arguments."""
    if not _applies(device, measure, world_size):
        yield
        return
    done = torch.zeros(1)
    if rank == 0:
        try:
            yield
        finally:
            dist.broadcast(done, src=0)
        return
    work = dist.broadcast(done, src=0, async_op=True)
    if rank < ranks_per_node:  # rank 0's machine (ranks are node-major)
        a, b = torch.randn(_SIDE, _SIDE), torch.randn(_SIDE, _SIDE)
        src, dst = torch.ones(_COPY_FLOATS), torch.empty(_COPY_FLOATS)
        while not work.is_completed():
            torch.mm(a, b)
            dst.copy_(src)
    work.wait()
    yield
