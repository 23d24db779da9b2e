"""A torchrun worker: each rank's gradient scaler sees an overflow on its own stage or not; after agreeing, all
ranks must hold the same flags. Rank r writes ``OUT/rank{r}.pt`` = its flags before and after.

Usage: ``python -m torch.distributed.run --nproc_per_node=3 tests/distributed/_overflow_worker.py OUT``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_autopart.runtime.gradients import agree_on_overflow
from tests.distributed.job import end_job

__all__: list[str] = []


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    layer = torch.nn.Linear(2, 2)
    scaler.scale(layer(torch.ones(1, 2)).sum()).backward()
    if rank == 1:  # only this stage's gradients overflow
        layer.weight.grad[0, 0] = float("inf")
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler.unscale_(optimizer)
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    before = [float(f) for f in found.values()]
    agree_on_overflow(found)
    after = [float(f) for f in found.values()]
    scaler.step(optimizer)
    scaler.update()
    torch.save({"before": before, "after": after, "scale": scaler.get_scale()}, Path(sys.argv[1]) / f"rank{rank}.pt")
    end_job()


if __name__ == "__main__":
    main()
