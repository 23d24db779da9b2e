"""The SLURM pre-emption test's training job: ``examples/slurm/train.py`` with a slow step and a record per rank.

Usage (one ``srun`` task per rank): ``python tests/launchers/_slurm_preempt.py OUT [train.py arguments]``. Rank r
of run n (``SLURM_RESTART_COUNT``, 0 before any requeue) writes ``OUT/pid.n.r`` when training starts,
``OUT/steps.n.r.json`` (``{global step: loss}``) after every step, and ``OUT/exit.n.r`` (the code ``fit``
ended with) on its way out; rank 0 touches ``OUT/running.n`` after ``MARK`` steps, when the test signals.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.slurm.train import main

__all__ = ["MARK", "PACE", "Record"]

#: The step after which the test may signal, and the seconds each step sleeps so that training outlasts it.
MARK, PACE = 4, 0.3


class Record(L.Callback):
    """Writes this rank's pid, its loss per step and the start marker; sleeps ``PACE`` after each step."""

    def __init__(self, out: Path, run: int) -> None:
        self.out, self.run = out, run
        self.steps: dict[int, float] = {}

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        (self.out / f"pid.{self.run}.{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps[trainer.global_step] = float(trainer.callback_metrics["train_loss"])
        (self.out / f"steps.{self.run}.{trainer.global_rank}.json").write_text(json.dumps(self.steps))
        if trainer.global_rank == 0 and len(self.steps) == MARK:
            (self.out / f"running.{self.run}").touch()
        time.sleep(PACE)


def _main() -> None:
    out = Path(sys.argv[1])
    run = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    code: Any = "error"
    try:
        main(sys.argv[2:], callbacks=[Record(out, run)])
        code = 0
    except SystemExit as stop:
        code = stop.code
        raise
    finally:  # written whole or not at all: the requeue's SIGTERM may end this process at any instruction
        name = f"exit.{run}.{os.environ['SLURM_PROCID']}"
        (out / f".{name}").write_text(str(code))
        os.replace(out / f".{name}", out / name)


if __name__ == "__main__":
    _main()
