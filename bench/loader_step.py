"""The training loader's share of a step on the CPU: plain Lightning's step against the plan's, with and without
the loader's time ([Note: loader time], [Note: loader in the step]).

Usage: ``python bench/loader_step.py [--hidden 1024] [--layers 4] [--batch 256] [--workers 0 2] [--steps 20]
[--warmup 5] [--rounds 2]``.

Per worker count and round, plain Lightning (one CPU process, progress bar on, SGD) trains the tutorial
``Net(hidden, layers)`` on its own ``train_dataloader``: ``SyntheticRegression`` samples made one by one in the
step (with ``num_workers`` workers), ``warmup + steps + 1`` steps, the median step timed from one step start to
the next. The plan for the same model is made as ``autopart plan`` makes it for a LightningModule (its first
batch, its loss, the loader timed; measure mode on this CPU, one device, one micro-batch); the table shows its
step with the loader's part and without it, each over the measured step.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_vs_plain import StepClock  # noqa: E402

from examples.tutorial import Net  # noqa: E402

__all__ = ["WorkersNet", "main", "measured_ms", "predicted_ms"]


class WorkersNet(Net):
    """The tutorial model whose training loader has ``workers`` worker processes."""

    def __init__(self, workers: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.workers = workers

    def train_dataloader(self) -> DataLoader[Any]:
        loader = super().train_dataloader()
        return DataLoader(loader.dataset, batch_size=loader.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.workers, persistent_workers=self.workers > 0)  # fmt: skip


def _model(args: argparse.Namespace, workers: int) -> WorkersNet:
    torch.manual_seed(0)
    samples = args.batch * (args.warmup + args.steps + 2)
    return WorkersNet(workers, hidden=args.hidden, layers=args.layers, batch_size=args.batch, num_samples=samples)


def measured_ms(args: argparse.Namespace, workers: int) -> float:
    """Plain Lightning's median step (ms) with the model's own loader."""
    clock = StepClock(args.warmup, args.steps, cuda=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.warmup + args.steps + 1, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[clock])  # fmt: skip
    trainer.fit(_model(args, workers))
    return statistics.median(clock.step_seconds()) * 1e3


def predicted_ms(args: argparse.Namespace, workers: int) -> tuple[float, float]:
    """The one-stage plan's step and its loader part (ms), planned as ``autopart plan`` plans the module."""
    from lightning_autopart.cli import _training_step
    from lightning_autopart.cluster import Cluster
    from lightning_autopart.planner import plan_model
    from lightning_autopart.profile import calibrate_cpu

    found = _training_step(_model(args, workers), meta=False)
    assert found is not None
    root, inputs, loss, samples, loader = found
    spec = calibrate_cpu()
    plan = plan_model(root, inputs, Cluster.from_spec(spec, devices=1), args.batch, profile="measure", spec=spec,
                      num_stages=1, micro_batches=1, loss=loss, loss_samples=samples, loader=loader)  # fmt: skip
    return plan.prediction.step_us / 1e3, plan.prediction.data_us / 1e3


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_autopart"):
        logging.getLogger(name).setLevel(logging.ERROR)
    rows = []
    for round_ in range(args.rounds):
        for workers in args.workers:
            measured = measured_ms(args, workers)
            step, data = predicted_ms(args, workers)
            rows.append({"round": round_, "workers": workers, "measured_ms": measured, "predicted_ms": step,
                         "data_ms": data})  # fmt: skip
    print(f"\nNet({args.hidden}, {args.layers}), batch {args.batch}, CPU ({torch.get_num_threads()} threads), "
          f"torch {torch.__version__}\n")  # fmt: skip
    print("| round | workers | measured ms | predicted ms (data) | predicted / measured | without data |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio, bare = r["predicted_ms"] / r["measured_ms"], (r["predicted_ms"] - r["data_ms"]) / r["measured_ms"]
        print(f"| {r['round']} | {r['workers']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} "
              f"({r['data_ms']:.1f}) | {ratio:.2f} | {bare:.2f} |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
