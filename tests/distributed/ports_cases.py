"""Lightning's own strategy tests (DDP, FSDP, ModelParallel, DeepSpeed), as actions run under autopart.

Shared by the launched script (``_ports_script.py``) and the references the test runs: one plain process (for
2 stages x 1 replica) in the test's process, and plain DDP on 2 processes (for 2 stages x 2 replicas) in the
launched job. An action is one ``fit`` (or a short sequence on one model) on a fresh model and Trainer; it
returns what every rank saw, as plain numbers and tensors, keyed so that a rank's result compares with the
reference's as a whole.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassPrecision, MulticlassRecall

from tests.distributed.lifecycle_cases import DistributedOrder
from tests.distributed.strategy_cases import LOCAL_BATCH, dataset
from tests.models import make

__all__ = ["TRAIN_BATCHES", "VAL_BATCHES", "PortLit", "run_action"]

#: Training and validation batches per replica per epoch.
TRAIN_BATCHES, VAL_BATCHES = 4, 2
#: Classes of the metrics: a sample's class is the position of its target's largest value.
CLASSES = 16


def _metrics(prefix: str) -> MetricCollection:
    # Precision and recall share their states: a compute group once the collection's update() has run.
    return MetricCollection(
        {
            "acc": MulticlassAccuracy(CLASSES, average="micro"),
            "prec": MulticlassPrecision(CLASSES, average="macro"),
            "rec": MulticlassRecall(CLASSES, average="macro"),
        },
        prefix=prefix,
    )


class PortLit(L.LightningModule):
    """The zoo MLP trained on MSE, with what Lightning's strategy tests do in their modules, chosen by ``cfg``:

    - ``metrics``: a ``MetricCollection`` updated by ``forward`` in training_step and by ``update`` in
      validation_step, each logged with ``log_dict`` (on_epoch), and a ``log_dict`` of tensors (sync_dist);
    - ``sync``: ``self.log(..., sync_dist=True)`` with reduce_fx sum, max and min, on step and epoch;
    - ``gather``: ``self.all_gather`` of the loss in training_step and validation_step, and of the replica index
      in ``on_train_epoch_end`` (outside any step);
    - ``skip_from``: ``on_train_batch_start`` returns -1 from that batch on (the rest of the epoch is skipped);
    - ``stop_at``: training_step sets ``trainer.should_stop`` at that batch, after the model call;
    - ``scheduler``: a StepLR stepped every "step" or "epoch";
    - ``clip``: ``configure_gradient_clipping`` overridden to clip the norm to this value itself.
    """

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        torch.manual_seed(0)
        self.model = make("mlp")
        if cfg.get("metrics"):
            self.train_metrics = _metrics("train_")
            self.val_metrics = _metrics("val_")
        self.gathered: list[torch.Tensor] = []
        self.distributed_in_setup: bool | None = None

    def setup(self, stage: str) -> None:
        self.distributed_in_setup = dist.is_initialized()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if batch_idx >= self.cfg.get("skip_from", TRAIN_BATCHES) else None

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        loss = F.mse_loss(out, y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        if self.cfg.get("stop_at") == batch_idx:
            self.trainer.should_stop = True
        if self.cfg.get("metrics"):
            self.train_metrics(out, y.argmax(-1))
            self.log_dict(self.train_metrics, on_step=True, on_epoch=True)
            self.log_dict({"out_mean": out.mean(), "out_abs": out.abs().mean()}, on_epoch=True, sync_dist=True)
        if self.cfg.get("sync"):
            self.log("loss_sum", loss, reduce_fx="sum", sync_dist=True, on_step=True, on_epoch=True)
            self.log("loss_max", loss, reduce_fx="max", sync_dist=True, on_epoch=True)
            self.log("loss_min", loss, reduce_fx="min", sync_dist=True, on_epoch=True)
        if self.cfg.get("gather"):
            gathered = self.all_gather(loss.detach())
            self.log("gathered_loss", gathered.mean())
            self.log("gathered_size", float(gathered.numel()))
        return loss

    def on_train_epoch_end(self) -> None:
        if self.cfg.get("gather"):
            self.gathered.append(self.all_gather(torch.tensor(float(replica_of(self.trainer.strategy)))).cpu())

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        out = self(x)
        loss = F.mse_loss(out, y)
        self.log("val_loss", loss, sync_dist=True)
        if self.cfg.get("metrics"):
            self.val_metrics.update(out, y.argmax(-1))
            self.log_dict(self.val_metrics, on_epoch=True)
        if self.cfg.get("sync"):
            self.log("val_loss_sum", loss, reduce_fx="sum", sync_dist=True)
        if self.cfg.get("gather"):
            self.log("val_gathered", self.all_gather(loss).mean())

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        if "clip" in self.cfg:
            self.clip_gradients(optimizer, gradient_clip_val=self.cfg["clip"], gradient_clip_algorithm="norm")
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        if "scheduler" not in self.cfg:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.cfg["scheduler"]}}


def replica_of(strategy: Any) -> int:
    """This process's data-parallel replica (a DDP rank; 0 on one device)."""
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
    return int(kwargs["rank"]) if kwargs else 0


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


