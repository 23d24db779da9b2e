"""A torchrun worker for planning under load: 3 gloo ranks, 2 per "machine". Rank 0 "plans" (sleeps) inside
``planning_load``; each rank records the CPU seconds it spent there, with the load on and off. Rank r writes
``OUT/rank{r}.pt``.

Usage: ``python -m torch.distributed.run --nproc_per_node=3 tests/distributed/_load_worker.py OUT``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_autopart.lightning.load import planning_load
from tests.distributed.job import end_job

PLANNING_S = 0.6


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cpu = torch.device("cpu")
    result = {}
    for name, measure in (("loaded", True), ("idle", False)):
        dist.barrier()
        start = time.process_time()
        with planning_load(rank, 3, 2, cpu, measure):
            if rank == 0:
                time.sleep(PLANNING_S)
        result[name] = time.process_time() - start
    torch.save(result, out / f"rank{rank}.pt")
    end_job()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
