"""The RaNNC tutorial model: a stack of ``hidden x hidden`` linear layers, as a LightningModule.

Run it as the RaNNC tutorial does (``batch_size hidden layers``), from the repository root::

    python examples/tutorial.py 64 512 10                  # Lightning starts 2 CPU processes (every GPU on a GPU host)
    mpirun -np 2 python examples/tutorial.py 64 512 10     # or torchrun --nproc_per_node=2, or srun
    python -m examples.tutorial --device-memory 12MB       # a memory too small for one device: 2 stages

or with LightningCLI (``fit`` and a config; the config's ``strategy: autopart`` works because this file imports
``lightning_autopart``, which registers the name)::

    python -m examples.tutorial fit --config examples/configs/tutorial.yaml --model.hidden 1024
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Literal

# Run as a file (python examples/tutorial.py, mpirun ...): make the package `examples` importable.
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.common import SUBCOMMANDS, SyntheticDataModule, cli_main, default_devices
from examples.data import SyntheticRegression
from lightning_autopart import AutoPartitionStrategy  # importing the package registers strategy="autopart"

__all__ = ["Net", "main"]


class Net(SyntheticDataModule):
    """``layers`` linear layers of width ``hidden`` applied in sequence, trained with MSE on a linear teacher.

    ``Net(5000, 100)`` is the tutorial's large configuration: 2,500,500,000 parameters, too big to train
    with data parallelism alone on a 40 GB GPU.

    The layers are purely linear with PyTorch's default initialisation, so the signal shrinks about
    sqrt(3)-fold per layer: plain SGD at lr 0.01 barely moves the loss of a 10-layer ``Net`` (it stays
    near 1.0), while ``optimizer="adam", lr=1e-3`` brings it from 1.0 to about 0.45 in 64 steps.

    Args:
        hidden: Width of every layer (input and output features).
        layers: Number of linear layers.
        lr: Learning rate.
        batch_size: Samples per batch of the training and validation loaders.
        momentum: SGD momentum (ignored by Adam).
        optimizer: ``"sgd"`` or ``"adam"``.
        num_samples: Samples in the synthetic training set.
    """

    def __init__(
        self,
        hidden: int = 512,
        layers: int = 10,
        lr: float = 0.01,
        batch_size: int = 64,
        momentum: float = 0.0,
        optimizer: Literal["sgd", "adam"] = "sgd",
        num_samples: int = 4096,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layers = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(layers)])
        self.example_input_array = torch.randn(2, hidden)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), prog_bar=True, sync_dist=True)

    def _dataset(self) -> SyntheticRegression:
        """Training samples followed by four batches of held-out validation samples."""
        n = self.hparams["num_samples"] + 4 * self.hparams["batch_size"]
        return SyntheticRegression(n, self.hparams["hidden"], seed=0)


class _Throughput(L.Callback):
    """Measures training samples per second, skipping the first ``warmup`` steps (the first builds the pipeline
    schedules; the next ones warm the allocator and caches)."""

    def __init__(self, batch_size: int, warmup: int = 5) -> None:
        self.batch_size = batch_size
        self.warmup = warmup
        self.start: float | None = None
        self.steps = 0
        #: Measured global samples per second (None: too few steps after the warm-up).
        self.samples_per_s: float | None = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.steps = trainer.global_step - self.warmup
        if self.start is not None and self.steps > 0:
            elapsed = time.perf_counter() - self.start
            # One batch per data-parallel replica per step (the stages of one pipeline share their batch).
            replicas = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1}
            samples = self.steps * self.batch_size * replicas["num_replicas"]
            self.samples_per_s = samples / elapsed
            if trainer.is_global_zero:
                print(f"{self.samples_per_s:.1f} samples/s ({self.steps} steps in {elapsed:.2f} s)")


def _compare_throughput(trainer: L.Trainer, measured: _Throughput) -> None:
    """Print the plan's predicted samples/s beside the measured ones, and why they differ on a CPU."""
    plan = getattr(trainer.strategy, "plan", None)
    if plan is None or measured.samples_per_s is None:
        return
    predicted = plan.prediction.samples_per_s
    print(
        f"throughput: predicted {predicted:,.0f} samples/s (plan, {plan.profile_mode} on {plan.device}), "
        f"measured {measured.samples_per_s:,.0f} samples/s ({measured.steps} steps after {measured.warmup} "
        f"warm-up), {measured.samples_per_s / predicted:.0%} of the prediction"
    )
    if not str(plan.device).startswith("cpu"):
        return
    step_ms = 1000 * plan.batch_size / measured.samples_per_s
    print(
        "why they differ: the plan prices compute, transfers, the optimizer step, the loader's batches and the "
        f"pipeline's host time, timed on this CPU ({plan.prediction.step_us / 1000:.1f} ms a step); a measured "
        f"step ({step_ms:.1f} ms) also holds Lightning's loop and logging, which a model this small cannot hide, "
        f"and the {trainer.world_size} processes share this machine's {os.cpu_count()} cores with whatever else "
        "runs, whose speed moves between planning and training"
    )


