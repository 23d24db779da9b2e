"""A 2-stage MLP trained with AutoPartitionStrategy on 2 gloo processes, with one fault injected on one rank.

Usage: ``python tests/distributed/_faults_script.py FAULT TIMEOUT OUT [DEVICES]`` (DEVICES=4: 2 stages x 2
replicas, stage 0 on ranks 0 and 2, stage 1 on ranks 1 and 3): ``FAULT`` is one of :data:`FAULTS`,
``TIMEOUT`` the strategy's ``timeout`` in seconds or ``default`` (Lightning's 30 minutes), ``OUT`` a folder
where each rank writes ``pid{rank}`` (its process id) once its process group is up, so that a test can watch,
stop or kill exactly the processes the job started, and where the rank the fault hits writes ``fault``
(``time.time()`` when it strikes), the origin of the exit times a test checks.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_autopart.lightning.strategy import AutoPartitionStrategy

__all__ = ["FAULTS"]

#: Fault name -> (rank it hits, what it does). Every fault hits the third training batch (index 2) or the
#: second validation batch, once the log channel runs its steady path (a receive posted before each step).
FAULTS = {
    "train_first": (0, "training_step raises on the first stage"),
    "train_last": (1, "training_step raises on the last stage"),
    "oom_forward": (0, "the first stage's forward raises torch.OutOfMemoryError"),
    "validation_last": (1, "validation_step raises on the last stage"),
    "optimizer_first": (0, "the optimizer's step raises on the first stage, after the pipeline ran"),
    "configure_optimizers_last": (1, "configure_optimizers raises on the last stage"),
    "loader_last": (1, "the dataset's __getitem__ raises on the last stage"),
    "kill_last": (1, "the last stage's process is killed (SIGKILL)"),
    "kill_first": (0, "the first stage's process is killed (SIGKILL)"),
    "stop_last": (1, "the last stage's process is stopped (SIGSTOP): a frozen node"),
    "stop_last_logs": (1, "the last stage is stopped after its schedule, before it sends the step's logs"),
    "stop_first": (0, "the first stage's process is stopped (it hosts the store under Lightning's launcher)"),
}

#: The training batch (index) and validation batch a fault hits.
AT_BATCH, AT_VAL_BATCH = 2, 1
#: Samples per batch.
BATCH = 8


#: The job's output folder (set by ``main``).
OUT = Path(".")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _strike() -> None:
    """Record when the fault strikes (just before it does)."""
    (OUT / "fault").write_text(repr(time.time()))


class _Data(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random regression pairs; with ``fail_rank``, item ``AT_BATCH * BATCH`` raises on that rank."""

    def __init__(self, fail_rank: int | None = None) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(8 * BATCH, 16, generator=generator)
        self.y = torch.randn(8 * BATCH, 16, generator=generator)
        self.fail_rank = fail_rank

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index == AT_BATCH * BATCH and _rank() == self.fail_rank:
            _strike()
            raise OSError(f"injected failure: sample {index} is unreadable on rank {_rank()}")
        return self.x[index], self.y[index]


class _FailingSGD(torch.optim.SGD):
    """SGD whose third step raises after running the closure (the pipeline's forward and backward)."""

    steps = 0

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = super().step(closure)
        self.steps += 1
        if self.steps == AT_BATCH + 1:
            _strike()
            raise RuntimeError(f"injected failure in the optimizer step on rank {_rank()}")
        return loss


class FaultyMLP(L.LightningModule):
    """Four linear layers; ``fault`` names the fault and ``rank`` the rank it hits."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault
        self.target = FAULTS[fault][0]
        self.net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])

    def _hit(self, fault: str) -> bool:
        return self.fault == fault and self.global_rank == self.target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx != AT_BATCH:
            return
        if self._hit("kill_last") or self._hit("kill_first"):
            _strike()
            os.kill(os.getpid(), signal.SIGKILL)
        if self._hit("stop_last") or self._hit("stop_first"):
            _strike()
            os.kill(os.getpid(), signal.SIGSTOP)
        if self._hit("stop_last_logs"):  # the peer then waits in the log channel's group, not the pipeline's
            channel = self.trainer.strategy._steps.channel  # type: ignore[attr-defined]
            send = channel._send

            def frozen_send(*args: Any, **kwargs: Any) -> Any:
                _strike()
                os.kill(os.getpid(), signal.SIGSTOP)
                return send(*args, **kwargs)

            channel._send = frozen_send
        if self._hit("oom_forward"):
            runner = self.trainer.strategy._runner  # type: ignore[attr-defined]

            def out_of_memory(*_: Any) -> None:
                _strike()
                raise torch.OutOfMemoryError(
                    f"injected: CUDA out of memory in the first stage on rank {_rank()}"
                )

            runner.modules[0].register_forward_pre_hook(out_of_memory)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == AT_BATCH and (self._hit("train_first") or self._hit("train_last")):
            _strike()
            raise RuntimeError(f"injected failure in training_step on rank {self.global_rank}")
        loss = F.mse_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        if batch_idx == AT_VAL_BATCH and self._hit("validation_last"):
            _strike()
            raise ValueError(f"injected failure in validation_step on rank {self.global_rank}")
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        if self._hit("configure_optimizers_last"):
            _strike()
            raise TypeError(f"injected failure in configure_optimizers on rank {self.global_rank}")
        kind = _FailingSGD if self._hit("optimizer_first") else torch.optim.SGD
        return kind(self.parameters(), lr=0.01)


class _WritePid(L.Callback):
    """Writes ``OUT/pid{rank}`` once the process group is up (a test watches exactly these processes)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        (self.out / f"pid{trainer.global_rank}").write_text(str(os.getpid()))


def main() -> None:
    global OUT
    fault, timeout, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    devices = int(sys.argv[4]) if len(sys.argv) > 4 else 2  # 4: 2 stages x 2 replicas
    OUT = out
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # the watcher asks where a hung rank waits
    torch.set_num_threads(1)
    options: dict[str, Any] = {} if timeout == "default" else {"timeout": timedelta(seconds=float(timeout))}
    strategy = AutoPartitionStrategy(num_stages=2, micro_batches=2, profile="estimate", **options)
    validate = fault == "validation_last"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2 if validate else 0,
        val_check_interval=2 if validate else None,
        callbacks=[_WritePid(out)],
    )
    loader_fault = FAULTS[fault][0] if fault == "loader_last" else None
    train = DataLoader(_Data(loader_fault), batch_size=BATCH, drop_last=True)
    val = DataLoader(_Data(), batch_size=BATCH, drop_last=True)
    trainer.fit(FaultyMLP(fault), train, val if validate else None)


if __name__ == "__main__":
    main()