class Recorder(L.Callback):
    """This rank's view: callback metrics after each training batch and validation, gradients, hook calls."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.validations: list[dict[str, float]] = []
        self.sanity_batches = 0
        self.grad_sums: list[float] = []
        self.largest_grads: list[tuple[float, float]] = []  # (norm, largest value) before clipping
        self.starts: list[tuple[int, int]] = []
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.starts.append((trainer.global_step, trainer.current_epoch))
        strategy = trainer.strategy
        self.seen = {
            "strategy_model_is_module": strategy.model is pl_module,
            "trainer_model_is_module": trainer.model is pl_module,
            "device": str(pl_module.device),
            "root_device": str(strategy.root_device),
        }

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.steps.append(_numbers(trainer.callback_metrics))
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None and p.device.type != "meta"]
        self.grad_sums.append(float(sum(g.double().sum() for g in grads)) if grads else 0.0)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None and p.device.type != "meta"]
        if grads:
            norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            self.largest_grads.append((norm, max(float(g.abs().max()) for g in grads)))

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.sanity_batches += int(trainer.sanity_checking)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.validations.append(_numbers(trainer.callback_metrics))


def _loaders(replicas: int, reference: bool, epochs: int) -> tuple[DataLoader[Any], DataLoader[Any]]:
    """Training and validation loaders: ``LOCAL_BATCH`` samples per replica per batch. A distributed run gets
    plain loaders (Lightning adds its DistributedSampler); the one-process reference gets the same global
    batches, in the order that sampler gives ``replicas`` ranks."""
    n = LOCAL_BATCH * replicas * TRAIN_BATCHES
    train_data, val_data = dataset("mlp", n), dataset("mlp", LOCAL_BATCH * replicas * VAL_BATCHES)
    if not reference:
        return DataLoader(train_data, batch_size=LOCAL_BATCH), DataLoader(val_data, batch_size=LOCAL_BATCH)
    batch = LOCAL_BATCH * replicas
    order = DistributedOrder(n, [replicas] * epochs, batch)
    return DataLoader(train_data, batch_size=batch, sampler=order), DataLoader(val_data, batch_size=batch)


def _trainer(action: dict[str, Any], strategy: Any, devices: int, recorder: Recorder, **options: Any) -> L.Trainer:
    settings: dict[str, Any] = {
        "max_epochs": 2,
        "num_sanity_val_steps": 0,
        "enable_checkpointing": False,
        "logger": False,
        **action.get("trainer", {}),
        **options,
    }
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
        **settings,
    )


def _local_params(model: L.LightningModule) -> dict[str, torch.Tensor]:
    """This rank's parameters (another stage's stay on the meta device under autopart)."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.device.type != "meta"}


