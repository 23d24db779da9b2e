"""The PyTorch DDP tutorial's task under autopart: a ResNet-18 classifying CIFAR-10 (3x32x32 images, 10 classes).

The model is torchvision's ``resnet18(num_classes=10)`` layout written out (no torchvision needed), and the data a
:class:`CIFAR10DataModule`: synthetic CIFAR-shaped images by default, the real CIFAR-10 with ``data_dir`` (needs
torchvision; downloaded there by rank 0 of each node if missing). From the repository root::

    python -m examples.image_classifier                                   # synthetic, 2 CPU processes
    python -m examples.image_classifier --data.data_dir data --trainer.max_epochs 2 --trainer.max_steps -1
    torchrun --nproc_per_node=8 -m examples.image_classifier --data.data_dir data --data.batch_size 256

What changes from the DDP tutorial's script: no process group, ``DistributedSampler`` or ``.to(local_rank)`` code
(Lightning and the strategy do it), and ``strategy="autopart"`` instead of wrapping the model in DDP. Its
``torch.softmax`` before ``CrossEntropyLoss`` is left out: the loss applies log-softmax itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset

import lightning_autopart  # noqa: F401  (registers strategy="autopart")
from examples.common import cli_main
from examples.data import SyntheticImages

__all__ = ["BasicBlock", "CIFAR10DataModule", "ImageClassifier", "main"]

#: CIFAR-10's per-channel mean and standard deviation (of the training set).
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm (the first carrying the stride) plus an identity or 1x1 shortcut."""

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or in_channels != channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.downsample(x))


class ImageClassifier(L.LightningModule):
    """ResNet-18: a 7x7 stem, four stages of two :class:`BasicBlock` s (64, 128, 256, 512 channels) and a head.

    11,181,642 parameters with 10 classes, as torchvision's ``resnet18(num_classes=10)``. Trained with SGD
    (momentum, weight decay) and cross-entropy; logs ``train_loss``, ``val_loss`` and ``val_acc``.

    Args:
        num_classes: Number of classes.
        lr: SGD learning rate.
        momentum: SGD momentum.
        weight_decay: SGD weight decay.
    """

    def __init__(
        self, num_classes: int = 10, lr: float = 0.05, momentum: float = 0.9, weight_decay: float = 5e-4
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        self.layer1 = nn.Sequential(BasicBlock(64, 64), BasicBlock(64, 64))
        self.layer2 = nn.Sequential(BasicBlock(64, 128, stride=2), BasicBlock(128, 128))
        self.layer3 = nn.Sequential(BasicBlock(128, 256, stride=2), BasicBlock(256, 256))
        self.layer4 = nn.Sequential(BasicBlock(256, 512, stride=2), BasicBlock(512, 512))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes))
        self.example_input_array = torch.randn(2, 3, 32, 32)

    def forward(self, images: Tensor) -> Tensor:
        x = self.stem(images)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
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

    def configure_optimizers(self) -> torch.optim.Optimizer:
        h = self.hparams
        return torch.optim.SGD(
            self.parameters(), lr=h["lr"], momentum=h["momentum"], weight_decay=h["weight_decay"]
        )


def _cifar10(root: str, train: bool, download: bool) -> Dataset[Any]:
    """The real CIFAR-10 split under ``root``, normalised; torchvision is needed only here."""
    try:
        from torchvision import datasets, transforms
    except ImportError as error:
        raise ImportError(
            f"data_dir={root!r} asks for the real CIFAR-10, which is read with torchvision, and torchvision is not "
            "installed: `pip install torchvision`, or leave data_dir unset to train on synthetic images"
        ) from error
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)])
    return datasets.CIFAR10(root, train=train, transform=transform, download=download)


class CIFAR10DataModule(L.LightningDataModule):
    """CIFAR-10 from ``data_dir`` (torchvision), or ``num_samples`` synthetic 3x32x32 images in 10 classes.

    Args:
        data_dir: Directory of the real CIFAR-10 (downloaded into it when missing); None: synthetic images.
        batch_size: Images per batch of one pipeline replica.
        num_samples: Synthetic training images (plus 4 batches for validation); ignored with ``data_dir``.
        num_workers: Loader worker processes.
    """

    def __init__(
        self, data_dir: str | None = None, batch_size: int = 32, num_samples: int = 2048, num_workers: int = 0
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def prepare_data(self) -> None:
        """Download once per node (Lightning runs this on local rank 0 only)."""
        if self.hparams["data_dir"] is not None:
            for train in (True, False):
                _cifar10(self.hparams["data_dir"], train, download=True)

    def setup(self, stage: str) -> None:
        h = self.hparams
        if h["data_dir"] is not None:
            self.train_set = _cifar10(h["data_dir"], train=True, download=False)
            self.val_set = _cifar10(h["data_dir"], train=False, download=False)
            return
        images = SyntheticImages(h["num_samples"] + 4 * h["batch_size"], channels=3, size=32, classes=10)
        self.train_set = Subset(images, range(h["num_samples"]))
        self.val_set = Subset(images, range(h["num_samples"], len(images)))

    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        # drop_last: every batch the size the pipeline was planned for (BatchNorm trains on it)
        h = self.hparams
        return DataLoader(
            self.train_set,
            batch_size=h["batch_size"],
            shuffle=True,
            drop_last=True,
            num_workers=h["num_workers"],
        )

    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return DataLoader(
            self.val_set, batch_size=self.hparams["batch_size"], num_workers=self.hparams["num_workers"]
        )


def main(args: Sequence[str] | None = None) -> None:
    """Train :class:`ImageClassifier` on :class:`CIFAR10DataModule` (``configs/image_classifier.yaml`` as defaults)."""
    cli_main(ImageClassifier, CIFAR10DataModule, config="image_classifier.yaml", args=args)


if __name__ == "__main__":
    main()
