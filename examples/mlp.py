"""An MLP whose layers differ in cost by orders of magnitude, as a LightningModule.

It shows why autopart balances stages by measured cost rather than by layer count. From the repository root::

    python -m examples.mlp                     # examples/configs/mlp.yaml: 96M parameters, 2 stages on 2 CPU processes
    torchrun --nproc_per_node=8 -m examples.mlp --trainer.strategy.num_stages null
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import lightning_autopart  # noqa: F401  (registers strategy="autopart")
from examples.common import SyntheticDataModule, cli_main
from examples.data import SyntheticRegression

__all__ = ["DEFAULT_WIDTHS", "UnevenMLP", "main"]

#: Default feature widths. The 9 linear layers between them cost (in parameters, roughly also in FLOPs
#: per sample) 8.4M, 67M, 2.1M, 66K, 1.1M, 17M, 262K, 4K and 66K: the second layer alone holds 70% of
#: the model, the eighth 0.004%. Splitting these 9 layers evenly by count into 3 stages gives stages of
#: 77.6M, 17.9M and 0.3M parameters (95.8M in all).
DEFAULT_WIDTHS: tuple[int, ...] = (1024, 8192, 8192, 256, 256, 4096, 4096, 64, 64, 1024)


class UnevenMLP(SyntheticDataModule):
    """``len(widths) - 1`` linear layers with ReLU between them, trained with MSE on a linear teacher.

    The layers are the children of one flat ``nn.Sequential`` (``Linear, ReLU, Linear, ..., Linear``),
    so a partitioner sees each layer at its true, very unequal cost. A partitioner that balances by
    layer count puts almost all of the work on one stage; one that balances by measured cost does not.

    Args:
        widths: Feature widths: input, hidden layers..., output. At least two.
        lr: Learning rate.
        batch_size: Samples per batch of the training and validation loaders.
        momentum: SGD momentum (ignored by Adam).
        optimizer: ``"sgd"`` or ``"adam"``.
        num_samples: Samples in the synthetic training set.
    """

    def __init__(
        self,
        widths: Sequence[int] = DEFAULT_WIDTHS,
        lr: float = 0.01,
        batch_size: int = 64,
        momentum: float = 0.0,
        optimizer: Literal["sgd", "adam"] = "sgd",
        num_samples: int = 4096,
    ) -> None:
        super().__init__()
        widths = list(widths)
        if len(widths) < 2:
            raise ValueError(f"UnevenMLP needs at least an input and an output width (widths={widths})")
        self.save_hyperparameters()
        modules: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(itertools.pairwise(widths)):
            if i > 0:
                modules.append(nn.ReLU())
            modules.append(nn.Linear(n_in, n_out))
        self.layers = nn.Sequential(*modules)
        self.example_input_array = torch.randn(2, widths[0])

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)

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
        widths = self.hparams["widths"]
        n = self.hparams["num_samples"] + 4 * self.hparams["batch_size"]
        return SyntheticRegression(n, widths[0], seed=0, out_dim=widths[-1])


def main(args: Sequence[str] | None = None) -> None:
    """Train :class:`UnevenMLP` with LightningCLI (``configs/mlp.yaml`` as defaults)."""
    cli_main(UnevenMLP, config="mlp.yaml", args=args)


if __name__ == "__main__":
    main()
