"""Runs the actions of a JSON file (see ``lifecycle_cases.py``) with AutoPartitionStrategy, as a user script would.

Usage: ``python tests/distributed/_lifecycle_script.py ACTIONS OUT DEVICES``; rank r writes ``OUT/rank{r}.pt``
= {action index: result}.
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
from tests.distributed.lifecycle_cases import run_action

__all__: list[str] = []


def main() -> None:
    torch.set_num_threads(1)
    actions = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    devices = int(sys.argv[3])
    results: dict[int, Any] = {}
    for i, action in enumerate(actions):
        strategy: Any = "ddp"  # plain Lightning, to write or read checkpoints across strategies
        if not action.get("plain"):
            strategy = AutoPartitionStrategy(
                num_stages=action.get("stages", devices),
                micro_batches=2,
                profile="estimate",
                checkpoint=action.get("checkpoint", "sharded"),
            )
        results[i] = run_action(action, out, strategy, devices)
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save(results, out / f"rank{rank}.pt")
    end_job()


if __name__ == "__main__":
    main()
