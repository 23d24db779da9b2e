"""A torchrun worker for planning under load: 3 gloo ranks, 2 per "machine". Rank 0 "plans" (sleeps, and runs
the pipeline probe twice with rank 1) inside ``planning_load``; each rank records the CPU seconds it spent
there, with the load on and off, and rank 0 the probes' results. Rank r writes ``OUT/rank{r}.pt``.

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
    result: dict[str, object] = {}
    for name, measure in (("loaded", True), ("idle", False)):
        dist.barrier()
        start = time.process_time()
        with planning_load(rank, 3, 2, cpu, measure) as probe:
            result[f"{name}_probe"] = probe is not None
            if rank == 0:
                time.sleep(PLANNING_S / 2)
                if probe is not None:  # a probe, load between, another probe (rank 1 follows both)
                    result["overheads"] = [probe.pipeline_overhead_us(1500.0, 65536)]
                    time.sleep(PLANNING_S / 2)
                    result["overheads"].append(probe.pipeline_overhead_us(400.0, 256))
                else:
                    time.sleep(PLANNING_S / 2)
        result[name] = time.process_time() - start
    torch.save(result, out / f"rank{rank}.pt")
    end_job()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
