"""A user-style training script: fits the cases of a JSON file with AutoPartitionStrategy and saves each rank's result.

Usage: ``python tests/distributed/_strategy_script.py CASES OUT DEVICES`` (Lightning's launcher starts the other
processes) or under ``torchrun``. Rank r writes ``OUT/rank{r}.pt`` = {case index: {"params", "losses"}}.
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
from lightning_autopart.runtime.runner import PipelineRunner
from tests.census import StepProbe
from tests.distributed.job import end_job
from tests.distributed.strategy_cases import STEPS, fit

__all__: list[str] = []


def run(case: dict[str, Any], devices: int) -> dict[str, Any]:
    """Fit one case; return this rank's stage parameters (original names) and its logged losses."""
    strategy = AutoPartitionStrategy(
        num_stages=case["stages"],
        micro_batches=case.get("micro_batches", 2),
        schedule=case.get("schedule", "GPipe"),
        profile="estimate",
    )
    syncs: list[bool] = []  # the sync flag of every pipeline step: one all-reduce per optimizer step
    step = PipelineRunner.step

    def spied(self: PipelineRunner, *args: Any, sync: bool = True, **kwargs: Any) -> Any:
        syncs.append(sync)
        return step(self, *args, sync=sync, **kwargs)

    PipelineRunner.step = spied  # type: ignore[method-assign]
    probe = StepProbe(1, STEPS)  # host syncs of the steady steps (the first builds the schedules)
    try:
        model, losses, metrics = fit(case, strategy, devices, devices // case["stages"], probe)
    finally:
        PipelineRunner.step = step  # type: ignore[method-assign]
    local = {id(p) for p in strategy._params}
    params = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in local}
    # Another stage's parameter stays on the meta device here: shape kept, no memory.
    held = {n: p.device.type for n, p in model.named_parameters() if id(p) not in local}
    return {
        "params": params,
        "losses": losses,
        "metrics": metrics,
        "plan_stages": strategy.plan.num_stages if strategy.plan else 0,
        "syncs": syncs,
        "held_elsewhere": held,
        "host_syncs": probe.syncs,
        "schedules": sorted(strategy._runner._schedules) if strategy._runner is not None else [],
    }


def main() -> None:
    torch.set_num_threads(1)
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    devices = int(sys.argv[3])
    results: dict[int, Any] = {}
    rank = -1
    try:
        for i, case in enumerate(cases):
            if case.get("validate"):
                case["ckpt_dir"] = str(out / f"ckpt{i}")
            results[i] = run(case, devices)
            rank = dist.get_rank()
    finally:
        if rank < 0 and dist.is_initialized():
            rank = dist.get_rank()
        torch.save(results, out / f"rank{max(rank, 0)}.pt")
    end_job()


if __name__ == "__main__":
    main()