def _probe(strategy: Any) -> dict[str, Any]:
    """Lightning's collectives and the strategy's data-parallel view, called by every rank outside any step, with
    values that differ between replicas (a DDP rank is a replica)."""
    replica = replica_of(strategy)
    rank = strategy.global_rank
    strategy.barrier("ports")
    value = torch.tensor(float(replica + 1))
    return {
        "sampler": dict(strategy.distributed_sampler_kwargs),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "process_group_backend": getattr(strategy, "process_group_backend", None),
        "broadcast0": strategy.broadcast({"from": rank, "replica": replica}, src=0),
        "broadcast_last": strategy.broadcast(rank, src=strategy.world_size - 1),
        "reduce": {op: float(strategy.reduce(value.clone(), reduce_op=op)) for op in ("sum", "mean", "max", "min")},
        "all": strategy.reduce_boolean_decision(replica == 0, all=True),
        "any": strategy.reduce_boolean_decision(replica == 0, all=False),
        "all_gather": strategy.all_gather(torch.tensor([float(replica)])).cpu(),
    }


def run_action(
    action: dict[str, Any], strategy: Callable[[], Any], devices: int, replicas: int, out: Path
) -> dict[str, Any]:
    """Run ``action`` (see ``test_lightning_ports.LAUNCHES``) with Trainers on ``strategy()``; with
    ``strategy() == "auto"`` (the reference) one process runs it over the same global batches. Checkpoints are
    written under ``out``."""
    reference = strategy() == "auto"
    cfg = action.get("cfg", {})
    epochs = int(action.get("trainer", {}).get("max_epochs", 2)) + 1
    train, val = _loaders(replicas, reference, epochs)
    model = PortLit(cfg)
    recorder = Recorder()
    trainer = _trainer(action, strategy(), devices, recorder)
    result: dict[str, Any] = {}
    if action.get("twice"):  # fit, then fit on with the same Trainer and model (Lightning's idiom)
        trainer.fit_loop.max_epochs = 1
        trainer.fit(model, train, val)
        result["first_fit"] = (trainer.global_step, trainer.current_epoch)
        trainer.fit_loop.max_epochs = 2
    trainer.fit(model, train, val)
    result.update(
        steps=recorder.steps,
        validations=recorder.validations,
        sanity_batches=recorder.sanity_batches,
        final=_numbers(trainer.callback_metrics),
        global_step=trainer.global_step,
        epoch=trainer.current_epoch,
        params=_local_params(model),
        grad_sums=recorder.grad_sums,
        largest_grads=recorder.largest_grads,
        lr=trainer.optimizers[0].param_groups[0]["lr"],
        gathered=list(model.gathered),
        seen={**recorder.seen, "distributed_in_setup": model.distributed_in_setup},
        starts=recorder.starts,
    )
    if action.get("evaluate"):  # validate and test on the fitted model: values, and weights left unchanged
        (result["validate"],) = _numbers_list(trainer.validate(model, val, verbose=False))
        (result["test"],) = _numbers_list(trainer.test(model, val, verbose=False))
        result["unchanged"] = all(
            torch.equal(p, result["params"][n]) for n, p in _local_params(model).items()
        ) and set(_local_params(model)) == set(result["params"])
    if action.get("probe") and not reference:
        result["probe"] = _probe(trainer.strategy)
    if action.get("resume"):  # a checkpoint of this fit, resumed by a fresh Trainer and model for one more epoch
        path = out / action["resume"]
        trainer.save_checkpoint(path)
        again = Recorder()
        resumed = _trainer(action, strategy(), devices, again, max_epochs=trainer.current_epoch + 1)
        resumed.fit(PortLit(cfg), train, val, ckpt_path=path)
        result["resumed"] = {"starts": again.starts, "global_step": resumed.global_step,
                             "epoch": resumed.current_epoch, "steps": again.steps}  # fmt: skip
    # Teardown: every tensor this rank holds is back on the CPU (or was never materialised: meta), nothing stashed.
    result["torn_down"] = all(
        t.device.type in ("cpu", "meta") for t in (*model.parameters(), *model.buffers())
    ) and not getattr(trainer.strategy, "_stash", [])
    return result


def _numbers_list(results: list[dict[str, Any]]) -> list[dict[str, float]]:
    return [_numbers(r) for r in results]
