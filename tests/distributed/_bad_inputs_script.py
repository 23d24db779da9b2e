"""A NaN training loss on 2 processes, as a user script meets it: every rank must stop at the same step and name
the first bad batch, the last stage and its rank (see [Note: non-finite loss] in lightning/finite.py).

Usage: ``python tests/distributed/_bad_inputs_script.py OUT STAGES NAN_RANK`` under torchrun (2 processes):
``STAGES`` is 2 (one pipeline of 2 stages) or 1 (2 replicas); the loss turns NaN from batch 2 on the rank
``NAN_RANK`` only. Each rank writes ``OUT/rank{r}.txt`` with the error it raised and its global step then, and
exits with :data:`RAISED` (the tests tell it from any other failure).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_autopart.errors import NonFiniteLossError
from lightning_autopart.lightning.strategy import AutoPartitionStrategy
from tests.distributed.strategy_cases import Lit, dataset

__all__ = ["NAN_FROM", "RAISED", "STEPS"]

#: The batch from which the loss is NaN, the training batches, and the exit code of a rank that raised.
NAN_FROM, STEPS, RAISED = 2, 6, 7


class _NaNLit(Lit):
    def __init__(self, nan_rank: int) -> None:
        super().__init__("mlp")
        self.nan_rank = nan_rank

    def _loss(self, batch: list[Tensor]) -> Tensor:
        loss = F.mse_loss(self(batch[0]), batch[1])
        if self.trainer.global_step >= NAN_FROM and self.global_rank == self.nan_rank:
            return loss * float("nan")
        return loss


def main() -> None:
    out, stages, nan_rank = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    strategy = AutoPartitionStrategy(num_stages=stages, micro_batches=2, profile="estimate")
    trainer: Any = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(dataset("mlp", 4 * STEPS * (3 - stages)), batch_size=4)  # STEPS batches per replica
    try:
        trainer.fit(_NaNLit(nan_rank), loader)
    except NonFiniteLossError as error:
        (out / f"rank{trainer.global_rank}.txt").write_text(f"{trainer.global_step}\n{error}")
        sys.stdout.flush()
        os._exit(RAISED)
    os._exit(0)


if __name__ == "__main__":
    main()
