"""What every example shares: synthetic loaders on the module, the launcher's process count, and LightningCLI."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from torch.utils.data import DataLoader, Dataset, Subset

__all__ = ["CONFIGS", "SUBCOMMANDS", "ExampleCLI", "SyntheticDataModule", "cli_main", "default_devices"]

#: The examples' LightningCLI configs; each example reads its own as defaults.
CONFIGS = Path(__file__).resolve().with_name("configs")

#: LightningCLI's subcommands; an example run with none of them fits.
SUBCOMMANDS = ("fit", "validate", "test", "predict")


class SyntheticDataModule(L.LightningModule):
    """A LightningModule whose data is ``_dataset()``: ``num_samples`` training samples, then held-out ones.

    Subclasses save ``lr``, ``momentum``, ``optimizer`` ("sgd" or "adam"), ``batch_size`` and ``num_samples`` as
    hyperparameters and implement ``_dataset``.
    """

    def _dataset(self) -> Dataset[Any]:
        """Training samples followed by four batches of held-out validation samples."""
        raise NotImplementedError

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams["optimizer"] == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=self.hparams["momentum"])

    def train_dataloader(self) -> DataLoader[Any]:
        train = Subset(self._dataset(), range(self.hparams["num_samples"]))
        return DataLoader(train, batch_size=self.hparams["batch_size"], shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader[Any]:
        data = self._dataset()
        val = Subset(data, range(self.hparams["num_samples"], len(data)))  # type: ignore[arg-type]
        return DataLoader(val, batch_size=self.hparams["batch_size"])


def default_devices() -> tuple[int | str, int]:
    """``(devices, num_nodes)`` for the Trainer: the launcher's processes, else every GPU here, else 2 CPU processes.

    Lightning needs both to match what torchrun, mpirun or srun started; read from their environment, the same
    command line runs under each of them, and under Lightning's own launcher (``python train.py``).
    """
    env = os.environ
    for local, world in (
        ("LOCAL_WORLD_SIZE", "WORLD_SIZE"),  # torchrun
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE"),  # Open MPI's mpirun
        ("MPI_LOCALNRANKS", "PMI_SIZE"),  # MPICH and Intel MPI (Hydra)
    ):
        if local in env and world in env:
            per_node = int(env[local])
            return per_node, max(1, int(env[world]) // per_node)
    if SLURMEnvironment.detect():  # srun: what Lightning checks the Trainer against
        nodes = int(env.get("SLURM_NNODES", "1"))
        return int(env.get("SLURM_NTASKS_PER_NODE", int(env["SLURM_NTASKS"]) // nodes)), nodes
    return ("auto" if torch.cuda.is_available() else 2), 1


class ExampleCLI(LightningCLI):
    """LightningCLI with ``links``: ``(source, target)`` arguments whose value the target takes from the source."""

    def __init__(self, *args: Any, links: Sequence[tuple[str, str]] = (), **kwargs: Any) -> None:
        self.links = links
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for source, target in self.links:
            parser.link_arguments(source, target)


def cli_main(
    model_class: type[L.LightningModule],
    datamodule_class: type[L.LightningDataModule] | None = None,
    *,
    config: str,
    links: Sequence[tuple[str, str]] = (),
    args: Sequence[str] | None = None,
) -> ExampleCLI:
    """Run LightningCLI on an example, with ``configs/<config>`` as its defaults; ``fit`` when no subcommand is given.

    ``devices`` and ``num_nodes`` default to :func:`default_devices` (a config or ``--trainer.devices`` overrides
    them). After ``fit``, rank 0 prints the steps trained and the last training loss.
    """
    argv = sys.argv if args is None else ["", *args]  # Lightning's launcher reruns sys.argv: edit it in place
    if len(argv) < 2 or argv[1] not in (*SUBCOMMANDS, "-h", "--help"):
        argv.insert(1, "fit")
    devices, num_nodes = default_devices()
    defaults = {"default_config_files": [str(CONFIGS / config)]}
    cli = ExampleCLI(
        model_class,
        datamodule_class,
        links=links,
        trainer_defaults={"devices": devices, "num_nodes": num_nodes},
        parser_kwargs={subcommand: defaults for subcommand in SUBCOMMANDS},
        save_config_kwargs={"overwrite": True},
        args=None if args is None else argv[1:],
    )
    if cli.subcommand == "fit" and cli.trainer.is_global_zero:
        loss = cli.trainer.callback_metrics.get("train_loss")
        shown = "none logged" if loss is None else f"{float(loss):.4f}"
        print(f"trained {cli.trainer.global_step} steps, final train_loss={shown}")
    return cli
