"""A torchrun worker: trains zoo models under several plans with PipelineRunner and saves the results.

Usage: ``python -m torch.distributed.run --nproc_per_node=N tests/distributed/_runtime_worker.py CASES OUT``,
where CASES is a JSON list of {"model", "stages", "replicas", "schedule"} and OUT a directory; rank r writes
``OUT/rank{r}.pt`` = {case index: {"params": {fqn: tensor}, "losses": [loss per step]}}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_autopart.capture import capture
from lightning_autopart.runtime import PipelineRunner
from tests.distributed.runtime_cases import batches, loss_fn, make_case_plan, micro_example
from tests.models import make

__all__: list[str] = []


def run_case(case: dict[str, Any], rank: int) -> dict[str, Any]:
    """Train ``STEPS`` SGD steps of one case; return this rank's parameters and losses."""
    model = make(case["model"])
    captured = capture(model, micro_example(case["model"]), method="export")
    plan = make_case_plan(case, captured.num_blocks)
    runner = PipelineRunner(plan, captured, rank, "cpu", loss_fn(case["model"]))
    params = list(dict.fromkeys(p for m in runner.modules.values() for p in m.parameters()))
    optimizer = torch.optim.SGD(params, lr=0.1)
    share = runner.local_batch_size
    lo, hi = runner.placement.replica * share, (runner.placement.replica + 1) * share
    losses = []
    for x, y in batches(case["model"], plan.batch_size):
        loss = runner.step(x[lo:hi] if runner.is_first else None, y[lo:hi] if runner.is_last else None)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(None if loss is None else float(loss))
    named = {n: p.detach().clone() for m in runner.modules.values() for n, p in m.named_parameters()}
    return {"params": named, "losses": losses, "replica": runner.placement.replica}


def main() -> None:
    torch.set_num_threads(1)
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    try:
        for i, case in enumerate(cases):
            if case["stages"] * case["replicas"] // case.get("chunks", 1) == dist.get_world_size():
                results[i] = run_case(case, rank)
                dist.barrier()
    finally:
        torch.save(results, out / f"rank{rank}.pt")
        dist.destroy_process_group()
    os._exit(0)  # skip the slow interpreter teardown of torch


if __name__ == "__main__":
    main()
