"""A user-style script: fits a test model on 2 stages, saving its plan (``save``) or running a saved one (``load``).

Usage: ``python tests/distributed/_plan_reuse_script.py OUT DEVICES MODE [MODEL]`` (Lightning's launcher starts the
other processes). ``save`` plans the MLP (``profile="measure"``) and writes ``OUT/plan.json``; ``load`` runs that
plan in a fresh ``MODEL`` (default the MLP), counting the calls to capture, ``profile_model`` and ``partition`` (a
load must profile and plan nothing, and capture once per rank). Rank r writes ``OUT/{MODE}_rank{r}.pt`` =
{"losses", "calls", "plan"}.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning_autopart.capture
import lightning_autopart.partition
import lightning_autopart.planner
from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from tests.distributed.job import end_job
from tests.distributed.strategy_cases import fit

__all__: list[str] = []

#: Counted calls by function name.
CALLS: Counter[str] = Counter()


def _count(module: Any, name: str) -> None:
    """Count the calls of ``module.name`` (the planner imports these where it calls them, so the patch is seen)."""
    original: Callable[..., Any] = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        CALLS[name] += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)


def main() -> None:
    torch.set_num_threads(1)
    out, devices, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    model = sys.argv[4] if len(sys.argv) > 4 else "mlp"
    _count(lightning_autopart.capture, "capture")
    _count(lightning_autopart.planner, "profile_model")
    _count(lightning_autopart.partition, "partition")
    plan_file = str(out / "plan.json")
    if mode == "save":
        strategy = AutoPartitionStrategy(num_stages=2, micro_batches=2, save_plan=plan_file)
    else:  # num_stages, micro_batches: the plan's
        strategy = AutoPartitionStrategy(load_plan=plan_file)
    _, losses, _ = fit({"model": model}, strategy, devices, replicas=1)
    assert strategy.plan is not None
    result = {"losses": losses, "calls": dict(CALLS), "plan": strategy.plan.to_json()}
    torch.save(result, out / f"{mode}_rank{dist.get_rank()}.pt")
    end_job()


if __name__ == "__main__":
    main()
