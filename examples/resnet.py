r"""A wide ResNet with bottleneck blocks (BiT-style width factor), as a LightningModule.

RaNNC's enlarged ResNets (``resnet50x2`` ... ``resnet152x8``: depth 50, 101 or 152 times width 2, 4 or 8) with
synthetic images, no torchvision. From the repository root::

    python -m examples.resnet                 # examples/configs/resnet.yaml: a ResNet-26 on 32x32 images, 2 CPU processes
    torchrun --nproc_per_node=8 -m examples.resnet --model.depth 152 --model.width_factor 8 \
        --model.num_classes 1000 --model.image_size 224 --model.batch_size 32    # resnet152x8, 3.7B parameters
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import lightning_autopart  # noqa: F401  (registers strategy="autopart", the name configs/resnet.yaml uses)
from examples.common import SyntheticDataModule, cli_main
from examples.data import SyntheticImages

__all__ = ["BLOCKS_PER_DEPTH", "RANNC_MODELS", "Bottleneck", "ResNet", "main"]

#: RaNNC's model names (its ResNet example's ``MODEL=``) -> (depth, width_factor).
RANNC_MODELS: dict[str, tuple[int, int]] = {
    f"resnet{depth}x{width}": (depth, width) for depth in (50, 101, 152) for width in (2, 4, 8)
}

#: Bottleneck blocks per stage for each supported depth (depth = 3 * sum(blocks) + 2).
BLOCKS_PER_DEPTH: dict[int, tuple[int, int, int, int]] = {
    26: (2, 2, 2, 2),
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
    200: (3, 24, 36, 3),
}


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4, plus an identity or projection shortcut."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.downsample(x))


class ResNet(SyntheticDataModule):
    """ResNet-``depth`` x ``width_factor``: every channel width of the ResNet-v1.5 layout is multiplied.

    The top level is a pipeline-friendly chain: ``stem`` (conv 7x7, BN, ReLU, max-pool), ``layer1`` ..
    ``layer4`` (``nn.Sequential`` of :class:`Bottleneck` blocks at widths ``64w, 128w, 256w, 512w``,
    outputs 4x wider) and ``head`` (global average pool, flatten, linear).

    Parameter counts (checked on the meta device): ``ResNet(50, 1)`` has 25,557,032, as torchvision's
    ResNet-50; ``ResNet(152, 4)`` has 936,563,944, as BiT's R152x4; ``ResNet(152, 8)``, RaNNC's 3.7B
    ResNet152x8 example, has 3,728,582,120 (3,712,197,120 in the convolutions and batch norms and
    16,385,000 in the classifier).

    Args:
        depth: Number of weighted layers; one of 26, 50, 101, 152, 200.
        width_factor: Multiplier of every channel width (1 is the standard ResNet).
        num_classes: Number of output classes.
        image_size: Height and width of the (square) synthetic training images.
        lr: Learning rate.
        batch_size: Images per batch of the training and validation loaders.
        momentum: SGD momentum (ignored by Adam).
        optimizer: ``"sgd"`` or ``"adam"``.
        num_samples: Images in the synthetic training set.
    """

    def __init__(
        self,
        depth: int = 152,
        width_factor: int = 8,
        num_classes: int = 1000,
        image_size: int = 224,
        lr: float = 0.01,
        batch_size: int = 32,
        momentum: float = 0.0,
        optimizer: Literal["sgd", "adam"] = "sgd",
        num_samples: int = 1024,
    ) -> None:
        super().__init__()
        if depth not in BLOCKS_PER_DEPTH:
            raise ValueError(
                f"unsupported ResNet depth (depth={depth}); use one of {sorted(BLOCKS_PER_DEPTH)}"
            )
        self.save_hyperparameters()
        stem_width = 64 * width_factor
        self.stem = nn.Sequential(
            nn.Conv2d(3, stem_width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(stem_width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        in_channels = stem_width
        stages: list[nn.Sequential] = []
        for i, num_blocks in enumerate(BLOCKS_PER_DEPTH[depth]):
            width = 64 * width_factor * 2**i
            blocks: list[nn.Module] = []
            for j in range(num_blocks):
                stride = 2 if i > 0 and j == 0 else 1
                blocks.append(Bottleneck(in_channels, width, stride))
                in_channels = width * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_channels, num_classes))
        self._init_weights()
        self.example_input_array = torch.randn(2, 3, image_size, image_size)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> ResNet:
        """Build one of :data:`RANNC_MODELS` by name (``"resnet152x8"``), with ``overrides`` applied on top."""
        if name not in RANNC_MODELS:
            raise ValueError(f"unknown ResNet name (name={name!r}); use one of {sorted(RANNC_MODELS)}")
        depth, width_factor = RANNC_MODELS[name]
        return cls(depth, width_factor, **overrides)

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        for module in self.modules():
            # Each residual branch starts as zero, so the network starts close to the identity.
            if isinstance(module, Bottleneck):
                nn.init.zeros_(module.bn3.weight)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        return self.head(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.log("val_loss", F.cross_entropy(logits, labels), prog_bar=True, sync_dist=True)
        self.log("val_acc", (logits.argmax(dim=1) == labels).float().mean(), prog_bar=True, sync_dist=True)

    def _dataset(self) -> SyntheticImages:
        """Training images followed by four batches of held-out validation images."""
        n = self.hparams["num_samples"] + 4 * self.hparams["batch_size"]
        size, classes = self.hparams["image_size"], self.hparams["num_classes"]
        return SyntheticImages(n, channels=3, size=size, classes=classes, seed=0)


def main(args: Sequence[str] | None = None) -> None:
    """Train :class:`ResNet` on its synthetic images with LightningCLI (``configs/resnet.yaml`` as defaults)."""
    cli_main(ResNet, config="resnet.yaml", args=args)


if __name__ == "__main__":
    main()
