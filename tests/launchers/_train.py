"""A user-style training script for the launcher tier: fits a small tutorial ``Net`` under whatever launcher
started it (torchrun on one or several "nodes", mpirun) and records what every rank saw.

Usage: ``python tests/launchers/_train.py OUT [--devices N] [--num-nodes M] [--num-stages S] [--steps K]``.
Rank 0 saves the plan to ``OUT/plan.json``; rank r writes ``OUT/rank{r}.json`` with its ranks, the cluster
environment Lightning chose, the stages it held, the launch it came from (``$AUTOPART_TEST_NODE``, set by the
test on each "node" launch) and the logged losses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.tutorial import Net
from lightning_autopart import AutoPartitionStrategy

__all__: list[str] = []


class _Losses(L.Callback):
    """The ``train_loss`` of every step, as this rank sees it (replayed from the last stage)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def main() -> None:
    """Fit, then write this rank's record."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--devices", type=int, default=1, help="processes per node, as the launcher started them"
    )
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0)
    model = Net(32, 4, lr=1e-2, batch_size=16, optimizer="adam", num_samples=256)
    strategy = AutoPartitionStrategy(
        num_stages=args.num_stages, micro_batches=2, schedule="GPipe", save_plan=str(args.out / "plan.json")
    )
    losses = _Losses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_steps=args.steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses],
    )
    trainer.fit(model)
    runner = strategy._runner
    assert runner is not None and all(math.isfinite(v) for v in losses.losses)
    record = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "environment": type(strategy.cluster_environment).__name__,
        "launch": os.environ.get("AUTOPART_TEST_NODE"),
        "stages": list(runner.placement.stages),
        "losses": losses.losses,
        "global_step": trainer.global_step,
    }
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
    if trainer.is_global_zero:
        print(f"autopart-test: rank 0 finished {trainer.global_step} steps, loss {losses.losses[-1]:.4f}")


if __name__ == "__main__":
    main()
