"""LightningModules and data of the strategy tests, shared by the launched script and the in-process reference."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from tests.models import make

__all__ = ["CNN", "LOCAL_BATCH", "STEPS", "Lit", "dataset", "fit", "global_order", "make_lit"]

#: Samples per pipeline per step (the loader's batch) and optimizer steps per case.
LOCAL_BATCH, STEPS = 4, 3


class CNN(nn.Module):
    """Two convolutions (no BatchNorm: micro-batches would change its statistics), pooling and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


class Lit(L.LightningModule):
    """A zoo model as a LightningModule; ``via_submodule`` calls ``self.model(...)`` in the step."""

    def __init__(
        self,
        name: str,
        via_submodule: bool = False,
        lr: float = 0.1,
        fail_at: int = -1,
        extra_logs: bool = False,
        reduction: str = "mean",
        outputs: bool = False,
    ) -> None:
        super().__init__()
        self.outputs = outputs  # training_step returns a dict that on_train_batch_end reads on every rank
        self.reduction = reduction  # "sum": the loss sums over samples ([Note: a loss that grows])
        self.fail_at = fail_at
        self.extra_logs = extra_logs
        self.name = name
        self.via_submodule = via_submodule
        self.lr = lr
        torch.manual_seed(0)
        self.model = CNN() if name == "cnn" else make(name)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(*inputs)

    def _loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        if self.name in ("loss", "structured"):  # the labels go into the model, which computes the loss
            out = self(*batch)
            return out if self.name == "loss" else out.loss + 0.0 * out.extra["pair"].first.sum()
        *inputs, y = batch
        out = self.model(*inputs) if self.via_submodule else self(*inputs)
        if self.name == "gpt":
            return F.cross_entropy(out.flatten(0, 1), y.flatten())
        if self.name == "cnn":
            return F.cross_entropy(out, y)
        return F.mse_loss(out, y, reduction=self.reduction)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == self.fail_at and self.global_rank == self.trainer.world_size - 1:
            raise RuntimeError(f"injected failure on rank {self.global_rank}")
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        if self.extra_logs:  # logs that come and go change what the last stage sends along the pipeline
            if batch_idx % 2 == 1:
                self.log("last_odd_batch", batch_idx, reduce_fx="max")
            self.log("loss_x2", 2 * loss, on_epoch=True, sync_dist=True)
            self.log("half", 0.5)
        if self.outputs:  # [Note: a step's other outputs]: per-sample values concatenated, a count summed
            first = batch[0].flatten(1)[:, 0]  # and a string: it travels in the channel's layout, once
            return {"loss": loss, "samples": torch.tensor(len(batch[0])), "first": first, "tag": "b7"}
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.outputs:  # each replica's share, summed over the replicas as DDP's ranks would be
            self.log("out_samples", outputs["samples"].float(), sync_dist=True, reduce_fx="sum")
            self.log("out_first", outputs["first"].float().sum() + len(outputs["first"]), sync_dist=True, reduce_fx="sum")
            self.log("out_tag", float(outputs["tag"][1:]), sync_dist=True)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def make_lit(case: dict[str, Any]) -> Lit:
    """The LightningModule of a case."""
    return Lit(
        case["model"],
        via_submodule=case.get("via_submodule", False),
        fail_at=case.get("fail_at", -1),
        extra_logs=case.get("extra_logs", False),
        reduction=case.get("reduction", "mean"),
        lr=case.get("lr", 0.1),
        outputs=case.get("outputs", False),
    )


def dataset(name: str, n: int) -> TensorDataset:
    """``n`` deterministic samples (inputs..., target) for model ``name``."""
    g = torch.Generator().manual_seed(1)
    if name == "gpt":
        return TensorDataset(
            torch.randint(0, 50, (n, 8), generator=g), torch.randint(0, 50, (n, 8), generator=g)
        )
    if name == "cnn":
        return TensorDataset(torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 5, (n,), generator=g))
    if name == "two_inputs":
        return TensorDataset(
            torch.randn(n, 6, generator=g), torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)
        )
    if name == "residual":
        return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))
    if name in ("loss", "structured"):  # int64 labels travel through the pipeline to the loss in forward
        return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 5, (n,), generator=g))
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 16, generator=g))


def global_order(n: int, replicas: int) -> list[int]:
    """Sample order making global batch k of one process equal to the k-th batches of ``replicas`` ranks.

    Lightning shuffles training data with ``DistributedSampler(shuffle=True, seed=0)``; rank r takes
    ``perm[r::replicas]`` of the epoch's permutation.
    """
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    shards = [perm[r::replicas] for r in range(replicas)]
    order = []
    for k in range(n // (replicas * LOCAL_BATCH)):
        for shard in shards:
            order += shard[k * LOCAL_BATCH : (k + 1) * LOCAL_BATCH]
    return order


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def fit(
    case: dict[str, Any], strategy: Any, devices: int, replicas: int, probe: L.Callback | None = None
) -> tuple[Lit, list[float], dict[str, float]]:
    """Train a case for ``STEPS`` optimizer steps; each batch holds ``LOCAL_BATCH x replicas`` samples in all.

    Case options: ``accumulate`` (gradient accumulation), ``clip`` (gradient norm clipping), ``outputs`` (a dict
    returned, read by ``on_train_batch_end``), ``validate`` (a validation loader, a
    ``ModelCheckpoint(monitor="val_loss")`` writing to ``ckpt_dir``), ``precision`` ("bf16-mixed", or "16-mixed"
    with a GradScaler of initial scale ``scale``, 2**16 by default). Returns the model, the logged ``train_loss``
    per batch and the final callback metrics (with the gradient scaler's final "scale"). ``probe`` is one more
    callback (tests/census.py's StepProbe).
    """
    model = make_lit(case)
    accumulate = case.get("accumulate", 1)
    n = LOCAL_BATCH * replicas * STEPS * accumulate
    data: Dataset[Any] = dataset(case["model"], n)
    batch = LOCAL_BATCH
    if strategy == "auto":  # the reference: one process, the same global batches in one loader batch each
        batch = LOCAL_BATCH * replicas
        data = Subset(data, global_order(n, replicas))
    losses = _Losses()
    callbacks: list[L.Callback] = [losses, *([probe] if probe is not None else [])]
    val = None
    if case.get("validate"):
        val = DataLoader(dataset(case["model"], 2 * LOCAL_BATCH * replicas), batch_size=batch)
        callbacks.append(ModelCheckpoint(dirpath=case.get("ckpt_dir"), monitor="val_loss"))
        # Every rank must see val_loss and agree on stopping (reduce_boolean_decision over the whole world).
        callbacks.append(EarlyStopping(monitor="val_loss", patience=1000))
    precision: dict[str, Any] = {}
    scaler = None
    if case.get("precision") == "16-mixed":  # Lightning takes fp16 autocast on the CPU as a plugin
        scaler = torch.amp.GradScaler("cpu", init_scale=case.get("scale", 2.0**16))
        precision["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler)]
    elif case.get("precision"):
        precision["precision"] = case["precision"]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        **precision,
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=case.get("clip"),
        logger=False,
        enable_checkpointing=bool(case.get("validate")),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    trainer.fit(model, DataLoader(data, batch_size=batch), val)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if scaler is not None:
        metrics["scale"] = scaler.get_scale()
    return model, losses.losses, metrics
