"""A user-style script: fits the test MLP with ``AutoPartitionStrategy()`` left to the planner, saving or loading a plan.

Usage: ``python tests/distributed/_auto_plan_script.py OUT DEVICES MODE`` (Lightning's launcher starts the other
processes). MODE ``save`` plans (``profile="measure"``) and writes ``OUT/plan.json``; ``load`` runs that plan.
Rank r writes ``OUT/{MODE}_rank{r}.pt`` = {"params", "plan", "replicas"}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from tests.distributed.job import end_job
from tests.distributed.strategy_cases import LOCAL_BATCH, STEPS, dataset, make_lit

__all__: list[str] = []

#: Samples in the training set: enough for STEPS steps whatever the number of replicas (up to 2).
SAMPLES = LOCAL_BATCH * 2 * STEPS


def main() -> None:
    torch.set_num_threads(1)
    out, devices, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    plan_file = str(out / "plan.json")
    files = {"save_plan": plan_file} if mode == "save" else {"load_plan": plan_file}
    strategy = AutoPartitionStrategy(**files)  # num_stages, micro_batches, schedule: the planner decides
    model = make_lit({"model": "mlp"})
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
    trainer.fit(model, DataLoader(dataset("mlp", SAMPLES), batch_size=LOCAL_BATCH))
    assert strategy.plan is not None
    local = {id(p) for p in strategy._params}
    result = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in local},
        "plan": strategy.plan.to_json(),
        "replicas": strategy.plan.replicas,
    }
    torch.save(result, out / f"{mode}_rank{dist.get_rank()}.pt")
    end_job()


if __name__ == "__main__":
    main()
