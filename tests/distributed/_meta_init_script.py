"""Builds a model too big for one (budgeted) device without allocating it, trains it with autopart, reports.

Usage: ``python tests/distributed/_meta_init_script.py HOWS OUT DEVICES``; HOWS are comma-separated fits, each
"plain" (one process, built on the CPU), "init_module" (``Trainer.init_module(empty_init=True)``),
"configure_model" (layers built in the hook) or "meta" (the script builds under ``torch.device("meta")``).
Rank r writes ``OUT/{HOW}{r}.pt`` per fit.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from tests.distributed.job import end_job

__all__: list[str] = []

WIDTH, DEPTH, STEPS, BATCH = 256, 8, 4, 8


def layers() -> nn.Sequential:
    """Linear layers with LayerNorm (reset_parameters everywhere, as torch.nn's modules have)."""
    body: list[nn.Module] = []
    for _ in range(DEPTH):
        body += [nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Tanh()]
    return nn.Sequential(*body, nn.Linear(WIDTH, 4))


class MetaLit(L.LightningModule):
    def __init__(self, in_hook: bool = False) -> None:
        super().__init__()
        self.in_hook = in_hook
        self.net: nn.Module | None = None if in_hook else layers()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.net is None:
            self.net = layers()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(self.trainer.callback_metrics["loss"]))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Held(L.Callback):
    """Each rank's non-meta parameters when training starts (the initial weights) and their bytes."""

    def __init__(self) -> None:
        self.initial: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.initial = {n: p.detach().cpu().clone() for n, p in pl_module.named_parameters() if not p.is_meta}


def fit(how: str, out: Path, devices: int) -> None:
    """Build the model ``how`` says, train it, save this rank's report (and, under autopart, a full checkpoint)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH * STEPS, WIDTH, generator=g), torch.randint(0, 4, (BATCH * STEPS,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH)
    held = Held()
    options: dict[str, Any] = dict(
        accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[held],
    )  # fmt: skip
    if how == "plain":
        L.seed_everything(7)
        model = MetaLit()
        trainer = L.Trainer(devices=1, **options)
    else:
        # 8 x 256 x 256 float32 weights (2.1 MB) with Adam's states do not fit 3 MB: the plan needs several stages.
        strategy = AutoPartitionStrategy(micro_batches=2, device_memory="3MB", checkpoint="full")
        # One replica: the loader's own order, as the plain run's (Lightning would shuffle via DistributedSampler).
        trainer = L.Trainer(devices=devices, strategy=strategy, use_distributed_sampler=False, **options)
        L.seed_everything(7)
        if how == "init_module":
            with trainer.init_module(empty_init=True):
                model = MetaLit()
        elif how == "meta":
            with torch.device("meta"):
                model = MetaLit()
        else:
            model = MetaLit(in_hook=True)
    trainer.fit(model, loader)
    rank = dist.get_rank() if dist.is_initialized() else 0
    result: dict[str, Any] = {"losses": model.losses, "initial": held.initial}
    if how == "plain":
        result["final"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        part = trainer.strategy._part  # type: ignore[attr-defined]
        result["stage_param_bytes"] = sum(s.param_bytes for s in part.plan.stages if rank in s.ranks)
        result["materialized"] = part.materialized
        result["held_bytes"] = sum(p.nbytes for p in model.parameters() if not p.is_meta)
        result["num_stages"] = part.plan.num_stages
        trainer.save_checkpoint(out / f"{how}.ckpt")
    torch.save(result, out / f"{how}{rank}.pt")


def main() -> None:
    torch.set_num_threads(1)
    out, devices = Path(sys.argv[2]), int(sys.argv[3])
    for how in sys.argv[1].split(","):
        fit(how, out, devices)
    end_job()


if __name__ == "__main__":
    main()
