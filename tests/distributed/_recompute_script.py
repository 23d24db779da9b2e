"""Recompute (activation checkpointing) jobs: PipelineRunner cases under torchrun, a strategy fit under Lightning.

Usage:
- ``python -m torch.distributed.run --nproc_per_node=2 tests/distributed/_recompute_script.py runner CASES OUT``:
  CASES is a JSON list of {"model", "stages", "replicas", "schedule", "checkpoint": [stage indices]}; rank r
  writes ``OUT/rank{r}.pt`` = {case index: {"params", "buffers", "losses"}}.
- ``python tests/distributed/_recompute_script.py strategy OUT DEVICES`` (Lightning's launcher starts the other
  processes): fits :class:`TallLit` with ``AutoPartitionStrategy(device_memory=BUDGET)``; rank r writes
  ``OUT/strategy_rank{r}.pt`` = {"params", "plan", "replicas"}.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_autopart.capture import capture
from lightning_autopart.runtime.runner import PipelineRunner
from tests.distributed.job import end_job
from tests.distributed.recompute_cases import (
    BUDGET,
    TallLit,
    checkpointed,
    make_model,
    model_example,
    tall_dataset,
)
from tests.distributed.runtime_cases import batches, loss_fn, make_case_plan

__all__: list[str] = []


def run_case(case: dict[str, Any], rank: int) -> dict[str, Any]:
    """``STEPS`` SGD steps of one case, the random generator seeded alike before every step (dropout)."""
    name = case["model"]
    model = make_model(name)
    captured = capture(model, model_example(name), method="export")
    plan = checkpointed(make_case_plan(case, captured.num_blocks), case["checkpoint"])
    data_name = "mlp" if name == "normdrop" else name
    runner = PipelineRunner(plan, captured, rank, "cpu", loss_fn(data_name))
    params = list(dict.fromkeys(p for m in runner.modules.values() for p in m.parameters()))
    optimizer = torch.optim.SGD(params, lr=0.1)
    share = runner.local_batch_size
    losses = []
    for step, (x, y) in enumerate(batches(data_name)):
        lo = runner.placement.replica * share
        torch.manual_seed(1000 + 10 * step + rank)
        xs, ys = x[lo : lo + share], y[lo : lo + share]
        loss = runner.step(xs if runner.is_first else None, ys if runner.is_last else None)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(None if loss is None else float(loss))
    modules = runner.modules.values()
    return {
        "params": {n: p.detach().clone() for m in modules for n, p in m.named_parameters()},
        "buffers": {n: b.detach().clone() for m in modules for n, b in m.named_buffers()},
        "losses": losses,
    }


def runner_main(cases_file: Path, out: Path) -> None:
    cases = json.loads(cases_file.read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    try:
        for i, case in enumerate(cases):
            results[i] = run_case(case, rank)
            dist.barrier()
    finally:
        torch.save(results, out / f"rank{rank}.pt")
        dist.destroy_process_group()


def strategy_main(out: Path, devices: int) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_autopart.lightning.strategy import AutoPartitionStrategy
    from tests.distributed.strategy_cases import LOCAL_BATCH, STEPS

    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("lightning_autopart.runtime").setLevel(logging.INFO)
    strategy = AutoPartitionStrategy(device_memory=BUDGET)  # stages, micro-batches, schedule: the planner's
    model = TallLit()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(tall_dataset(LOCAL_BATCH * 2 * STEPS), batch_size=LOCAL_BATCH))
    assert strategy.plan is not None
    local = {id(p) for p in strategy._params}
    result = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in local},
        "plan": strategy.plan.to_json(),
        "replicas": strategy.plan.replicas,
    }
    torch.save(result, out / f"strategy_rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    torch.set_num_threads(1)
    if sys.argv[1] == "runner":
        runner_main(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        strategy_main(Path(sys.argv[2]), int(sys.argv[3]))
    end_job()


if __name__ == "__main__":
    main()
