"""Runs the actions of a JSON file (see ``ports_cases.py``) with AutoPartitionStrategy, or plain DDP for actions
marked ``"plain"``, as a user script would.

Usage: ``python tests/distributed/_ports_script.py ACTIONS OUT DEVICES`` (Lightning's launcher starts the other
processes) or under ``torchrun``; rank r writes ``OUT/rank{r}.pt`` = {action index: result}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from tests.distributed.job import end_job
from tests.distributed.ports_cases import run_action

__all__: list[str] = []


def main() -> None:
    torch.set_num_threads(1)
    actions = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    devices = int(sys.argv[3])
    results: dict[int, Any] = {}
    rank = -1
    try:
        for i, action in enumerate(actions):
            stages = action.get("stages", 2)

            def strategy(action: dict[str, Any] = action, stages: int = stages) -> Any:
                if action.get("plain"):
                    return "ddp"
                schedule = action.get("schedule", "GPipe")
                return AutoPartitionStrategy(num_stages=stages, micro_batches=2, schedule=schedule, profile="estimate")

            replicas = devices if action.get("plain") else devices // stages
            results[i] = run_action(action, strategy, devices, replicas, out)
            rank = dist.get_rank()
    finally:
        if rank < 0 and dist.is_initialized():
            rank = dist.get_rank()
        torch.save(results, out / f"rank{max(rank, 0)}.pt")
    end_job()


if __name__ == "__main__":
    main()
