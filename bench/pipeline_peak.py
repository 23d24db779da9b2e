"""Each pipeline rank's step peak against its stage's predicted memory, on 2 gloo ranks of this machine.

Usage: ``python bench/pipeline_peak.py [--cases 1F1B:4 1F1B:8 GPipe:4] [--batch 1024]`` (about 20 s a case).

A 2-stage MLP (8 x Linear(256, 1024) + GELU + Linear(1024, 256)), SGD (no state, so activations decide the
peak), ``--batch`` samples of 256 features a step. Each case runs ``AutoPartitionStrategy(num_stages=2,
micro_batches=M, schedule=S, profile="estimate")`` under Lightning's launcher (2 CPU processes). Measured: each
rank's peak tensor bytes over training batches 2-4 (``tests.census.StepPeak``: the stage's parameters, gradients
and optimizer state and the batch at the step's start, plus every storage the step creates; buffers made once
before the step, such as torch.distributed.pipelining's receive buffers, are not in it). Predicted: the plan's
``memory_bytes`` of the rank's stage. Prints one row per rank and case (see docs/limitations.md, "A pipeline
stage's memory").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _rank(schedule: str, micro: int, batch: int, out: Path) -> None:
    """One case, run by Lightning's launcher on every rank: writes this rank's row as JSON into ``out``."""
    import warnings

    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(ROOT))
    from lightning_autopart import AutoPartitionStrategy
    from tests.census import StepPeak

    warnings.filterwarnings("ignore")

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            blocks = [(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(8)]
            self.layers = nn.Sequential(*[m for block in blocks for m in block])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

        def training_step(self, b: list[torch.Tensor], i: int) -> torch.Tensor:
            return F.mse_loss(self(b[0]), b[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-4, foreach=True)

    data = TensorDataset(torch.randn(batch * 6, 256), torch.randn(batch * 6, 256))
    probe = StepPeak(2, 5)
    strategy = AutoPartitionStrategy(num_stages=2, micro_batches=micro, schedule=schedule, profile="estimate")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe],
    )  # fmt: skip
    trainer.fit(MLP(), DataLoader(data, batch_size=batch))
    assert strategy.plan is not None
    stage = next(s for s in strategy.plan.stages if trainer.global_rank in s.ranks)
    row = {"rank": trainer.global_rank, "measured": max(probe.peaks), "predicted": stage.memory_bytes}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(row))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["1F1B:4", "1F1B:8", "GPipe:4"])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)  # internal: one case, under Lightning's launcher
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_of:
        schedule, micro = args.rank_of.split(":")
        _rank(schedule, int(micro), args.batch, Path(args.out))
        return []
    print("| schedule | micro-batches | rank | predicted MB | measured MB | predicted / measured |")
    print("|---|---:|---:|---:|---:|---:|")
    rows: list[dict[str, Any]] = []
    for case in args.cases:
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + len(rows)))
        with tempfile.TemporaryDirectory() as out:
            command = [sys.executable, __file__, "--rank-of", case, "--batch", str(args.batch), "--out", out]
            subprocess.run(command, env=env, capture_output=True, timeout=300, check=False)
            found = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
        schedule, micro = case.split(":")
        if len(found) < 2:
            print(f"| {schedule} | {micro} | the job failed: rerun `python {__file__} --rank-of {case} --out DIR` |")
        for found_row in found:
            row = {"schedule": schedule, "micro": int(micro), **found_row}
            rows.append(row)
            ratio = row["predicted"] / row["measured"]
            print(
                f"| {schedule} | {micro} | {row['rank']} | {row['predicted'] / 1e6:.2f} | "
                f"{row['measured'] / 1e6:.2f} | {ratio:.3f} |",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
