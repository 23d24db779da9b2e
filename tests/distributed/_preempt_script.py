"""A fit that a test pre-empts with a signal, and the one that resumes it (see ``test_preemption.py``).

Usage: ``python tests/distributed/_preempt_script.py OUT TAG [--preempt SIGTERM,...|off] [--checkpoint full]
[--resume PATH] [--save PATH] [--stages N] [--pace SECONDS] [--in-step] [--timeout SECONDS]``, launched on 2 ranks by Lightning's launcher, torchrun or one
process per rank (``srun``). Rank r writes ``OUT/pid.TAG.r`` when training starts, ``OUT/losses.TAG.r.json``
(``{global step: loss}``) as it trains, and ``OUT/exit.TAG.r`` (the code ``fit`` ended with: the
:class:`~lightning_autopart.lightning.preemption.Preempted` code, or 0); rank 0 touches ``OUT/running.TAG``
after ``MARK`` steps, when the test signals. Each step sleeps ``PACE`` seconds, so the signal lands mid-training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed.lifecycle_cases import LifecycleLit
from tests.distributed.strategy_cases import LOCAL_BATCH, dataset

__all__ = ["EPOCHS", "MARK", "STEPS_PER_EPOCH", "ResumableLoader", "StepScheduled", "train"]

#: Optimizer steps per epoch, epochs, and the step after which the test may signal.
STEPS_PER_EPOCH, EPOCHS, MARK = 6, 2, 3

#: Seconds each step waits, so that a signal sent after step MARK arrives long before training ends.
PACE = 0.25


class StepScheduled(LifecycleLit):
    """The lifecycle model (Adam) with a scheduler stepped every optimizer step: a resume that lost or repeated
    a scheduler step would change the loss curve. ``pause`` seconds are spent inside each training step (on the
    last stage, per micro-batch), so that a signal lands while the first stage waits in the pipeline."""

    pause = 0.0

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        time.sleep(self.pause)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 4, 0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ResumableLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader that Lightning saves and restores (``state_dict``/``load_state_dict``, as torchdata's
    ``StatefulDataLoader``): a restored loader skips the batches its epoch had already handed out."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handed_out, self.skip = 0, 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        skip, self.skip, self.handed_out = self.skip, 0, 0
        for i, batch in enumerate(super().__iter__()):
            self.handed_out = i + 1
            if i >= skip:
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"handed_out": self.handed_out}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["handed_out"]


class _Record(L.Callback):
    """Writes the logged loss of every step, and paces the steps."""

    def __init__(self, out: Path, tag: str, pace: float) -> None:
        self.out, self.tag, self.pace, self.losses = out, tag, pace, {}

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        (self.out / f"pid.{self.tag}.{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses[trainer.global_step] = float(trainer.callback_metrics["train_loss"])
        path = self.out / f"losses.{self.tag}.{trainer.global_rank}.json"
        path.write_text(json.dumps(self.losses))
        if trainer.global_step == MARK and trainer.global_rank == 0:
            (self.out / f"running.{self.tag}").touch()
        time.sleep(self.pace)


def train(
    out: Path,
    tag: str,
    strategy: Any,
    devices: int,
    ckpt_path: str | None = None,
    pace: float = PACE,
    callbacks: tuple[L.Callback, ...] = (),
    in_step: bool = False,
) -> L.Trainer:
    """Fit :class:`StepScheduled` for ``EPOCHS`` epochs of ``STEPS_PER_EPOCH`` batches of ``2 x LOCAL_BATCH``
    samples; ``out`` is also the Trainer's ``default_root_dir``. One plain process (``strategy="auto"``) gets
    the sampler Lightning gives a distributed job's one replica, so both see the same batches."""
    torch.manual_seed(0)
    model = StepScheduled()
    if in_step:  # the pace inside the step (see StepScheduled), not at its end
        model.pause, pace = pace / 2, 0.0
    data = dataset("mlp", 2 * LOCAL_BATCH * STEPS_PER_EPOCH)
    sampler = DistributedSampler(data, num_replicas=1, rank=0) if strategy == "auto" else None
    loader = ResumableLoader(data, batch_size=2 * LOCAL_BATCH, sampler=sampler)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=EPOCHS,
        default_root_dir=out,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_Record(out, tag, pace), *callbacks],
    )
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("tag")
    parser.add_argument("--preempt", default="SIGTERM")
    parser.add_argument("--checkpoint", default="sharded")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save", default=None)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--pace", type=float, default=PACE)
    parser.add_argument("--in-step", action="store_true", help="spend the pace inside the training step")
    parser.add_argument("--timeout", type=float, default=None, help="seconds (None: the strategy's default)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from lightning_autopart.lightning.strategy import AutoPartitionStrategy

    signals = () if args.preempt == "off" else tuple(args.preempt.split(","))
    strategy = AutoPartitionStrategy(
        num_stages=args.stages,
        micro_batches=2,
        profile="estimate",
        checkpoint=args.checkpoint,
        preempt_signals=signals,
        preempt_checkpoint=args.save,
        **({"timeout": timedelta(seconds=args.timeout)} if args.timeout else {}),
    )
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", os.environ.get("LOCAL_RANK", "0"))))
    code: Any = 0
    try:
        train(args.out, args.tag, strategy, args.stages, args.resume, args.pace, in_step=args.in_step)
    except SystemExit as stop:
        code = stop.code
        raise
    except BaseException:
        code = "error"
        raise
    finally:
        (args.out / f"exit.{args.tag}.{rank}").write_text(str(code))


if __name__ == "__main__":
    main()
