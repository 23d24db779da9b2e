"""A small model trained with ``strategy=AutoPartitionStrategy()`` under SLURM: run it with ``sbatch train.sbatch``.

Each SLURM task is one rank (``srun`` starts them all: tasks per node = devices per node), Lightning reads the
ranks from SLURM's environment (``SLURMEnvironment``), and ``--num-nodes``/``--devices`` default to the job's
own ``SLURM_NNODES``/``SLURM_NTASKS_PER_NODE``, which Lightning requires them to equal. A requeued job (after
``--signal=USR1@90`` or ``scontrol requeue``) resumes from the checkpoint the pre-emption wrote, by itself.
Data are synthetic, so the script needs no download; put your own model and loader in their place.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_autopart import AutoPartitionStrategy

__all__ = ["Progress", "Regressor", "main"]


class Regressor(L.LightningModule):
    """An MLP of ``depth`` hidden layers learning a fixed random linear map (loss falls fast)."""

    def __init__(self, width: int = 64, depth: int = 4, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])


class Progress(Callback):
    """Prints where each rank runs and which stages it holds, then the step and loss every ``every`` steps on
    rank 0: a batch job's output has no progress bar."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        plan, rank = getattr(trainer.strategy, "plan", None), trainer.global_rank
        if plan is not None:
            node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
            held = [
                f"stage {i} (replica {s.ranks.index(rank)})"
                for i, s in enumerate(plan.stages)
                if rank in s.ranks
            ]
            print(f"rank {rank} on {node}: {', '.join(held)}", flush=True)

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step % self.every == 0:
            loss = float(trainer.callback_metrics["train_loss"])
            rank_zero_info(f"step {trainer.global_step} loss {loss:.4f}")


def _default(name: str, fallback: int) -> int:
    return int(os.environ.get(name, fallback))


def main(argv: Sequence[str] | None = None, callbacks: Sequence[Callback] = ()) -> L.Trainer:
    """Parse ``argv``, train, and print where the checkpoint went; ``callbacks`` are added to the Trainer's."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-nodes", type=int, default=_default("SLURM_NNODES", 1))
    parser.add_argument("--devices", type=int, default=_default("SLURM_NTASKS_PER_NODE", 1))
    parser.add_argument("--accelerator", default="auto", help="gpu, cpu or auto")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64, help="per pipeline replica")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument(
        "--stages", type=int, default=None, help="pipeline stages (None: the planner decides)"
    )
    parser.add_argument("--profile", default="measure", help="measure (on the device) or estimate")
    parser.add_argument("--root", type=Path, default=Path("runs/slurm"), help="logs and checkpoints")
    parser.add_argument("--print-every", type=int, default=10)
    args = parser.parse_args(argv)

    L.seed_everything(0)
    x = torch.randn(args.batch_size * 64, args.width)
    y = x @ torch.randn(args.width, args.width) / args.width**0.5
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True, drop_last=True)
    checkpoint = ModelCheckpoint(dirpath=args.root / "checkpoints", save_last=True)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        num_nodes=args.num_nodes,  # = #SBATCH --nodes
        devices=args.devices,  # = #SBATCH --ntasks-per-node (one task per GPU)
        strategy=AutoPartitionStrategy(num_stages=args.stages, profile=args.profile),
        max_steps=args.max_steps,
        default_root_dir=args.root,
        callbacks=[checkpoint, Progress(args.print_every), *callbacks],
        enable_progress_bar=False,
        log_every_n_steps=args.print_every,
    )
    # ckpt_path=None: on SLURM, a requeued job finds Lightning's hpc_ckpt_N.ckpt (the pre-emption's) by itself.
    trainer.fit(Regressor(args.width, args.depth), loader)
    loss = float(trainer.callback_metrics["train_loss"])
    rank_zero_info(
        f"training finished: step {trainer.global_step}, loss {loss:.4f}, checkpoint {checkpoint.last_model_path}"
    )
    return trainer


if __name__ == "__main__":
    main()