def main(argv: list[str] | None = None) -> None:
    """Train ``Net`` with ``strategy="autopart"``; print the plan, the loss and samples/s.

    ``python examples/tutorial.py [batch_size hidden layers]`` (the RaNNC tutorial's arguments) or the options
    below; ``fit ...`` runs LightningCLI instead (``fit --config examples/configs/tutorial.yaml``). The processes
    are the launcher's (torchrun, mpirun, srun), else every GPU here, else 2 CPU processes (``--devices``). Force a
    pipeline with ``--num-stages 2`` or a small ``--device-memory 20MB``; ``--strategy ddp`` runs plain DDP.
    ``--save-plan plan.json`` keeps the plan; ``--load-plan plan.json`` runs it again with no profiling or planning.
    Seeded (``--seed``): every run ends at the same loss. Ends with the plan's predicted samples/s beside the
    measured ones.
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS:
        cli_main(Net, config="tutorial.yaml", args=argv)
        return
    parser = argparse.ArgumentParser(description=main.__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("batch", nargs="?", type=int, metavar="batch_size", help="as --batch-size")
    parser.add_argument("width", nargs="?", type=int, metavar="hidden", help="as --hidden")
    parser.add_argument("depth", nargs="?", type=int, metavar="layers", help="as --layers")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="samples per batch of one replica")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--accelerator", default="auto", help="cpu, gpu or auto (default)")
    parser.add_argument("--devices", type=int, default=None, help="processes per node (default: see above)")
    parser.add_argument("--strategy", default="autopart", help="autopart (default), ddp, auto, ...")
    parser.add_argument("--num-stages", type=int, default=None, help="force the pipeline depth")
    parser.add_argument("--micro-batches", type=int, default=None, help="force the micro-batch count")
    parser.add_argument("--device-memory", default=None, help="pretend a device has this memory: 20MB")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and data order")
    parser.add_argument("--save-plan", default=None, help="write the plan to this JSON file")
    parser.add_argument("--load-plan", default=None, help="run this saved plan: no profiling, no planning")
    args = parser.parse_args(argv)
    batch_size = args.batch or args.batch_size
    hidden = args.width or args.hidden
    layers = args.depth or args.layers
    devices, num_nodes = default_devices()

    torch.set_num_threads(1)
    L.seed_everything(args.seed)  # the same weights on every rank, and the same final loss on every run
    model = Net(hidden, layers, lr=args.lr, batch_size=batch_size, optimizer=args.optimizer)
    strategy: Any = args.strategy
    if args.strategy == "autopart":
        strategy = AutoPartitionStrategy(
            num_stages=args.num_stages,
            micro_batches=args.micro_batches,
            device_memory=args.device_memory,
            save_plan=args.save_plan,
            load_plan=args.load_plan,
        )
    throughput = _Throughput(batch_size, warmup=min(5, args.max_steps // 4))
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices or devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=args.max_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        callbacks=[throughput],
    )
    if trainer.is_global_zero:
        print(f"#Parameters={sum(p.numel() for p in model.parameters())}")
    trainer.fit(model)
    if trainer.is_global_zero:
        print(f"final train_loss={float(trainer.callback_metrics['train_loss']):.4f}")
        _compare_throughput(trainer, throughput)
    print(f"Finished on rank{trainer.global_rank}")


if __name__ == "__main__":
    main()
