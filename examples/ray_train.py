"""The tutorial ``Net`` trained with ``AutoPartitionStrategy`` inside Ray Train's ``TorchTrainer``.

Ray starts the worker processes and their process group; Lightning runs inside each worker with Ray's cluster
environment, and the strategy plans and pipelines as under torchrun. Needs the ``ray`` extra::

    pip install 'lightning_autopart[ray]'
    python -m examples.ray_train                      # a local Ray cluster, 2 CPU workers, 2 pipeline stages
    python -m examples.ray_train --address auto       # an existing Ray cluster (ray start --head ...)

What differs from Ray's Lightning guide (which uses ``RayDDPStrategy``):

- The strategy is ``AutoPartitionStrategy`` with Ray's ``RayLightningEnvironment`` (in ``plugins``, or as its
  ``cluster_environment``). It starts no process under Ray: the environment says the processes exist (Ray sets
  ``LOCAL_RANK``), and the strategy joins the process group Ray made (its backend and timeout come from Ray's
  ``TorchConfig``, not from the strategy).
- ``Trainer(devices=<workers per node>, num_nodes=<nodes>)``, not ``devices="auto"``: their product must be
  the number of workers, and the plan prices links inside and across nodes from them.
- No ``ray.train.lightning.prepare_trainer``: it only checks that the strategy is one of Ray's own
  (``RayDDPStrategy``, ``RayFSDPStrategy``, ``RayDeepSpeedStrategy``) and refuses any other.
- ``RayTrainReportCallback`` works: with ``checkpoint="full"`` rank 0 writes one ``checkpoint.ckpt`` that a plain
  ``Net`` loads; the metrics are the ones every rank sees (logged on the last stage, replayed everywhere).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["main", "train_loop"]

ROOT = Path(__file__).resolve().parents[1]


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: fit ``Net`` with the strategy and report the losses and the plan to Ray."""
    import lightning as L
    import ray.train
    import torch
    from ray.train.lightning import RayLightningEnvironment, RayTrainReportCallback

    from examples.tutorial import Net
    from lightning_autopart import AutoPartitionStrategy

    torch.set_num_threads(1)
    L.seed_everything(config["seed"])  # the same initial weights on every worker
    model = Net(
        config["hidden"], config["layers"], lr=1e-2, batch_size=config["batch_size"], optimizer="adam"
    )
    strategy = AutoPartitionStrategy(
        num_stages=config["num_stages"],
        save_plan=config["save_plan"],
        checkpoint="full",
    )
    losses: list[float] = []

    class Losses(L.Callback):
        """Keeps every step's ``train_loss`` (replayed from the last stage on every rank)."""

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            losses.append(float(trainer.callback_metrics["train_loss"]))

    context = ray.train.get_context()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=context.get_local_world_size(),
        num_nodes=context.get_world_size() // context.get_local_world_size(),
        strategy=strategy,
        plugins=[RayLightningEnvironment()],  # or AutoPartitionStrategy(cluster_environment=...)
        max_epochs=1,
        max_steps=config["max_steps"],
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[Losses(), RayTrainReportCallback()],
    )
    trainer.fit(model)
    if trainer.is_global_zero:  # Ray keeps rank 0's metrics: one line with what the test and the user check
        assert strategy.plan is not None
        summary = {"losses": losses, "stages": strategy.plan.num_stages, "nodes": strategy.plan.cluster.nodes}
        print(f"autopart-ray: {json.dumps(summary)}", flush=True)


def main(argv: list[str] | None = None) -> None:
    """Start (or join) a Ray cluster, train on ``--workers`` CPU workers and print Ray's result."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument(
        "--address", default=None, help="an existing Ray cluster ('auto'); default: a local one"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-plan", default=None, help="rank 0 writes the plan here")
    parser.add_argument("--storage", default=str(Path("out", "ray").resolve()), help="Ray Train's results")
    args = parser.parse_args(argv)

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # Workers import this package and the examples from the repository, wherever Ray starts them.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    if args.address is None:
        ray.init(num_cpus=args.workers, include_dashboard=False, runtime_env={"env_vars": env})
    else:
        ray.init(address=args.address, runtime_env={"env_vars": env})
    try:
        config = {
            k: getattr(args, k) for k in ("hidden", "layers", "batch_size", "max_steps", "seed", "num_stages")
        }
        config["save_plan"] = str(Path(args.save_plan).resolve()) if args.save_plan else None
        trainer = TorchTrainer(
            train_loop,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
            run_config=RunConfig(name="autopart", storage_path=args.storage),
        )
        result = trainer.fit()
        path = result.checkpoint.path if result.checkpoint else None
        # one write, newline included: Ray's own processes write to the same stream between two writes
        sys.stdout.write(f"ray result: metrics {result.metrics}, checkpoint {path}\n")
    finally:
        ray.shutdown()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
